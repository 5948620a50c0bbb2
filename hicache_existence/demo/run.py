"""``hicache-existence demo``: a simulated prefill server, end to end.

The parent plays SGLang's HTTP server: prometheus_client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, as ``--enable-metrics`` sets), the aggregated
``/metrics``, one scheduler process per TP rank and a live progress line.  Each
rank joins a gloo group (torch installed, more than one rank), builds an
``ExistenceRuntime`` and replays the trace through ``SimulatedScheduler``: the
divergence checker compares replicas and the reconciler agrees its verdicts over
gloo, checking beliefs against the embedded L3 (or a Redis ledger, ``--redis-url``).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import itertools
import math
import multiprocessing as mp
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_existence.accounting.advisor import recommended_multiple
from hicache_existence.config import Config
from hicache_existence.exporters.catalog import DeploymentLabels

BUNDLED_TRACE = "mooncake_sample.jsonl"


@dataclass(frozen=True)
class DemoOptions:
    """Everything the demo can be told (the CLI builds it)."""

    trace: Path | None = None
    ranks: int = 2
    steps: int = 0  # 0: one pass over the trace
    requests_per_step: int = 4
    steps_per_s: float = 40.0  # 0: as fast as possible
    host: str = "127.0.0.1"
    port: int = 9464
    cap: int = 16384
    l3_pages: int = 12000
    l3_drop_every: int = 200
    redis_url: str = ""
    keep_running: bool = False
    progress: bool = True
    config: Config = field(default_factory=Config)
    #: The ranks' logging, as the CLI resolved it (``logging.level`` or
    #: ``--log-level``); empty: a rank leaves its logging unconfigured.
    log_level: str = ""
    log_json: bool = False


def bundled_trace() -> Path:
    """The Mooncake sample shipped with the package (first 1,200 requests)."""
    return Path(str(importlib.resources.files("hicache_existence.demo") / "data" / BUNDLED_TRACE))


def demo_config(opts: DemoOptions) -> Config:
    """The runtime configuration the ranks use: every feature on, short intervals."""
    base = opts.config
    return Config.from_mapping(
        {
            "enabled": True,
            "cache": {"max_entries": opts.cap},
            "metrics": {
                "mode": "multiprocess",
                "flush_interval_s": 0.25,
                "model_name": base.metrics.model_name or "demo-model",
                "storage_backend": base.metrics.storage_backend or "demo-l3",
                "page_size_bytes": base.metrics.page_size_bytes or 64 * 2 * 61 * 128 * 2,
                "initial_pools": "kv,swa",
            },
            "divergence": {"enabled": True, "interval_steps": 25},
            "reconciler": {
                "enabled": True,
                "redis_url": opts.redis_url,
                "sampling_rate": max(base.reconciler.sampling_rate, 0.05),
                "verifications_per_s": max(base.reconciler.verifications_per_s, 200.0),
            },
            "advisor": {"enabled": True, "sampling_rate": 0.25},
        },
        base,
    )


def preflight(opts: DemoOptions) -> str | None:
    """What would stop the demo before it starts, as a one-line error (``None``: go).

    Checked in the parent, before any rank or port: the trace reads and expands
    (the same ``TraceError`` text as ``replay``), and a ``--redis-url`` is valid,
    its client is installed and the server answers a PING.  A ledger that is down
    at start stops the demo (exit 2) rather than running a "Redis" demo without it.
    """
    from hicache_existence.replay.pages import expand
    from hicache_existence.replay.trace import TraceError, read_trace

    if opts.trace is not None:
        try:
            expand(read_trace(opts.trace))
        except (TraceError, ValueError) as exc:
            return f"error: {exc}"
    if importlib.util.find_spec("prometheus_client") is None:
        return (
            "error: the demo serves /metrics with prometheus-client: "
            "pip install 'hicache-existence[demo]'"
        )
    if not opts.redis_url:
        return None
    from hicache_existence.config import redact_url
    from hicache_existence.reconcile.ledgers import ledger_from_section

    shown = redact_url(opts.redis_url)
    try:
        config = demo_config(opts)
    except ValueError as exc:
        return f"error: --redis-url {shown}: {exc}"
    if importlib.util.find_spec("redis") is None:
        return "error: --redis-url needs the Redis client: pip install 'hicache-existence[redis]'"
    try:
        ledger = ledger_from_section(config.reconciler, "demo-preflight")
    except (ValueError, TypeError) as exc:
        return f"error: --redis-url {shown}: {exc}"
    try:
        if not ledger.ping():
            return (
                f"error: --redis-url {shown}: Redis does not answer (not running, wrong "
                "address or refused); start it, or leave --redis-url out to use the "
                "demo's embedded L3 as the ground truth"
            )
    finally:
        ledger.close()
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------
# one rank


def rank_main(
    rank: int,
    world: int,
    dist_port: int,
    opts: DemoOptions,
    reports: Any,
    stop: Any,
) -> None:
    """A scheduler process: join the group, build the runtime, replay, report."""
    import signal

    # Ctrl-C goes to the parent, which sets ``stop``; ranks then stop together
    # at an agreed step (a rank leaving on its own would strand the collectives).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    if opts.log_level:  # a spawned process starts with logging unconfigured
        from hicache_existence.logs import configure_logging

        configure_logging(opts.log_level, json_output=opts.log_json)
    try:
        _rank_loop(rank, world, dist_port, opts, reports, stop)
    except BaseException as exc:  # report, then let the parent decide
        reports.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _exit_with_parent(interval_s: float = 0.5) -> None:
    """End this rank as soon as the parent is gone, however it went (even SIGKILL,
    which leaves it no chance to stop us): a rank re-parented to init would serve
    no one and hold its port, memory and gloo peers."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="hicache-existence-parent-watch", daemon=True).start()


def _rank_loop(
    rank: int, world: int, dist_port: int, opts: DemoOptions, reports: Any, stop: Any
) -> None:
    from hicache_existence.demo.scheduler import SimulatedScheduler
    from hicache_existence.replay.l3 import L3
    from hicache_existence.replay.pages import expand
    from hicache_existence.replay.trace import read_trace
    from hicache_existence.runtime import ExistenceRuntime

    group: Any = None
    agreement: Any = None
    config = demo_config(opts)
    if world > 1:
        import torch.distributed as dist

        from hicache_existence.reconcile.agreement import GlooAgreement
        from hicache_existence.replicas.divergence import TorchGlooGroup

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world
        )
        group = TorchGlooGroup.create(timeout_s=config.divergence.timeout_s)
        agreement = GlooAgreement.new_group()
    truth: Any = None
    writer: Any = None
    if opts.redis_url:
        from hicache_existence.reconcile.ledger_writer import LedgerWriter
        from hicache_existence.reconcile.ledgers import ledger_from_section
        from hicache_existence.reconcile.redis_truth import shard_id

        ledger = ledger_from_section(config.reconciler, shard_id("demo", rank, world))
        # As the wrapping storage backend does: the storage path only enqueues, a
        # background thread writes to Redis, so a Redis that dies mid-run costs
        # counted ledger errors and an open breaker, never the scheduler.
        writer = _WriterLedger(LedgerWriter(ledger))
        # Verified after the records of the acks before each question (ledger_writer).
        truth = writer.writer.truth(max(config.reconciler.timeout_ms, 1) / 1000.0)
    shard = L3(opts.l3_pages, drop_every=opts.l3_drop_every, ledger=writer)
    labels = DeploymentLabels(
        model_name=config.metrics.model_name,
        engine_type="prefill",
        tp_rank=rank,
        storage_backend=config.metrics.storage_backend,
    )
    runtime = ExistenceRuntime(
        config, labels, group=group, truth=truth or shard, agreement=agreement
    ).start()
    scheduler = SimulatedScheduler(runtime, shard, clear_swa_every=100)
    requests = expand(read_trace(opts.trace or bundled_trace())).requests
    steps = opts.steps or math.ceil(len(requests) / opts.requests_per_step)
    period = 1.0 / opts.steps_per_s if opts.steps_per_s > 0 else 0.0
    started = time.monotonic()
    cycled = itertools.cycle(requests)
    step = 0
    # _stop_agreed: SIGINT / SIGTERM to the parent.
    while (opts.keep_running or step < steps) and not _stop_agreed(stop, world, step):
        scheduler.step(list(itertools.islice(cycled, opts.requests_per_step)))
        step += 1
        if rank == 0 and step % 10 == 0:
            reports.put({"rank": 0, "progress": _progress(scheduler, step, steps, opts)})
        if period:
            delay = started + step * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    runtime.telemetry.step()  # a last flush
    if writer is not None:
        writer.writer.close(timeout_s=2.0)
    summary = _summary(runtime, scheduler, step, world, writer) if rank == 0 else None
    runtime.close()
    reports.put({"rank": rank, "done": True, "summary": summary})
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


class _WriterLedger:
    """``L3``'s ledger interface over a ``LedgerWriter`` (enqueue only)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def record_stored(self, pool: str, hashes: Sequence[str]) -> None:
        self.writer.stored(pool, hashes)

    def record_removed(self, pool: str, hashes: Sequence[str]) -> None:
        self.writer.removed(pool, hashes)


def _stop_agreed(stop: Any, world: int, step: int) -> bool:
    """Ranks must stop at the same step (collectives): every 10 steps they agree
    on the stop flag with a MAX all-reduce."""
    if step % 10:
        return False
    flag = 1 if stop.is_set() else 0
    if world == 1:
        return bool(flag)
    import torch
    import torch.distributed as dist

    t = torch.tensor([flag], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _checks(runtime: Any) -> tuple[Any, Any]:
    """The divergence checker's stats and the reconciler's snapshot (None: off)."""
    checker = runtime.checker.stats() if runtime.checker is not None else None
    return checker, runtime.reconciler.snapshot() if runtime.reconciler is not None else None


def _progress(scheduler: Any, step: int, steps: int, opts: DemoOptions) -> str:
    """The live progress line (rank 0 sends it, the parent prints it)."""
    total = scheduler.runtime.cache.stats().total
    checker, rec = _checks(scheduler.runtime)
    t = scheduler.totals
    line = (
        f"step {step}{'' if opts.keep_running else f'/{steps}'}  requests {t.requests}  "
        f"page hit ratio {total.page_hit_ratio:.3f}  evictions {total.evictions}  "
        f"written {t.writes_issued}  avoided {t.writes_avoided}  "
        f"redundant {t.redundant_writes}  checks {checker.checks if checker else 0} "
        f"(divergences {checker.divergences if checker else 0})  "
        f"stale positives found {sum(rec.stale_positives.values()) if rec else 0}"
    )
    errors = sum(rec.errors.values()) if rec else 0
    if rec and (rec.circuit_state or errors):
        line += f"  ground truth: breaker {_BREAKER_STATES[rec.circuit_state]}, {errors} errors"
    return line


#: The reconciler's circuit states (``reconcile.breaker``), as printed.
_BREAKER_STATES = ("closed", "open", "half-open")


def _summary(runtime: Any, scheduler: Any, steps: int, ranks: int, writer: Any) -> str:
    """The closing report (rank 0 writes it, the parent prints it), capacity advice included."""
    runtime.cache.settle()  # classify the last step's misses before reporting them
    t, kv = scheduler.totals, runtime.cache.stats()["kv"]
    checker, rec = _checks(runtime)
    lines = [
        "",
        f"demo finished: {steps} steps, {t.requests} requests, "
        f"{t.page_references} page references on {ranks} TP rank(s)",
        f"  kv pool: page hit ratio {kv.page_hit_ratio:.3f}, entries "
        f"{kv.entries}/{kv.capacity}, evictions {kv.evictions}, "
        f"misses cold/evicted/invalidated/cleared "
        f"{kv.misses_cold}/{kv.misses_evicted}/{kv.misses_invalidated}/{kv.misses_cleared}",
        f"  writes: {t.writes_issued} pages written, {t.writes_avoided} avoided, "
        f"{t.redundant_writes} redundant (already in L3)",
    ]
    if checker:
        lines.append(
            f"  TP replicas: {checker.checks} checks, {checker.divergences} divergences, "
            f"{checker.failures} failed checks"
        )
    if rec:
        shard = scheduler.shard
        lines.append(
            f"  reconciler: {sum(rec.queries.values())} verifications, "
            f"{sum(rec.stale_positives.values())} stale positives found, "
            f"{sum(rec.pages_invalidated.values())} beliefs invalidated, "
            f"{sum(rec.pages_learnt.values())} learnt, {sum(rec.errors.values())} errors "
            f"(L3 evicted {shard.evictions}, lost {shard.dropped} pages)"
        )
        if rec.circuit_opened or rec.circuit_state:
            lines.append(
                f"  ground truth unavailable at times: circuit breaker opened "
                f"{rec.circuit_opened} time(s), {_BREAKER_STATES[rec.circuit_state]} at the end "
                "(verifications paused while open; the cache kept serving)"
            )
    if writer is not None:
        pages = writer.writer.counts()["pages"]
        failed = sum(n for key, n in pages.items() if not key.endswith("/ok"))
        if failed:
            lines.append(
                f"  Redis ledger: {failed} page records not written (errors or a full queue; "
                "at worst a redundant L3 write later)"
            )
    # Buffer mode sizes the cap by the lookup curve (prefetch healing re-teaches
    # beliefs; docs/capacity.md).
    advice = runtime._advice().pools if runtime.advisor is not None else {}
    estimates = {pool: a.lookup_estimates for pool, a in advice.items()}
    lines.append(format_advice(estimates, runtime.config.cache.max_entries))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the parent: /metrics, progress, summary


class MetricsEndpoint:
    """SGLang's side of multiprocess metrics: aggregate the ranks' files and serve."""

    def __init__(self, directory: str, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        self._httpd, _ = start_http_server(port, addr=host, registry=registry)
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def format_advice(advice: dict[str, Mapping[float, float | None]], cap: int) -> str:
    """Estimated hit ratio per pool at multiples of the cap, and a recommendation."""
    if not advice:
        return "  capacity advice: not enough references sampled yet"
    lines = [
        f"  capacity advice (current cap {cap} entries per pool; estimated hit ratio of "
        "lookups, the buffer-mode curve):"
    ]
    for pool, estimates in sorted(advice.items()):
        known = {m: v for m, v in estimates.items() if v is not None}
        if not known:
            continue
        cells = "  ".join(f"{m:g}x={v:.3f}" for m, v in sorted(known.items()))
        lines.append(f"    {pool}: {cells}")
        enough = recommended_multiple(known)
        here = known.get(1.0)
        if here is not None and enough is not None and enough > 1.0:
            lines.append(
                f"      -> a cap of about {int(cap * enough)} ({enough:g}x) would raise it from "
                f"{here:.3f} to {known[enough]:.3f}"
            )
        elif here is not None:
            lines.append("      -> the current cap captures the reuse this workload has")
    return "\n".join(lines)


#: Seconds the ranks get to stop at an agreed step after SIGINT / SIGTERM.
STOP_GRACE_S = 15.0


class _Forced(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: stop the ranks now, without their summary."""


def _on_stop_signals(stop: Any, received: list[int]) -> Callable[[], None]:
    """SIGINT and SIGTERM (a supervisor's ``kill``) ask the ranks to stop together
    (``stop``); a second one forces it.  Returns the restorer of the old handlers."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        if received:
            raise _Forced(signum)
        received.append(signum)
        stop.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)

    return restore


def run_demo(opts: DemoOptions, out: Callable[[str], None] = print) -> int:
    """Run the demo; returns the exit status (``128 + signal`` if a signal cut a
    one-pass run short; 0 when it ends a ``keep_running`` one)."""
    ranks = opts.ranks
    if ranks > 1:
        try:
            import torch.distributed  # noqa: F401
        except Exception:
            out("torch is not installed: running one TP rank (pip install torch for two)")
            ranks = 1
    mp_dir = tempfile.mkdtemp(prefix="hicache-existence-demo-")
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir  # inherited by the ranks
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    stop = ctx.Event()
    received: list[int] = []
    restore = _on_stop_signals(stop, received)
    endpoint: MetricsEndpoint | None = None
    procs: list[Any] = []
    status = 0
    try:
        try:
            endpoint = MetricsEndpoint(mp_dir, opts.host, opts.port)
        except OSError as exc:
            print(
                f"error: cannot serve /metrics on {opts.host}:{opts.port}: {exc.strerror or exc} "
                "(use --port N, or --port 0 for any free port)",
                file=sys.stderr,
            )
            return 2
        out(f"serving /metrics at {endpoint.url} ({ranks} TP rank(s), multiprocess mode)")
        dist_port = _free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, ranks, dist_port, opts, reports, stop))
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        summary = _follow(reports, procs, ranks, opts, received, out)
        for p in procs:
            p.join(timeout=STOP_GRACE_S if received else 30)
        if summary is not None and not any(p.exitcode for p in procs):
            out(summary)
        else:
            status = 1
        if received and (status or not opts.keep_running):
            status = 128 + received[0]
    except _Forced as exc:
        status = 128 + int(exc.args[0])
    except KeyboardInterrupt:  # a SIGINT outside the main thread's handler
        stop.set()
        status = 130
    finally:
        restore()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if endpoint is not None:
            endpoint.close()
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        shutil.rmtree(mp_dir, ignore_errors=True)
    return status


def _follow(
    reports: Any,
    procs: list[Any],
    ranks: int,
    opts: DemoOptions,
    received: list[int],
    out: Callable[[str], None],
) -> str | None:
    """The ranks' reports until each is done (``None``: a rank failed, or did not
    stop within ``STOP_GRACE_S`` of a signal)."""
    done = 0
    summary: str | None = None
    tty = sys.stderr.isatty()
    last_print = 0.0
    stop_by = math.inf
    while done < ranks:
        if received and stop_by == math.inf:
            stop_by = time.monotonic() + STOP_GRACE_S
        if time.monotonic() > stop_by:
            out(f"the ranks did not stop within {STOP_GRACE_S:g} s; terminating them")
            return None
        try:
            msg = reports.get(timeout=0.5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                if not received:
                    out("a rank exited with an error")
                return None
            continue
        if "error" in msg:
            out(f"rank {msg['rank']} failed: {msg['error']}")
            return None
        if "progress" in msg and opts.progress and not received:
            now = time.monotonic()
            if tty:
                sys.stderr.write("\r" + msg["progress"][:200])
                sys.stderr.flush()
            elif now - last_print >= 2.0:
                out(msg["progress"])
                last_print = now
        if msg.get("done"):
            done += 1
            summary = msg["summary"] or summary  # rank 0's
    if tty:
        sys.stderr.write("\n")
    return summary
