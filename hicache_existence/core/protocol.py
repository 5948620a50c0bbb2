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
    """One pool's beliefs: ``PoolBeliefs`` or the seed generation's view of its shared LRU."""

    @property
    def name(self) -> str:
        """The pool's name (``"kv"``, ``"swa"``, ...)."""

    @property
    def max_entries(self) -> int:
        """The cap this pool counts against (shared by every pool if ``shared_lru``)."""

    def add(self, hashes: Iterable[str]) -> None:
        """Insert or refresh every page in order, then evict to the cap."""

    def invalidate_beyond(self, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop the beliefs beyond the leading ``keep_pages`` of ``hashes``."""

    def clear(self) -> None:
        """Forget this pool's beliefs and in-flight refs."""

    def contains(self, page_hash: str) -> bool:
        """One counted lookup; a hit is LRU-touched."""

    def contains_all(self, hashes: Iterable[str]) -> bool:
        """A counted chain lookup of believed pages (touches the believed prefix)."""

    def covered(self, hashes: Iterable[str]) -> bool:
        """A counted chain lookup of pages believed stored or in flight."""

    @property
    def covered_pages(self) -> int:
        """Pages of the ``covered()`` answered True while the tally was on."""

    def track_inflight(self, hashes: Iterable[str]) -> None:
        """One in-flight ref per page at its launch."""

    def untrack_inflight(self, hashes: Iterable[str]) -> None:
        """Drop one in-flight ref per page at its storage ack."""

    def believed(self, hashes: Iterable[str]) -> list[str]:
        """The pages of ``hashes`` believed stored: a read, neither touched nor counted."""

    def inflight_pages(self) -> Container[str]:
        """Pages from D2H launch to storage ack, live: read on the scheduler thread, never kept."""

    def lru_keys(self) -> tuple[str, ...]:
        """This pool's believed pages, least recently used first (O(entries))."""

    def inflight_refs(self) -> dict[str, int]:
        """A copy of the in-flight refcounts this pool keeps itself."""

    def stats(self) -> PoolStats:
        """An immutable snapshot of this pool's accounting."""


class ExistenceCache(Protocol):
    """A whole existence cache of either generation, as this package uses it."""

    @property
    def shared_lru(self) -> bool:
        """Whether every pool lives in one LRU under one cap (the seed generation)."""

    @property
    def max_entries(self) -> int:
        """The cap (per pool created from now on; or the one shared cap)."""

    def pool(self, name: str) -> PoolView:
        """The beliefs of pool ``name``, created on first use."""

    def pools(self) -> tuple[PoolView, ...]:
        """Every pool created so far, in creation order."""

    def pool_names(self) -> tuple[str, ...]:
        """Names of the pools created so far, in creation order."""

    def clear(self) -> None:
        """Forget every belief of every pool."""

    def tally_covered(self, on: bool) -> None:
        """Turn every pool's tally of covered pages (``covered_pages``) on or off."""

    def settle(self) -> None:
        """Classify every pool's pending misses (miss reasons)."""

    def stats(self) -> CacheStats:
        """An immutable snapshot of every pool; safe from another thread."""

    def lru_items(self) -> Iterable[tuple[str, str]]:
        """``(pool, page_hash)`` beliefs oldest first: one order if ``shared_lru``, else by pool."""

    def __len__(self) -> int:
        """Entries over all pools."""


__all__ = ["ExistenceCache", "PoolView"]
