"""The current API generation (sglang 0.5.23): one LRU of believed page hashes per pool.

A drop-in for ``sglang.srt.mem_cache.buffer_mode.storage_existence_cache`` (same
classes, methods, results and LRU order) with accounting, its beliefs in an
``LruIndex`` (docs/design.md).  Mutate only on the scheduler thread at lockstep points
(TP replicas stay identical); ``stats()`` is safe from any thread.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence

from hicache_existence.core import _validate, lru
from hicache_existence.core.counting import CountingPool
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource
from hicache_existence.core.registry import MissMemoryFactory, PoolRegistry
from hicache_existence.core.stats import CLEARED, EVICTED, INVALIDATED

_SEQ = (list, tuple)

#: Upstream's default cap per pool (~32M tokens at page size 64).
HICACHE_EXISTENCE_CACHE_MAX_ENTRIES = 512 * 1024


class PoolBeliefs(CountingPool):
    """One pool's LRU of page hashes believed in L3 and its refcounted in-flight pages
    (D2H launch to storage ack); ``CountingPool`` counts lookups (and tallies covered
    pages), as for the seed."""

    __slots__ = ("_max_entries",)

    def __init__(
        self,
        max_entries: int = HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
        name: str = "kv",
        *,
        miss_memory: MissMemory | None = None,
        observer: BeliefObserver | None = None,
        advisor: SamplerSource | None = None,
    ) -> None:
        name = _validate.pool_name(name, "name")
        self._max_entries = _validate.count(max_entries, "max_entries", 1)
        # Upstream's attribute names (_entries, _inflight) for code that peeks; own index: tag 0.
        super().__init__(name, lru.LruIndex(), 0, miss_memory, observer, advisor)

    @property
    def max_entries(self) -> int:
        """The cap; lowering it takes effect at the next ``add``, as upstream."""
        return self._max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self._max_entries = _validate.count(value, "max_entries", 1)

    def add(self, hashes: Iterable[str]) -> None:
        """Insert or refresh every page in order, then evict oldest-first to the cap."""
        seq: Sequence[str] = (
            hashes if type(hashes) in _SEQ else _validate.page_sequence(hashes)  # type: ignore[assignment]
        )
        entries = self._entries
        n = len(seq)
        # Pages already present (or repeated) move to the MRU end, as upstream.
        inserted = entries.add(seq)
        c = self._counters
        c.adds += 1
        c.inserts += inserted
        c.refreshes += n - inserted
        excess = len(entries) - self._max_entries
        if excess > 0:
            self._evict(excess)
        if self._observer is not None:
            self._observer.added(self.name, seq)

    def _evict(self, excess: int) -> None:
        """The one eviction path: the ``excess`` least recently used entries."""
        if self._memory is None:
            self._entries.evict(excess)
        else:
            self._remember(self._entries.evict_keys(excess).get(0, []), EVICTED)
        self._counters.evictions += excess

    def invalidate_beyond(self, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop beliefs beyond the leading ``keep_pages`` of ``hashes`` (absent ones skipped)."""
        keep = _validate.count(keep_pages, "keep_pages")
        seq = lru.page_hashes(hashes)
        gone = self._entries.discard(seq[keep:])
        c = self._counters
        c.invalidate_calls += 1
        c.invalidations += len(gone)
        if gone:
            self._remember(gone, INVALIDATED)
        if self._observer is not None:
            self._observer.invalidated(self.name, seq, keep)

    def track_inflight(self, hashes: Iterable[str]) -> None:
        """One ref per page at its D2H launch (several writes may carry the same page)."""
        seq = lru.page_hashes(hashes)
        lru.inflight_add(self._inflight, seq)
        self._counters.inflight_tracked += len(seq)
        if self._observer is not None:
            self._observer.inflight(self.name, seq, 1)

    def untrack_inflight(self, hashes: Iterable[str]) -> None:
        """Drop one ref per page at the storage ack (or a failed launch)."""
        seq = lru.page_hashes(hashes)
        released, unmatched = lru.inflight_release(self._inflight, seq)
        c = self._counters
        c.inflight_released += released
        c.inflight_unmatched += unmatched
        if self._observer is not None:
            self._observer.inflight(self.name, seq, -1)

    def clear(self) -> None:
        """Forget every belief and in-flight ref (misses that follow are ``cleared``)."""
        entries = self._entries
        c = self._counters
        c.clears += 1
        c.cleared_pages += len(entries)
        if entries and self._memory is not None:
            self._remember(entries.keys(), CLEARED)
        entries.clear()
        self._inflight.clear()
        if self._observer is not None:
            self._observer.cleared(self.name, False)

    def clear_inflight(self) -> None:
        """Forget in-flight refs only (e.g. after the write pipeline is reset)."""
        self._inflight.clear()
        self._counters.inflight_clears += 1
        if self._observer is not None:
            self._observer.cleared(self.name, True)

    def believed(self, hashes: Iterable[str]) -> list[str]:
        """Believed pages of ``hashes``, untouched, uncounted: was a write's page believed?"""
        entries = self._entries
        return [h for h in hashes if h in entries]

    def contains_all(self, hashes: Iterable[str]) -> bool:
        """Every page believed stored?  Stops at the first that is not, touching those before."""
        return self._walk(_validate.page_sequence(hashes), None)

    def covered(self, hashes: Iterable[str]) -> bool:
        """Every page believed or in flight?  Touches believed ones; in-flight-only: rescues.
        (Upstream asks per admission: a list or tuple goes straight to the walk.)"""
        seq = hashes if type(hashes) in _SEQ else _validate.page_sequence(hashes)
        if self._walk(seq, self._inflight):  # type: ignore[arg-type]
            if self.tally:
                self.covered_pages += len(seq)  # type: ignore[arg-type]
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"PoolBeliefs(name={self.name!r}, entries={len(self._entries)}, "
            f"max_entries={self._max_entries}, inflight={len(self._inflight)})"
        )

    def lru_keys(self) -> tuple[str, ...]:
        """Believed page hashes, least recently used first (O(entries); for tests)."""
        return tuple(self._entries.keys())

    def inflight_pages(self) -> Container[str]:
        """The pages with an in-flight ref, live (the refcounts themselves)."""
        return self._inflight


#: Upstream's name for the per-pool class.
PoolExistenceBeliefs = PoolBeliefs


#: No name is this object (``StorageExistenceCache._alias`` before any name is seen).
_NO_ALIAS = object()


class StorageExistenceCache(PoolRegistry[PoolBeliefs]):
    """Every storage pool's beliefs, each pool created on first use.  All off by default (no
    arguments is upstream's call): ``miss_memory`` (``pool name -> MissMemory | None``, per
    new pool), ``observer`` (every pool's operations), ``advisor`` (new pools' samplers)."""

    shared_lru = False

    def __init__(
        self,
        max_entries: int = HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
        *,
        miss_memory: MissMemoryFactory | None = None,
        observer: BeliefObserver | None = None,
        advisor: SamplerSource | None = None,
    ) -> None:
        #: The last non-``str`` name asked for and its pool (a pool is never replaced):
        #: sglang asks with ``PoolName`` members, whose ``__hash__`` is Python code.
        #: One tuple, so a reader on another thread never pairs a name with another's pool.
        self._alias: tuple[object, PoolBeliefs | None] = (_NO_ALIAS, None)
        super().__init__(max_entries, miss_memory, observer, advisor)
        self._listen()

    def pool(self, name: str) -> PoolBeliefs:
        """The beliefs of pool ``name``, created on first use."""
        alias = self._alias
        if name is alias[0]:
            return alias[1]  # type: ignore[return-value]
        try:
            beliefs = self._pools.get(name)
        except TypeError:  # unhashable: let the validator word the error
            beliefs = None
        if beliefs is None:
            key = _validate.pool_name(name, "name")
            beliefs = self._pools.get(key)
            if beliefs is None:
                beliefs = PoolBeliefs(
                    self._max_entries,
                    key,
                    miss_memory=self._miss_memory(key) if self._miss_memory else None,
                    observer=self._observer,
                    advisor=self._advisor,
                )
                beliefs.tally = self._tally
                self._pools[key] = beliefs
        if type(name) is not str:
            self._alias = (name, beliefs)
        return beliefs

    def lru_items(self) -> Iterator[tuple[str, str]]:
        """``(pool, page_hash)`` beliefs, pool by pool, each least recently used first."""
        for beliefs in list(self._pools.values()):
            for key in beliefs.lru_keys():
                yield beliefs.name, key

    def clear(self) -> None:
        """Clear every pool (beliefs and in-flight refs)."""
        for beliefs in list(self._pools.values()):
            beliefs.clear()

    def clear_inflight(self) -> None:
        """Drop every pool's in-flight refs."""
        for beliefs in list(self._pools.values()):
            beliefs.clear_inflight()

    def __len__(self) -> int:
        """Entries over all pools."""
        return sum(len(b) for b in list(self._pools.values()))

    def __repr__(self) -> str:
        return f"StorageExistenceCache(max_entries={self._max_entries}, pools={list(self._pools)})"
