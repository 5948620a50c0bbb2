"""Log events derived from snapshot deltas: first time at cap, eviction bursts,
clears.

Instead of hooks in the cache's hot path, ``Monitor.observe(stats)`` compares the
current ``stats()`` snapshot with the previous one, O(pools), at flush time.
Events use the stable names in ``hicache_existence.logs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hicache_existence import logs
from hicache_existence.core.stats import CacheStats, PoolStats


class Monitor:
    """Emits ``CACHE_AT_CAPACITY`` once per pool, ``CACHE_CLEARED`` per clear seen
    and ``EVICTION_BURST`` (at most one a minute per pool) when evictions per
    second over an interval exceed ``burst_fraction`` of the pool's capacity."""

    def __init__(
        self, *, burst_fraction: float = 0.05, clock: Callable[[], float] | None = None
    ) -> None:
        self.burst_fraction = float(burst_fraction)
        self._clock = clock or time.monotonic
        self._logger = logs.get_logger("hicache_existence.exporters.monitor")
        self._previous: CacheStats | None = None
        self._previous_at = 0.0
        self._at_cap: set[str] = set()
        self._limiters: dict[str, logs.RateLimiter] = {}

    def observe(self, stats: CacheStats) -> None:
        """Compare ``stats`` with the previous snapshot and log what changed."""
        now = self._clock()
        previous, elapsed = self._previous, now - self._previous_at
        self._previous, self._previous_at = stats, now
        log = self._logger
        # Seed generation: one cap shared by every pool, reached by their sum.
        shared = sum(p.entries for p in stats.pools.values()) if stats.shared_capacity else 0
        for pool, current in stats.items():
            entries = shared if stats.shared_capacity else current.entries
            if current.capacity and entries >= current.capacity and pool not in self._at_cap:
                self._at_cap.add(pool)
                log.info(
                    logs.CACHE_AT_CAPACITY,
                    pool=pool,
                    entries=current.entries,
                    capacity=current.capacity,
                    evictions=current.evictions,
                )
            if previous is None:
                continue
            before = previous.pools.get(pool) or PoolStats(pool)
            clears = current.clears - before.clears
            if clears > 0:
                cleared = current.cleared_pages - before.cleared_pages
                log.info(logs.CACHE_CLEARED, pool=pool, clears=clears, cleared_pages=cleared)
            evicted = current.evictions - before.evictions
            if evicted <= 0 or elapsed <= 0 or not current.capacity:
                continue
            rate = evicted / elapsed
            if rate >= self.burst_fraction * current.capacity:
                limiter = self._limiters.get(pool)
                if limiter is None:
                    limiter = self._limiters[pool] = logs.RateLimiter(1 / 60, clock=self._clock)
                if limiter.allow():
                    log.warning(
                        logs.EVICTION_BURST,
                        pool=pool,
                        evictions=evicted,
                        interval_s=round(elapsed, 3),
                        evictions_per_s=round(rate, 1),
                        capacity=current.capacity,
                        suppressed=limiter.take_suppressed(),
                    )
