"""The reconciler's counters and latency histogram, and their frozen snapshot.

Each field has one writer thread (the scheduler's or the worker), so plain ``+=``
needs no lock; ``snapshot()`` may run on any thread and copies dicts before
reading them.  Label values are bounded: pool names, and the tuples below.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Any

#: Query outcomes (label ``result``), in three groups: the doctor, the alerts
#: and the dashboard read these names, never spell them.
PRESENT = "present"  # every verified page is in L3
ABSENT = "absent"  # a believed or verified page is missing from L3 (trusted)
UNTRUSTED = "untrusted"  # short answer while the ledger cannot prove absence
ERROR = "error"  # ground truth raised (see errors by kind)
TIMEOUT = "timeout"  # no answer within the per-query timeout (scheduler side)
REJECTED = "rejected"  # failed fast: circuit open
VOID = "void"  # discarded: the pool was cleared while the query was out
#: Ground truth answered.
ANSWERED_RESULTS = (PRESENT, ABSENT, UNTRUSTED)
#: No answer: ground truth failed, was too slow, or the circuit was open.
FAILED_RESULTS = (ERROR, TIMEOUT, REJECTED)
#: Neither: the question no longer mattered.
DISCARDED_RESULTS = (VOID,)
RESULTS = (*ANSWERED_RESULTS, *FAILED_RESULTS, *DISCARDED_RESULTS)

#: Error kinds (label ``kind``).
ERROR_KINDS = (
    "connection",
    "timeout",
    "garbage",
    "ledger_empty",
    "ledger_reset",
    "ledger_behind",
    "server",
    "unsupported",
    "internal",
)

#: Upper bounds (seconds) of the query-latency histogram buckets (+Inf implied).
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative-on-read histogram with fixed buckets; one writer thread."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._bounds, tuple(accumulate(list(self._counts))), self.sum)


@dataclass(frozen=True)
class HistogramSnapshot:
    """``cumulative[i]`` observations <= ``bounds[i]``; the last entry is +Inf."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0


class ReconcilerCounters:
    """Mutable counters; see the field comments for the owning thread."""

    def __init__(self) -> None:
        # worker thread
        self.worker_results: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[str] = Counter()
        self.latency = Histogram()
        self.late_answers = 0
        self.max_query_cpu_s = 0.0
        # scheduler thread
        self.scheduler_results: Counter[tuple[str, str]] = Counter()
        self.stale_positives: Counter[str] = Counter()
        self.pages_invalidated: Counter[str] = Counter()
        self.pages_learnt: Counter[str] = Counter()
        self.verdicts_applied: Counter[str] = Counter()
        self.invalidations_withheld: Counter[str] = Counter()
        self.candidates_sampled = 0
        self.candidates_admitted = 0
        self.candidates_dropped = 0
        self.agreements = 0
        self.internal_errors = 0
        self.apply_calls = 0
        self.max_apply_s = 0.0
        self.max_observe_s = 0.0
        self.max_agreement_s = 0.0
        self.outstanding = 0


@dataclass(frozen=True)
class ReconcilerSnapshot:
    """What the metrics layer exports; every mapping is a copy."""

    #: (pool, result) -> queries; result in ``RESULTS``.
    queries: dict[tuple[str, str], int] = field(default_factory=dict)
    #: kind -> errors; kind in ``ERROR_KINDS``.
    errors: dict[str, int] = field(default_factory=dict)
    #: Verifications that dropped at least one believed page L3 lacks, per pool.
    stale_positives: dict[str, int] = field(default_factory=dict)
    #: Beliefs removed by verdicts, per pool.
    pages_invalidated: dict[str, int] = field(default_factory=dict)
    #: Pages added to beliefs because L3 had them (another instance wrote them,
    #: or this one did and its beliefs had evicted them), per pool.
    pages_learnt: dict[str, int] = field(default_factory=dict)
    #: Agreed verdicts applied, per pool.
    verdicts_applied: dict[str, int] = field(default_factory=dict)
    #: Absence verdicts not acted on because the page the answer stopped at was
    #: being written (in flight, or added since the query), per pool.
    invalidations_withheld: dict[str, int] = field(default_factory=dict)
    candidates_sampled: int = 0
    candidates_admitted: int = 0
    candidates_dropped: int = 0
    agreements: int = 0
    late_answers: int = 0
    #: 0 closed, 1 open, 2 half-open.
    circuit_state: int = 0
    circuit_opened: int = 0
    outstanding: int = 0
    query_seconds: HistogramSnapshot = field(default_factory=lambda: Histogram().snapshot())
    #: Longest scheduler-thread call into the reconciler so far (apply / observe).
    max_apply_s: float = 0.0
    max_observe_s: float = 0.0
    #: Longest agreement collective (gloo MIN all-reduce, waiting for peers included).
    max_agreement_s: float = 0.0
    #: Longest CPU time the worker spent on one query: it bounds how long the
    #: worker can hold the GIL while the scheduler thread waits for it.
    max_query_cpu_s: float = 0.0
    #: L3 objects the probes found and the backend leased for reading (Mooncake
    #: grants a read lease per object an existence query finds; 0 elsewhere).
    objects_leased: int = 0


def snapshot(
    c: ReconcilerCounters, circuit_state: int, circuit_opened: int, objects_leased: int = 0
) -> ReconcilerSnapshot:
    """Copy ``c`` (safe from any thread: dict copies are atomic under the GIL);
    every snapshot field named like a counter is that counter, copied."""
    copied: dict[str, Any] = {
        f.name: dict(v) if isinstance(v := getattr(c, f.name), Counter) else v
        for f in fields(ReconcilerSnapshot)
        if hasattr(c, f.name)
    }
    queries: Counter[tuple[str, str]] = Counter(dict(c.worker_results))
    queries.update(dict(c.scheduler_results))
    if c.internal_errors:
        copied["errors"]["internal"] = copied["errors"].get("internal", 0) + c.internal_errors
    return ReconcilerSnapshot(
        **copied,
        queries=dict(queries),
        circuit_state=circuit_state,
        circuit_opened=circuit_opened,
        query_seconds=c.latency.snapshot(),
        objects_leased=objects_leased,
    )
