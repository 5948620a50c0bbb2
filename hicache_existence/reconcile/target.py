"""Uniform access to either cache generation for the reconciler's verdicts.

Mutations happen on the scheduler thread at the lockstep point, through the
cache's public API.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any


class CacheTarget:
    """The current (per-pool) or the seed (flat) generation's cache."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._per_pool = hasattr(cache, "pool")

    def invalidate_beyond(self, pool: str, chain: Sequence[str], keep: int) -> None:
        if self._per_pool:
            self._cache.pool(pool).invalidate_beyond(chain, keep)
        else:
            self._cache.invalidate_beyond(pool, chain, keep)

    def add(self, pool: str, chain: Sequence[str]) -> None:
        if self._per_pool:
            self._cache.pool(pool).add(chain)
        else:
            self._cache.add(pool, chain)

    def inflight(self, pool: str) -> Container[str] | None:
        """``pool``'s pages between D2H launch and storage ack (current generation:
        the cache's refcounts, upstream's ``_inflight``; the seed generation keeps
        none, the write path does: see ``Reconciler.inflight_cover``)."""
        if self._per_pool:
            refs: Container[str] | None = getattr(self._cache.pool(pool), "_inflight", None)
            return refs
        return None

    def counts(self, pool: str) -> tuple[int, int]:
        """(invalidations, inserts) of ``pool`` so far."""
        if self._per_pool:
            s = self._cache.pool(pool).stats()
        else:
            stats = self._cache.stats()
            if pool not in stats:
                return (0, 0)
            s = stats[pool]
        return (s.invalidations, s.inserts)

    def believes_all(self, pool: str, chain: Sequence[str]) -> bool:
        """Whether every page is believed, without touching the LRU (False when
        the cache offers no way to tell: learning then re-adds, harmlessly)."""
        if self._per_pool:
            entries = getattr(self._cache.pool(pool), "_entries", None)
            if entries is not None:
                return all(map(entries.__contains__, chain))
        return False
