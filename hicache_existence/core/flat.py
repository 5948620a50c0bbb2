"""The seed API generation: one LRU over ``(pool, page_hash)`` with a shared cap.

Behaves exactly like the seed's ``StorageExistenceCache`` (global LRU order across
pools, one cap for all of them) with accounting, at a fraction of its per-page
cost.  The trick is the key: one ``LruIndex`` (``hicache_existence.core.lru``) holds
the single global LRU order, and a page's pool is a small integer *tag* stored
beside its hash, never a ``(pool, hash)`` tuple built and hashed per page (which
is half the seed's lookup cost and 67 bytes an entry).  The primary pool (``kv``
by default, where almost all traffic goes) has tag 0.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

from hicache_existence.core import _validate, lru
from hicache_existence.core.cache import HICACHE_EXISTENCE_CACHE_MAX_ENTRIES, MissMemoryFactory
from hicache_existence.core.counting import CountingPool
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource
from hicache_existence.core.stats import (
    CLEARED,
    EVICTED,
    INVALIDATED,
    CacheStats,
    make_cache_stats,
)

_EMPTY: frozenset[str] = frozenset()


class _Pool(CountingPool):
    """Per-pool bookkeeping of the flat cache: its counted lookups over the shared
    index under its tag (``CountingPool``, as the current generation's pools),
    and its entry count."""

    __slots__ = ("size",)

    def __init__(
        self,
        name: str,
        entries: lru.LruIndexType,
        tag: int,
        memory: MissMemory | None,
        observer: BeliefObserver | None,
        advisor: SamplerSource | None,
    ) -> None:
        super().__init__(name, entries, tag, memory, observer, advisor)
        #: Entries of this pool in the shared index.
        self.size = 0


class FlatStorageExistenceCache:
    """One LRU of ``(pool, page_hash)`` beliefs shared by all pools (seed API)."""

    def __init__(
        self,
        max_entries: int = HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
        *,
        primary_pool: str = "kv",
        miss_memory: MissMemoryFactory | None = None,
        observer: BeliefObserver | None = None,
        advisor: SamplerSource | None = None,
    ) -> None:
        self._max_entries = _validate.count(max_entries, "max_entries", 1)
        self._primary = _validate.pool_name(primary_pool, "primary_pool")
        self._entries: lru.LruIndexType = lru.LruIndex()
        self._pools: dict[str, _Pool] = {}
        self._by_tag: dict[int, _Pool] = {}
        self._miss_memory = miss_memory
        self._any_memory = False
        self._observer = observer
        self._advisor = advisor

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

    def _pool(self, resolved: _Pool | str, pages: Sequence[str] | None = None) -> _Pool:
        """The record for ``_resolve``'s answer, created only now, after the caller
        validated everything else, so a call that fails validation leaves no trace.
        ``pages`` are a batch the index checks only later, when it runs: a new pool
        checks them here first."""
        if isinstance(resolved, _Pool):
            return resolved
        if pages is not None:
            _validate.page_hashes(pages)
        rec = self._pools.get(resolved)
        if rec is None:
            memory = self._miss_memory(resolved) if self._miss_memory else None
            tag = 0 if resolved == self._primary else len(self._pools) + 1
            rec = _Pool(resolved, self._entries, tag, memory, self._observer, self._advisor)
            self._pools[resolved] = self._by_tag[tag] = rec
            self._any_memory = self._any_memory or memory is not None
        return rec

    # -- mutations -----------------------------------------------------------
    def add(self, pool: str, hashes: Iterable[str]) -> None:
        """Insert or refresh every page of ``pool`` in order, then evict the
        globally least recently used entries down to the shared cap."""
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
        seq = _validate.page_hashes(hashes)
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

    # -- queries -------------------------------------------------------------
    def contains(self, pool: str, page_hash: str) -> bool:
        """Whether one page of ``pool`` is believed stored; a hit is LRU-touched."""
        rec = self._resolve(pool)
        if not isinstance(rec, _Pool):  # a new pool: check the page before creating it
            _validate.page_hash(page_hash)
            rec = self._pool(rec)
        return rec.contains(page_hash)  # checks the page before any change

    def believed(self, pool: str, hashes: Iterable[str]) -> list[str]:
        """The pages of ``pool`` in ``hashes`` believed stored, neither touched nor
        counted: a read for accounting (was a written page believed at launch?)."""
        rec = self._pools.get(pool)
        if rec is None:
            return []
        contains, tag = self._entries.contains, rec.tag
        return [h for h in hashes if contains(h, tag)]

    def contains_all(self, pool: str, hashes: Iterable[str]) -> bool:
        """Whether every page is believed stored; stops at the first that is not,
        having LRU-touched the pages before it."""
        resolved = self._resolve(pool)
        seq = _validate.page_sequence(hashes)
        return self._pool(resolved, seq)._walk(seq, None)

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
        seq = _validate.page_sequence(hashes)
        return self._pool(resolved, seq)._walk(seq, extra_cover)

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
        names = {tag: rec.name for tag, rec in self._by_tag.items()}
        return tuple((names[tag], key) for tag, key in self._entries.items())

    def stats(self) -> CacheStats:
        """An immutable snapshot of every pool, O(pools); safe from another thread:
        the pool dict is copied in one C call before it is walked (listing its items
        can let a collection, then the scheduler thread, in between two pools)."""
        cap = self._max_entries
        return make_cache_stats(
            {
                name: rec._counters.snapshot(name, rec.size, cap, 0)
                for name, rec in self._pools.copy().items()
            },
            shared_capacity=True,
        )
