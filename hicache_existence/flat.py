"""The seed API generation: one LRU over ``(pool, page_hash)`` with a shared cap.

Behaves exactly like the seed's ``StorageExistenceCache`` (global LRU order across
pools, one cap for all of them) with accounting, at a fraction of its per-page
cost.  The trick is the key: pages of the primary pool (``kv`` by default, where
almost all traffic goes) are keyed by the hash string itself, other pools by a
``(pool, hash)`` tuple.  A ``str`` never equals a ``tuple``, so the key spaces
cannot collide, one ``OrderedDict`` still holds the single global LRU order, and
the primary pool skips building and hashing a tuple per page (which is half the
seed's lookup cost and 67 bytes an entry).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import repeat
from operator import itemgetter

from hicache_existence import _validate
from hicache_existence.cache import (
    _ABSENT,
    HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
    MissMemoryFactory,
    _exhaust,
)
from hicache_existence.observers import BeliefObserver, MissMemory
from hicache_existence.stats import (
    CLEARED,
    EVICTED,
    INVALIDATED,
    CacheStats,
    PoolCounters,
    make_cache_stats,
)

_Key = str | tuple[str, str]
_EMPTY: frozenset[str] = frozenset()


class _Pool:
    """Per-pool bookkeeping of the flat cache: its name, counters, entry count."""

    __slots__ = ("name", "counters", "size", "memory", "missed")

    def __init__(self, name: str, memory: MissMemory | None) -> None:
        self.name = name
        self.counters = PoolCounters()
        self.size = 0
        self.memory = memory
        self.missed: list[str] = []

    def settle(self) -> None:
        """Classify the misses recorded since the last call (see cache.py)."""
        missed = self.missed
        if not missed or self.memory is None:
            return
        self.missed = []
        counts = self.counters.miss_reasons
        for reason, n in Counter(self.memory.classify(missed)).items():
            counts[reason] += n

    def remember(self, keys: list[str], reason: int) -> None:
        """Settle pending misses, then record ``keys`` leaving for ``reason``."""
        if self.memory is not None:
            self.settle()
            self.memory.remember(keys, reason)


class FlatStorageExistenceCache:
    """One LRU of ``(pool, page_hash)`` beliefs shared by all pools (seed API)."""

    def __init__(
        self,
        max_entries: int = HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
        *,
        primary_pool: str = "kv",
        miss_memory: MissMemoryFactory | None = None,
        observer: BeliefObserver | None = None,
    ) -> None:
        self._max_entries = _validate.count(max_entries, "max_entries", 1)
        self._primary = _validate.pool_name(primary_pool, "primary_pool")
        self._entries: OrderedDict[_Key, None] = OrderedDict()
        self._pools: dict[str, _Pool] = {}
        self._miss_memory = miss_memory
        self._any_memory = False
        self._observer = observer

    @property
    def max_entries(self) -> int:
        """The cap shared by every pool; lowering it takes effect at the next add."""
        return self._max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self._max_entries = _validate.count(value, "max_entries", 1)

    def _resolve(self, pool: str) -> _Pool | str:
        """The record of a known ``pool``, else its validated name (raises on a bad
        one).  Known pools skip validation: the hot path pays one dict lookup."""
        try:
            rec = self._pools.get(pool)
        except TypeError:
            rec = None
        return rec if rec is not None else _validate.pool_name(pool)

    def _pool(self, resolved: _Pool | str) -> _Pool:
        """The record for ``_resolve``'s answer, created only now, after the caller
        validated everything else, so a call that fails validation leaves no trace."""
        if isinstance(resolved, _Pool):
            return resolved
        rec = self._pools.get(resolved)
        if rec is None:
            memory = self._miss_memory(resolved) if self._miss_memory else None
            rec = self._pools[resolved] = _Pool(resolved, memory)
            self._any_memory = self._any_memory or memory is not None
        return rec

    def _keys(self, rec: _Pool, seq: Sequence[str]) -> Sequence[_Key]:
        if rec.name == self._primary:
            return seq
        return list(zip(repeat(rec.name), seq))

    # -- mutations -----------------------------------------------------------
    def add(self, pool: str, hashes: Iterable[str]) -> None:
        """Insert or refresh every page of ``pool`` in order, then evict the
        globally least recently used entries down to the shared cap."""
        resolved = self._resolve(pool)
        seq = _validate.page_hashes(hashes)
        rec = self._pool(resolved)
        keys = self._keys(rec, seq)
        entries = self._entries
        n = len(seq)
        before = len(entries)
        for key in keys:  # measured faster than OrderedDict.update(zip(...)) here
            entries[key] = None
        inserted = len(entries) - before
        if inserted != n:
            _exhaust(map(entries.move_to_end, keys))
        rec.size += inserted
        c = rec.counters
        c.adds += 1
        c.inserts += inserted
        c.refreshes += n - inserted
        excess = len(entries) - self._max_entries
        if excess > 0:
            self._evict(excess)
        if self._observer is not None:
            self._observer.added(rec.name, seq)

    def _evict(self, excess: int) -> None:
        """The one eviction path; attributes each evicted entry to its pool."""
        popitem = self._entries.popitem
        pools = self._pools
        if len(pools) == 1 and not self._any_memory:
            # One pool owns every entry: nothing to attribute, drain in C.
            _exhaust(map(popitem, repeat(False, excess)))
            (rec,) = pools.values()
            rec.size -= excess
            rec.counters.evictions += excess
            return
        keys = [key for key, _ in map(popitem, repeat(False, excess))]
        others = [key for key in keys if type(key) is tuple]
        counts: dict[str, int] = Counter(map(itemgetter(0), others))
        if len(others) != len(keys):
            counts[self._primary] = len(keys) - len(others)
        for name, evicted in counts.items():
            rec = pools[name]
            rec.size -= evicted
            rec.counters.evictions += evicted
            if rec.memory is not None:
                if name == self._primary:
                    hashes = [key for key in keys if type(key) is str]
                else:
                    hashes = [key[1] for key in others if key[0] == name]
                rec.remember(hashes, EVICTED)

    def invalidate_beyond(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop ``pool``'s beliefs beyond the leading ``keep_pages`` of ``hashes``."""
        resolved = self._resolve(pool)
        keep = _validate.count(keep_pages, "keep_pages")
        seq = _validate.page_hashes(hashes)
        rec = self._pool(resolved)
        tail = seq[keep:]
        results = list(map(self._entries.pop, self._keys(rec, tail), repeat(_ABSENT)))
        dropped = len(tail) - results.count(_ABSENT)
        rec.size -= dropped
        c = rec.counters
        c.invalidate_calls += 1
        c.invalidations += dropped
        if dropped and rec.memory is not None:
            rec.remember([h for h, r in zip(tail, results) if r is not _ABSENT], INVALIDATED)
        if self._observer is not None:
            self._observer.invalidated(rec.name, seq, keep)

    def clear(self) -> None:
        """Forget every belief of every pool."""
        pools = self._pools
        if any(rec.memory is not None for rec in pools.values()):
            by_pool: dict[str, list[str]] = {}
            for key in self._entries:
                if type(key) is str:
                    by_pool.setdefault(self._primary, []).append(key)
                else:
                    by_pool.setdefault(key[0], []).append(key[1])
            for name, hashes in by_pool.items():
                pools[name].remember(hashes, CLEARED)
        self._entries.clear()
        for rec in list(pools.values()):
            c = rec.counters
            c.clears += 1
            c.cleared_pages += rec.size
            rec.size = 0
            if self._observer is not None:
                self._observer.cleared(rec.name, False)

    # -- queries -------------------------------------------------------------
    def contains(self, pool: str, page_hash: str) -> bool:
        """Whether one page of ``pool`` is believed stored; a hit is LRU-touched."""
        resolved = self._resolve(pool)
        _validate.page_hash(page_hash)
        rec = self._pool(resolved)
        key: _Key = page_hash if rec.name == self._primary else (rec.name, page_hash)
        entries = self._entries
        c = rec.counters
        c.queries += 1
        c.pages_checked += 1
        if key in entries:
            entries.move_to_end(key)
            c.page_hits += 1
            c.query_hits += 1
            if self._observer is not None:
                self._observer.touched(rec.name, (page_hash,), 1)
            return True
        c.query_misses += 1
        self._count_miss(rec, page_hash)
        if self._observer is not None:
            self._observer.touched(rec.name, (page_hash,), 0)
        return False

    def contains_all(self, pool: str, hashes: Iterable[str]) -> bool:
        """Whether every page is believed stored; stops at the first that is not,
        having LRU-touched the pages before it."""
        resolved = self._resolve(pool)
        seq = _validate.page_hashes(hashes)
        return self._walk(self._pool(resolved), seq, _EMPTY)

    def covers_all(
        self,
        pool: str,
        hashes: Iterable[str],
        extra_cover: Container[str] = _EMPTY,
    ) -> bool:
        """Whether every page is believed stored or in ``extra_cover`` (e.g. its
        D2H was launched and the storage ack is certain).  Believed pages are
        LRU-touched; pages covered only by ``extra_cover`` are rescues."""
        resolved = self._resolve(pool)
        _validate.container(extra_cover, "extra_cover")
        seq = _validate.page_hashes(hashes)
        return self._walk(self._pool(resolved), seq, extra_cover)

    def _walk(self, rec: _Pool, seq: Sequence[str], cover: Container[str]) -> bool:
        c = rec.counters
        c.queries += 1
        move_to_end = self._entries.move_to_end
        primary = rec.name == self._primary
        try:
            if primary:
                _exhaust(map(move_to_end, seq))
            else:
                _exhaust(map(move_to_end, zip(repeat(rec.name), seq)))
        except KeyError as miss:
            if primary:
                pos = seq.index(miss.args[0])
            else:
                # A tuple key may arrive as the exception's args tuple itself.
                key = miss.args[0] if len(miss.args) == 1 else miss.args
                pos = seq.index(key[1])
            return self._walk_rest(rec, seq, pos, cover if cover else None)
        n = len(seq)
        c.query_hits += 1
        c.pages_checked += n
        c.page_hits += n
        if n and self._observer is not None:
            self._observer.touched(rec.name, seq, n)
        return True

    def _walk_rest(
        self, rec: _Pool, seq: Sequence[str], pos: int, cover: Container[str] | None
    ) -> bool:
        """Finish a walk from ``seq[pos]``, the first page not believed (Python
        loop, as the seed's; only on a miss or an extra-cover rescue)."""
        c = rec.counters
        hits = pos
        rescues = 0
        if cover is not None:
            entries = self._entries
            move_to_end = entries.move_to_end
            name = rec.name
            primary = name == self._primary
            for i in range(pos, len(seq)):
                h = seq[i]
                key: _Key = h if primary else (name, h)
                if key in entries:
                    move_to_end(key)
                    hits += 1
                elif h in cover:
                    rescues += 1
                else:
                    break
            else:
                n = len(seq)
                c.query_hits += 1
                c.pages_checked += n
                c.page_hits += hits
                c.rescues += rescues
                if self._observer is not None:
                    self._observer.touched(name, seq, n)
                return True
        stop = hits + rescues
        c.query_misses += 1
        c.pages_checked += stop + 1
        c.page_hits += hits
        c.rescues += rescues
        self._count_miss(rec, seq[stop])
        if self._observer is not None:
            self._observer.touched(rec.name, seq, stop)
        return False

    @staticmethod
    def _count_miss(rec: _Pool, page_hash: str) -> None:
        rec.counters.page_misses += 1
        if rec.memory is not None:
            rec.missed.append(page_hash)  # classified in a batch by settle()

    def settle(self) -> None:
        """Classify every pool's pending misses (miss reasons); scheduler thread."""
        for rec in list(self._pools.values()):
            rec.settle()

    # -- introspection -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"FlatStorageExistenceCache(max_entries={self._max_entries}, "
            f"entries={len(self._entries)}, pools={list(self._pools)})"
        )

    def pool_names(self) -> tuple[str, ...]:
        """Pools seen so far, in first-use order."""
        return tuple(self._pools)

    def lru_keys(self) -> tuple[tuple[str, str], ...]:
        """``(pool, page_hash)`` beliefs, least recently used first (for tests)."""
        primary = self._primary
        return tuple(
            (primary, key) if type(key) is str else key  # type: ignore[misc]
            for key in self._entries
        )

    def stats(self) -> CacheStats:
        """An immutable snapshot of every pool, O(pools); safe from another thread."""
        cap = self._max_entries
        return make_cache_stats(
            {
                name: rec.counters.snapshot(name, rec.size, cap, 0)
                for name, rec in list(self._pools.items())
            },
            shared_capacity=True,
        )
