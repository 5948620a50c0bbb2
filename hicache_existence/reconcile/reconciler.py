"""The reconciler: verifies sampled beliefs against ground truth and heals them.

The scheduler thread never waits for I/O: a lookup costs a decrement
(``sampling``), ``apply(step)`` acts every ``agree_interval_steps`` calls, and one
worker thread asks (``worker``, behind a ``breaker``).  TP replicas stay identical
because every input of a decision is the same on every rank: the chains picked,
the answers acted on (the MIN of every rank's ``vector``) and the budget (a
``bucket`` refilled from the agreed clock).  Every rank joins every agreement
whatever its state, so a diverged replica cannot hang the others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from hicache_existence.config import ReconcilerSection
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.reconcile.agreement import Agreement, SingleRank
from hicache_existence.reconcile.breaker import CircuitBreaker
from hicache_existence.reconcile.bucket import TokenBucket
from hicache_existence.reconcile.counters import (
    ReconcilerCounters,
    ReconcilerSnapshot,
    snapshot,
)
from hicache_existence.reconcile.ground_truth import GroundTruth, leased_objects
from hicache_existence.reconcile.sampling import Candidates, Sampler
from hicache_existence.reconcile.vector import Vector
from hicache_existence.reconcile.verdicts import WritesSince, apply_verdict, default_learns
from hicache_existence.reconcile.worker import PENDING, TIMED_OUT, VOIDED, Query, QueryWorker

logger = logging.getLogger(__name__)


class Reconciler:
    """Install it as the cache's observer (alone or in a ``Tee``) and call
    ``apply(step)`` once per scheduler step on every rank, after
    ``check_hicache_events``, so every rank has seen the same writes when it
    acts; with ``truth=None`` it does nothing.  Arguments are checked where they
    enter (``ReconcilerSection``).  Not configuration: ``max_candidates`` picks
    wait for admission (memory), one agreement acts on ``apply_page_budget``
    pages (scheduler time; a longer first chain still applies, alone)."""

    def __init__(
        self,
        cache: ExistenceCache,
        truth: GroundTruth | None,
        *,
        agreement: Agreement | None = None,
        sampling_rate: float = 0.01,
        verifications_per_s: float = 50.0,
        pages_per_query: int = 1024,
        timeout_s: float = 0.05,
        queue_size: int = 256,
        max_verdicts_per_step: int = 8,
        agree_interval_steps: int = 4,
        breaker: CircuitBreaker | None = None,
        learn: bool = True,
        learns: Callable[[str], bool] = default_learns,
        max_candidates: int = 64,
        apply_page_budget: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._truth = truth
        self._agreement: Agreement = agreement if agreement is not None else SingleRank()
        self._sampler = Sampler(float(sampling_rate), pages_per_query)
        self._candidates = Candidates(max_candidates)
        self._bucket = TokenBucket(verifications_per_s)
        self._timeout = float(timeout_s)
        self._queue_size = queue_size
        self._slots = max_verdicts_per_step
        self._interval = agree_interval_steps
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        self._learns = learns if learn else lambda pool: False
        self._page_budget = apply_page_budget
        self._clock = clock
        self._t0 = clock()
        #: Told every applied verdict, ``(pool, chain, leading)``: ``chain[:leading]``
        #: was found in L3 (the storage-tier KV events' verification time).
        self.verdict_observer: Callable[[str, Sequence[str], int], None] | None = None

        self.counters = ReconcilerCounters()
        self._steps = 0
        self._seq = 0
        self._outstanding: deque[Query] = deque()
        self._writes = WritesSince()
        self._recording = self._writes.recording  # the pools whose adds are recorded
        self._worker: QueryWorker | None = None  # started at the first admission
        self._applying = False
        self._on = truth is not None
        self._internal_logged = 0

    @classmethod
    def from_section(
        cls,
        section: ReconcilerSection,
        cache: ExistenceCache,
        truth: GroundTruth | None,
        agreement: Agreement | None = None,
        **overrides: Any,
    ) -> Reconciler:
        """A reconciler configured by the ``reconciler`` section."""
        kwargs: dict[str, Any] = {
            "agreement": agreement,
            "sampling_rate": section.sampling_rate,
            "verifications_per_s": section.verifications_per_s,
            "pages_per_query": section.pages_per_query,
            "timeout_s": max(section.timeout_ms, 0.001) / 1000.0,
            "queue_size": section.queue_size,
            "max_verdicts_per_step": section.max_verdicts_per_step,
            "agree_interval_steps": section.agree_interval_steps,
            "breaker": CircuitBreaker(
                section.breaker_failures, section.breaker_backoff_s, section.breaker_backoff_max_s
            ),
            "learn": section.learn,
            **overrides,
        }
        return cls(cache, truth if section.enabled else None, **kwargs)

    @property
    def active(self) -> bool:
        """Whether the reconciler does anything (it has ground truth, is not closed)."""
        return self._on

    # -- BeliefObserver (scheduler thread, once per cache operation) ------------------
    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        """A lookup walked ``hashes``: maybe pick its chain for verification (not
        picking, the common case, costs a decrement; only a pick is copied and timed)."""
        if not self._on or self._applying:
            return
        sampler = self._sampler
        sampler.countdown -= 1
        if sampler.countdown > 0:
            return
        try:
            n = sampler.picked(len(hashes))
            if n:
                t0 = time.perf_counter()
                c = self.counters
                added = self._candidates.offer(pool, hashes, n)
                if added is not None:
                    c.candidates_sampled += 1
                    if not added:
                        c.candidates_dropped += 1
                c.max_observe_s = max(c.max_observe_s, time.perf_counter() - t0)
        except Exception:
            self._internal_error("touched")

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        """Pages added while a query of the pool is out must not be invalidated by
        its (older) answer."""
        if pool in self._recording and not self._applying:  # one dict probe when none is out
            self._writes.added(pool, hashes)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Nothing to do: an invalidation only removes beliefs."""

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """Nothing to do (the write path's hot path): a verdict reads what is in
        flight when it applies, and ``added`` notes the acks (see ``verdicts``)."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        """A cleared pool (L3 flushed, storage detached) voids the answers out and
        drops its candidates; in-flight refs cleared alone (the write pipeline was
        reset) void the answers out too: the dropped writes may land with no ack."""
        if not self._on:
            return
        try:
            for q in self._outstanding:
                if q.pool == pool and not q.void:
                    self._give_up(q, VOIDED)  # a later answer only counts as late
                    q.void = True
            if not inflight_only:
                self._candidates.drop_pool(pool)
        except Exception:
            self._internal_error("cleared")

    # -- the lockstep point ----------------------------------------------------------
    def steps_to_due(self) -> int:
        """``apply`` calls until one agrees and applies (1: the next), the same on
        every rank (off, the call it names returns at once)."""
        return self._interval - self._steps % self._interval

    def advance(self, steps: int) -> None:
        """Count ``steps`` steps on which nothing is due (fewer than
        ``steps_to_due()``): what that many ``apply`` calls would have done."""
        self._steps += steps

    def apply(self, step: int = -1) -> None:
        """Once per scheduler step on every rank, after the HiCache events are
        drained: every ``agree_interval_steps`` calls it agrees with the other
        ranks and applies verdicts.  Never raises, never waits on I/O."""
        if not self._on:
            return
        self._steps += 1
        if self._steps % self._interval:
            return
        t0 = time.perf_counter()
        try:
            self._agree_and_apply()
        finally:
            c = self.counters
            c.apply_calls += 1
            c.max_apply_s = max(c.max_apply_s, time.perf_counter() - t0)

    def _agree_and_apply(self) -> None:
        try:
            vec = self._local_vector(self._clock())
        except Exception:
            self._internal_error("vector")
            vec = Vector.idle(self._slots)
        t0 = time.perf_counter()
        try:
            words = self._agreement.min_reduce(vec.words())
        except Exception:
            # The group is gone (peer died, timeout): stop for good rather than
            # risk a mismatched collective later.
            self._on = False
            logger.exception("hicache-existence reconciler: agreement failed; reconciler stopped")
            return
        c = self.counters
        c.agreements += 1
        c.max_agreement_s = max(c.max_agreement_s, time.perf_counter() - t0)
        try:
            self._apply_agreed(Vector.from_words(words, self._slots))
        except Exception:
            self._internal_error("apply")

    def _local_vector(self, now: float) -> Vector:
        deadline = now - self._timeout
        # Time out queries that waited too long (they are in submission order).
        for q in self._outstanding:
            if q.submitted > deadline:
                break
            if q.state == PENDING and not q.void and self._give_up(q, TIMED_OUT):
                self._breaker.failure(q.probe)  # a store that does not answer in time fails
        verdicts = []
        for q in islice(self._outstanding, self._slots):
            verdict = q.local_verdict()
            if verdict is None:
                break
            verdicts.append(verdict)
        permits = self._breaker.permits()
        free = self._queue_size - len(self._outstanding)
        admit = min(len(self._candidates), free, self._slots)
        if permits >= 0:
            admit = min(admit, permits)
        elapsed_ms = int((now - self._t0) * 1000.0)
        return Vector.local(verdicts, max(admit, 0), elapsed_ms, self._slots)

    def _give_up(self, q: Query, state: int) -> bool:
        return self._worker is not None and self._worker.give_up(q, state)

    def _apply_agreed(self, agreed: Vector) -> None:
        budget = self._page_budget
        applied = 0
        self._applying = True
        try:
            while applied < agreed.done and self._outstanding:
                q = self._outstanding[0]
                if applied and len(q.chain) > budget:
                    break  # the rest stays agreed-upon-later: chain sizes are identical
                budget -= len(q.chain)
                self._outstanding.popleft()
                self._candidates.release(q.pool, q.chain)
                self._writes.closed(q.pool)
                leading, trusted = agreed.leading[applied], agreed.trusted[applied]
                applied += 1
                if leading >= 0 and not q.void:
                    try:
                        self._apply_verdict(q, min(leading, len(q.chain)), trusted > 0)
                    except Exception:
                        # Rank-local: the rest of the agreed verdicts, the refill
                        # and the admission must still run, or the ranks' queues
                        # stop matching slot for slot.
                        self._internal_error("verdict")
        finally:
            self._applying = False
        self._bucket.refill(agreed.elapsed_ms)
        self._admit(min(agreed.admit, self._bucket.tokens()))
        self.counters.outstanding = len(self._outstanding)

    @property
    def applying(self) -> bool:
        """Whether verdicts are being applied now (an invalidation seen meanwhile
        is the reconciler's, not a prefetch hit query's)."""
        return self._applying

    def _apply_verdict(self, q: Query, leading: int, trusted: bool) -> None:
        pool = q.pool
        c = self.counters
        observer = self.verdict_observer
        if observer is not None:
            try:
                observer(pool, q.chain, leading)
            except Exception:  # rank-local: must not change what this rank applies
                self._internal_error("verdict observer")
        outcome = apply_verdict(
            self._cache,
            pool,
            q.chain,
            leading,
            trusted,
            lambda: self._doomed(q, leading),
            self._learns(pool),
        )
        if outcome.withheld:
            c.invalidations_withheld[pool] += 1
        if outcome.invalidated:
            c.stale_positives[pool] += 1
            c.pages_invalidated[pool] += outcome.invalidated
        if outcome.learnt:
            c.pages_learnt[pool] += outcome.learnt
        c.verdicts_applied[pool] += 1

    def _doomed(self, q: Query, leading: int) -> Sequence[str] | None:
        """What ``invalidate_beyond(..., leading)`` may drop for ``q``'s absence
        verdict (``WritesSince.span``; None: withhold)."""
        inflight = self._cache.pool(q.pool).inflight_pages()
        try:
            return self._writes.span(q.pool, q.chain, leading, q.adds_before, (inflight,))
        except Exception:  # an in-flight set upstream passed that cannot be read
            self._internal_error("in-flight set")
            return None

    def _admit(self, n: int) -> None:
        self._writes.prune()  # pools with nothing out no longer need their adds
        c = self.counters
        now = self._clock()
        for i, (pool, chain) in enumerate(self._candidates.take()):
            if i >= n:
                self._candidates.release(pool, chain)
                c.candidates_dropped += 1
                continue
            q = Query(self._seq, pool, chain, now)
            self._seq += 1
            q.probe = self._breaker.admitted()
            q.adds_before = self._writes.opened(pool)
            self._outstanding.append(q)
            self._bucket.spend()
            c.candidates_admitted += 1
            if self._worker is None:
                assert self._truth is not None  # admission happens only when on
                self._worker = QueryWorker(self._truth, self._breaker, c)
            self._worker.submit(q)

    # -- introspection and lifecycle ---------------------------------------------------
    def snapshot(self) -> ReconcilerSnapshot:
        """Counters for the metrics layer (any thread)."""
        return snapshot(
            self.counters, self._breaker.state, self._breaker.opened, leased_objects(self._truth)
        )

    @property
    def circuit_state(self) -> int:
        return self._breaker.state

    def outstanding(self) -> int:
        """Queries admitted and not yet applied."""
        return len(self._outstanding)

    def idle(self) -> bool:
        """Nothing admitted, out or waiting to be admitted."""
        return not self._outstanding and not self._candidates

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the worker (pending answers are dropped)."""
        self._on = False
        if self._worker is not None:
            self._worker.close(timeout_s)

    def _internal_error(self, where: str) -> None:
        self.counters.internal_errors += 1
        if self._internal_logged < 10:
            self._internal_logged += 1
            logger.exception("hicache-existence reconciler: internal error in %s", where)
