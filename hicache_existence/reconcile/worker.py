"""A verification query and the worker thread that asks ground truth.

The scheduler thread admits queries and times them out; the worker answers them.
A query's state changes hands under one lock, so an answer after its timeout (or
after its pool was cleared) only counts as late.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from hicache_existence.reconcile.breaker import CircuitBreaker
from hicache_existence.reconcile.counters import (
    ABSENT,
    ERROR,
    PRESENT,
    REJECTED,
    TIMEOUT,
    UNTRUSTED,
    VOID,
    ReconcilerCounters,
)
from hicache_existence.reconcile.ground_truth import (
    GroundTruth,
    GroundTruthError,
    absence_is_evidence,
)

logger = logging.getLogger(__name__)

# Query states.
PENDING, DONE, TIMED_OUT, VOIDED = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class Query:
    seq: int
    pool: str
    chain: tuple[str, ...]
    submitted: float
    state: int = PENDING
    leading: int = -1  # -1: error / no answer
    trusted: int = 0
    probe: bool = False
    void: bool = False
    adds_before: int = 0  # the pool's add ordinal when the query was admitted

    def local_verdict(self) -> tuple[int, int] | None:
        """(leading, trusted) once this rank is done with the query, else None."""
        if self.void:
            return (-1, 0)
        if self.state == PENDING:
            return None
        return (self.leading, self.trusted)


class QueryWorker:
    """One daemon thread answering queries in submission order."""

    def __init__(
        self, truth: GroundTruth, breaker: CircuitBreaker, counters: ReconcilerCounters
    ) -> None:
        self._truth = truth
        self._breaker = breaker
        self._counters = counters
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Query | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="hicache-existence-reconciler", daemon=True
        )
        self._thread.start()

    def submit(self, q: Query) -> None:
        self._jobs.put_nowait(q)

    def give_up(self, q: Query, state: int) -> bool:
        """Scheduler side: mark a still-pending query timed out or void; False
        when its answer already came."""
        with self._lock:
            if q.state != PENDING:
                return False
            q.state = state
            self._counters.scheduler_results[(q.pool, TIMEOUT if state == TIMED_OUT else VOID)] += 1
            return True

    def close(self, timeout_s: float) -> None:
        self._jobs.put_nowait(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            q = self._jobs.get()
            if q is None:
                return
            if q.state != PENDING or q.void:
                if q.probe and q.state == VOIDED:
                    self._breaker.abandoned()  # else no probe would ever go again
                continue  # timed out or voided before we got to it
            if self._breaker.rejects(q.probe):
                self._finish(q, -1, 0, REJECTED)
            else:
                self._ask(q)

    def _ask(self, q: Query) -> None:
        truth, c = self._truth, self._counters
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        kind = ""
        leading = -1
        trusted = 0
        try:
            leading = truth.leading_present(q.pool, q.chain)
            if isinstance(leading, bool) or not isinstance(leading, int):
                raise TypeError(f"leading_present returned {type(leading).__name__}")
            if not 0 <= leading <= len(q.chain):
                raise ValueError(f"leading_present returned {leading} of {len(q.chain)}")
            trusted = 1 if absence_is_evidence(truth) else 0
        except GroundTruthError as exc:
            kind = exc.kind
        except (TypeError, ValueError):
            kind = "garbage"
        except Exception:
            kind = "internal"
            logger.debug("reconciler query failed", exc_info=True)
        c.latency.observe(time.perf_counter() - t0)
        c.max_query_cpu_s = max(c.max_query_cpu_s, time.thread_time() - cpu0)
        if kind:
            c.errors[kind] += 1
            # An answer the scheduler already timed out was counted as a failure
            # there: counting it again would double the probe's backoff twice (a
            # voided one was not: a probe's outcome must still reach the breaker).
            if self._finish(q, -1, 0, ERROR) or q.state != TIMED_OUT:
                if kind != "unsupported":  # a pool the truth cannot answer is not ill health
                    self._breaker.failure(q.probe)
                elif q.probe:
                    self._breaker.success()
            return
        self._breaker.success()
        result = PRESENT if leading == len(q.chain) else ABSENT if trusted else UNTRUSTED
        self._finish(q, leading, trusted, result)

    def _finish(self, q: Query, leading: int, trusted: int, result: str) -> bool:
        """Record the answer; False when it came late (timed out or voided)."""
        with self._lock:
            if q.state != PENDING:
                self._counters.late_answers += 1
                return False
            q.leading = leading
            q.trusted = trusted
            q.state = DONE
            self._counters.worker_results[(q.pool, result)] += 1
            return True
