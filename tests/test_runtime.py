"""ExistenceRuntime: one Config wires cache, checks, reconciler, advisor and export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from hicache_existence.config import Config
from hicache_existence.demo.run import bundled_trace
from hicache_existence.demo.scheduler import SimulatedScheduler
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.pages import expand
from hicache_existence.replay.trace import read_trace
from hicache_existence.runtime import ExistenceRuntime

ROOT = Path(__file__).resolve().parents[1]


def _config(mode: str = "standalone") -> Config:
    return Config.from_mapping(
        {
            "enabled": True,
            "cache": {"max_entries": 2048},
            "metrics": {"mode": mode, "port": 0, "flush_interval_s": 0},
            "divergence": {"interval_steps": 5},
            "reconciler": {"enabled": True, "sampling_rate": 0.5, "verifications_per_s": 500},
            "advisor": {"sampling_rate": 0.5},
        }
    )


def _requests(limit: int = 200):
    return expand(read_trace(bundled_trace())).requests[:limit]


def _drive(runtime: ExistenceRuntime, shard: L3, steps: int = 40) -> SimulatedScheduler:
    scheduler = SimulatedScheduler(runtime, shard, clear_swa_every=10)
    requests = _requests()
    for step in range(steps):
        scheduler.step(requests[(step * 4) % len(requests) :][:4])
    runtime.cache.settle()
    return scheduler


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = []
        for part in rest.rstrip("}").split('",'):
            if "=" in part:
                k, v = part.split("=", 1)
                labels.append((k.strip(","), v.strip('"')))
        out[(name, tuple(sorted(labels)))] = float(value)
    return out


def _value(samples, name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            total += v
            found = True
    assert found, f"no series {name} {labels}"
    return total


def test_runtime_exports_every_feature_with_the_snapshot_values():
    """A standalone scrape of a driven runtime shows cache, divergence, reconciler,
    advisor and histogram series equal to the components' own snapshots."""
    shard = L3(1500, drop_every=50)
    runtime = ExistenceRuntime(_config(), truth=shard).start()
    try:
        _drive(runtime, shard)
        # The reconciler's worker answers queries asynchronously: stop it, so that
        # the scrape and the snapshots below see the same counts.
        runtime.reconciler.close(timeout_s=10.0)
        runtime.telemetry.step()
        url = runtime.telemetry.server.url
        with urllib.request.urlopen(url, timeout=10) as response:
            samples = _parse(response.read().decode())
        checks = runtime.checker.stats()
        rec = runtime.reconciler.snapshot()
        stats = runtime.cache.stats()
    finally:
        runtime.close()
    assert checks.checks >= 8 and checks.divergences == 0
    assert _value(samples, "hicache_existence_divergence_checks_total") == checks.checks
    assert _value(samples, "hicache_existence_divergence_active") == 1
    assert _value(samples, "hicache_existence_page_hits_total", pool="kv") == stats["kv"].page_hits
    answered = sum(rec.queries.values())
    assert answered > 0
    assert _value(samples, "hicache_existence_reconciler_queries_total") == answered
    assert (
        _value(samples, "hicache_existence_reconciler_query_seconds_count")
        == rec.query_seconds.count
    )
    assert _value(samples, "hicache_existence_reconciler_query_seconds_bucket", le="+Inf") == (
        rec.query_seconds.count
    )
    assert _value(samples, "hicache_existence_reconciler_errors_total", kind="connection") == 0
    ratios = {
        dict(lab)["cap_multiplier"]: v
        for (n, lab), v in samples.items()
        if n == "hicache_existence_advisor_estimated_hit_ratio" and dict(lab)["pool"] == "kv"
    }
    assert set(ratios) == {"0.25", "0.5", "1", "2", "4", "8"}
    assert all(0.0 <= v <= 1.0 for v in ratios.values())
    assert ratios["8"] >= ratios["0.25"]
    misses = {
        dict(lab)["reason"]: v
        for (n, lab), v in samples.items()
        if n == "hicache_existence_page_misses_total" and dict(lab)["pool"] == "swa"
    }
    assert misses["cleared"] > 0


def test_step_survives_a_failing_component():
    """A component that raises is logged and skipped; step() never raises."""
    runtime = ExistenceRuntime(_config(mode="off"))

    class Broken:
        def apply(self, step: int) -> None:
            raise RuntimeError("reconciler exploded")

        def close(self) -> None:
            pass

    runtime.reconciler = Broken()  # type: ignore[assignment]
    for _ in range(12):
        runtime.step()
    assert runtime.checker.stats().checks == 2  # the rest of the step still ran
    runtime.close()


def test_divergence_off_joins_the_handshake_and_exports_no_series():
    """divergence.enabled=false: the checker still runs the start-up handshake once
    (so ranks that disagree are caught), then never checks; the digest observes
    nothing and no divergence family is exported (the checks-stopped alert keys on
    the series, so it cannot fire for a deployment that turned checks off)."""
    config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "standalone", "port": 0, "flush_interval_s": 0},
            "divergence": {"enabled": False, "interval_steps": 5},
        }
    )
    runtime = ExistenceRuntime(config).start()
    try:
        assert runtime.digest not in runtime.tee.observers
        runtime.cache.pool("kv").add(["a" * 64])
        for _ in range(12):
            runtime.step()
        s = runtime.checker.stats()
        with urllib.request.urlopen(runtime.telemetry.server.url, timeout=10) as response:
            samples = _parse(response.read().decode())
    finally:
        runtime.close()
    assert (s.steps, s.checks, s.active, s.config_mismatches, s.failures) == (12, 0, False, 0, 0)
    assert runtime.digest.pool_digests() == {}  # it saw no operation
    assert _value(samples, "hicache_existence_page_inserts_total", pool="kv") == 1
    assert not [name for name, _ in samples if "divergence" in name]


def test_a_single_replica_digest_observes_nothing_and_its_checks_still_count():
    """A world of one needs no digest (its checks are ok without one): with no
    group given, the digest never observes the cache; with a group given, whose size
    may be known only later (SGLang's is bound at the first step), it observes until
    ``group_bound`` finds a world of one, and for a group of two it stays."""
    from hicache_existence.replicas.divergence import InProcessWorld

    config = _config(mode="off")
    runtime = ExistenceRuntime(config)
    assert runtime.digest not in runtime.tee.observers
    runtime.cache.pool("kv").add(["a" * 64])
    assert runtime.cache.pool("kv").covered(["a" * 64])
    for _ in range(10):
        runtime.step()
    assert runtime.digest.pool_digests() == {}  # it saw no operation
    assert runtime.checker.stats().checks == 10 // config.divergence.interval_steps > 0
    runtime.close()

    one = ExistenceRuntime(config, group=InProcessWorld(1).group(0))
    assert one.digest in one.tee.observers  # not known to be alone until bound
    one.group_bound()
    assert one.digest not in one.tee.observers
    one.cache.pool("kv").add(["b" * 64])
    assert one.digest.pool_digests() == {}
    one.close()

    pair = ExistenceRuntime(config, group=InProcessWorld(2).group(0))
    pair.group_bound()
    assert pair.digest in pair.tee.observers
    pair.cache.pool("kv").add(["a" * 64])
    assert set(pair.digest.pool_digests()) == {"kv"}
    pair.close()


def test_without_ground_truth_there_is_no_reconciler():
    """reconciler.enabled without a truth builds no reconciler (nothing to ask)."""
    runtime = ExistenceRuntime(_config(mode="off"), truth=None)
    assert runtime.reconciler is None
    runtime.close()


def test_flat_generation_runtime_checks_with_the_shared_lru_digest():
    """generation='flat' builds the seed-generation cache with the shared-LRU digest."""
    from hicache_existence.core.flat import FlatStorageExistenceCache
    from hicache_existence.replicas.digest import SharedLruDigest

    runtime = ExistenceRuntime(_config(mode="off"), generation="flat")
    assert isinstance(runtime.cache, FlatStorageExistenceCache)
    assert isinstance(runtime.digest, SharedLruDigest)
    runtime.cache.add("kv", ["a" * 64])
    for _ in range(5):
        runtime.step()
    assert runtime.checker.stats().checks == 1
    runtime.close()


_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_runtime import _config, _drive
    from hicache_existence.exporters.catalog import DeploymentLabels
    from hicache_existence.replay.l3 import L3
    from hicache_existence.runtime import ExistenceRuntime
    shard = L3(1500, drop_every=50)
    rt = ExistenceRuntime(_config("multiprocess"), DeploymentLabels(tp_rank={rank}), truth=shard)
    rt.start()
    _drive(rt, shard, steps=30)
    rt.telemetry.step()
    rec = rt.reconciler.snapshot()
    print(json.dumps({{"checks": rt.checker.stats().checks, "queries": sum(rec.queries.values()),
                      "latency_count": rec.query_seconds.count,
                      "latency_sum": rec.query_seconds.sum}}))
    rt.close()
    """
)


@pytest.mark.multiprocess
def test_feature_metrics_aggregate_in_multiprocess_mode(tmp_path):
    """Two processes feed feature counters and the latency histogram through
    prometheus_client multiprocess files; MultiProcessCollector sums them exactly."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    results = []
    for rank in (0, 1):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests"), rank=rank)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    samples = _parse(generate_latest(registry).decode())
    assert _value(samples, "hicache_existence_divergence_checks_total") == sum(
        r["checks"] for r in results
    )
    assert _value(samples, "hicache_existence_reconciler_queries_total") == sum(
        r["queries"] for r in results
    )
    assert _value(samples, "hicache_existence_reconciler_query_seconds_count") == sum(
        r["latency_count"] for r in results
    )
    assert _value(samples, "hicache_existence_reconciler_query_seconds_sum") == pytest.approx(
        sum(r["latency_sum"] for r in results)
    )
    for rank in ("0", "1"):
        assert _value(samples, "hicache_existence_divergence_active", tp_rank=rank) == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("div_interval", "rec_interval"), [(5, 3), (7, 7), (1, 4), (64, 10)])
def test_the_idle_fast_path_runs_what_every_step_would(div_interval, rec_interval):
    """``step()`` skips the components on steps with nothing due and credits the
    skipped steps at the next due one: the divergence checks and the reconciler's
    agreements land on exactly the steps of a checker and a reconciler called on
    every step (the reference here), so the TP lockstep points do not move."""
    from hicache_existence.replicas.divergence import DivergenceChecker, InProcessWorld

    config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "off", "flush_interval_s": 10},
            "divergence": {"interval_steps": div_interval},
            "reconciler": {"enabled": True, "agree_interval_steps": rec_interval},
        }
    )
    clock = _Clock()
    shard = L3(1024)
    runtime = ExistenceRuntime(config, truth=shard, clock=clock)
    reference = DivergenceChecker(
        runtime.digest, InProcessWorld(1).group(0), config.divergence, cache=runtime.cache
    )
    checked_at, reference_at = [], []
    for step in range(1, 301):
        before = runtime.checker.stats().checks
        runtime.step()
        if runtime.checker.stats().checks > before:
            checked_at.append(step)
        if reference.on_step() is not None and reference.stats().last_check_step == step:
            reference_at.append(step)
    assert checked_at == reference_at and len(checked_at) == 300 // div_interval
    assert runtime.steps == reference.step == 300
    # the checker's own count catches up at its next due step, never later
    assert 300 - div_interval < runtime.checker.step <= 300
    assert runtime.reconciler is not None
    assert runtime.reconciler.counters.apply_calls == 300 // rec_interval
    runtime.close()


def test_the_fast_path_still_flushes_metrics_on_time():
    """Steps between flushes do not flush; the first step past ``flush_interval_s``
    does, whatever the step counts."""
    config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "off", "flush_interval_s": 10},
            "divergence": {"enabled": False},
        }
    )
    clock = _Clock()
    runtime = ExistenceRuntime(config, clock=clock)
    flushes = []
    real = runtime.telemetry.step

    def counted() -> bool:
        flushed = real()
        if flushed:
            flushes.append(runtime.steps)
        return flushed

    runtime.telemetry.step = counted  # type: ignore[method-assign]
    for _ in range(50):
        runtime.step()
    clock.now = 10.5
    for _ in range(50):
        runtime.step()
    clock.now = 21.0  # the flush at 10.5 made the next one due at 20.5
    runtime.step()
    assert flushes == [1, 51, 101]
    runtime.close()


def test_a_flush_due_in_a_busy_stretch_waits_for_an_idle_step():
    """A flush that falls due right after a long (batch) iteration waits for the
    first step after a short (polling) one, at most half a flush interval; a step
    after a pause longer than that is no busy stretch and flushes at once."""
    from hicache_existence.runtime import BUSY_STEP_S

    config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "off", "flush_interval_s": 10},
            "divergence": {"enabled": False},
        }
    )
    clock = _Clock()
    runtime = ExistenceRuntime(config, clock=clock)
    flushes = []
    real = runtime.telemetry.step

    def counted() -> bool:
        flushed = real()
        if flushed:
            flushes.append(runtime.steps)
        return flushed

    runtime.telemetry.step = counted  # type: ignore[method-assign]
    poll, batch = BUSY_STEP_S / 20, BUSY_STEP_S * 5

    def steps(n: int, gap: float) -> None:
        for _ in range(n):
            clock.now += gap
            runtime.step()

    steps(1, 0.0)  # step 1 flushes (the first one always does); next due at 10
    clock.now = 9.999
    steps(1, 0.0)  # step 2, after a long pause, before the flush is due
    steps(3, batch)  # steps 3-5: due from step 3 (10.009), each after a batch
    assert flushes == [1]
    steps(2, poll)  # step 6 comes after a polling iteration: it flushes
    assert flushes == [1, 6]
    due = clock.now + 10
    at = {}
    while clock.now < due + 5 + batch:  # a busy stretch past the longest wait
        steps(1, batch)
        at[runtime.steps] = clock.now
    # no step of the stretch flushed before half an interval past due, the first after did
    (last,) = flushes[2:]
    assert at[last] >= due + 5 > at[last - 1]
    # a pause (a scheduler that slept) is no busy stretch: due 1 s ago, flushed at once
    clock.now = at[last] + 10 + 1
    runtime.step()
    assert flushes[-1] == runtime.steps
    runtime.close()


def test_the_demo_scheduler_is_the_replay_model_on_the_runtime() -> None:
    """The demo writes through the replay's model (``replay.model`` over
    ``replay.l3``, issue 29 item 4): the runtime's write accounting hears exactly
    the writes, avoided writes and redundant pages the model counts, the
    redundant ones with their cause (the swa pool, cleared every 10 steps,
    writes again what L3 still holds)."""
    config = Config.from_mapping({"metrics": {"mode": "off"}}, _config())
    shard = L3(1500, drop_every=50)
    runtime = ExistenceRuntime(config, truth=shard).start()
    try:
        scheduler = _drive(runtime, shard, steps=60)
        writes = runtime.writes.stats()
    finally:
        runtime.close()
    kv, swa, totals = writes["kv"], writes["swa"], scheduler.totals
    assert totals.writes_issued > 0 and totals.writes_avoided > 0
    assert (kv.written, kv.avoided, kv.redundant) == (
        totals.writes_issued,
        totals.writes_avoided,
        totals.redundant_writes,
    )
    assert kv.causes.get("recompute", 0) == kv.redundant
    assert swa.redundant > 0 and swa.causes["recompute"] == swa.redundant
    assert shard.evictions > 0 and len(shard) <= 2 * 1500  # kv and swa, each bounded


def test_a_span_that_fails_to_start_still_counts_the_step(monkeypatch) -> None:
    """An application's span processor may raise in on_start (the OpenTelemetry SDK
    lets it): the due divergence step still runs on that rank, or its checks run
    one step behind every other rank's for good (a false "step" divergence, or a
    stall in the collective)."""
    import contextlib
    import threading

    from hicache_existence import runtime as rt_module
    from hicache_existence.replicas.divergence import InProcessWorld

    real_span = rt_module.span
    left = {"rank0": 1}

    def flaky_span(*a, **kw):
        name = threading.current_thread().name
        if left.get(name):
            left[name] -= 1
            raise RuntimeError("span processor bug")
        return real_span(*a, **kw)

    monkeypatch.setattr(rt_module, "span", flaky_span)
    cfg = Config.from_json(
        '{"metrics": {"mode": "off"}, "divergence": {"interval_steps": 5, "timeout_s": 5}}'
    )
    world = InProcessWorld(2, timeout_s=5)
    runtimes = [ExistenceRuntime(cfg, group=world.group(r)) for r in range(2)]

    def run(runtime: ExistenceRuntime) -> None:
        for _ in range(30):
            runtime.cache.pool("kv").add(["a" * 64])
            runtime.step()

    threads = [
        threading.Thread(target=run, args=(r,), name=f"rank{i}") for i, r in enumerate(runtimes)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = [r.checker.stats() for r in runtimes]
    assert left["rank0"] == 0
    assert [s.steps for s in stats] == [30, 30]
    assert [s.divergences for s in stats] == [0, 0]
    for r in runtimes:
        with contextlib.suppress(Exception):
            r.close()
