"""One scheduler process's hicache-existence, wired from one ``Config``: the cache
(either API generation) with its observers, accounting and exporters, and ``step()``,
which the SGLang plugin calls right after ``check_hicache_events`` (the demo after
each simulated step: the same code path).  ``step()`` never raises into the
scheduler, except under the divergence policy ``abort``, whose purpose is to raise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

from hicache_existence import logs
from hicache_existence.accounting.advisor import CapacityAdvisor
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.recorder import Recorder
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.core import gate
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.observers import BeliefObserver, Tee
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.events import emitter as _events
from hicache_existence.exporters import FeatureSources, Telemetry
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.exporters.otel import SPAN_DIVERGENCE_CHECK, span
from hicache_existence.reconcile.agreement import Agreement
from hicache_existence.reconcile.ground_truth import GroundTruth
from hicache_existence.reconcile.reconciler import Reconciler
from hicache_existence.replicas.digest import ReplicaDigest, SharedLruDigest
from hicache_existence.replicas.divergence import (
    NEVER,
    CheckGroup,
    DivergenceChecker,
    DivergenceError,
    InProcessWorld,
)

Generation = Literal["current", "flat"]

#: A scheduler iteration longer than this ran a batch (an idle polling iteration
#: takes about 0.1 ms of CPU): a flush due right after one waits (``core.gate``).
BUSY_STEP_S = 0.002


class ExistenceRuntime:
    """Cache, accounting, checks and exporters of one scheduler process.

    ``group``: the replica group the divergence checker compares over (every TP rank
    holding a replica); ``None``: a single replica, whose checks count as ok without
    a digest or a collective, so its metrics still move.  With ``divergence.enabled``
    off the checker still joins the start-up handshake (which stops every rank's
    checks when ranks disagree) and exports nothing.  ``truth``: the reconciler's
    ground truth (``None``: no reconciler); ``agreement``: its cross-rank verdict
    agreement (``None``: one rank).  ``host_mode``: what ``mode_info`` exports
    (HiCache's host memory mode, SGLang's write policy, whether ``cache_mode.dedup``
    acts).  ``instance`` names this process in a recorded trace (default: host name
    and ranks).  ``count_writes`` false: this host memory mode's write-path hooks are
    missing, so the write families are not exported at all.
    """

    def __init__(
        self,
        config: Config | None = None,
        labels: DeploymentLabels | None = None,
        *,
        generation: Generation = "current",
        group: CheckGroup | None = None,
        truth: GroundTruth | None = None,
        agreement: Agreement | None = None,
        env: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        host_mode: tuple[str, str, bool | str] = ("buffer_only", "", False),
        instance: str | None = None,
        count_writes: bool = True,
        events: _events.Placement | None = None,
    ) -> None:
        self.config = config = config or Config()
        if generation not in ("current", "flat"):
            raise ValueError(f"generation must be 'current' or 'flat', got {generation!r}")
        self.generation = generation
        self.labels = labels or DeploymentLabels(
            model_name=config.metrics.model_name, storage_backend=config.metrics.storage_backend
        )
        self._logger = logs.get_logger("hicache_existence.runtime")
        self._errors = logs.RateLimiter(1 / 60, clock=clock)
        #: The per-step test (``core.gate``).  ``tick`` is the gate itself, which the
        #: SGLang hook calls: no Python frame of ours on an idle step.
        defer_s = config.metrics.flush_interval_s / 2
        self._gate = gate.step_gate(self._step_due, clock, BUSY_STEP_S, defer_s)
        self.tick: Callable[[], Any] = self._gate
        #: The steps already handed to the checker and the reconciler.
        self._credited = 0

        max_entries = config.cache.max_entries
        self.ghosts = (
            GhostFactory.from_config(config, max_entries) if config.miss_reasons.enabled else None
        )
        flat = generation == "flat"
        checking = config.divergence.enabled
        # Built with checks off too, for the handshake (a rank that skipped it would
        # leave the others waiting); off, the digest observes nothing.
        self.digest: ReplicaDigest = SharedLruDigest() if flat else ReplicaDigest()
        self.advisor = CapacityAdvisor.from_config(config.advisor, shared=flat)
        # A given group may be bound later (SGLang's, at the first step), so the digest
        # observes until ``group_bound`` finds a world of one.
        observers: list[BeliefObserver] = [self.digest] if checking and group is not None else []
        if group is None:
            group = InProcessWorld(1, timeout_s=config.divergence.timeout_s).group(0)
        self._group = group
        self.recorder = Recorder.from_config(
            config.recorder, self.labels, instance=instance, host_mode=host_mode[0]
        )
        if self.recorder is not None:
            observers.append(self.recorder.tap)
        self.tee = Tee(*observers)
        cache_class = FlatStorageExistenceCache if flat else StorageExistenceCache
        self.cache: ExistenceCache = cache_class(
            max_entries, miss_memory=self.ghosts, observer=self.tee, advisor=self.advisor
        )

        self.reconciler: Reconciler | None = None
        if config.reconciler.enabled and truth is not None:
            self.reconciler = Reconciler.from_section(
                config.reconciler, self.cache, truth, agreement
            )
            self.tee.append(self.reconciler)
        #: Storage-tier KV events (``events``; ``None``: off, or not this rank's to
        #: publish; default placement: TP and PP rank 0, the package's own publisher).
        self.events = _events.from_config(
            config.events,
            events
            or _events.Placement(
                self.labels.tp_rank == 0 and self.labels.pp_rank == 0,
                self.labels.dp_rank,
                self.labels.storage_backend,
            ),
        )
        if self.events is not None:
            self.tee.append(self.events)
            reconciler = self.reconciler
            if reconciler is not None:
                reconciler.verdict_observer = self.events.verified
                self.events.source = lambda: "reconciler" if reconciler.applying else "hit_query"

        self._check_interval = config.divergence.interval_steps
        self.checker: DivergenceChecker = DivergenceChecker(
            self.digest, group, config.divergence, cache=self.cache
        )

        self.writes = WriteAccounting(page_size_bytes=config.metrics.page_size_bytes)
        self.telemetry = Telemetry(
            self.cache,
            config,
            self.labels,
            writes=self.writes,
            # Write path not hooked: its families absent, not 0 while L3 is written.
            write_families=count_writes,
            ghosts=self.ghosts,
            env=env,
            clock=clock,
            features=FeatureSources(
                # Off: no divergence series at all (the checks-stopped alert keys on
                # the series, so a deployment that turned checks off never fires it).
                divergence=self.checker.stats if checking else None,
                reconciler=self.reconciler.snapshot if self.reconciler is not None else None,
                advisor=self._advice if self.advisor is not None else None,
                mode=lambda: host_mode,
                shared_capacity=flat,
                recorder=self.recorder.snapshot if self.recorder is not None else None,
                events=self.events.snapshot if self.events is not None else None,
            ),
        )

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> ExistenceRuntime:
        """Start the recorder, the events publisher and telemetry (metrics port, start-up log)."""
        for part in (self.recorder, self.events, self.telemetry):
            if part is not None:
                part.start()
        return self

    def close(self) -> None:
        """Stop the reconciler, recorder and events publisher; release the metrics port."""
        for part in (self.reconciler, self.recorder, self.events, self.telemetry):
            if part is not None:
                part.close()

    def __enter__(self) -> ExistenceRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def group_bound(self) -> None:
        """Call once the replica group is bound (SGLang's at the first step), never
        before: in a world of one the digest stops observing the cache instead of
        folding every operation for a comparison that cannot fail."""
        if self._group.size == 1:
            self.tee.discard(self.digest)

    # -- the per-step hook -------------------------------------------------------
    @property
    def steps(self) -> int:
        """Scheduler steps taken (calls of ``step`` / ``tick``)."""
        return self._gate.steps

    def step(self) -> None:
        """Everything due once per scheduler step; call it on every rank at the
        same lockstep point (after ``check_hicache_events``).  A step with nothing
        due costs the gate's test (``core.gate``, which explains when a step is
        due); skipped steps are credited to the checker and the reconciler at the
        next step with work."""
        self._gate()

    def _step_due(self, n: int, now: float, flush: bool) -> None:
        """A step the gate let through; ``flush``: the metrics flush is due (by
        time, not in a busy stretch)."""
        skipped = n - 1 - self._credited
        self._credited = n
        reconciler = self.reconciler
        if skipped:
            self.checker.advance(skipped)
            if reconciler is not None:
                reconciler.advance(skipped)  # a count: cannot raise
        if reconciler is not None:
            try:
                reconciler.apply(self.steps)
            except Exception as exc:  # observability never takes the scheduler down
                self._report("reconciler", exc)
        self._check()
        g = self._gate
        if flush:
            self.telemetry.step()  # never raises (its own guard)
        try:
            wake = min(self.checker.steps_to_due(), NEVER)
            if reconciler is not None:
                wake = min(wake, reconciler.steps_to_due())
            g.flush_at = self.telemetry.due_at
        except Exception as exc:  # then every step takes this path, as before
            self._report("step schedule", exc)
            wake, g.flush_at = 1, math.inf
        g.wake = n + wake

    def _check(self) -> None:
        checker = self.checker
        due = self.config.divergence.enabled and (checker.step + 1) % self._check_interval == 0
        stepped = not due
        try:
            if due:
                with span(SPAN_DIVERGENCE_CHECK, step=checker.step + 1):
                    stepped = True
                    checker.on_step()
            else:
                checker.on_step()
        except DivergenceError:
            raise  # policy "abort": raising is the point
        except Exception as exc:
            self._report("divergence", exc)
            if not stepped:
                # The span failed to start (an application span processor): the step
                # still counts, or this rank's checks run a step behind every other's.
                checker.on_step()  # never raises, except DivergenceError (abort)

    def _report(self, what: str, exc: Exception) -> None:
        if self._errors.allow():
            self._logger.error(logs.EXPORTER_ERROR, exporter=what, error=repr(exc))

    def _advice(self) -> Any:
        assert self.advisor is not None
        # Each pool's cap (or the shared one) without a stats() snapshot (the flush
        # takes one already).
        return self.advisor.snapshot(self.advisor.capacities_of(self.cache))
