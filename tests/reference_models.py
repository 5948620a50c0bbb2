"""Plain reference models of the cache's contract (upstream's semantics, docs/design.md).

Written for clarity, not speed, and independently of ``hicache_existence``'s code
(only the counter names come from its declaration): the LRU order is a Python
list (oldest first), every walk is an explicit loop, and every accounting counter
is bumped where the contract says it happens.  Both generations are one model,
``RefBeliefs``: an LRU list with per-pool counters, where the current
generation's pool has a list of its own and the seed generation's pools share
one, so each counter is bumped in one place for both.  The stateful
tests drive the real caches and these models with the same calls and compare
return values, state, LRU order, in-flight refs and every ``stats()`` field.

The models assume valid input (tests/test_bad_input.py covers the rest).
"""

from __future__ import annotations

from hicache_existence.core.stats import COUNTER_FIELDS, GAUGE_FIELDS

# The field names are the package's one declaration (PoolStats); what the models
# count, and when, is written here independently (tests/test_declarations.py
# checks that they count every declared counter).
COUNTERS = COUNTER_FIELDS
GAUGES = GAUGE_FIELDS
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
# Both generations: an LRU list of keys with per-pool accounting.
# --------------------------------------------------------------------------


class RefBeliefs:
    """An LRU list of keys (oldest first) under one cap, with each pool's
    counters, miss reasons and how each key last left.  ``key(pool, h)`` is the
    key of a page and ``pool_of(key)`` its pool: a page hash in a current-
    generation pool's own list, ``(pool, page hash)`` in the seed generation's
    shared one (where an eviction is counted in the evicted entry's pool)."""

    def __init__(self, max_entries):
        self.max_entries = max_entries
        self.lru = []  # keys, oldest first
        self.counts = {}  # pool -> counters; a pool is known once a call names it
        self.reasons = {}  # pool -> miss-reason counts
        self.departed = {}  # key -> how it last left the beliefs

    def key(self, pool, h):
        raise NotImplementedError

    def pool_of(self, key):
        raise NotImplementedError

    def _known(self, pool):
        if pool not in self.counts:
            self.counts[pool] = zero_counters()
            self.reasons[pool] = zero_reasons()
        return self.counts[pool]

    def _touch(self, key):
        self.lru.remove(key)
        self.lru.append(key)

    def walk(self, pool, hashes, rescue):
        """Walk pages in order; believed -> touch + hit; rescue(h) -> rescue;
        else one miss and stop."""
        c = self._known(pool)
        answer = True
        for h in hashes:
            c["pages_checked"] += 1
            key = self.key(pool, h)
            if key in self.lru:
                self._touch(key)
                c["page_hits"] += 1
            elif rescue(h):
                c["rescues"] += 1
            else:
                c["page_misses"] += 1
                self.reasons[pool][self.departed.get(key, "cold")] += 1
                answer = False
                break
        c["queries"] += 1
        c["query_hits" if answer else "query_misses"] += 1
        return answer

    def add_pages(self, pool, hashes):
        c = self._known(pool)
        c["adds"] += 1
        for h in hashes:
            key = self.key(pool, h)
            if key in self.lru:
                c["refreshes"] += 1
                self.lru.remove(key)
            else:
                c["inserts"] += 1
            self.lru.append(key)
        # The batch may overshoot the cap; evict oldest-first at its end.
        while len(self.lru) > self.max_entries:
            evicted = self.lru.pop(0)
            self.departed[evicted] = "evicted"
            self.counts[self.pool_of(evicted)]["evictions"] += 1

    def invalidate_pages(self, pool, hashes, keep_pages):
        c = self._known(pool)
        c["invalidate_calls"] += 1
        for h in list(hashes)[keep_pages:]:
            key = self.key(pool, h)
            if key in self.lru:
                self.lru.remove(key)
                self.departed[key] = "invalidated"
                c["invalidations"] += 1

    def clear_pages(self):
        """Forget every key; each known pool counts a clear and its entries."""
        for pool, c in self.counts.items():
            c["clears"] += 1
            c["cleared_pages"] += self.entries_of(pool)
        for key in self.lru:
            self.departed[key] = "cleared"
        self.lru = []

    def entries_of(self, pool):
        return sum(1 for key in self.lru if self.pool_of(key) == pool)

    def __len__(self):
        return len(self.lru)


# --------------------------------------------------------------------------
# Current generation: one LRU (+ in-flight refs) per pool, cap per pool.
# --------------------------------------------------------------------------


class RefPool(RefBeliefs):
    """Reference model of ``PoolBeliefs``: one pool's LRU and in-flight refs."""

    def __init__(self, name, max_entries):
        super().__init__(max_entries)
        self.name = name
        self.refs = {}  # page hash -> positive ref count
        self.counters = self._known(name)
        self.miss_reasons = self.reasons[name]

    def key(self, pool, h):
        return h

    def pool_of(self, key):
        return self.name

    # -- API --
    def add(self, hashes):
        self.add_pages(self.name, list(hashes))

    def contains(self, h):
        return self.walk(self.name, [h], rescue=lambda page: False)

    def contains_all(self, hashes):
        return self.walk(self.name, list(hashes), rescue=lambda page: False)

    def covered(self, hashes):
        return self.walk(self.name, list(hashes), rescue=lambda page: page in self.refs)

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
        self.invalidate_pages(self.name, hashes, keep_pages)

    def clear(self):
        self.clear_pages()
        self.refs = {}

    def clear_inflight(self):
        self.counters["inflight_clears"] += 1
        self.refs = {}

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


class RefFlat(RefBeliefs):
    """Reference model of ``FlatStorageExistenceCache``: one LRU of
    ``(pool, page hash)`` keys, one shared cap."""

    def __init__(self, max_entries):
        super().__init__(max_entries)
        self.counters = self.counts
        self.miss_reasons = self.reasons

    def key(self, pool, h):
        return (pool, h)

    def pool_of(self, key):
        return key[0]

    def add(self, pool, hashes):
        self.add_pages(pool, list(hashes))

    def contains(self, pool, h):
        return self.walk(pool, [h], rescue=lambda page: False)

    def contains_all(self, pool, hashes):
        return self.walk(pool, list(hashes), rescue=lambda page: False)

    def covers_all(self, pool, hashes, extra_cover=frozenset()):
        return self.walk(pool, list(hashes), rescue=lambda page: page in extra_cover)

    def invalidate_beyond(self, pool, hashes, keep_pages):
        self.invalidate_pages(pool, hashes, keep_pages)

    def clear(self):
        self.clear_pages()

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
