"""Accounting: mutable per-pool counters (recording) and frozen snapshots (reporting).

Recording bumps plain ``int`` slots once per *call* with its page counts (never per
page: a metrics-library call costs more than the lookup it counts).  Snapshots carry
derived ratios, after Caffeine's ``CacheStats`` (1.0 when nothing was asked), and
subtract to deltas.  One declaration, ``PoolStats``'s fields, yields the counters,
the snapshots, the catalog's families and docs/design.md's counter table; a new
counter is one field here plus its increments (CONTRIBUTING, "Adding a counter").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

#: Why a page missed.  Index order is the order of ``PoolCounters.miss_reasons``.
MISS_REASONS: tuple[str, ...] = ("cold", "evicted", "invalidated", "cleared")
COLD, EVICTED, INVALIDATED, CLEARED = range(4)

Kind = Literal["counter", "gauge", "miss_reason"]


def _declared(kind: Kind, help: str, family: str, otel_unit: str) -> Any:
    return field(
        default=0,
        metadata={"kind": kind, "help": help, "family": family, "otel_unit": otel_unit},
    )


def counter(help: str = "", *, family: str = "", otel_unit: str = "") -> Any:
    """A monotonic counter, bumped by its owner, subtracted by ``-``.  ``help`` (read on
    ``/metrics`` and docs/metrics.md), ``family`` (exported name sans prefix; default the
    field's name), ``otel_unit``: ``exporters/catalog.py`` builds the families from them."""
    return _declared("counter", help, family, otel_unit)


def gauge(help: str = "", *, family: str = "", otel_unit: str = "") -> Any:
    """A point-in-time value, read from the pool at snapshot time (kept, not
    subtracted, by ``-``); declared like ``counter()``."""
    return _declared("gauge", help, family, otel_unit)


def miss_reason() -> Any:
    """A classified-miss counter ``misses_<reason>`` (one per ``MISS_REASONS``), kept in
    ``PoolCounters.miss_reasons``, exported as a ``reason`` label of ``page_misses``."""
    return field(default=0, metadata={"kind": "miss_reason"})


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """An immutable snapshot of one pool's accounting (exported names: docs/metrics.md):
    ``pages_checked == page_hits + rescues + page_misses``; a chain query stops at its
    first uncovered page, so ``page_misses`` is at most one per query; ``inserts +
    refreshes`` is the number of pages passed to ``add``."""

    pool: str
    queries: int = counter(
        "Lookups: contains, contains_all, covered and covers_all calls.", otel_unit="{query}"
    )
    query_hits: int = counter(
        "Lookups that answered True (every page covered).", otel_unit="{query}"
    )
    query_misses: int = counter(
        "Lookups that answered False (stopped at an uncovered page).", otel_unit="{query}"
    )
    pages_checked: int = counter(
        "Pages examined by lookups, up to and including the stopping page.", otel_unit="{page}"
    )
    page_hits: int = counter(
        "Examined pages found believed stored (LRU-touched).", otel_unit="{page}"
    )
    rescues: int = counter(
        "Examined pages not believed but covered by an in-flight write (covered) or "
        "extra_cover (covers_all).",
        family="page_rescues",
        otel_unit="{page}",
    )
    page_misses: int = counter(
        "Examined pages not covered (at most one per lookup), by reason: cold (never "
        "believed), evicted (dropped by the cap), invalidated (dropped by "
        "invalidate_beyond or a heal), cleared; unclassified without miss-reason memory.",
        otel_unit="{page}",
    )
    adds: int = counter(
        "add() calls (storage acks and fill commits).", family="add_calls", otel_unit="{call}"
    )
    inserts: int = counter(
        "Pages added that were not believed before.", family="page_inserts", otel_unit="{page}"
    )
    refreshes: int = counter(
        "Pages added that were already believed (moved to most recent).",
        family="page_refreshes",
        otel_unit="{page}",
    )
    evictions: int = counter(
        "Entries dropped by the cap (least recently used first).", otel_unit="{entry}"
    )
    invalidate_calls: int = counter(
        "invalidate_beyond() calls (heals after a prefetch shortfall).", otel_unit="{call}"
    )
    invalidations: int = counter("Entries dropped by invalidate_beyond().", otel_unit="{entry}")
    clears: int = counter("clear() calls that reached the pool.", otel_unit="{call}")
    cleared_pages: int = counter("Entries dropped by clears.", otel_unit="{entry}")
    inflight_tracked: int = counter("In-flight refs taken at D2H launch.", otel_unit="{ref}")
    inflight_released: int = counter("In-flight refs released at storage ack.", otel_unit="{ref}")
    inflight_clears: int = counter(
        "clear_inflight() calls that reached the pool.", otel_unit="{call}"
    )
    inflight_unmatched: int = counter(
        "Pages acknowledged by untrack_inflight() that held no in-flight ref (an ack after "
        "clear_inflight, or a second ack of one launch).",
        otel_unit="{page}",
    )
    entries: int = gauge("Page hashes currently believed stored.", otel_unit="{entry}")
    capacity: int = gauge(
        "The cap: per pool (current generation) or the one cap shared by every pool (seed).",
        family="capacity_entries",
        otel_unit="{entry}",
    )
    inflight: int = gauge(
        "Distinct pages with in-flight refs.", family="inflight_pages", otel_unit="{page}"
    )
    misses_cold: int = miss_reason()
    misses_evicted: int = miss_reason()
    misses_invalidated: int = miss_reason()
    misses_cleared: int = miss_reason()

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
        """Classified page misses; with miss-reason memory they sum to ``page_misses`` once
        settled (``settle()``, per step: classification is batched), else all zero."""
        return MappingProxyType({r: getattr(self, f"misses_{r}") for r in MISS_REASONS})

    def __sub__(self, other: PoolStats) -> PoolStats:
        """Counters become deltas, gauges keep this (newer) value.  Unclamped: older minus
        newer, or across a re-created cache, goes negative rather than hide the mistake."""
        if not isinstance(other, PoolStats):
            return NotImplemented
        if other.pool != self.pool:
            raise ValueError(f"cannot subtract pool {other.pool!r} stats from pool {self.pool!r}")
        values = {
            f.name: getattr(self, f.name)
            if f.name in _KEPT
            else getattr(self, f.name) - getattr(other, f.name)
            for f in fields(self)
        }
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
        names = (*(f.name for f in fields(self)), *_RATIOS)
        return {name: getattr(self, name) for name in names}


def fields_of_kind(snapshot_type: type, kind: Kind) -> tuple[str, ...]:
    """Fields of ``snapshot_type`` marked ``kind``, in declaration order."""
    return tuple(f.name for f in fields(snapshot_type) if f.metadata.get("kind") == kind)


#: Monotonic counters, in ``PoolStats`` field order (derived: declare in ``PoolStats``).
COUNTER_FIELDS: tuple[str, ...] = fields_of_kind(PoolStats, "counter")
#: Point-in-time values.
GAUGE_FIELDS: tuple[str, ...] = fields_of_kind(PoolStats, "gauge")
#: Kept, not subtracted, by ``PoolStats.__sub__``.
_KEPT = frozenset({"pool", *GAUGE_FIELDS})
#: The derived ratios ``as_dict`` adds.
_RATIOS = ("page_hit_ratio", "coverage_ratio", "query_hit_ratio", "miss_ratio", "fill_ratio")
_REASON_FIELDS = fields_of_kind(PoolStats, "miss_reason")
if tuple(f"misses_{r}" for r in MISS_REASONS) != _REASON_FIELDS:  # pragma: no cover
    raise AssertionError(f"PoolStats miss-reason fields {_REASON_FIELDS} != MISS_REASONS")


class PoolCounters:
    """The live counters of one pool: one plain ``int`` slot per ``PoolStats`` counter (a
    slot increment is the cheapest counter Python has).  Owned and mutated by the cache."""

    __slots__ = (*COUNTER_FIELDS, "miss_reasons")

    if TYPE_CHECKING:  # every counter is an ``int`` slot

        def __getattr__(self, name: str) -> int: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def __init__(self) -> None:
        for name in COUNTER_FIELDS:
            setattr(self, name, 0)
        self.miss_reasons: list[int] = [0] * len(MISS_REASONS)

    def snapshot(self, pool: str, entries: int, capacity: int, inflight: int) -> PoolStats:
        """Freeze the counters together with the pool's current gauges."""
        values = {name: getattr(self, name) for name in COUNTER_FIELDS}
        values.update(zip(_REASON_FIELDS, self.miss_reasons))
        return PoolStats(pool=pool, entries=entries, capacity=capacity, inflight=inflight, **values)


@dataclass(frozen=True, slots=True)
class CacheStats(Mapping[str, PoolStats]):
    """Every pool's snapshot, a mapping ``pool -> PoolStats``; ``total`` sums fields over
    pools, but with ``shared_capacity`` (seed generation) its capacity is the shared cap."""

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
        total = sum(self.pools.values(), PoolStats(pool="*"))
        if self.shared_capacity and self.pools:
            total = replace(total, capacity=next(iter(self.pools.values())).capacity)
        return total

    def __sub__(self, other: CacheStats) -> CacheStats:
        """Per-pool deltas; a pool absent from ``other`` counts from zero."""
        if not isinstance(other, CacheStats):
            return NotImplemented
        pools = {
            name: stats - other.pools.get(name, PoolStats(pool=name))
            for name, stats in self.pools.items()
        }
        return CacheStats(MappingProxyType(pools), self.shared_capacity)

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON output."""
        return {
            "pools": {name: s.as_dict() for name, s in self.pools.items()},
            "total": self.total.as_dict(),
        }
