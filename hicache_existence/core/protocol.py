"""The one interface both cache generations offer the rest of the package.

The current generation (sglang 0.5.22+) hands out an object per pool
(``cache.pool(name).add(hashes)``); the seed's (0.5.19-0.5.21) takes the pool in every
call (``cache.add(pool, hashes)``) with one LRU and one cap for all pools.  Both shapes
stay, exactly, for sglang; the package (reconciler, cache-mode writes, TP digests and
divergence checks, runtime) speaks only the per-pool protocols below, which the seed
generation offers as views of its shared LRU.  The one difference left is a fact:
``shared_lru``, one pool's operations can evict another's (the digest then audits the
shared order, a divergence heal clears everything, the advisor reports one cap).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Protocol

from hicache_existence.core.stats import CacheStats, PoolStats


class PoolView(Protocol):
    """One pool's beliefs: ``PoolBeliefs`` or the seed generation's view of its shared LRU
    (``FlatPoolBeliefs``), whose methods document each call.  Lookups are counted and
    touch the believed pages they walk; ``believed`` reads, neither touching nor counting."""

    @property
    def name(self) -> str: ...
    @property
    def max_entries(self) -> int:
        """The cap this pool counts against (shared by every pool if ``shared_lru``)."""

    @property
    def covered_pages(self) -> int: ...
    def add(self, hashes: Iterable[str]) -> None: ...
    def invalidate_beyond(self, hashes: Sequence[str], keep_pages: int) -> None: ...
    def clear(self) -> None: ...
    def contains(self, page_hash: str) -> bool: ...
    def contains_all(self, hashes: Iterable[str]) -> bool: ...
    def covered(self, hashes: Iterable[str]) -> bool: ...
    def track_inflight(self, hashes: Iterable[str]) -> None: ...
    def untrack_inflight(self, hashes: Iterable[str]) -> None: ...
    def believed(self, hashes: Iterable[str]) -> list[str]: ...
    def inflight_pages(self) -> Container[str]:
        """Pages from D2H launch to storage ack, live: read on the scheduler thread, never kept."""

    def lru_keys(self) -> tuple[str, ...]: ...
    def inflight_refs(self) -> dict[str, int]: ...
    def stats(self) -> PoolStats: ...


class ExistenceCache(Protocol):
    """A whole existence cache of either generation, as this package uses it."""

    @property
    def shared_lru(self) -> bool:
        """Whether every pool lives in one LRU under one cap (the seed generation)."""

    @property
    def max_entries(self) -> int:
        """The cap (per pool created from now on; or the one shared cap)."""

    def pool(self, name: str) -> PoolView: ...
    def pools(self) -> tuple[PoolView, ...]: ...
    def pool_names(self) -> tuple[str, ...]: ...
    def clear(self) -> None: ...
    def tally_covered(self, on: bool) -> None: ...
    def settle(self) -> None: ...
    def stats(self) -> CacheStats:
        """An immutable snapshot of every pool; safe from another thread."""

    def lru_items(self) -> Iterable[tuple[str, str]]:
        """``(pool, page_hash)`` beliefs oldest first: one order if ``shared_lru``, else by pool."""

    def __len__(self) -> int: ...


__all__ = ["ExistenceCache", "PoolView"]
