"""Plain reference models of the cache's contract (upstream's semantics, docs/design.md).

Written for clarity, not speed, and independently of ``hicache_existence``: the LRU
order is a Python list (oldest first), every walk is an explicit loop, and every
accounting counter is bumped where the contract says it happens.  The stateful
tests drive the real caches and these models with the same calls and compare
return values, state, LRU order, in-flight refs and every ``stats()`` field.

The models assume valid input (tests/test_bad_input.py covers the rest).
"""

from __future__ import annotations

COUNTERS = (
    "queries",
    "query_hits",
    "query_misses",
    "pages_checked",
    "page_hits",
    "rescues",
    "page_misses",
    "adds",
    "inserts",
    "refreshes",
    "evictions",
    "invalidate_calls",
    "invalidations",
    "clears",
    "cleared_pages",
    "inflight_tracked",
    "inflight_released",
    "inflight_clears",
    "inflight_unmatched",
)
GAUGES = ("entries", "capacity", "inflight")
FIELDS = COUNTERS + GAUGES
# Why a missed page was not believed: the last way it left the beliefs, or "cold".
MISS_REASONS = ("cold", "evicted", "invalidated", "cleared")


def zero_counters():
    """A fresh counter dict, every counter at 0."""
    return {name: 0 for name in COUNTERS}


def zero_reasons():
    """A fresh miss-reason count dict."""
    return {reason: 0 for reason in MISS_REASONS}


class ExactMissMemory:
    """A MissMemory that never forgets: the reason codes are indexes into
    ``MISS_REASONS`` (0 = cold).  With it, classified misses are exact."""

    def __init__(self):
        self.reasons = {}

    def remember(self, keys, reason):
        for key in keys:
            self.reasons[key] = reason

    def reason(self, key):
        return self.reasons.get(key, 0)

    def classify(self, keys):
        return [self.reason(key) for key in keys]


def add_stats(a, b):
    """Field-wise sum of two stats dicts."""
    return {name: a[name] + b[name] for name in FIELDS}


# --------------------------------------------------------------------------
# Current generation: one LRU (+ in-flight refs) per pool, cap per pool.
# --------------------------------------------------------------------------


class RefPool:
    """Reference model of ``PoolBeliefs``: one pool's LRU and in-flight refs."""

    def __init__(self, name, max_entries):
        self.name = name
        self.max_entries = max_entries
        self.lru = []  # page hashes, oldest first
        self.refs = {}  # page hash -> positive ref count
        self.counters = zero_counters()
        self.departed = {}  # page hash -> how it last left the beliefs
        self.miss_reasons = zero_reasons()

    # -- helpers --
    def _touch(self, h):
        self.lru.remove(h)
        self.lru.append(h)

    def _finish_query(self, answer):
        self.counters["queries"] += 1
        if answer:
            self.counters["query_hits"] += 1
        else:
            self.counters["query_misses"] += 1
        return answer

    def _walk(self, hashes, rescue):
        """Walk pages in order; believed -> touch + hit; rescue(h) -> rescue;
        else one miss and stop."""
        for h in hashes:
            self.counters["pages_checked"] += 1
            if h in self.lru:
                self._touch(h)
                self.counters["page_hits"] += 1
            elif rescue(h):
                self.counters["rescues"] += 1
            else:
                self.counters["page_misses"] += 1
                self.miss_reasons[self.departed.get(h, "cold")] += 1
                return self._finish_query(False)
        return self._finish_query(True)

    # -- API --
    def add(self, hashes):
        hashes = list(hashes)
        self.counters["adds"] += 1
        for h in hashes:
            if h in self.lru:
                self.counters["refreshes"] += 1
                self.lru.remove(h)
            else:
                self.counters["inserts"] += 1
            self.lru.append(h)
        # The batch may overshoot the cap; evict oldest-first at its end.
        while len(self.lru) > self.max_entries:
            evicted = self.lru.pop(0)
            self.departed[evicted] = "evicted"
            self.counters["evictions"] += 1

    def contains(self, h):
        return self._walk([h], rescue=lambda page: False)

    def contains_all(self, hashes):
        return self._walk(list(hashes), rescue=lambda page: False)

    def covered(self, hashes):
        return self._walk(list(hashes), rescue=lambda page: page in self.refs)

    def track_inflight(self, hashes):
        for h in hashes:
            self.refs[h] = self.refs.get(h, 0) + 1
            self.counters["inflight_tracked"] += 1

    def untrack_inflight(self, hashes):
        for h in hashes:
            if h not in self.refs:
                self.counters["inflight_unmatched"] += 1
                continue  # absent: nothing released
            self.refs[h] -= 1
            self.counters["inflight_released"] += 1
            if self.refs[h] == 0:
                del self.refs[h]

    def invalidate_beyond(self, hashes, keep_pages):
        hashes = list(hashes)
        self.counters["invalidate_calls"] += 1
        for h in hashes[keep_pages:]:
            if h in self.lru:
                self.lru.remove(h)
                self.departed[h] = "invalidated"
                self.counters["invalidations"] += 1

    def clear(self):
        self.counters["clears"] += 1
        self.counters["cleared_pages"] += len(self.lru)
        for h in self.lru:
            self.departed[h] = "cleared"
        self.lru = []
        self.refs = {}

    def clear_inflight(self):
        self.counters["inflight_clears"] += 1
        self.refs = {}

    def __len__(self):
        return len(self.lru)

    def stats(self):
        out = dict(self.counters)
        out["entries"] = len(self.lru)
        out["capacity"] = self.max_entries
        out["inflight"] = len(self.refs)
        return out


class RefCache:
    """Reference model of the current-generation ``StorageExistenceCache``."""

    def __init__(self, max_entries):
        self.max_entries = max_entries  # applies to pools created afterwards
        self.pools = {}  # name -> RefPool, in creation order

    def pool(self, name):
        if name not in self.pools:
            self.pools[name] = RefPool(name, self.max_entries)
        return self.pools[name]

    def pool_names(self):
        return tuple(self.pools)

    def clear(self):
        for p in self.pools.values():
            p.clear()

    def clear_inflight(self):
        for p in self.pools.values():
            p.clear_inflight()

    def stats(self):
        return {name: p.stats() for name, p in self.pools.items()}

    def total(self):
        """Every field summed over pools (capacity too: caps are per pool)."""
        total = {name: 0 for name in FIELDS}
        for p in self.pools.values():
            total = add_stats(total, p.stats())
        return total


# Heal policies, exactly as upstream sglang 0.5.23 composes them.


def ref_chain_heal_from_query(pool, chain, keys, hit_pages, evidence):
    """ChainPagesPolicy: invalidate beyond the agreed hit; with evidence re-add
    the verified prefix (an add call even when the prefix is empty)."""
    pool.invalidate_beyond(chain, hit_pages)
    if evidence:
        pool.add(list(chain)[:hit_pages])


def ref_trailing_heal_from_query(pool, chain, keys, hit_pages, evidence):
    """TrailingWindowPolicy: the query only invalidates."""
    pool.invalidate_beyond(chain, hit_pages)


def ref_heal_from_transfer(pool, keys, delivered_pages):
    """Both policies: drop the beliefs beyond the delivered pages."""
    pool.invalidate_beyond(keys, delivered_pages)


# --------------------------------------------------------------------------
# Seed generation: one LRU keyed by (pool, hash), one shared cap.
# --------------------------------------------------------------------------


class RefFlat:
    """Reference model of ``FlatStorageExistenceCache``."""

    def __init__(self, max_entries):
        self.max_entries = max_entries
        self.lru = []  # (pool, page hash), oldest first
        self.counters = {}  # pool -> counters; a pool is known once a call names it
        self.departed = {}  # (pool, page hash) -> how it last left the beliefs
        self.miss_reasons = {}  # pool -> miss-reason counts

    def _known(self, pool):
        if pool not in self.counters:
            self.counters[pool] = zero_counters()
            self.miss_reasons[pool] = zero_reasons()
        return self.counters[pool]

    def _touch(self, key):
        self.lru.remove(key)
        self.lru.append(key)

    def _walk(self, pool, hashes, rescue):
        c = self._known(pool)
        answer = True
        for h in hashes:
            c["pages_checked"] += 1
            key = (pool, h)
            if key in self.lru:
                self._touch(key)
                c["page_hits"] += 1
            elif rescue(h):
                c["rescues"] += 1
            else:
                c["page_misses"] += 1
                self.miss_reasons[pool][self.departed.get(key, "cold")] += 1
                answer = False
                break
        c["queries"] += 1
        c["query_hits" if answer else "query_misses"] += 1
        return answer

    def add(self, pool, hashes):
        hashes = list(hashes)
        c = self._known(pool)
        c["adds"] += 1
        for h in hashes:
            key = (pool, h)
            if key in self.lru:
                c["refreshes"] += 1
                self.lru.remove(key)
            else:
                c["inserts"] += 1
            self.lru.append(key)
        while len(self.lru) > self.max_entries:
            evicted = self.lru.pop(0)
            self.departed[evicted] = "evicted"
            self.counters[evicted[0]]["evictions"] += 1  # the evicted entry's pool

    def contains(self, pool, h):
        return self._walk(pool, [h], rescue=lambda page: False)

    def contains_all(self, pool, hashes):
        return self._walk(pool, list(hashes), rescue=lambda page: False)

    def covers_all(self, pool, hashes, extra_cover=frozenset()):
        return self._walk(pool, list(hashes), rescue=lambda page: page in extra_cover)

    def invalidate_beyond(self, pool, hashes, keep_pages):
        hashes = list(hashes)
        c = self._known(pool)
        c["invalidate_calls"] += 1
        for h in hashes[keep_pages:]:
            key = (pool, h)
            if key in self.lru:
                self.lru.remove(key)
                self.departed[key] = "invalidated"
                c["invalidations"] += 1

    def clear(self):
        for pool, c in self.counters.items():
            c["clears"] += 1
            c["cleared_pages"] += self.entries_of(pool)
        for key in self.lru:
            self.departed[key] = "cleared"
        self.lru = []

    def entries_of(self, pool):
        n = 0
        for p, _ in self.lru:
            if p == pool:
                n += 1
        return n

    def __len__(self):
        return len(self.lru)

    def pool_names(self):
        return tuple(self.counters)

    def stats(self):
        out = {}
        for pool, c in self.counters.items():
            s = dict(c)
            s["entries"] = self.entries_of(pool)
            s["capacity"] = self.max_entries  # the shared cap
            s["inflight"] = 0
            out[pool] = s
        return out

    def total(self):
        """Every field summed over pools, except capacity: the one shared cap
        (0 with no known pool, as hicache_existence/core/stats.py documents)."""
        total = {name: 0 for name in FIELDS}
        for s in self.stats().values():
            total = add_stats(total, s)
        total["capacity"] = self.max_entries if self.counters else 0
        return total


def check_miss_reasons(got, want, memory, cache):
    """Classified misses: all zero without a memory; with one, exact (or, where the
    cache classifies lazily until ``settle()``, never ahead of the model)."""
    if not memory:
        assert dict(got) == dict.fromkeys(want, 0)
    elif hasattr(cache, "settle"):
        assert all(got[reason] <= want[reason] for reason in want), (dict(got), want)
    else:
        assert dict(got) == want


def on_pure_python_index(machine: type) -> type:
    """``machine`` driving caches built on the pure-Python index (what
    ``HICACHE_EXISTENCE_BACKEND=python`` selects): the fallback must behave
    exactly like the compiled index, so the same state machine runs on both."""
    from hicache_existence.core import lru

    class PurePython(machine):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            self._saved_index = lru.LruIndex
            lru.LruIndex = lru.PyLruIndex
            super().__init__()

        def teardown(self) -> None:
            lru.LruIndex = self._saved_index

    PurePython.__name__ = PurePython.__qualname__ = f"PurePython{machine.__name__}"
    return PurePython
