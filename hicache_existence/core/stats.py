"""Accounting: mutable per-pool counters (recording) and frozen snapshots (reporting).

Recording is plain ``int`` attributes on a slotted object, bumped once per *call*
with the call's page counts (never once per page: a metrics-library call costs
more than the page lookup it would count).  Reporting is an immutable snapshot
with derived ratios, modelled on Caffeine's ``CacheStats``: ratios are 1.0 when
nothing was asked, and snapshots subtract to deltas so exporters and tests can
reason about an interval.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

#: Why a page missed.  Index order is the order of ``PoolCounters.miss_reasons``.
MISS_REASONS: tuple[str, ...] = ("cold", "evicted", "invalidated", "cleared")
COLD, EVICTED, INVALIDATED, CLEARED = range(4)

#: Monotonic counters, in snapshot field order.
COUNTER_FIELDS: tuple[str, ...] = (
    "queries",
    "query_hits",
    "query_misses",
    "pages_checked",
    "page_hits",
    "rescues",
    "page_misses",
    "adds",
    "inserts",
    "refreshes",
    "evictions",
    "invalidate_calls",
    "invalidations",
    "clears",
    "cleared_pages",
    "inflight_tracked",
    "inflight_released",
    "inflight_clears",
)
#: Point-in-time values.
GAUGE_FIELDS: tuple[str, ...] = ("entries", "capacity", "inflight")


class PoolCounters:
    """The live counters of one pool.  Owned and mutated by the cache only."""

    __slots__ = (*COUNTER_FIELDS, "miss_reasons")

    def __init__(self) -> None:
        self.queries: int = 0
        self.query_hits: int = 0
        self.query_misses: int = 0
        self.pages_checked: int = 0
        self.page_hits: int = 0
        self.rescues: int = 0
        self.page_misses: int = 0
        self.adds: int = 0
        self.inserts: int = 0
        self.refreshes: int = 0
        self.evictions: int = 0
        self.invalidate_calls: int = 0
        self.invalidations: int = 0
        self.clears: int = 0
        self.cleared_pages: int = 0
        self.inflight_tracked: int = 0
        self.inflight_released: int = 0
        self.inflight_clears: int = 0
        self.miss_reasons: list[int] = [0, 0, 0, 0]

    def snapshot(self, pool: str, entries: int, capacity: int, inflight: int) -> PoolStats:
        """Freeze the counters together with the pool's current gauges."""
        return PoolStats(
            pool,
            self.queries,
            self.query_hits,
            self.query_misses,
            self.pages_checked,
            self.page_hits,
            self.rescues,
            self.page_misses,
            self.adds,
            self.inserts,
            self.refreshes,
            self.evictions,
            self.invalidate_calls,
            self.invalidations,
            self.clears,
            self.cleared_pages,
            self.inflight_tracked,
            self.inflight_released,
            self.inflight_clears,
            entries,
            capacity,
            inflight,
            *self.miss_reasons,
        )


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """An immutable snapshot of one pool's accounting.

    Counter semantics (see docs/metrics.md for the exported names):
    ``pages_checked == page_hits + rescues + page_misses``; a chain query stops at
    its first uncovered page, so ``page_misses`` is at most one per query;
    ``inserts + refreshes`` is the number of pages passed to ``add``.
    """

    pool: str
    queries: int = 0
    query_hits: int = 0
    query_misses: int = 0
    pages_checked: int = 0
    page_hits: int = 0
    rescues: int = 0
    page_misses: int = 0
    adds: int = 0
    inserts: int = 0
    refreshes: int = 0
    evictions: int = 0
    invalidate_calls: int = 0
    invalidations: int = 0
    clears: int = 0
    cleared_pages: int = 0
    inflight_tracked: int = 0
    inflight_released: int = 0
    inflight_clears: int = 0
    entries: int = 0
    capacity: int = 0
    inflight: int = 0
    misses_cold: int = 0
    misses_evicted: int = 0
    misses_invalidated: int = 0
    misses_cleared: int = 0

    # -- derived ratios (1.0 when there was nothing to measure, like Caffeine) --
    @property
    def page_hit_ratio(self) -> float:
        """Pages found believed over pages checked."""
        return _ratio(self.page_hits, self.pages_checked)

    @property
    def coverage_ratio(self) -> float:
        """Pages covered (believed or rescued by in-flight/extra cover) over checked."""
        return _ratio(self.page_hits + self.rescues, self.pages_checked)

    @property
    def query_hit_ratio(self) -> float:
        """Queries answered True over queries."""
        return _ratio(self.query_hits, self.queries)

    @property
    def miss_ratio(self) -> float:
        """Queries answered False over queries (0.0 with no queries)."""
        return 1.0 - self.query_hit_ratio

    @property
    def fill_ratio(self) -> float:
        """Entries over capacity (0.0 for a pool with no capacity)."""
        return self.entries / self.capacity if self.capacity else 0.0

    @property
    def misses_by_reason(self) -> Mapping[str, int]:
        """Classified page misses.  With miss-reason memory enabled they sum to
        ``page_misses`` once the cache has settled (``settle()``, which the
        per-step hook calls; a miss only records its page, classification is
        batched); without it they are all zero."""
        return MappingProxyType(
            {
                "cold": self.misses_cold,
                "evicted": self.misses_evicted,
                "invalidated": self.misses_invalidated,
                "cleared": self.misses_cleared,
            }
        )

    def __sub__(self, other: PoolStats) -> PoolStats:
        """Counters become deltas; gauges keep this (the newer) snapshot's value.

        No clamping: subtracting a newer snapshot from an older one, or across a
        re-created cache, gives negative counts rather than hiding the mistake."""
        if not isinstance(other, PoolStats):
            return NotImplemented
        if other.pool != self.pool:
            raise ValueError(f"cannot subtract pool {other.pool!r} stats from pool {self.pool!r}")
        values = {}
        for f in fields(self):
            name = f.name
            mine = getattr(self, name)
            if name == "pool" or name in GAUGE_FIELDS:
                values[name] = mine
            else:
                values[name] = mine - getattr(other, name)
        return PoolStats(**values)

    def __add__(self, other: PoolStats) -> PoolStats:
        """Field-wise sum (gauges too); used to total pools."""
        if not isinstance(other, PoolStats):
            return NotImplemented
        values = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "pool"
        }
        return PoolStats(pool=self.pool, **values)

    def as_dict(self) -> dict[str, object]:
        """Fields plus derived ratios, for JSON output."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            page_hit_ratio=self.page_hit_ratio,
            coverage_ratio=self.coverage_ratio,
            query_hit_ratio=self.query_hit_ratio,
            miss_ratio=self.miss_ratio,
            fill_ratio=self.fill_ratio,
        )
        return out


@dataclass(frozen=True, slots=True)
class CacheStats(Mapping[str, PoolStats]):
    """An immutable snapshot of every pool, a mapping ``pool -> PoolStats``.

    ``total`` sums every field over pools.  For the flat (seed) generation the
    capacity is shared, so ``total.capacity`` is that one shared cap rather than a
    sum; ``shared_capacity`` says which applies.
    """

    pools: Mapping[str, PoolStats]
    shared_capacity: bool = False

    def __getitem__(self, pool: str) -> PoolStats:
        return self.pools[pool]

    def __iter__(self) -> Iterator[str]:
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    @property
    def total(self) -> PoolStats:
        """All pools summed (pool name ``"*"``)."""
        total = PoolStats(pool="*")
        for stats in self.pools.values():
            total = total + stats
        if self.shared_capacity and self.pools:
            capacity = next(iter(self.pools.values())).capacity
            total = replace(total, capacity=capacity)
        return total

    def __sub__(self, other: CacheStats) -> CacheStats:
        """Per-pool deltas; a pool absent from ``other`` counts from zero."""
        if not isinstance(other, CacheStats):
            return NotImplemented
        return CacheStats(
            MappingProxyType(
                {
                    name: stats - other.pools.get(name, PoolStats(pool=name))
                    for name, stats in self.pools.items()
                }
            ),
            self.shared_capacity,
        )

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON output."""
        return {
            "pools": {name: s.as_dict() for name, s in self.pools.items()},
            "total": self.total.as_dict(),
        }


def make_cache_stats(pools: Mapping[str, PoolStats], shared_capacity: bool = False) -> CacheStats:
    """Build a ``CacheStats`` over a private copy of ``pools``."""
    return CacheStats(MappingProxyType(dict(pools)), shared_capacity)
