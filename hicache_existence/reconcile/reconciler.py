"""The reconciler: checks sampled beliefs against ground truth and heals them.

It is a ``BeliefObserver`` of the cache.  On the scheduler thread it only does
O(1) work per lookup (``touched``) and, once per step, ``apply(step)`` at the
lockstep point; the ground-truth I/O runs on one worker thread behind a bounded
queue, so the scheduler never waits on Redis.

Determinism across TP ranks (replicas must stay identical):

* **Picking** uses only the cache's own inputs: a lookup's chain is a candidate
  when the lookup's ordinal reaches the next of a sequence of random gaps drawn
  from a fixed-seed PRNG (mean gap 1 / ``sampling_rate``); every replica sees the
  same lookups, so every replica picks the same chains.
* **Agreement** happens every ``agree_interval_steps`` calls of ``apply`` (on
  every rank, whatever its state, so a diverged replica cannot hang the others):
  one MIN all-reduce of a fixed-size vector carrying, per rank, how many queries
  are done contiguously from the oldest one, each of their answers (-1 for an
  error, so any rank's error means no action), a trust bit per answer, how many
  candidates the rank could admit, and its clock.
* **Applying** the first agreed verdicts: ``invalidate_beyond(chain, leading)``
  when ground truth is short of the chain (never on an error, nor when the ledger
  cannot prove absence, nor when the missing page is being written: see
  *Writes racing a query*), and, for all-pages pools, ``add(chain[:leading])``
  when ground truth holds pages the beliefs lack (learnt from another instance).
* **Budget**: a token bucket refilled from the agreed (MIN) clock admits at most
  ``verifications_per_s`` queries per second, identically on every rank.

A circuit breaker stops admitting (and fails queued queries fast) while ground
truth keeps failing, probing again with exponential backoff.

Writes racing a query.  An answer taken at time T says nothing about a page
whose write was in flight at T or launched after it: the write lands (and the
ledger records it) after the answer.  Such a page is *written since the query*
when, at the moment the verdict is applied, it is in flight (the cache's
in-flight refs; for the seed generation the write path's in-flight set,
``inflight_cover``) or it was added (``add``: the storage ack inserts a write's
pages, then releases them from flight) after the query was admitted (admission
precedes T, so the window is conservative).  Every page whose write overlaps T
is one of those: launched before T and still out (in flight), launched before T
and acked since (added since), launched after T (in flight, or added since).
Checking in-flight membership alone misses the acked-since pages; an epoch
taken at the query alone misses writes launched before it and still out.  A
release without an add is a launch that failed (the page really is absent); a
reset of the write pipeline (``clear_inflight``), whose writes may land with no
ack, voids the answers out.

If the first missing page was written since the query, the verdict's
invalidation is withheld (counted, ``invalidations_withheld``; the chain is
verified again when a later lookup picks it): past an unfinished write the
answer proves nothing.  Otherwise the pages beyond it are dropped except those
written since the query.
Every rank sees the same writes at the same lockstep points, so every rank
withholds the same verdicts.
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from itertools import islice, repeat
from typing import Any

from hicache_existence.config import ReconcilerSection
from hicache_existence.reconcile.agreement import Agreement, SingleRank
from hicache_existence.reconcile.breaker import CLOSED, CircuitBreaker
from hicache_existence.reconcile.counters import (
    ReconcilerCounters,
    ReconcilerSnapshot,
    snapshot,
)
from hicache_existence.reconcile.ground_truth import (
    GroundTruth,
    GroundTruthError,
    absence_is_evidence,
    leased_objects,
)

logger = logging.getLogger(__name__)

#: Seed of the sampling PRNG: a constant, so every rank draws the same gaps.
_SAMPLING_SEED = 0x68696361636865
#: Padding for vector slots beyond the completed queries (never agreed upon).
_BIG = 1 << 62

#: Pools whose keys are a trailing window of the chain (upstream TRAILING_PAGES):
#: a verdict only invalidates there, as upstream's ``TrailingWindowPolicy``.
TRAILING_POOLS = frozenset({"swa", "auxiliary_swa", "mamba", "draft_swa"})

# Query states.
_PENDING, _DONE, _TIMED_OUT, _VOID = 0, 1, 2, 3

#: Where the write path keeps a pool's in-flight pages when the cache does not
#: (the seed generation): ``pool -> pages`` (or None for none).
InflightCover = Callable[[str], "Container[str] | None"]


def invalidation_span(
    chain: Sequence[str], leading: int, written: Callable[[str], bool]
) -> Sequence[str] | None:
    """The chain to pass to ``invalidate_beyond(..., leading)`` for an absence
    verdict, given ``written(page)``: whether the page was written since the
    answer was taken (in flight, or acknowledged since).  None (withhold) when
    ``chain[leading]``, the page the answer stopped at, was: the answer
    predates its write and proves nothing about the pages after it.  Otherwise
    the chain without the later pages that were written since."""
    if written(chain[leading]):
        return None
    rest = chain[leading + 1 :]
    if not any(map(written, rest)):
        return chain
    return (*chain[: leading + 1], *(p for p in rest if not written(p)))


def _disjoint(pages: Container[str], tail: Sequence[str]) -> bool:
    """Whether ``pages`` certainly holds none of ``tail`` (in C for dicts and
    sets; other containers answer False and take the page-by-page check)."""
    if isinstance(pages, dict):
        return pages.keys().isdisjoint(tail)
    if isinstance(pages, (set, frozenset)):
        return pages.isdisjoint(tail)
    return False


def default_learns(pool: str) -> bool:
    """Whether verdicts may add presence to ``pool`` (all-pages pools only)."""
    return pool not in TRAILING_POOLS and not pool.endswith("_state")


class _Query:
    __slots__ = (
        "seq",
        "pool",
        "chain",
        "submitted",
        "state",
        "leading",
        "trusted",
        "probe",
        "void",
        "adds_before",
    )

    def __init__(self, seq: int, pool: str, chain: tuple[str, ...], submitted: float) -> None:
        self.seq = seq
        self.pool = pool
        self.chain = chain
        self.submitted = submitted
        self.state = _PENDING
        self.leading = -1  # -1: error / no answer
        self.trusted = 0
        self.probe = False
        self.void = False
        self.adds_before = 0  # the pool's add ordinal when the query was admitted

    def local_verdict(self) -> tuple[int, int] | None:
        """(leading, trusted) once this rank is done with the query, else None."""
        if self.void:
            return (-1, 0)
        if self.state == _PENDING:
            return None
        return (self.leading, self.trusted)


class _Target:
    """Uniform access to either cache generation (mutations happen on the
    scheduler thread at the lockstep point, through the cache's public API)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._per_pool = hasattr(cache, "pool")

    def invalidate_beyond(self, pool: str, chain: Sequence[str], keep: int) -> None:
        if self._per_pool:
            self._cache.pool(pool).invalidate_beyond(chain, keep)
        else:
            self._cache.invalidate_beyond(pool, chain, keep)

    def add(self, pool: str, chain: Sequence[str]) -> None:
        if self._per_pool:
            self._cache.pool(pool).add(chain)
        else:
            self._cache.add(pool, chain)

    def inflight(self, pool: str) -> Container[str] | None:
        """``pool``'s pages between D2H launch and storage ack (current generation:
        the cache's refcounts, upstream's ``_inflight``; the seed generation keeps
        none, the write path does: see ``Reconciler.inflight_cover``)."""
        if self._per_pool:
            refs: Container[str] | None = getattr(self._cache.pool(pool), "_inflight", None)
            return refs
        return None

    def counts(self, pool: str) -> tuple[int, int]:
        """(invalidations, inserts) of ``pool`` so far."""
        if self._per_pool:
            s = self._cache.pool(pool).stats()
        else:
            stats = self._cache.stats()
            if pool not in stats:
                return (0, 0)
            s = stats[pool]
        return (s.invalidations, s.inserts)

    def believes_all(self, pool: str, chain: Sequence[str]) -> bool:
        """Whether every page is believed, without touching the LRU (False when
        the cache offers no way to tell: learning then re-adds, harmlessly)."""
        if self._per_pool:
            entries = getattr(self._cache.pool(pool), "_entries", None)
            if entries is not None:
                return all(map(entries.__contains__, chain))
        return False


class Reconciler:
    """Verifies sampled beliefs against ``truth`` and heals ``cache``.

    Install it as the cache's observer (alone or in a ``Tee``) and call
    ``apply(step)`` once per scheduler step on every rank at the lockstep point
    (after ``check_hicache_events``).  With ``truth=None`` it does nothing.
    """

    def __init__(
        self,
        cache: Any,
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
        inflight_cover: InflightCover | None = None,
    ) -> None:
        if not 0.0 <= float(sampling_rate) <= 1.0:
            raise ValueError(f"sampling_rate must be within [0, 1], got {sampling_rate}")
        if verifications_per_s < 0:
            raise ValueError(f"verifications_per_s must be >= 0, got {verifications_per_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for name, value in (
            ("pages_per_query", pages_per_query),
            ("queue_size", queue_size),
            ("max_verdicts_per_step", max_verdicts_per_step),
            ("agree_interval_steps", agree_interval_steps),
            ("max_candidates", max_candidates),
            ("apply_page_budget", apply_page_budget),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._cache = cache
        self._target = _Target(cache)
        self._truth = truth
        self._agreement: Agreement = agreement if agreement is not None else SingleRank()
        rate = float(sampling_rate)
        self._gap_span = max(1, round(2.0 / rate) - 1) if rate > 0 else 0
        self._rng = random.Random(_SAMPLING_SEED)
        self._countdown = self._gap()
        # The bucket counts thousandths of a token in integers: refilled from the
        # agreed clock, it is bit-identical on every rank.
        self._rate_milli = round(float(verifications_per_s) * 1000)
        self._burst_milli = max(1000, self._rate_milli)
        self._tokens_milli = self._burst_milli
        self._last_ms: int | None = None
        self._pages = pages_per_query
        self._timeout = float(timeout_s)
        self._queue_size = queue_size
        self._m = max_verdicts_per_step
        self._interval = agree_interval_steps
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        self._learn = learn
        self._learns = learns
        self._max_candidates = max_candidates
        self._page_budget = apply_page_budget
        self._clock = clock
        self._t0 = clock()
        #: In-flight pages the cache does not track (seed generation): the
        #: integration sets it to the write pipeline's in-flight set.
        self.inflight_cover: InflightCover | None = inflight_cover
        #: Told every applied verdict, ``(pool, chain, leading)``: ``chain[:leading]``
        #: was found in L3 (the storage-tier KV events' verification time).
        self.verdict_observer: Callable[[str, Sequence[str], int], None] | None = None

        self.counters = ReconcilerCounters()
        self._lock = threading.Lock()  # guards a query's state hand-off
        self._steps = 0
        self._seq = 0
        self._candidates: list[tuple[str, tuple[str, ...]]] = []
        self._pending: set[tuple[str, str]] = set()  # (pool, last page) queued or out
        self._outstanding: deque[_Query] = deque()
        # pool -> {page: ordinal of the add (storage ack) that last added it},
        # kept only while a query of the pool is out.
        self._recent: dict[str, dict[str, int]] = {}
        self._adds = 0
        self._recent_cap = 1 << 18
        self._out_per_pool: dict[str, int] = {}
        self._jobs: queue.Queue[_Query | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._broken = False
        self._applying = False
        self._on = truth is not None
        self._internal_logged = 0

    @classmethod
    def from_section(
        cls,
        section: ReconcilerSection,
        cache: Any,
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
        }
        kwargs.update(overrides)
        return cls(cache, truth if section.enabled else None, **kwargs)

    @property
    def active(self) -> bool:
        """Whether the reconciler does anything (it has ground truth, is not closed)."""
        return self._on

    # -- BeliefObserver (scheduler thread, once per cache operation) ------------------
    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        """A lookup walked ``hashes``: maybe pick its chain for verification.

        Not picking (the common case) costs a decrement; only a picked chain is
        copied and timed."""
        if not self._on or self._applying:
            return
        self._countdown -= 1
        if self._countdown > 0:
            return
        try:
            self._countdown = self._gap()
            n = min(len(hashes), self._pages)
            if n:
                self._pick(pool, hashes, n, hashes[n - 1])
        except Exception:
            self._internal_error("touched")

    def _gap(self) -> int:
        """Lookups until the next pick: uniform in [1, 2 / sampling_rate - 1] (mean
        1 / sampling_rate), drawn from a PRNG with a fixed seed in integer
        arithmetic only, so every rank, on any platform, draws the same gaps
        (random gaps, unlike every k-th lookup, cannot alias with a periodic
        workload)."""
        span = self._gap_span
        if span <= 0:
            return sys.maxsize
        return 1 + ((self._rng.getrandbits(32) * span) >> 32)

    def _pick(self, pool: str, hashes: Sequence[str], n: int, last: str) -> None:
        t0 = time.perf_counter()
        key = (pool, last)
        c = self.counters
        if key not in self._pending:
            c.candidates_sampled += 1
            if len(self._candidates) >= self._max_candidates:
                c.candidates_dropped += 1
            else:
                self._candidates.append((pool, tuple(hashes[:n])))
                self._pending.add(key)
        dt = time.perf_counter() - t0
        if dt > c.max_observe_s:
            c.max_observe_s = dt

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        """Pages added while a query of the pool is out must not be invalidated by
        its (older) answer."""
        if self._applying:
            return
        recent = self._recent.get(pool)
        if recent is not None and len(recent) < self._recent_cap:
            self._adds += 1
            recent.update(zip(hashes, repeat(self._adds)))

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Nothing to do: an invalidation only removes beliefs."""

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """Nothing to do (the write path's hot path): a launch since the query is
        in flight when the verdict applies, a storage ack ``add``s its pages
        before releasing them (``added`` notes those), and a release without
        an add is a launch that failed, whose page really is absent."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        """A cleared pool (L3 flushed, storage detached): answers to queries that
        were out are void, pending candidates are dropped.  In-flight refs
        cleared alone (the write pipeline was reset): the dropped writes may
        still land in L3 with no ack to say so, so answers to queries that were
        out are void too."""
        if not self._on:
            return
        try:
            for q in self._outstanding:
                if q.pool == pool and not q.void:
                    with self._lock:
                        if q.state == _PENDING:
                            q.state = _VOID  # a later answer only counts as late
                            self.counters.scheduler_results[(pool, "void")] += 1
                    q.void = True
            if inflight_only:
                return
            kept = [(p, chain) for p, chain in self._candidates if p != pool]
            for p, chain in self._candidates:
                if p == pool:
                    self._pending.discard((p, chain[-1]))
            self._candidates = kept
        except Exception:
            self._internal_error("cleared")

    # -- the lockstep point ----------------------------------------------------------
    def steps_to_due(self) -> int:
        """How many more ``apply`` calls until one agrees and applies (1: the next);
        counted in steps, the same on every rank (off, the call it names returns at once)."""
        return self._interval - self._steps % self._interval

    def advance(self, steps: int) -> None:
        """Count ``steps`` steps on which nothing is due (fewer than
        ``steps_to_due()``): what that many ``apply`` calls would have done."""
        self._steps += steps

    def apply(self, step: int = -1) -> None:
        """Call once per scheduler step on every rank, after the HiCache events
        are drained.  Every ``agree_interval_steps`` calls it agrees with the other
        ranks and applies verdicts; it never raises and never waits on I/O."""
        if not self._on:
            return
        self._steps += 1
        if self._steps % self._interval:
            return
        t0 = time.perf_counter()
        try:
            self._agree_and_apply()
        finally:
            dt = time.perf_counter() - t0
            c = self.counters
            c.apply_calls += 1
            if dt > c.max_apply_s:
                c.max_apply_s = dt

    def _agree_and_apply(self) -> None:
        m = self._m
        now = self._clock()
        try:
            vec = self._local_vector(now)
        except Exception:
            self._internal_error("vector")
            vec = [0, 0, 0] + [_BIG] * m + [0] * m
        t0 = time.perf_counter()
        try:
            agreed = self._agreement.min_reduce(vec)
        except Exception:
            # The group is gone (peer died, timeout): stop for good rather than
            # risk a mismatched collective later.
            self._broken = True
            self._on = False
            logger.exception("hicache-existence reconciler: agreement failed; reconciler stopped")
            return
        c = self.counters
        c.agreements += 1
        dt = time.perf_counter() - t0
        if dt > c.max_agreement_s:
            c.max_agreement_s = dt
        try:
            self._apply_agreed(agreed)
        except Exception:
            self._internal_error("apply")

    def _local_vector(self, now: float) -> list[int]:
        m = self._m
        c = self.counters
        deadline = now - self._timeout
        # Time out queries that waited too long (they are in submission order).
        for q in self._outstanding:
            if q.submitted > deadline:
                break
            if q.state == _PENDING and not q.void:
                with self._lock:
                    if q.state == _PENDING:
                        q.state = _TIMED_OUT
                        c.scheduler_results[(q.pool, "timeout")] += 1
                        # A store that does not answer in time is failing.
                        self._breaker.failure(q.probe)
        leading = [_BIG] * m
        trusted = [0] * m
        done = 0
        for q in islice(self._outstanding, m):
            verdict = q.local_verdict()
            if verdict is None:
                break
            leading[done], trusted[done] = verdict
            done += 1
        permits = self._breaker.permits()
        free = self._queue_size - len(self._outstanding)
        admit = min(len(self._candidates), free, m)
        if permits >= 0:
            admit = min(admit, permits)
        elapsed_ms = int((now - self._t0) * 1000.0)
        return [done, max(admit, 0), elapsed_ms, *leading, *trusted]

    def _apply_agreed(self, agreed: list[int]) -> None:
        m = self._m
        done, admit, elapsed_ms = agreed[0], agreed[1], agreed[2]
        budget = self._page_budget
        applied = 0
        self._applying = True
        try:
            while applied < done and self._outstanding:
                q = self._outstanding[0]
                if applied and len(q.chain) > budget:
                    break  # the rest stays agreed-upon-later: chain sizes are identical
                budget -= len(q.chain)
                self._outstanding.popleft()
                self._retire(q)
                leading, trust = agreed[3 + applied], agreed[3 + m + applied]
                applied += 1
                if leading >= 0 and not q.void:
                    self._apply_verdict(q, min(leading, len(q.chain)), trust > 0)
        finally:
            self._applying = False
        self._refill(elapsed_ms)
        self._admit(min(admit, self._tokens_milli // 1000))
        self.counters.outstanding = len(self._outstanding)

    @property
    def applying(self) -> bool:
        """Whether verdicts are being applied now (an invalidation seen meanwhile
        is the reconciler's, not a prefetch hit query's)."""
        return self._applying

    def _apply_verdict(self, q: _Query, leading: int, trusted: bool) -> None:
        pool, chain = q.pool, q.chain
        c = self.counters
        target = self._target
        observer = self.verdict_observer
        if observer is not None:
            observer(pool, chain, leading)
        if leading < len(chain) and trusted:
            doomed = self._not_written_since(q, leading)
            if doomed is None:
                c.invalidations_withheld[pool] += 1
            else:
                before, _ = target.counts(pool)
                target.invalidate_beyond(pool, doomed, leading)
                after, _ = target.counts(pool)
                if after > before:
                    c.stale_positives[pool] += 1
                    c.pages_invalidated[pool] += after - before
        if self._learn and leading > 0 and self._learns(pool):
            head = chain[:leading]
            if not target.believes_all(pool, head):
                _, before = target.counts(pool)
                target.add(pool, head)
                _, after = target.counts(pool)
                if after > before:
                    c.pages_learnt[pool] += after - before
        c.verdicts_applied[pool] += 1

    def _not_written_since(self, q: _Query, leading: int) -> Sequence[str] | None:
        """What ``invalidate_beyond(..., leading)`` may drop for ``q``'s absence
        verdict: None when ``chain[leading]`` (the first page ground truth lacks)
        was written since the query (module docstring); else the chain without
        the later pages that were.  O(1) when the pool has no write in flight
        and none acked since the query."""
        pool, chain = q.pool, q.chain
        recent = self._recent.get(pool)
        if recent is None:
            recent = {}
        elif len(recent) >= self._recent_cap:
            return None  # stopped recording: cannot tell, keep the beliefs
        cover = self.inflight_cover
        try:
            extra = cover(pool) if cover is not None else None
        except Exception:  # the write path's set is unreadable: cannot tell
            self._internal_error("inflight_cover")
            return None
        sources = [s for s in (self._target.inflight(pool), extra) if s]
        if not recent and not sources:
            return chain
        tail = chain[leading:]
        if all(_disjoint(s, tail) for s in (recent, *sources)):
            return chain  # the common case, in C: nothing written touches the tail
        since = q.adds_before
        get = recent.get

        def written(page: str) -> bool:
            return get(page, -1) > since or any(page in s for s in sources)

        return invalidation_span(chain, leading, written)

    def _retire(self, q: _Query) -> None:
        self._pending.discard((q.pool, q.chain[-1]))
        left = self._out_per_pool.get(q.pool, 0) - 1
        if left > 0:
            self._out_per_pool[q.pool] = left
        else:
            # The pool's recent adds stay until ``_admit`` (the verdict reads them).
            self._out_per_pool.pop(q.pool, None)

    def _refill(self, elapsed_ms: int) -> None:
        if self._last_ms is None:
            self._last_ms = elapsed_ms
            return
        if elapsed_ms > self._last_ms:
            gained = (elapsed_ms - self._last_ms) * self._rate_milli // 1000
            self._tokens_milli = min(self._burst_milli, self._tokens_milli + gained)
            self._last_ms = elapsed_ms

    def _admit(self, n: int) -> None:
        # Recent-add sets of pools with nothing out are no longer needed.
        for pool in [p for p in self._recent if p not in self._out_per_pool]:
            del self._recent[pool]
        c = self.counters
        candidates = self._candidates
        self._candidates = []
        now = self._clock()
        for i, (pool, chain) in enumerate(candidates):
            if i >= n:
                self._pending.discard((pool, chain[-1]))
                c.candidates_dropped += 1
                continue
            q = _Query(self._seq, pool, chain, now)
            self._seq += 1
            q.probe = self._breaker.admitted()
            q.adds_before = self._adds
            self._outstanding.append(q)
            self._out_per_pool[pool] = self._out_per_pool.get(pool, 0) + 1
            self._recent.setdefault(pool, {})
            self._tokens_milli -= 1000
            c.candidates_admitted += 1
            self._ensure_worker()
            self._jobs.put_nowait(q)

    # -- the worker thread -------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run, name="hicache-existence-reconciler", daemon=True
            )
            self._worker.start()

    def _run(self) -> None:
        truth = self._truth
        assert truth is not None
        c = self.counters
        while True:
            q = self._jobs.get()
            if q is None:
                return
            if q.state != _PENDING or q.void:
                continue  # timed out or voided before we got to it
            if self._breaker.rejects(q.probe):
                self._finish(q, -1, 0, "rejected")
                continue
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
            cpu = time.thread_time() - cpu0
            if cpu > c.max_query_cpu_s:
                c.max_query_cpu_s = cpu
            if kind:
                c.errors[kind] += 1
                if kind != "unsupported":  # a pool the truth cannot answer is not ill health
                    self._breaker.failure(q.probe)
                elif q.probe:
                    self._breaker.success()
                self._finish(q, -1, 0, "error")
            else:
                self._breaker.success()
                if leading == len(q.chain):
                    result = "present"
                else:
                    result = "absent" if trusted else "untrusted"
                self._finish(q, leading, trusted, result)

    def _finish(self, q: _Query, leading: int, trusted: int, result: str) -> None:
        with self._lock:
            if q.state != _PENDING:
                self.counters.late_answers += 1
                return
            q.leading = leading
            q.trusted = trusted
            q.state = _DONE
            self.counters.worker_results[(q.pool, result)] += 1

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
        self._closed = True
        self._on = False
        if self._worker is not None:
            self._jobs.put_nowait(None)
            self._worker.join(timeout_s)

    def _internal_error(self, where: str) -> None:
        self.counters.internal_errors += 1
        if self._internal_logged < 10:
            self._internal_logged += 1
            logger.exception("hicache-existence reconciler: internal error in %s", where)


def circuit_closed(reconciler: Reconciler) -> bool:
    return reconciler.circuit_state == CLOSED
