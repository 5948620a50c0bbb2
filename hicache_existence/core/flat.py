"""The seed API generation: one LRU over ``(pool, page_hash)`` with a shared cap.

Behaves exactly like the seed's ``StorageExistenceCache`` (global LRU order, one cap
for all pools) with accounting: one ``LruIndex`` holds the global order, a page's pool
a small int *tag* beside its hash (docs/design.md); the primary pool (``kv`` by
default, almost all traffic) has tag 0.  ``pool(name)`` offers each pool as a
``core.protocol.PoolView`` whose mutations and chain lookups are the cache's own
public calls, so they behave (and are observed by the write hooks) as upstream's are.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence

from hicache_existence.core import _validate, lru
from hicache_existence.core.cache import HICACHE_EXISTENCE_CACHE_MAX_ENTRIES
from hicache_existence.core.counting import CountingPool
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource
from hicache_existence.core.registry import MissMemoryFactory, PoolRegistry
from hicache_existence.core.stats import CLEARED, EVICTED, INVALIDATED

_EMPTY: frozenset[str] = frozenset()


class FlatPoolBeliefs(CountingPool):
    """One pool of the flat cache as a ``PoolView``: lookups over the shared index under its
    tag, its entry count, in-flight refs; mutations and chain lookups call the cache."""

    __slots__ = ("size", "_cache", "_cover")

    def __init__(
        self,
        cache: FlatStorageExistenceCache,
        name: str,
        tag: int,
        memory: MissMemory | None,
    ) -> None:
        super().__init__(name, cache._entries, tag, memory, cache._observer, cache._advisor)
        #: Entries of this pool in the shared index.
        self.size = 0
        self._cache = cache
        # The last covers_all's extra_cover (buffer mode: the seed's live
        # inflight_backup_hashes).  Cache mode's own in-flight refs are CountingPool's.
        self._cover: Container[str] = _EMPTY

    @property
    def max_entries(self) -> int:
        """The cap shared by every pool."""
        return self._cache.max_entries

    def add(self, hashes: Iterable[str]) -> None:
        self._cache.add(self.name, hashes)

    def invalidate_beyond(self, hashes: Sequence[str], keep_pages: int) -> None:
        self._cache.invalidate_beyond(self.name, hashes, keep_pages)

    def contains_all(self, hashes: Iterable[str]) -> bool:
        return self._cache.contains_all(self.name, hashes)

    def covered(self, hashes: Iterable[str]) -> bool:
        """``covers_all`` with this pool's in-flight refs as the extra cover."""
        if not self.tally:
            return self._cache.covers_all(self.name, hashes, extra_cover=self._inflight)
        seq = _validate.page_sequence(hashes)
        if self._cache.covers_all(self.name, seq, extra_cover=self._inflight):
            self.covered_pages += len(seq)
            return True
        return False

    def track_inflight(self, hashes: Iterable[str]) -> None:
        """Our own refs (cache mode), counted as the current generation counts them;
        upstream's pipeline set (buffer mode) is upstream's and is not counted."""
        seq = lru.page_hashes(hashes)
        lru.inflight_add(self._inflight, seq)
        self._counters.inflight_tracked += len(seq)

    def untrack_inflight(self, hashes: Iterable[str]) -> None:
        released, unmatched = lru.inflight_release(self._inflight, lru.page_hashes(hashes))
        self._counters.inflight_released += released
        self._counters.inflight_unmatched += unmatched

    def clear(self) -> None:
        """Forget this pool's beliefs and in-flight refs (the others' stay)."""
        gone = self._entries.discard(self.lru_keys(), self.tag)
        self.size -= len(gone)
        c = self._counters
        c.clears += 1
        c.cleared_pages += len(gone)
        if gone:
            self._remember(gone, CLEARED)
        self._inflight.clear()
        if self._observer is not None:
            self._observer.cleared(self.name, False)

    def believed(self, hashes: Iterable[str]) -> list[str]:
        contains, tag = self._entries.contains, self.tag
        return [h for h in hashes if contains(h, tag)]

    def inflight_pages(self) -> Container[str]:
        """Our own in-flight refs and what upstream's last ``covers_all`` covered as such."""
        own, cover = self._inflight, self._cover
        if not own:
            return cover
        if not cover or cover is own:
            return own
        return _Both(own, cover)

    def lru_keys(self) -> tuple[str, ...]:
        tag = self.tag
        return tuple(k for t, k in self._entries.items() if t == tag)

    def __len__(self) -> int:
        return self.size


class _Both:
    """Two in-flight sources read as one (only in a process mixing both modes)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, page: object) -> bool:
        return page in self.a or page in self.b


class FlatStorageExistenceCache(PoolRegistry[FlatPoolBeliefs]):
    """One LRU of ``(pool, page_hash)`` beliefs shared by all pools (seed API)."""

    shared_lru = True

    def __init__(
        self,
        max_entries: int = HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
        *,
        primary_pool: str = "kv",
        miss_memory: MissMemoryFactory | None = None,
        observer: BeliefObserver | None = None,
        advisor: SamplerSource | None = None,
    ) -> None:
        super().__init__(max_entries, miss_memory, observer, advisor)
        self._primary = _validate.pool_name(primary_pool, "primary_pool")
        self._entries: lru.LruIndexType = lru.LruIndex()
        self._by_tag: dict[int, FlatPoolBeliefs] = {}
        self._any_memory = False
        self._listen()

    def _resolve(self, pool: str) -> FlatPoolBeliefs | str:
        """A known ``pool``'s record (the hot path: one dict lookup), else its checked name."""
        try:
            rec = self._pools.get(pool)
        except TypeError:
            rec = None
        return rec if rec is not None else _validate.pool_name(pool)

    def _pool(
        self, resolved: FlatPoolBeliefs | str, pages: Sequence[str] | None = None
    ) -> FlatPoolBeliefs:
        """``_resolve``'s record, created only after the caller validated all (a failed call
        leaves no trace); a new pool first checks ``pages``, which the index checks later."""
        if isinstance(resolved, FlatPoolBeliefs):
            return resolved
        if pages is not None:
            lru.page_hashes(pages)
        rec = self._pools.get(resolved)
        if rec is None:
            memory = self._miss_memory(resolved) if self._miss_memory else None
            tag = 0 if resolved == self._primary else len(self._pools) + 1
            rec = FlatPoolBeliefs(self, resolved, tag, memory)
            rec.tally = self._tally
            self._pools[resolved] = self._by_tag[tag] = rec
            self._any_memory = self._any_memory or memory is not None
        return rec

    def add(self, pool: str, hashes: Iterable[str]) -> None:
        """Insert or refresh ``pool``'s pages in order, then evict globally LRU to the cap."""
        resolved = self._resolve(pool)
        seq = _validate.page_sequence(hashes)
        entries = self._entries
        rec = self._pool(resolved, seq)
        n = len(seq)
        inserted = entries.add(seq, rec.tag)
        rec.size += inserted
        c = rec._counters
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
        by_tag = self._by_tag
        if not self._any_memory:
            for tag, evicted in self._entries.evict(excess).items():
                rec = by_tag[tag]
                rec.size -= evicted
                rec._counters.evictions += evicted
            return
        for tag, hashes in self._entries.evict_keys(excess).items():
            rec = by_tag[tag]
            rec.size -= len(hashes)
            rec._counters.evictions += len(hashes)
            rec._remember(hashes, EVICTED)

    def invalidate_beyond(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop ``pool``'s beliefs beyond the leading ``keep_pages`` of ``hashes``."""
        resolved = self._resolve(pool)
        keep = _validate.count(keep_pages, "keep_pages")
        seq = lru.page_hashes(hashes)
        rec = self._pool(resolved)
        gone = self._entries.discard(seq[keep:], rec.tag)
        rec.size -= len(gone)
        c = rec._counters
        c.invalidate_calls += 1
        c.invalidations += len(gone)
        if gone:
            rec._remember(gone, INVALIDATED)
        if self._observer is not None:
            self._observer.invalidated(rec.name, seq, keep)

    def clear(self) -> None:
        """Forget every belief of every pool."""
        pools = self._pools
        if self._any_memory:
            # Drain oldest first, grouped by pool, for the miss memories.
            for tag, hashes in self._entries.evict_keys(len(self._entries)).items():
                self._by_tag[tag]._remember(hashes, CLEARED)
        self._entries.clear()
        for rec in list(pools.values()):
            c = rec._counters
            c.clears += 1
            c.cleared_pages += rec.size
            rec.size = 0
            if self._observer is not None:
                self._observer.cleared(rec.name, False)

    def contains(self, pool: str, page_hash: str) -> bool:
        """Whether one page of ``pool`` is believed stored; a hit is LRU-touched."""
        rec = self._resolve(pool)
        if not isinstance(rec, FlatPoolBeliefs):  # a new pool: check the page before creating it
            _validate.page_hash(page_hash)
            rec = self._pool(rec)
        return rec.contains(page_hash)  # checks the page before any change

    def believed(self, pool: str, hashes: Iterable[str]) -> list[str]:
        """Believed pages of ``hashes`` in ``pool``, untouched, uncounted (accounting)."""
        rec = self._pools.get(pool)
        return [] if rec is None else rec.believed(hashes)

    def contains_all(self, pool: str, hashes: Iterable[str]) -> bool:
        """Every page believed stored?  Stops at the first that is not, touching those before."""
        resolved = self._resolve(pool)
        seq = _validate.page_sequence(hashes)
        return self._pool(resolved, seq)._walk(seq, None)

    def covers_all(
        self,
        pool: str,
        hashes: Iterable[str],
        extra_cover: Container[str] = _EMPTY,
    ) -> bool:
        """Every page believed or in ``extra_cover`` (e.g. D2H launched, storage ack certain)?
        Believed pages are touched; those only in ``extra_cover`` are rescues."""
        resolved = self._resolve(pool)
        _validate.container(extra_cover, "extra_cover")
        seq = _validate.page_sequence(hashes)
        rec = self._pool(resolved, seq)
        rec._cover = extra_cover  # the pool's in-flight pages (``inflight_pages``)
        return rec._walk(seq, extra_cover)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"FlatStorageExistenceCache(max_entries={self._max_entries}, "
            f"entries={len(self._entries)}, pools={list(self._pools)})"
        )

    def pool(self, name: str) -> FlatPoolBeliefs:
        """Pool ``name`` as a ``PoolView``, created on first use (as the seed's calls do)."""
        return self._pool(self._resolve(name))

    def lru_items(self) -> Iterator[tuple[str, str]]:
        """``(pool, page_hash)`` beliefs in the one shared LRU order, oldest first."""
        names = {tag: rec.name for tag, rec in self._by_tag.items()}
        return ((names[tag], key) for tag, key in self._entries.items())

    def lru_keys(self) -> tuple[tuple[str, str], ...]:
        """``(pool, page_hash)`` beliefs, least recently used first (for tests)."""
        return tuple(self.lru_items())
