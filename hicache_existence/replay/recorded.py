"""Replay of a recorded trace (version 2): the cache's own reference stream, again.

``recorded_curves`` runs the recorded events, per instance and pool, through the
advisor's exact LRU stack (``core.sampler``) and reads its two curves (the
reference stream, and lookups alone) at any caps; a recorded stack distance ``d``
stands for ``d / rate`` entries (``accounting.advisor.hit_ratios``).  At sample
rate 1 they are the advisor's curves; below it a SHARDS estimate from another
sample (the recorder's hash-prefix pages, not the advisor's salted hash).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache_existence.accounting import recorder as _recorder
from hicache_existence.accounting.advisor import hit_ratios
from hicache_existence.core import lru
from hicache_existence.core.sampler import SamplerType
from hicache_existence.replay.trace import Trace

_ALL = 1 << 64


@dataclass(frozen=True)
class RecordedCurve:
    """One instance's and pool's curves at the caps asked for."""

    instance: str
    pool: str
    sample_rate: float
    caps: tuple[int, ...]
    #: Estimated hit ratio of the reference stream at each cap (None: no data).
    stream: tuple[float | None, ...]
    #: The same for lookups alone.
    lookups: tuple[float | None, ...]
    #: Recorded page references of the stream, and of lookups.
    references: int
    lookup_references: int
    #: Recorded events per kind (the writes and prefetch queries included).
    events: dict[str, int] = field(default_factory=dict)


def _feed(sampler: SamplerType, kind: str, pages: tuple[str, ...], walked: int, miss: bool) -> None:
    if kind == _recorder.LOOKUP:
        sampler.walked(pages[: walked + 1] if miss else pages[:walked], walked)
    elif kind == _recorder.ADD:
        sampler.added(pages)
    elif kind == _recorder.INVALIDATE:
        sampler.removed(pages)
    elif kind == _recorder.CLEAR:
        sampler.clear()


def recorded_curves(trace: Trace, caps: Sequence[int]) -> list[RecordedCurve]:
    """The stream and lookup curves of every instance and pool of a recorded trace."""
    distinct: dict[tuple[int, str], set[str]] = {}
    for e in trace.events:
        if e.pages and e.kind != _recorder.REQUEST:
            distinct.setdefault((e.instance, e.pool), set()).update(e.pages)
    samplers: dict[tuple[int, str], SamplerType] = {}
    counts: dict[tuple[int, str], dict[str, int]] = {}
    for e in trace.events:
        if e.kind == _recorder.REQUEST:
            continue
        key = (e.instance, e.pool)
        tally = counts.setdefault(key, dict.fromkeys(_recorder.KINDS[:-1], 0))
        tally[e.kind] += 1
        sampler = samplers.get(key)
        if sampler is None:
            keys = max(1, min(1 << 28, len(distinct.get(key, ())) + 1))
            sampler = samplers[key] = lru.Sampler(_ALL, keys, 0)
        _feed(sampler, e.kind, e.pages, e.walked, e.miss)
    out = []
    rate = trace.sample_rate
    for key in sorted(samplers, key=lambda k: (k[0], k[1] != "kv", k[1])):
        sampler = samplers[key]
        c = sampler.counts()
        out.append(
            RecordedCurve(
                trace.instances[key[0]] if trace.instances else "",
                key[1],
                rate,
                tuple(caps),
                tuple(hit_ratios(sampler, caps, rate, counts=c)),
                tuple(hit_ratios(sampler, caps, rate, lookups=True, counts=c)),
                int(c["raw_sampled"]),
                round(c["lookup_sampled"]),
                counts[key],
            )
        )
    return out


def format_curves(curves: Sequence[RecordedCurve], format_cap: Callable[[int], str]) -> str:
    """The curves as a table (``format_cap``: the sweep's cap formatter)."""
    lines = []
    for curve in curves:
        events = ", ".join(f"{n:,} {kind}" for kind, n in curve.events.items() if n)
        lines.append(
            f"recorded stream, instance {curve.instance or '?'}, pool {curve.pool}: sample rate "
            f"{curve.sample_rate:g}, {curve.references:,} recorded page references "
            f"({curve.lookup_references:,} by lookups); events: {events}"
        )
        lines.append(f"{'cap':>9} {'stream hit ratio':>17} {'lookup hit ratio':>17}")
        for cap, s, lk in zip(curve.caps, curve.stream, curve.lookups):
            lines.append(f"{format_cap(cap):>9} {_ratio(s):>17} {_ratio(lk):>17}")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def to_json(trace: Trace, curves: Sequence[RecordedCurve]) -> dict[str, object]:
    """The curves as the JSON report's ``recorded`` section."""
    return {
        "source": trace.source,
        "sample_rate": trace.sample_rate,
        "instances": list(trace.instances),
        "curves": [
            {
                "instance": c.instance,
                "pool": c.pool,
                "caps": list(c.caps),
                "stream_hit_ratio": list(c.stream),
                "lookup_hit_ratio": list(c.lookups),
                "recorded_references": c.references,
                "recorded_lookup_references": c.lookup_references,
                "events": dict(c.events),
            }
            for c in curves
        ],
    }


def scaled(value: int, rate: float) -> int:
    """A size in pages as it applies to a trace sampled at ``rate`` (at least 1)."""
    return max(1, round(value * rate)) if value else 0
