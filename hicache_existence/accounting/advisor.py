"""Capacity advice from inside the live cache: its hit-ratio curve, estimated online.

"What cap do I need?" is a question about the cache's miss-ratio curve: the hit
ratio an LRU of each size would have had on the same reference stream.  The
advisor estimates it with SHARDS (Waldspurger et al., FAST '15): a fixed uniform
subset of pages is *sampled* (by hash, so a sampled page is sampled at every
reference), the sampled pages go through an exact LRU stack, and a sampled stack
distance ``d`` stands for ``d / rate`` pages.  The hit ratio is the plain ratio
over sampled references; SHARDS-adj (``adjust=True``) is available but was less
accurate on chained page streams (docs/capacity.md).

Two curves share one stack.  The *reference stream* is what the cache is asked and
told: every page passed to ``add`` and every page a lookup walked.  The *lookup*
curve counts only what lookups asked, including the page each one missed at: in
buffer mode a lookup miss is what triggers an L3 write, while a bigger cap also
turns prefetch-healing adds into refreshes that save nothing, so the lookup curve
is the one that tracks write savings (docs/capacity.md).

A reference is a hit at cap ``C`` when the page would be believed at the start of
its call in an LRU of ``C`` entries fed the same stream.  On ``add``/lookup
streams this is exact: with ``rate = 1`` at the 1x cap the stream curve is the
cache's own ``(page_hits + refreshes) / (pages walked + pages added)`` and the
lookup curve its ``page_hits / pages_checked``, and on a belief-only replay the
stream curve is the exact curve of ``replay --model belief-only``.  Two cases are
approximated, because one LRU stack cannot hold every cap's state: a page
removed by ``invalidate_beyond`` or ``clear`` leaves the stack, so deeper pages
move up (a real cache keeps that slot empty until the next insert), and a lookup
that walks an in-flight page beyond a cap moves it up (the real cache does not
hold it until its storage ack adds it, which buffer mode does soon after).

Where the work happens (the scheduler's hot path pays almost nothing): a cache
built with ``advisor=`` attaches one ``Sampler`` per pool (``sampler()``; one for
all pools with ``shared=True``) to its LRU index, which feeds it from inside its
own batch calls (``hicache_existence.core.sampler``): an unsampled page costs one
integer comparison on a hash the index holds anyway, a sampled one a few hundred
nanoseconds of C.  No buffer, no per-step drain, nothing dropped.  The advisor is
also a ``BeliefObserver``, to feed by hand (tests, benchmarks, a cache of
another kind); do not do both for one cache, or every reference counts twice.
``snapshot()`` (any thread) turns the histograms into hit ratios at 0.25x .. 8x
each pool's current cap.  Nothing here raises into the cache.
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

DEFAULT_SAMPLING_RATE = 0.02
DEFAULT_MAX_SAMPLED_PAGES = 131072


def multiplier_label(multiplier: float) -> str:
    """``0.25`` -> ``"0.25"``, ``1.0`` -> ``"1"`` (the ``cap_multiplier`` label value)."""
    return f"{multiplier:g}"


#: The recommended cap is the smallest multiple whose estimated hit ratio is within
#: this of the best estimate: a cap that buys less than one point is not worth it.
ADVICE_TOLERANCE = 0.01


def recommended_multiple(curve: Mapping[float, float]) -> float | None:
    """The smallest cap multiple whose estimate is within ``ADVICE_TOLERANCE`` of the
    curve's best (None for an empty curve): the one cap-advice rule, which the doctor,
    ``hicache-existence demo`` and the dashboard's PromQL (dashboards/build.py renders
    it from ``ADVICE_TOLERANCE`` and ``MULTIPLIERS``) all apply."""
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
    if counts is None:
        counts = sampler.counts()
    prefix = "lookup" if lookups else "stream"
    sampled = float(counts[f"{prefix}_sampled"])
    if sampled <= 0:
        return [None] * len(caps)
    limits = [math.ceil(cap * rate) for cap in caps]
    # SHARDS-adj: the sample's surplus or shortfall against the expected count is
    # put in the first bucket and the total becomes the expected count.
    delta = float(counts[f"{prefix}_references"]) * rate - sampled if adjust else 0.0
    denominator = sampled + delta
    if denominator <= 0:
        return [None] * len(caps)
    out: list[float | None] = []
    for limit, hits in zip(limits, sampler.cumulative(limits, lookups)):
        if max_keys is not None and limit > max_keys:
            out.append(None)
        else:
            out.append(min(1.0, max(0.0, (hits + delta) / denominator)))
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

    def hit_ratio(self, pool: str, multiplier: float) -> float | None:
        """The estimate for ``pool`` at ``multiplier`` x its cap (None if unknown)."""
        advice = self.pools.get(pool)
        return None if advice is None else advice.estimates.get(multiplier)

    def lookup_hit_ratio(self, pool: str, multiplier: float) -> float | None:
        """The lookup-only estimate for ``pool`` at ``multiplier`` x its cap."""
        advice = self.pools.get(pool)
        return None if advice is None else advice.lookup_estimates.get(multiplier)

    def gauge_samples(self, lookups: bool = False) -> list[tuple[dict[str, str], float]]:
        """``(labels, value)`` pairs, ``{pool, cap_multiplier}`` -> the estimated hit
        ratio of the reference stream (with ``lookups=True``: of lookups alone, what
        decides writes in buffer mode), exported as the catalog's advisor gauges;
        unknown estimates are left out."""
        out = []
        for pool, advice in self.pools.items():
            values = advice.lookup_estimates if lookups else advice.estimates
            for multiplier, value in values.items():
                if value is not None:
                    out.append(
                        ({"pool": pool, "cap_multiplier": multiplier_label(multiplier)}, value)
                    )
        return out


class CapacityAdvisor:
    """Estimates each pool's hit-ratio curve (SHARDS) from samplers attached to
    the cache's LRU index (see the module docstring).

    ``shared=True`` models one LRU over all pools, as the seed (flat) generation
    has, reported under pool ``"all"``.  ``half_life_references`` > 0 weighs recent
    references more (the weight doubles every that many page references), so the
    curve follows a changing workload; 0 keeps the whole history.
    ``sampler_factory`` overrides the sampler type (default: the one matching
    the cache's index, ``lru.Sampler``).
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
        sampling_rate: float = DEFAULT_SAMPLING_RATE,
        *,
        max_sampled_pages: int = DEFAULT_MAX_SAMPLED_PAGES,
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
        """The sampler that estimates ``pool``'s curve (the shared one with
        ``shared=True``), created on first use with ``factory`` (what the cache's
        index takes: ``lru.sampler_class(index)``).  Scheduler thread only."""
        name = SHARED_POOL if self.shared else pool
        sampler = self._samplers.get(name)
        if sampler is None:
            make = self._factory or factory or lru.Sampler
            sampler = make(self._threshold, self._max_keys, self._half_life)
            self._samplers[name] = sampler
        return sampler

    def _tag(self, pool: str) -> int:
        if not self.shared:
            return 0
        tag = self._tags.get(pool)
        if tag is None:
            tag = self._tags[pool] = len(self._tags)
        return tag

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
    def estimate(self, pool: str, cap: int, *, lookups: bool = False) -> float | None:
        """Estimated hit ratio of ``pool`` at ``cap`` entries: of the reference stream,
        or with ``lookups=True`` of the pages lookups asked for (None: no data yet)."""
        _validate.count(cap, "cap", 1)
        sampler = self._samplers.get(SHARED_POOL if self.shared else pool)
        if sampler is None:
            return None
        return hit_ratios(
            sampler,
            [cap],
            self.sampling_rate,
            adjust=self.adjust,
            lookups=lookups,
            max_keys=self._max_keys,
        )[0]

    def snapshot(
        self,
        capacities: Mapping[str, int] | int | None = None,
        multipliers: Sequence[float] = MULTIPLIERS,
    ) -> AdvisorSnapshot:
        """Hit ratios at ``multipliers`` x each pool's cap.  ``capacities`` maps pool ->
        cap, or is one cap for every pool (shared-cap cache); pools without a cap get
        no estimates.  Any thread: the sampler dict is copied in one C call before it
        is walked, and each sampler read is one C call (atomic under the GIL); the
        pure-Python sampler may be a reference apart between curves."""
        pools: dict[str, PoolAdvice] = {}
        lost = 0
        for name, sampler in self._samplers.copy().items():
            cap = (
                capacities
                if isinstance(capacities, int)
                else (capacities.get(name) if capacities is not None else None)
            )
            counts = sampler.counts()
            estimates: dict[float, float | None] = {}
            lookup_estimates: dict[float, float | None] = {}
            if cap:
                caps = [max(1, int(cap * m)) for m in multipliers]
                for lookups, out in ((False, estimates), (True, lookup_estimates)):
                    values = hit_ratios(
                        sampler,
                        caps,
                        self.sampling_rate,
                        adjust=self.adjust,
                        lookups=lookups,
                        max_keys=self._max_keys,
                        counts=counts,
                    )
                    out.update(zip(multipliers, values))
            lost += int(counts["lost"])
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
            lost,
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
