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

from collections import Counter
from collections.abc import Container, Iterable, Sequence

from hicache_existence.core import _validate, lru
from hicache_existence.core.cache import HICACHE_EXISTENCE_CACHE_MAX_ENTRIES, MissMemoryFactory
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource
from hicache_existence.core.sampler import SamplerType
from hicache_existence.core.stats import (
    CLEARED,
    EVICTED,
    INVALIDATED,
    CacheStats,
    PoolCounters,
    make_cache_stats,
)

_EMPTY: frozenset[str] = frozenset()


class _Pool:
    """Per-pool bookkeeping of the flat cache: its name, index tag, counters,
    entry count."""

    __slots__ = ("name", "tag", "counters", "size", "memory", "missed", "sampler")

    def __init__(self, name: str, tag: int, memory: MissMemory | None) -> None:
        self.name = name
        self.tag = tag
        self.counters = PoolCounters()
        self.size = 0
        self.memory = memory
        self.missed: list[str] = []
        #: The capacity advisor's sampler, fed by the index under ``tag``.
        self.sampler: SamplerType | None = None

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
            rec = self._pools[resolved] = _Pool(resolved, tag, memory)
            self._by_tag[tag] = rec
            if self._advisor is not None:
                entries = self._entries
                rec.sampler = self._advisor.sampler(resolved, lru.sampler_class(entries))
                entries.attach(tag, rec.sampler)
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
        by_tag = self._by_tag
        if not self._any_memory:
            for tag, evicted in self._entries.evict(excess).items():
                rec = by_tag[tag]
                rec.size -= evicted
                rec.counters.evictions += evicted
            return
        for tag, hashes in self._entries.evict_keys(excess).items():
            rec = by_tag[tag]
            rec.size -= len(hashes)
            rec.counters.evictions += len(hashes)
            if rec.memory is not None:
                rec.remember(hashes, EVICTED)

    def invalidate_beyond(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop ``pool``'s beliefs beyond the leading ``keep_pages`` of ``hashes``."""
        resolved = self._resolve(pool)
        keep = _validate.count(keep_pages, "keep_pages")
        seq = _validate.page_hashes(hashes)
        rec = self._pool(resolved)
        gone = self._entries.discard(seq[keep:], rec.tag)
        rec.size -= len(gone)
        c = rec.counters
        c.invalidate_calls += 1
        c.invalidations += len(gone)
        if gone and rec.memory is not None:
            rec.remember(gone, INVALIDATED)
        if self._observer is not None:
            self._observer.invalidated(rec.name, seq, keep)

    def clear(self) -> None:
        """Forget every belief of every pool."""
        pools = self._pools
        if self._any_memory:
            # Drain oldest first, grouped by pool, for the miss memories.
            for tag, hashes in self._entries.evict_keys(len(self._entries)).items():
                self._by_tag[tag].remember(hashes, CLEARED)
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
        c = rec.counters
        c.queries += 1
        c.pages_checked += 1
        if self._entries.touch(page_hash, rec.tag):
            c.page_hits += 1
            c.query_hits += 1
            if rec.sampler is not None:
                rec.sampler.walked((page_hash,), 1, rec.tag)
            if self._observer is not None:
                self._observer.touched(rec.name, (page_hash,), 1)
            return True
        c.query_misses += 1
        self._count_miss(rec, page_hash)
        if rec.sampler is not None:
            rec.sampler.walked((page_hash,), 0, rec.tag)
        if self._observer is not None:
            self._observer.touched(rec.name, (page_hash,), 0)
        return False

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
        return self._walk(self._pool(resolved, seq), seq, _EMPTY)

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
        return self._walk(self._pool(resolved, seq), seq, extra_cover)

    def _walk(self, rec: _Pool, seq: Sequence[str], cover: Container[str]) -> bool:
        n = len(seq)
        pos = self._entries.touch_prefix(seq, rec.tag)  # validates seq before any change
        c = rec.counters
        c.queries += 1
        if pos != n:
            return self._walk_rest(rec, seq, pos, cover if cover else None)
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
            touch = self._entries.touch
            name = rec.name
            tag = rec.tag
            for i in range(pos, len(seq)):
                h = seq[i]
                if touch(h, tag):
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
                if rec.sampler is not None:
                    rec.sampler.walked(seq, n, tag)
                if self._observer is not None:
                    self._observer.touched(name, seq, n)
                return True
        stop = hits + rescues
        c.query_misses += 1
        c.pages_checked += stop + 1
        c.page_hits += hits
        c.rescues += rescues
        self._count_miss(rec, seq[stop])
        if rec.sampler is not None:
            rec.sampler.walked(seq, stop, rec.tag)
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
        names = {tag: rec.name for tag, rec in self._by_tag.items()}
        return tuple((names[tag], key) for tag, key in self._entries.items())

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
