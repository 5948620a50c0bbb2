"""Fleet replay: N prefill instances behind a router, sharing one L3 and a ledger.

Each instance is the write-path model (``replay.model``) with its own cache,
device prefix cache and pending writes; L3 and the pages being written are the
fleet's, so a page one instance wrote is redundant when another writes it again.
Ledger learning verifies a fraction of lookups with the reconciler's own sampling
and verdict code, the ledger being exact (its errors, budgets and latency are not
modelled).  docs/replay.md ("Fleet mode") describes the routers and the columns.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.reconcile.sampling import Candidates, Sampler
from hicache_existence.reconcile.verdicts import apply_verdict, default_learns, invalidation_span
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.model import Instance, ModelConfig, ModelResult, simulate, total
from hicache_existence.replay.pages import PageRequest, PageTrace

Router = Literal["round-robin", "prefix-affinity"]
ROUTERS: tuple[Router, ...] = ("round-robin", "prefix-affinity")
MAX_INSTANCES = 4096


@dataclass(frozen=True)
class FleetConfig:
    """The fleet around the per-instance model."""

    instances: int = 1
    router: Router = "round-robin"
    #: Leading pages that pick the instance under ``prefix-affinity``.
    affinity_pages: int = 8
    #: Fraction of cache lookups verified against the ledger (0: no learning).
    learn_rate: float = 0.0
    #: Leading pages of a looked-up chain one verification covers.
    pages_per_query: int = 1024
    #: Pages per ledger record round trip (``reconciler.write_batch``).
    write_batch: int = 512


@dataclass
class InstanceResult:
    """One instance's share (pages unless named otherwise)."""

    requests: int = 0
    writes_issued: int = 0
    redundant_writes: int = 0
    writes_avoided: int = 0
    #: Ledger learning: verifications, pages added because the ledger held them,
    #: beliefs dropped because it did not, verdicts not acted on because the
    #: page the ledger lacked was being written (in flight on the instance).
    verifications: int = 0
    pages_learnt: int = 0
    pages_invalidated: int = 0
    verdicts_withheld: int = 0
    #: Ledger record round trips (``write_batch`` pages each, per landed write).
    ledger_record_calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FleetResult:
    """Fleet totals (``model``, summed over instances) and each instance's share."""

    cap: int
    config: FleetConfig
    model: ModelResult
    instances: list[InstanceResult] = field(default_factory=list)
    #: Seconds the trace spans (first to last timestamp; 1 s at least).
    span_s: float = 1.0
    #: Pages the shared L3 holds at the end, over all pools.
    l3_pages_held: int = 0

    @property
    def pages_learnt(self) -> int:
        return sum(i.pages_learnt for i in self.instances)

    @property
    def verifications(self) -> int:
        return sum(i.verifications for i in self.instances)

    def ledger_ops_per_s_per_instance(self) -> dict[str, float]:
        """Ledger traffic per instance per second of trace time: record round trips,
        recorded pages, verification queries (mean and busiest instance)."""
        n = len(self.instances) or 1
        calls = [i.ledger_record_calls for i in self.instances]
        pages = [i.writes_issued for i in self.instances]
        queries = [i.verifications for i in self.instances]
        return {
            "record_calls": sum(calls) / n / self.span_s,
            "record_calls_max": max(calls, default=0) / self.span_s,
            "record_pages": sum(pages) / n / self.span_s,
            "queries": sum(queries) / n / self.span_s,
            "queries_max": max(queries, default=0) / self.span_s,
        }

    def redundant_share(self) -> list[float]:
        """Each instance's share of the fleet's redundant writes."""
        total = self.model.redundant_writes
        return [i.redundant_writes / total if total else 0.0 for i in self.instances]

    def as_dict(self) -> dict[str, Any]:
        return {
            "cap": self.cap,
            "config": asdict(self.config),
            "fleet": self.model.as_dict(),
            "pages_learnt": self.pages_learnt,
            "verifications": self.verifications,
            "span_s": self.span_s,
            "l3_pages_held": self.l3_pages_held,
            "ledger_ops_per_s_per_instance": self.ledger_ops_per_s_per_instance(),
            "instances": [i.as_dict() for i in self.instances],
        }


class _Learner:
    """The reconciler's sampling (``reconcile.sampling``) as a cache observer:
    picks looked-up chains with its gap sequence; the fleet verifies them at
    the instance's next step (no budget: every pick is verified)."""

    def __init__(self, rate: float, pages_per_query: int) -> None:
        self.sampler = Sampler(rate, pages_per_query)
        self.picked = Candidates(sys.maxsize)

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        sampler = self.sampler
        sampler.countdown -= 1
        if sampler.countdown <= 0 and (n := sampler.picked(len(hashes))):
            self.picked.offer(pool, hashes, n)

    def _ignored(self, *args: object) -> None:
        """The other observer calls: nothing to do."""

    added = invalidated = inflight = cleared = _ignored


class _Instance(Instance):
    def __init__(
        self,
        cap: int,
        config: ModelConfig,
        fleet: FleetConfig,
        page_size: int,
        l3: L3,
        writing: dict[str, dict[str, int]],
    ) -> None:
        self.learner = (
            _Learner(fleet.learn_rate, fleet.pages_per_query) if fleet.learn_rate else None
        )
        cache = StorageExistenceCache(cap, observer=self.learner)
        super().__init__(cache, cap, config, page_size, l3, writing)
        self.share = InstanceResult()
        self.batch = fleet.write_batch

    def landed(self, keys: Sequence[str]) -> None:
        self.share.ledger_record_calls += -(-len(keys) // self.batch)

    def verify(self) -> None:
        """Apply the verdicts of the chains picked since the last step, with the
        reconciler's own verdict code (``reconcile.verdicts``)."""
        if self.learner is None or not self.learner.picked:
            return
        share = self.share
        picked = self.learner.picked
        for pool, chain in picked.take():
            picked.release(pool, chain)
            leading = self.l3.leading(pool, chain, read=False)
            share.verifications += 1
            refs = self.cache.pool(pool).inflight_refs()
            outcome = apply_verdict(
                self.cache,
                pool,
                chain,
                leading,
                True,  # the ledger here is exact: absence is evidence
                # The answer is taken now: a page written since it is one in
                # flight on this instance.
                lambda: invalidation_span(chain, leading, refs.__contains__),  # noqa: B023
                default_learns(pool),
            )
            share.verdicts_withheld += outcome.withheld
            share.pages_invalidated += outcome.invalidated
            share.pages_learnt += outcome.learnt


def route(req: PageRequest, number: int, fleet: FleetConfig) -> int:
    """The instance a request goes to (``number`` is its 0-based position)."""
    n = fleet.instances
    if n == 1:
        return 0
    if fleet.router == "round-robin" or not req.pages:
        return number % n
    key = req.pages[min(fleet.affinity_pages, len(req.pages)) - 1]
    try:
        return int(key[:16], 16) % n
    except ValueError:  # page traces may carry non-hex hashes
        import zlib

        return zlib.crc32(key.encode()) % n


def run_fleet(
    trace: PageTrace,
    cap: int,
    config: ModelConfig | None = None,
    fleet: FleetConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FleetResult:
    """Replay ``trace`` through ``fleet.instances`` instances at ``cap`` each."""
    config = config or ModelConfig()
    fleet = fleet or FleetConfig()
    started = time.perf_counter()
    l3 = L3(config.l3_pages)
    writing: dict[str, dict[str, int]] = {}
    instances = [
        _Instance(cap, config, fleet, trace.page_size, l3, writing) for _ in range(fleet.instances)
    ]

    def verify() -> None:
        # Verdicts of earlier picks arrive before this request, on every
        # instance (the reconciler applies them within a few steps).
        for inst in instances:
            inst.verify()

    peak = simulate(
        trace,
        instances,
        progress,
        pick=lambda req, number: route(req, number, fleet),
        before=verify if fleet.learn_rate > 0 else None,
    )
    verify()
    for inst in instances:
        for name in _SHARES:
            setattr(inst.share, name, getattr(inst.result, name))
    verdicts = sum(i.share.pages_invalidated for i in instances)
    fleet_result = total(instances, l3, peak, verdicts)
    fleet_result.elapsed_s = time.perf_counter() - started
    times = [r.timestamp_ms for r in trace.requests]
    span = (max(times) - min(times)) / 1000.0 if times else 0.0
    return FleetResult(
        cap=cap,
        config=fleet,
        model=fleet_result,
        instances=[i.share for i in instances],
        span_s=max(span, 1.0),
        l3_pages_held=len(l3),
    )


#: The counters of an instance's share that are its ``ModelResult``'s.
_SHARES = ("requests", "writes_issued", "redundant_writes", "writes_avoided")


__all__ = ["ROUTERS", "FleetConfig", "FleetResult", "InstanceResult", "route", "run_fleet"]
