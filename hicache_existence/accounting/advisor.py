"""Capacity advice from inside the live cache: its hit-ratio curve, estimated online.

The hit ratio an LRU of each size would have had on the same reference stream, by
SHARDS (docs/capacity.md, "How it works"): pages sampled by hash go through one
exact LRU stack, a sampled stack distance ``d`` standing for ``d / rate`` pages.
Two curves share the stack: the *reference stream* (every page added or walked by
a lookup) and the *lookup* curve (what lookups asked, the page each missed at
included: what decides L3 writes in buffer mode).  Exact on ``add``/lookup
streams; approximated, as one stack cannot hold every cap's state: a page removed
by ``invalidate_beyond`` or ``clear`` leaves the stack, so deeper pages move up (a
real cache keeps the slot empty until the next insert); a lookup walking an
in-flight page beyond a cap moves it up (the real cache holds it only once its
storage ack adds it, soon after in buffer mode).

A cache built with ``advisor=`` attaches one ``Sampler`` per pool (one for all with
``shared=True``) to its LRU index, which feeds it from inside its own batch calls
(``core.sampler``): an unsampled page costs one integer comparison.  The advisor is
also a ``BeliefObserver`` to feed by hand (tests, benchmarks, other caches); never
both for one cache, or every reference counts twice.  Nothing here raises into the
cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hicache_existence.core import _validate, lru
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.core.sampler import SamplerType, threshold

if TYPE_CHECKING:
    from hicache_existence.config import AdvisorSection

#: Cap multipliers reported per pool (a fixed set: bounded label cardinality).
MULTIPLIERS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
#: Pool name under which a shared-cap (flat generation) cache is reported.
SHARED_POOL = "all"


def multiplier_label(multiplier: float) -> str:
    """``0.25`` -> ``"0.25"``, ``1.0`` -> ``"1"`` (the ``cap_multiplier`` label value)."""
    return f"{multiplier:g}"


#: Advice takes the smallest multiple within this of the best estimate: a cap that
#: buys less than one point is not worth it.
ADVICE_TOLERANCE = 0.01


def recommended_multiple(curve: Mapping[float, float]) -> float | None:
    """The smallest cap multiple within ``ADVICE_TOLERANCE`` of the curve's best
    (None for an empty curve): the one cap-advice rule, applied by the doctor, the
    demo and the dashboard's PromQL (rendered by dashboards/build.py)."""
    if not curve:
        return None
    best = max(curve.values())
    return min(m for m, v in curve.items() if v >= best - ADVICE_TOLERANCE)


def hit_ratios(
    sampler: SamplerType,
    caps: Sequence[int],
    rate: float,
    *,
    adjust: bool = False,
    lookups: bool = False,
    max_keys: int | None = None,
    counts: Mapping[str, Any] | None = None,
) -> list[float | None]:
    """Estimated hit ratio of an LRU of each cap from one sampler's curve; None
    without data or when the cap lies beyond the distances tracked
    (``max_keys / rate``).  ``counts``: the sampler's ``counts()``, if in hand."""
    counts = sampler.counts() if counts is None else counts
    prefix = "lookup" if lookups else "stream"
    sampled = float(counts[f"{prefix}_sampled"])
    # SHARDS-adj: the sample's surplus or shortfall against the expected count is
    # put in the first bucket and the total becomes the expected count.
    delta = float(counts[f"{prefix}_references"]) * rate - sampled if adjust else 0.0
    denominator = sampled + delta
    if sampled <= 0 or denominator <= 0:
        return [None] * len(caps)
    limits = [math.ceil(cap * rate) for cap in caps]
    out: list[float | None] = []
    for limit, hits in zip(limits, sampler.cumulative(limits, lookups)):
        beyond = max_keys is not None and limit > max_keys
        out.append(None if beyond else min(1.0, max(0.0, (hits + delta) / denominator)))
    return out


@dataclass(frozen=True)
class PoolAdvice:
    """One pool's estimated hit ratios around its current cap."""

    pool: str
    #: The pool's cap when the snapshot was taken (None: not known).
    capacity: int | None
    #: Multiplier of ``capacity`` -> estimated hit ratio (None: no data yet, or beyond
    #: the distances tracked).
    estimates: Mapping[float, float | None]
    #: Page references seen (the whole stream) and of those, sampled.
    references: int
    sampled_references: int
    #: Sampled pages currently tracked.
    sampled_pages: int
    #: Sampled page references lost (the sampler could not allocate memory).
    dropped_references: int
    #: Multiplier -> estimated hit ratio of lookups alone (the pages admission asked
    #: about, including the one each lookup missed at): what decides L3 writes.
    lookup_estimates: Mapping[float, float | None] = field(default_factory=dict)
    #: Pages lookups asked about (walked, plus the page each missed at).
    lookup_references: int = 0


@dataclass(frozen=True)
class AdvisorSnapshot:
    """An immutable view of the advisor, for exporters and the CLI."""

    sampling_rate: float
    pools: Mapping[str, PoolAdvice]
    #: Sampled page references lost for lack of memory, over all pools.
    dropped_references: int
    #: Hand-fed calls that failed (bad input); the cache's own path cannot fail.
    errors: int
    multipliers: tuple[float, ...] = field(default=MULTIPLIERS)

    def hit_ratio(self, pool: str, multiplier: float, lookups: bool = False) -> float | None:
        """The estimate for ``pool`` at ``multiplier`` x its cap, of lookups alone with
        ``lookups=True`` (None if unknown)."""
        advice = self.pools.get(pool)
        if advice is None:
            return None
        return (advice.lookup_estimates if lookups else advice.estimates).get(multiplier)

    def lookup_hit_ratio(self, pool: str, multiplier: float) -> float | None:
        return self.hit_ratio(pool, multiplier, lookups=True)

    def gauge_samples(self, lookups: bool = False) -> list[tuple[dict[str, str], float]]:
        """``({pool, cap_multiplier}, estimate)`` pairs for the catalog's advisor
        gauges: of the stream, or with ``lookups=True`` of lookups alone (what decides
        writes in buffer mode); unknown estimates are left out."""
        return [
            ({"pool": pool, "cap_multiplier": multiplier_label(m)}, value)
            for pool, advice in self.pools.items()
            for m, value in (advice.lookup_estimates if lookups else advice.estimates).items()
            if value is not None
        ]


class CapacityAdvisor:
    """Estimates each pool's hit-ratio curve (SHARDS) from samplers attached to
    the cache's LRU index (module docstring).

    ``shared=True`` models the seed (flat) generation's one LRU over all pools,
    reported as pool ``"all"``.  ``half_life_references`` > 0 weighs recent
    references more (the weight doubles every that many page references), so the
    curve follows a changing workload; 0 keeps the whole history.
    ``sampler_factory`` overrides the sampler type (default: the cache index's).
    """

    __slots__ = (
        "sampling_rate",
        "adjust",
        "shared",
        "_threshold",
        "_max_keys",
        "_half_life",
        "_factory",
        "_samplers",
        "_tags",
        "errors",
    )

    def __init__(
        self,
        sampling_rate: float = 0.02,
        *,
        max_sampled_pages: int = 131072,
        half_life_references: int = 0,
        adjust: bool = False,
        shared: bool = False,
        sampler_factory: Callable[..., SamplerType] | None = None,
    ) -> None:
        if not 0.0 < _validate.number(sampling_rate, "sampling_rate") <= 1.0:
            raise ValueError(f"sampling_rate must be within (0, 1], got {sampling_rate}")
        max_sampled_pages = _validate.count(max_sampled_pages, "max_sampled_pages", 1)
        half_life_references = _validate.count(half_life_references, "half_life_references")
        if max_sampled_pages > 1 << 28:
            raise ValueError(f"max_sampled_pages must be <= {1 << 28}, got {max_sampled_pages}")
        self.sampling_rate = float(sampling_rate)
        self.adjust = bool(adjust)
        self.shared = bool(shared)
        self._threshold = threshold(self.sampling_rate)
        self._max_keys = max_sampled_pages
        self._half_life = half_life_references
        self._factory = sampler_factory
        self._samplers: dict[str, SamplerType] = {}
        #: Pool -> tag, for the hand-fed path of a shared advisor (pools must not collide).
        self._tags: dict[str, int] = {}
        self.errors = 0

    @classmethod
    def from_config(
        cls, section: AdvisorSection, *, shared: bool = False
    ) -> CapacityAdvisor | None:
        """An advisor as configured, or None when disabled (or sampling rate 0)."""
        if not section.enabled or section.sampling_rate <= 0:
            return None
        return cls(
            section.sampling_rate,
            max_sampled_pages=section.max_sampled_pages,
            half_life_references=section.half_life_references,
            adjust=section.adjust,
            shared=shared,
        )

    # -- the samplers ------------------------------------------------------------
    def sampler(self, pool: str, factory: Callable[..., SamplerType] | None = None) -> SamplerType:
        """``pool``'s sampler (the shared one with ``shared=True``), made on first use
        with ``factory`` (``lru.sampler_class(index)``).  Scheduler thread only."""
        name = SHARED_POOL if self.shared else pool
        sampler = self._samplers.get(name)
        if sampler is None:
            make = self._factory or factory or lru.Sampler
            sampler = make(self._threshold, self._max_keys, self._half_life)
            self._samplers[name] = sampler
        return sampler

    def _tag(self, pool: str) -> int:
        return self._tags.setdefault(pool, len(self._tags)) if self.shared else 0

    # -- BeliefObserver: feeding by hand (never raises into the cache) -----------
    def _feed(self, pool: str, call: Callable[[SamplerType, int], object]) -> None:
        try:
            call(self.sampler(pool), self._tag(pool))
        except Exception:
            self.errors += 1

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self._feed(pool, lambda s, tag: s.added(_batch(hashes), tag))

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        self._feed(pool, lambda s, tag: s.walked(_batch(hashes), stop, tag))

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        self._feed(pool, lambda s, tag: s.removed(_batch(hashes)[keep_pages:], tag))

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """In-flight content is not a belief: not part of the reference stream."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        if not inflight_only:
            self._feed(pool, lambda s, tag: s.clear())

    # -- reporting -------------------------------------------------------------
    def _ratios(
        self,
        sampler: SamplerType,
        caps: list[int],
        lookups: bool,
        counts: Mapping[str, Any] | None = None,
    ) -> list[float | None]:
        return hit_ratios(
            sampler,
            caps,
            self.sampling_rate,
            adjust=self.adjust,
            lookups=lookups,
            max_keys=self._max_keys,
            counts=counts,
        )

    def estimate(self, pool: str, cap: int, *, lookups: bool = False) -> float | None:
        """Estimated hit ratio of ``pool`` at ``cap`` entries: of the reference stream,
        or with ``lookups=True`` of the pages lookups asked for (None: no data yet)."""
        _validate.count(cap, "cap", 1)
        sampler = self._samplers.get(SHARED_POOL if self.shared else pool)
        return None if sampler is None else self._ratios(sampler, [cap], lookups)[0]

    def snapshot(
        self,
        capacities: Mapping[str, int] | int | None = None,
        multipliers: Sequence[float] = MULTIPLIERS,
    ) -> AdvisorSnapshot:
        """Hit ratios at ``multipliers`` x each pool's cap (``capacities``: pool ->
        cap, or one cap for all; pools without a cap get no estimates).  Any thread:
        the sampler dict is copied and each sampler read in one C call (atomic under
        the GIL); the pure-Python sampler may be a reference apart between curves."""
        pools: dict[str, PoolAdvice] = {}
        for name, sampler in self._samplers.copy().items():
            cap = capacities if isinstance(capacities, int) else (capacities or {}).get(name)
            counts = sampler.counts()
            caps = [max(1, int(cap * m)) for m in multipliers] if cap else []
            estimates, lookup_estimates = (
                dict(zip(multipliers, self._ratios(sampler, caps, lookups, counts))) if caps else {}
                for lookups in (False, True)
            )
            pools[name] = PoolAdvice(
                name,
                cap or None,
                MappingProxyType(estimates),
                int(counts["raw_references"]),
                int(counts["raw_sampled"]),
                int(counts["tracked"]),
                int(counts["lost"]),
                MappingProxyType(lookup_estimates),
                int(counts["raw_lookups"]),
            )
        return AdvisorSnapshot(
            self.sampling_rate,
            MappingProxyType(pools),
            sum(p.dropped_references for p in pools.values()),
            self.errors,
            tuple(multipliers),
        )

    def capacities_of(self, cache: ExistenceCache) -> Mapping[str, int] | int:
        """The caps to report against: the one cap of a shared LRU, else each pool's."""
        if self.shared or cache.shared_lru:
            return int(cache.max_entries)
        return {p.name: int(p.max_entries) for p in cache.pools()}


def _batch(hashes: Sequence[str]) -> Sequence[str]:
    """A list or tuple as the samplers take (other sequences are copied)."""
    return hashes if isinstance(hashes, (list, tuple)) else list(hashes)
