"""Side-by-side timing: every candidate runs the same work in the same process.

Each round times every candidate once on identical inputs, rotating which one
goes first so that neither always inherits a warm CPU cache; the figure per
candidate is the median over rounds, and a comparison is the ratio of medians.
The garbage collector stays on, as in a serving process: the seed allocates a
GC-tracked tuple per page and pays for the collections that triggers, which is a
real property of its design.  A full collection runs before each comparison.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: A unit of work for one round: performs it and returns the pages it processed.
RoundFn = Callable[[int], int]


@dataclass(frozen=True)
class Timing:
    """Median and spread of one candidate's ns per page over rounds."""

    name: str
    ns_per_page: float
    low: float
    high: float
    rounds: int

    @property
    def pages_per_second(self) -> float:
        return 1e9 / self.ns_per_page if self.ns_per_page else float("inf")


@dataclass(frozen=True)
class Comparison:
    """``baseline`` against ``candidate`` on one scenario."""

    scenario: str
    baseline: Timing
    candidate: Timing
    #: baseline time / candidate time: >1 means the candidate is faster.
    speedup: float
    notes: dict[str, object] = field(default_factory=dict)


def time_rounds(
    candidates: Sequence[tuple[str, RoundFn]], rounds: int, warmup: int = 1
) -> list[Timing]:
    """Run ``rounds`` interleaved rounds and return one ``Timing`` per candidate."""
    samples: dict[str, list[float]] = {name: [] for name, _ in candidates}
    gc.collect()
    for r in range(warmup + rounds):
        shift = r % len(candidates)
        order = list(candidates[shift:]) + list(candidates[:shift])
        for name, fn in order:
            start = time.perf_counter_ns()
            pages = fn(r)
            elapsed = time.perf_counter_ns() - start
            if r >= warmup and pages:
                samples[name].append(elapsed / pages)
    out = []
    for name, _ in candidates:
        values = samples[name]
        out.append(
            Timing(
                name=name,
                ns_per_page=statistics.median(values),
                low=min(values),
                high=max(values),
                rounds=len(values),
            )
        )
    return out


def compare(
    scenario: str,
    baseline: tuple[str, RoundFn],
    candidate: tuple[str, RoundFn],
    rounds: int,
    **notes: object,
) -> Comparison:
    """Time ``baseline`` and ``candidate`` side by side on ``scenario``."""
    base, cand = time_rounds([baseline, candidate], rounds)
    return Comparison(scenario, base, cand, base.ns_per_page / cand.ns_per_page, dict(notes))


def compare_balanced(
    scenario: str,
    baselines: Sequence[RoundFn],
    candidates: Sequence[RoundFn],
    labels: tuple[str, str],
    rounds: int,
    **notes: object,
) -> Comparison:
    """Like ``compare``, over two instances of each side built in ABBA order
    (candidate, baseline, baseline, candidate).  Instances of the *same* class
    with the same history differ by up to ~50% on memory-bound work depending
    only on where, and in which order, their tables were allocated; giving each
    side one early and one late instance cancels that out.  Each side's figure
    is the mean of its two instances' medians."""
    base_label, cand_label = labels
    (c1, c2), (b1, b2) = candidates, baselines
    named = [
        (f"{cand_label}-1", c1),
        (f"{base_label}-1", b1),
        (f"{base_label}-2", b2),
        (f"{cand_label}-2", c2),
    ]
    timings = {t.name: t for t in time_rounds(named, rounds)}

    def side(label: str) -> Timing:
        a, b = timings[f"{label}-1"], timings[f"{label}-2"]
        return Timing(
            name=label,
            ns_per_page=(a.ns_per_page + b.ns_per_page) / 2,
            low=min(a.low, b.low),
            high=max(a.high, b.high),
            rounds=a.rounds + b.rounds,
        )

    base, cand = side(base_label), side(cand_label)
    return Comparison(scenario, base, cand, base.ns_per_page / cand.ns_per_page, dict(notes))


def lookup_round(
    method: Callable[..., bool], pool: str | None, plan: Sequence[Sequence[list[str]]]
) -> RoundFn:
    """A round that looks up round ``r``'s chains (all must hit); ``pool`` is
    passed first for the seed generation's ``method(pool, hashes)``."""

    def run(r: int) -> int:
        pages = 0
        for c in plan[r % len(plan)]:
            hit = method(c) if pool is None else method(pool, c)
            if not hit:
                raise AssertionError("benchmark chain unexpectedly missed")
            pages += len(c)
        return pages

    return run


def add_round(
    method: Callable[..., None], pool: str | None, plan: Sequence[Sequence[list[str]]]
) -> RoundFn:
    """A round that adds round ``r``'s (fresh) chains."""

    def run(r: int) -> int:
        pages = 0
        for c in plan[r]:
            if pool is None:
                method(c)
            else:
                method(pool, c)
            pages += len(c)
        return pages

    return run
