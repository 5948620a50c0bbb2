"""Capacity advice from inside the live cache: its hit-ratio curve, estimated online.

"What cap do I need?" is a question about the cache's miss-ratio curve: the hit
ratio an LRU of each size would have had on the same reference stream.  The
advisor estimates it with SHARDS (Waldspurger et al., FAST '15): a page is
*sampled* when the leading 64 bits of its SHA-256 hash are below
``rate * 2**64`` (spatial sampling: a sampled page is sampled at every reference,
on every TP rank alike), the sampled pages go through an exact LRU stack, and a
sampled stack distance ``d`` stands for ``d / rate`` pages.  The hit ratio is the
plain ratio over sampled references; SHARDS-adj (``adjust=True``) is available
but was less accurate on chained page streams (docs/capacity.md).

Two curves share one stack.  The *reference stream* is what the cache is asked and
told: every page passed to ``add`` and every page a lookup walked (``touched``).
The *lookup* curve counts only what lookups asked, including the page each one
missed at: in buffer mode a lookup miss is what triggers an L3 write, while a
bigger cap also turns prefetch-healing adds into refreshes that save nothing, so
the lookup curve is the one that tracks write savings (docs/capacity.md).

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

Cost split (the scheduler's hot path pays almost nothing):

* the ``BeliefObserver`` methods run inside cache operations and only append the
  caller's ``(pool, hashes, stop)`` to a bounded buffer -- O(1) per *operation*,
  no per-page work, no copy (sglang passes fresh lists and does not mutate them
  afterwards; a lookup's walked prefix is bounded by ``stop``);
* ``drain(budget_s)``, called once per scheduler step after the cache's events
  are processed, filters the buffered pages with a C-level string comparison and
  updates the stack, stopping when its time budget is spent (the rest waits);
* ``snapshot()`` (any thread) turns the histograms into hit ratios at 0.25x ..
  8x each pool's current cap.

If ``drain`` is not called often enough the buffer fills and further operations
are dropped (counted in ``dropped_operations`` / ``dropped_references``): sampled
pages referenced by a dropped operation look older than they are, so the estimate
is biased low until the stream has moved on.  Nothing here raises into the cache.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_existence.config import AdvisorSection

#: Cap multipliers reported per pool (a fixed set: bounded label cardinality).
MULTIPLIERS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
#: Proposed gauge: ``{pool, cap_multiplier}`` -> estimated hit ratio of the reference stream.
GAUGE_NAME = "hicache_existence_advisor_estimated_hit_ratio"
#: Proposed gauge: the same for lookups alone (what decides writes in buffer mode).
LOOKUP_GAUGE_NAME = "hicache_existence_advisor_estimated_lookup_hit_ratio"
#: Pool name under which a shared-cap (flat generation) cache is reported.
SHARED_POOL = "all"

DEFAULT_SAMPLING_RATE = 0.02
DEFAULT_BUFFER_OPS = 16384
DEFAULT_DRAIN_BUDGET_S = 0.002
DEFAULT_MAX_SAMPLED_PAGES = 131072

_HEX64 = re.compile(r"[0-9a-f]{64}")
_RESCALE_AT = 2.0**40
#: Timestamps per block of the stack (a few KiB: cheap to shift, few blocks to sum).
_BLOCK = 512
#: Every this many operations a pool's keys are re-checked for the 64-hex shape.
_HEX_CHECK_EVERY = 1024


class _Default:
    """The type of ``_DEFAULT``: "use the configured value"."""


_DEFAULT = _Default()


def multiplier_label(multiplier: float) -> str:
    """``0.25`` -> ``"0.25"``, ``1.0`` -> ``"1"`` (the ``cap_multiplier`` label value)."""
    return f"{multiplier:g}"


class _Stack:
    """An exact LRU stack over sampled keys, with stack distances in O(log n).

    Each key carries the timestamp of its last reference; the live timestamps
    are kept in a blocked sorted list (new ones are always the largest, so they
    append), and the distance of a key is the number of live timestamps after
    its own.  Every operation touches one block plus a C-level sum over block
    lengths: no global rebuild, so no latency spike on the scheduler thread.
    """

    __slots__ = ("times", "blocks", "maxes", "clock")

    def __init__(self) -> None:
        self.times: OrderedDict[Any, int] = OrderedDict()
        self.blocks: list[list[int]] = []
        self.maxes: list[int] = []
        self.clock = 0

    def after(self, t: int) -> int:
        """How many live timestamps are greater than the live timestamp ``t``."""
        i = bisect_left(self.maxes, t)
        block = self.blocks[i]
        later = sum(map(len, islice(self.blocks, i + 1, None)))
        return later + len(block) - bisect_right(block, t)

    def _discard(self, t: int) -> None:
        maxes = self.maxes
        blocks = self.blocks
        i = bisect_left(maxes, t)
        block = blocks[i]
        j = bisect_left(block, t)
        del block[j]
        if not block:
            del blocks[i]
            del maxes[i]
            return
        if j == len(block):
            maxes[i] = block[-1]
        if len(block) < _BLOCK // 4:
            # Merge a thinned-out block into a neighbour so the block count stays ~n/B.
            if i + 1 < len(blocks) and len(blocks[i + 1]) + len(block) <= _BLOCK:
                blocks[i + 1][:0] = block
                del blocks[i]
                del maxes[i]
            elif i > 0 and len(blocks[i - 1]) + len(block) <= _BLOCK:
                blocks[i - 1].extend(block)
                maxes[i - 1] = maxes[i]
                del blocks[i]
                del maxes[i]

    def push(self, key: Any) -> None:
        """Make ``key`` the most recent."""
        old = self.times.pop(key, None)
        if old is not None:
            self._discard(old)
        t = self.clock
        self.clock = t + 1
        self.times[key] = t
        blocks = self.blocks
        if blocks and len(blocks[-1]) < _BLOCK:
            blocks[-1].append(t)
            self.maxes[-1] = t
        else:
            blocks.append([t])
            self.maxes.append(t)

    def remove(self, key: Any) -> None:
        old = self.times.pop(key, None)
        if old is not None:
            self._discard(old)

    def trim(self, max_keys: int) -> None:
        """Forget the least recent keys beyond ``max_keys`` (their next reference is cold)."""
        times = self.times
        while len(times) > max_keys:
            _, old = times.popitem(last=False)
            self._discard(old)

    def clear(self) -> None:
        self.times.clear()
        self.blocks.clear()
        self.maxes.clear()


class _Curve:
    """A weighted histogram of sampled stack distances: one hit-ratio curve."""

    __slots__ = ("hist", "cold", "sampled", "references")

    def __init__(self) -> None:
        #: Weighted sampled references by sampled stack distance.
        self.hist: list[float] = []
        #: Weighted sampled references to pages the stack did not hold.
        self.cold = 0.0
        self.sampled = 0.0
        #: Weighted references of the whole stream (sampled or not).
        self.references = 0.0

    def bucket(self, d: int, w: float) -> None:
        hist = self.hist
        if d >= len(hist):
            hist.extend([0.0] * (d + 1 - len(hist)))
        hist[d] += w

    def rescale(self, scale: float) -> None:
        self.hist = [v * scale for v in self.hist]
        self.cold *= scale
        self.sampled *= scale
        self.references *= scale

    def hit_ratios(
        self, caps: Sequence[int], rate: float, adjust: bool, max_keys: int
    ) -> list[float | None]:
        """Estimated hit ratio of an LRU of each cap; None without data or when the
        cap lies beyond the distances tracked (``max_keys / rate``)."""
        if self.sampled <= 0:
            return [None] * len(caps)
        limits = [math.ceil(cap * rate) for cap in caps]
        top = min(max(limits), len(self.hist))
        cumulative = [0.0, *accumulate(islice(self.hist, top))]
        # SHARDS-adj: the sample's surplus or shortfall against the expected count is
        # put in the first bucket and the total becomes the expected count.
        delta = self.references * rate - self.sampled if adjust else 0.0
        denominator = self.sampled + delta
        if denominator <= 0:
            return [None] * len(caps)
        out: list[float | None] = []
        for limit in limits:
            if limit > max_keys:
                out.append(None)
                continue
            hits = cumulative[min(limit, top)] + delta
            out.append(min(1.0, max(0.0, hits / denominator)))
        return out


class _Estimator:
    """SHARDS over one LRU (a pool, or all pools of a shared-cap cache): one stack,
    two curves.  ``stream`` counts every page added or walked by a lookup (the
    cache's reference stream, the replay's yardstick); ``lookups`` counts only
    what lookups asked, including the page a lookup missed at (what admission
    decides writes by)."""

    __slots__ = (
        "stack",
        "stream",
        "lookups",
        "weight",
        "growth",
        "raw_references",
        "raw_sampled",
        "raw_lookups",
        "dropped",
        "max_keys",
        "ops",
        "hex_keys",
    )

    def __init__(self, max_keys: int, half_life: int) -> None:
        self.stack = _Stack()
        self.max_keys = max_keys
        self.stream = _Curve()
        self.lookups = _Curve()
        self.weight = 1.0
        self.growth = 2.0 ** (1.0 / half_life) if half_life else 1.0
        self.raw_references = 0
        self.raw_sampled = 0
        self.raw_lookups = 0
        self.dropped = 0
        self.ops = 0
        #: Whether this pool's keys look like 64-hex SHA-256 (re-checked now and then).
        self.hex_keys = True

    def advance(self, total: int, lookups: int = 0) -> float:
        """Count ``total`` stream references (and ``lookups`` lookup references) of
        the whole stream, sampled or not; returns their weight."""
        if self.growth != 1.0:
            self.weight *= self.growth**total
            if self.weight > _RESCALE_AT:
                self._rescale()
        w = self.weight
        self.stream.references += w * total
        self.raw_references += total
        if lookups:
            self.lookups.references += w * lookups
            self.raw_lookups += lookups
        return w

    def reference(
        self,
        keys: Sequence[Any],
        total: int,
        inserting: bool = True,
        missed: Any = None,
        lookups: int = 0,
    ) -> None:
        """One call's ``total`` references, of which ``keys`` were sampled.  Every
        distance is taken before the call's updates (batch semantics).  A lookup
        (``inserting=False``, ``lookups`` references counting the page it missed
        at, ``missed`` if that page was sampled) does not insert a page the stack
        does not hold, and the missed page is only counted, not moved: the cache
        does not hold it."""
        w = self.advance(total, lookups)
        stream = self.stream
        lookup = None if inserting else self.lookups
        if lookup is not None:
            lookup.sampled += w * (len(keys) + (missed is not None))
        if missed is not None:
            t = self.stack.times.get(missed)
            if t is None:
                lookup.cold += w  # type: ignore[union-attr]
            else:
                lookup.bucket(self.stack.after(t), w)  # type: ignore[union-attr]
        if not keys:
            return
        self.raw_sampled += len(keys)
        stream.sampled += w * len(keys)
        if len(keys) > 1 and len(set(keys)) != len(keys):
            keys = self._repeats_as_hits(keys, w, lookup)
        stack = self.stack
        times = stack.times
        after = stack.after
        hist = stream.hist
        absent: list[Any] = []
        # A key whose timestamp follows the previous key's (a chain referenced
        # again in order) is exactly one closer: no search needed.
        prev_t = prev_d = -2
        for key in keys:
            t = times.get(key)
            if t is None:
                stream.cold += w
                prev_t = -2
                if lookup is not None:
                    lookup.cold += w
                    absent.append(key)
                continue
            d = prev_d - 1 if t == prev_t + 1 else after(t)
            prev_t = t
            prev_d = d
            if d < len(hist):
                hist[d] += w
            else:
                stream.bucket(d, w)
            if lookup is not None:
                lookup.bucket(d, w)
        if absent:
            skip = set(absent)
            keys = [key for key in keys if key not in skip]
        push = stack.push
        for key in keys:
            push(key)
        if len(times) > self.max_keys:
            stack.trim(self.max_keys)

    def _repeats_as_hits(self, keys: Sequence[Any], w: float, lookup: _Curve | None) -> list[Any]:
        """A key repeated within one call is a hit at every cap (``add`` counts it a
        refresh, a walk found it); the stack sees each key once, at its last
        occurrence."""
        last = {key: index for index, key in enumerate(keys)}
        out = []
        for index, key in enumerate(keys):
            if last[key] == index:
                out.append(key)
            else:
                self.stream.bucket(0, w)
                if lookup is not None:
                    lookup.bucket(0, w)
        return out

    def _rescale(self) -> None:
        scale = 1.0 / self.weight
        self.stream.rescale(scale)
        self.lookups.rescale(scale)
        self.weight = 1.0

    def hit_ratios(
        self, caps: Sequence[int], rate: float, adjust: bool, lookups: bool = False
    ) -> list[float | None]:
        curve = self.lookups if lookups else self.stream
        return curve.hit_ratios(caps, rate, adjust, self.max_keys)


@dataclass(frozen=True)
class PoolAdvice:
    """One pool's estimated hit ratios around its current cap."""

    pool: str
    #: The pool's cap when the snapshot was taken (None: not known).
    capacity: int | None
    #: Multiplier of ``capacity`` -> estimated hit ratio (None: no data yet, or beyond
    #: the distances tracked).
    estimates: Mapping[float, float | None]
    #: Page references drained (the whole stream) and of those, sampled.
    references: int
    sampled_references: int
    #: Sampled pages currently tracked.
    sampled_pages: int
    #: Page references lost to a full buffer.
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
    pending_operations: int
    dropped_operations: int
    dropped_references: int
    drains: int
    drain_seconds: float
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
        """``(labels, value)`` pairs for ``GAUGE_NAME`` (``LOOKUP_GAUGE_NAME`` with
        ``lookups=True``); unknown estimates are left out."""
        out = []
        for pool, advice in self.pools.items():
            values = advice.lookup_estimates if lookups else advice.estimates
            for multiplier, value in values.items():
                if value is not None:
                    out.append(
                        ({"pool": pool, "cap_multiplier": multiplier_label(multiplier)}, value)
                    )
        return out


def _blake_sampled(keys: Iterable[str], threshold: int) -> list[str]:
    """Sampling for keys that are not 64-hex SHA-256 strings (uniform again)."""
    out = []
    for key in keys:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if int.from_bytes(digest, "big") < threshold:
            out.append(key)
    return out


class CapacityAdvisor:
    """A ``BeliefObserver`` that estimates each pool's hit-ratio curve (SHARDS).

    ``shared=True`` models one LRU over all pools, as the seed (flat) generation
    has, reported under pool ``"all"``.  ``half_life_references`` > 0 weighs recent
    references more (the weight doubles every that many page references), so the
    curve follows a changing workload; 0 keeps the whole history.
    """

    __slots__ = (
        "sampling_rate",
        "drain_budget_s",
        "adjust",
        "shared",
        "_threshold",
        "_prefix",
        "_limit",
        "_max_keys",
        "_half_life",
        "_clock",
        "_buf",
        "_estimators",
        "_lock",
        "dropped_operations",
        "dropped_references",
        "drains",
        "drain_seconds",
        "errors",
    )

    def __init__(
        self,
        sampling_rate: float = DEFAULT_SAMPLING_RATE,
        *,
        buffer_ops: int = DEFAULT_BUFFER_OPS,
        max_sampled_pages: int = DEFAULT_MAX_SAMPLED_PAGES,
        half_life_references: int = 0,
        adjust: bool = False,
        drain_budget_s: float | None = DEFAULT_DRAIN_BUDGET_S,
        shared: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float)):
            raise TypeError(f"sampling_rate must be a number, got {type(sampling_rate).__name__}")
        if not 0.0 < sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must be within (0, 1], got {sampling_rate}")
        for name, value, low in (
            ("buffer_ops", buffer_ops, 1),
            ("max_sampled_pages", max_sampled_pages, 1),
            ("half_life_references", half_life_references, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if drain_budget_s is not None and not 0 <= drain_budget_s < math.inf:
            raise ValueError(f"drain_budget_s must be a finite number >= 0, got {drain_budget_s}")
        self.sampling_rate = float(sampling_rate)
        self.drain_budget_s = drain_budget_s
        self.adjust = bool(adjust)
        self.shared = bool(shared)
        self._threshold = min(int(self.sampling_rate * 2.0**64), 2**64)
        # h < prefix  <=>  int(h[:16], 16) < threshold, for 64-char lowercase hex h.
        self._prefix = f"{self._threshold:016x}" if self._threshold < 2**64 else None
        self._limit = buffer_ops
        self._max_keys = max_sampled_pages
        self._half_life = half_life_references
        self._clock = clock
        self._buf: list[tuple[Any, ...]] = []
        self._estimators: dict[str, _Estimator] = {}
        self._lock = threading.Lock()
        self.dropped_operations = 0
        self.dropped_references = 0
        self.drains = 0
        self.drain_seconds = 0.0
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
            buffer_ops=section.buffer_ops,
            max_sampled_pages=section.max_sampled_pages,
            half_life_references=section.half_life_references,
            adjust=section.adjust,
            drain_budget_s=section.drain_budget_ms / 1000.0,
            shared=shared,
        )

    # -- BeliefObserver: O(1) per operation, called on the scheduler thread ----
    def added(self, pool: str, hashes: Sequence[str]) -> None:
        buf = self._buf
        if len(buf) < self._limit:
            buf.append((pool, hashes))
        else:
            self._overflow(pool, len(hashes))

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        buf = self._buf
        if len(buf) < self._limit:
            buf.append((pool, hashes, stop))
        else:
            self._overflow(pool, stop)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        buf = self._buf
        if len(buf) < self._limit:
            buf.append((pool, hashes, keep_pages, None))
        else:
            self.dropped_operations += 1

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """In-flight content is not a belief: not part of the reference stream."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        if inflight_only:
            return
        buf = self._buf
        # Kept beyond a full buffer (up to twice its size): a missed clear would
        # leave ghosts in the stack, and clears are rare.
        if len(buf) < 2 * self._limit:
            buf.append((pool,))
        else:
            self.dropped_operations += 1

    def _overflow(self, pool: str, pages: int) -> None:
        self.dropped_operations += 1
        self.dropped_references += pages
        try:
            self._estimator(pool).dropped += pages
        except Exception:  # never raise into the cache
            self.errors += 1

    # -- processing ------------------------------------------------------------
    @property
    def pending_operations(self) -> int:
        return len(self._buf)

    def _estimator(self, pool: str) -> _Estimator:
        name = SHARED_POOL if self.shared else pool
        est = self._estimators.get(name)
        if est is None:
            est = self._estimators[name] = _Estimator(self._max_keys, self._half_life)
        return est

    def _apply(self, op: tuple[Any, ...]) -> None:
        """Process one buffered operation (the general path; ``_run`` inlines the
        common one)."""
        size = len(op)
        pool = op[0]
        est = self._estimators.get(SHARED_POOL if self.shared else pool) or self._estimator(pool)
        if size == 1:
            est.stack.clear()
            return
        hashes = op[1]
        length = len(hashes)
        if not length:
            return
        start = op[2] if size == 4 else 0
        count = min(op[2], length) if size == 3 else length
        self._check_keys(est, hashes[min(start, length - 1)])
        keys = self._sample(est, hashes, start, count) if count > start else []
        if self.shared and keys:
            keys = [(pool, k) for k in keys]
        if size == 4:
            for key in keys:
                est.stack.remove(key)
        elif size == 2:
            if keys:
                est.reference(keys, count)
            else:
                est.advance(count)
        else:
            # A lookup: it walked hashes[:count] and, if count < length, missed there.
            missed = None
            if count < length and self._sample(est, hashes, count, count + 1):
                missed = (pool, hashes[count]) if self.shared else hashes[count]
            lookups = count + (count < length)
            if keys or missed is not None:
                est.reference(keys, count, False, missed, lookups)
            else:
                est.advance(count, lookups)

    def _sample(self, est: _Estimator, hashes: Sequence[str], start: int, stop: int) -> list[Any]:
        """The sampled keys among ``hashes[start:stop]``, in order."""
        prefix = self._prefix
        view: Iterable[str] = (
            hashes if not start and stop == len(hashes) else islice(hashes, start, stop)
        )
        if prefix is None:
            return list(view)
        if est.hex_keys:
            return [h for h in view if h < prefix]
        return _blake_sampled(view, self._threshold)

    @staticmethod
    def _check_keys(est: _Estimator, sample: str) -> None:
        """Every so often, check that the pool's keys are 64-hex (else sample by blake2b)."""
        est.ops += 1
        if est.ops % _HEX_CHECK_EVERY == 1:
            est.hex_keys = _HEX64.fullmatch(sample) is not None

    def _run(self, buf: list[tuple[Any, ...]], deadline: float) -> int:
        """Process ``buf`` from its start until the deadline; returns how many were done.

        The common operation (a lookup or an add of SHA-256 keys, per-pool LRUs,
        no decay, nothing sampled) is handled inline: per operation that is one
        C-level filter and a few additions.
        """
        n = len(buf)
        done = 0
        clock = self._clock
        prefix = self._prefix
        fast = prefix is not None and not self.shared
        estimators = self._estimators
        apply = self._apply
        while done < n:
            if done and not done & 7 and clock() >= deadline:
                break
            op = buf[done]
            done += 1
            try:
                size = len(op)
                est = estimators.get(op[0]) if fast and size < 4 else None
                if est is None or not est.hex_keys or est.growth != 1.0:
                    apply(op)
                    continue
                hashes = op[1]
                length = len(hashes)
                if size == 2:
                    keys = [h for h in hashes if h < prefix]
                    count = lookups = length
                else:
                    count = op[2]
                    if count < length:
                        if hashes[count] < prefix:  # the missed page is sampled
                            apply(op)
                            continue
                        keys = [h for h in islice(hashes, count) if h < prefix]
                        lookups = count + 1
                    else:
                        count = lookups = length
                        keys = [h for h in hashes if h < prefix]
                est.ops += 1
                if est.ops % _HEX_CHECK_EVERY == 1 and length:
                    est.hex_keys = _HEX64.fullmatch(hashes[0]) is not None
                if keys:
                    if size == 2:
                        est.reference(keys, count)
                    else:
                        est.reference(keys, count, False, None, lookups)
                else:
                    est.stream.references += count
                    est.raw_references += count
                    if size == 3:
                        est.lookups.references += lookups
                        est.raw_lookups += lookups
            except Exception:
                self.errors += 1
        return done

    def drain(self, budget_s: float | _Default | None = _DEFAULT) -> int:
        """Process buffered operations, oldest first, until none is left or the
        budget is spent (default: the configured ``drain_budget_s``; None: no limit).
        Returns how many were processed.  Never raises; skips the round if a
        snapshot holds the lock."""
        if isinstance(budget_s, _Default):
            budget_s = self.drain_budget_s
        if not self._buf or not self._lock.acquire(blocking=False):
            return 0
        clock = self._clock
        started = clock()
        deadline = started + budget_s if budget_s is not None else math.inf
        done = 0
        try:
            buf = self._buf
            done = self._run(buf, deadline)
            del buf[:done]
        except Exception:
            self.errors += 1
        finally:
            self.drains += 1
            self.drain_seconds += clock() - started
            self._lock.release()
        return done

    def discard_pending(self) -> int:
        """Drop the buffered operations unprocessed (counted as dropped); returns how many."""
        with self._lock:
            ops = self._buf
            dropped = len(ops)
            try:
                pages = sum(
                    len(op[1]) if len(op) == 2 else op[2] for op in ops if len(op) in (2, 3)
                )
            except Exception:
                pages = 0
                self.errors += 1
            ops.clear()
            self.dropped_operations += dropped
            self.dropped_references += pages
        return dropped

    # -- reporting -------------------------------------------------------------
    def estimate(self, pool: str, cap: int, *, lookups: bool = False) -> float | None:
        """Estimated hit ratio of ``pool`` at ``cap`` entries: of the reference stream,
        or with ``lookups=True`` of the pages lookups asked for (None: no data yet)."""
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap must be an int >= 1, got {cap!r}")
        with self._lock:
            est = self._estimators.get(SHARED_POOL if self.shared else pool)
            if est is None:
                return None
            return est.hit_ratios([cap], self.sampling_rate, self.adjust, lookups)[0]

    def snapshot(
        self,
        capacities: Mapping[str, int] | int | None = None,
        multipliers: Sequence[float] = MULTIPLIERS,
    ) -> AdvisorSnapshot:
        """Hit ratios at ``multipliers`` x each pool's cap.  ``capacities`` maps pool ->
        cap, or is one cap for every pool (shared-cap cache); pools without a cap get
        no estimates."""
        pools: dict[str, PoolAdvice] = {}
        with self._lock:
            for name, est in self._estimators.items():
                cap = (
                    capacities
                    if isinstance(capacities, int)
                    else (capacities.get(name) if capacities is not None else None)
                )
                estimates: dict[float, float | None] = {}
                lookup_estimates: dict[float, float | None] = {}
                if cap:
                    caps = [max(1, int(cap * m)) for m in multipliers]
                    rate = self.sampling_rate
                    values = est.hit_ratios(caps, rate, self.adjust)
                    estimates = dict(zip(multipliers, values))
                    values = est.hit_ratios(caps, rate, self.adjust, lookups=True)
                    lookup_estimates = dict(zip(multipliers, values))
                pools[name] = PoolAdvice(
                    name,
                    cap or None,
                    MappingProxyType(estimates),
                    est.raw_references,
                    est.raw_sampled,
                    len(est.stack.times),
                    est.dropped,
                    MappingProxyType(lookup_estimates),
                    est.raw_lookups,
                )
        return AdvisorSnapshot(
            self.sampling_rate,
            MappingProxyType(pools),
            len(self._buf),
            self.dropped_operations,
            self.dropped_references,
            self.drains,
            self.drain_seconds,
            self.errors,
            tuple(multipliers),
        )

    def capacities_of(self, cache: Any) -> Mapping[str, int] | int:
        """The caps to report against, read from a cache of either generation."""
        if self.shared or not hasattr(cache, "pools"):
            return int(cache.max_entries)
        return {p.name: int(p.max_entries) for p in cache.pools()}
