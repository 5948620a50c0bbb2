"""The divergence checker across real processes: torch.distributed gloo groups of 2
and 4 ranks on 127.0.0.1, each rank a spawned Python process with its own cache.

Each world runs every scenario once (module-scoped fixture), each scenario on a
fresh dedicated gloo group; the tests then read what every rank reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from divergence_workload import FAULTS  # noqa: E402

HEALTHY_STEPS = 10_000
INTERVAL = 100
INJECT_AT = 1234
FAULT_STEPS = 1_400
#: The stalled-rank scenario's timeout: ranks enter the collective up to a few
#: hundred ms apart on a loaded machine, and one waiting on a peer whose timer fired
#: first fails at about the timeout less that gap (a timeout only after 90% of it).
TIMEOUT_S = 6.0
WORLD_DEADLINE_S = 300


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        return
    message = "torch is not installed (pip install torch==2.13.0, a CPU build)"
    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_world(size: int, out_dir: Path) -> list[dict[str, Any]]:
    """Spawn ``size`` ranks, wait for all of them, return each rank's report."""
    _require_torch()
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__)),
                "--worker",
                str(rank),
                str(size),
                str(port),
                str(out_dir),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(size)
    ]
    deadline = time.monotonic() + WORLD_DEADLINE_S
    logs = []
    try:
        for p in procs:
            remaining = max(1.0, deadline - time.monotonic())
            out, _ = p.communicate(timeout=remaining)
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {size}-rank world did not finish within {WORLD_DEADLINE_S}s (a hang)")
    reports = []
    for rank, p in enumerate(procs):
        path = out_dir / f"rank{rank}.json"
        assert p.returncode == 0 and path.exists(), f"rank {rank} failed:\n{logs[rank][-4000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    size = request.param
    return _run_world(size, tmp_path_factory.mktemp(f"gloo{size}"))


# ---------------------------------------------------------------------------
# the tests


def test_identical_streams_run_10000_steps_without_false_alarm(world: list[dict[str, Any]]) -> None:
    """10,000 identical steps (evictions, heals, in-flight refs, audits) pass every
    check on every rank."""
    for report in world:
        h = report["healthy"]
        assert h["statuses"] == {"ok": HEALTHY_STEPS // INTERVAL}
        s = h["stats"]
        assert (s["checks"], s["divergences"], s["failures"]) == (100, 0, 0)
        assert s["last_check_step"] == HEALTHY_STEPS and s["active"]
        assert h["kv_evictions"] > 0 and h["kv_invalidations"] > 0


@pytest.mark.parametrize("fault", FAULTS)
def test_each_injected_fault_is_detected_within_one_interval(
    world: list[dict[str, Any]], fault: str
) -> None:
    """Every rank reports the fault at the first check after it, naming the faulty
    rank (the last one) and the pool."""
    size = len(world)
    pool = "probe" if fault == "touch_order" else "kv"
    for report in world:
        r = report["faults"][fault]
        assert r["first_detection"] == 1300
        assert r["first_detection"] - INJECT_AT <= INTERVAL
        assert r["statuses_before"] == ["ok"] * (INJECT_AT // INTERVAL)
        event = r["event"]
        # With two ranks the tie is broken towards rank 0 as the reference.
        assert event["diverged_ranks"] == [size - 1]
        assert pool in event["diverged_pools"] and event["kinds"] == ["state"]
        assert sorted(event["ranks"]) == list(range(size))


def test_heal_policy_clears_on_every_rank_at_the_same_step(world: list[dict[str, Any]]) -> None:
    """``heal``: all ranks clear the diverged pool at the detecting check, later checks
    pass, and the misses that follow are counted as ``cleared``."""
    for report in world:
        h = report["heal"]
        assert h["statuses"]["1300"] == "diverged"
        assert all(v == "ok" for k, v in h["statuses"].items() if k != "1300")
        assert (h["stats"]["heals"], h["stats"]["divergences"]) == (1, 1)
        assert h["kv_clears"] == 1 and h["kv_cleared_misses"] > 0
        assert h["event"]["action"] == "healed: cleared kv"


def test_abort_policy_raises_on_every_rank(world: list[dict[str, Any]]) -> None:
    """``abort``: every rank raises ``DivergenceError`` at the same check."""
    for report in world:
        a = report["abort"]
        assert a["raised"] == "DivergenceError" and a["step"] == 1300


def test_config_mismatch_is_detected_once_at_start(world: list[dict[str, Any]]) -> None:
    """A different interval on one rank, or checks disabled on one rank, leaves every
    rank inactive after the start-up handshake; no collective hangs."""
    for report in world:
        for case in ("interval", "enabled"):
            m = report["mismatch"][case]
            assert m["active"] is False and m["config_mismatches"] == 1
            assert m["checks"] == 0
            expected = "interval_steps" if case == "interval" else "enabled"
            assert expected in m["differing"]


def test_runtime_with_checks_off_on_some_ranks_meets_the_others_at_start(
    world: list[dict[str, Any]],
) -> None:
    """ExistenceRuntime with divergence.enabled on rank 0 only: every rank's runtime
    joins the handshake, so all of them report the mismatch and stop at once (a
    rank waiting for a peer that never checks would record a failed handshake
    instead; none checks alone); only rank 0,
    whose checks are on, exports the divergence families."""
    for report in world:
        m = report["mismatch"]["runtime"]
        assert (m["active"], m["checks"], m["config_mismatches"], m["failures"]) == (
            False,
            0,
            1,
            0,
        )
        assert m["exports_divergence"] is (report["rank"] == 0)


def test_rank_that_stops_checking_times_out_the_others(world: list[dict[str, Any]]) -> None:
    """A rank that stops calling the checker makes every other rank fail its next
    check with a timeout error within the configured time, then carry on."""
    size = len(world)
    for report in world[: size - 1]:
        t = report["timeout"]
        assert t["status"] == "failed" and t["step"] == 200
        assert t["event"]["timeout"] is True and "timed out" in t["event"]["error"], (
            report["rank"],
            t["event"]["error"],
        )
        assert TIMEOUT_S * 0.9 <= t["duration_s"] <= TIMEOUT_S + 5.0
        assert t["steps_completed"] == 300 and t["stats"]["active"] is False
    assert world[size - 1]["timeout"]["stopped_at"] == 150


@pytest.mark.parametrize(
    ("waited_s", "text", "timed_out"),
    [
        (0.0, "Timed out waiting 2000ms for recv operation to complete", True),
        (9.0, "Connection closed by peer [127.0.0.1]:4242", True),  # a peer's timer fired
        (8.9, "Connection closed by peer [127.0.0.1]:4242", False),  # a peer went away
        (0.0, "Connection reset by peer", False),
    ],
)
def test_gloo_failures_are_timeouts_by_gloos_words_or_by_the_time_waited(
    waited_s: float, text: str, timed_out: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective that failed after 90% of the timeout or more waited the
    timeout out, whatever gloo's words; earlier, only gloo's words say timeout."""
    from types import SimpleNamespace

    from hicache_existence.replicas import divergence
    from hicache_existence.replicas.divergence import GroupError, GroupTimeout, TorchGlooGroup

    clock = [100.0]  # the module's clock only: no real waiting
    monkeypatch.setattr(divergence, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    group = object.__new__(TorchGlooGroup)  # _run needs no process group
    group.timeout_s = 10.0

    def fails() -> None:
        clock[0] += waited_s
        raise RuntimeError(text)

    with pytest.raises(GroupError) as info:
        group._run("all_reduce", fails)
    assert isinstance(info.value, GroupTimeout) is timed_out
    assert text in str(info.value)


def test_check_cost_is_one_small_collective(
    world: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A check costs about one small all-reduce: its median stays within a few
    times a 2-word all-reduce plus the local digest work (figures printed)."""
    cost = max((r["cost_ms"] for r in world), key=lambda c: c["check"])
    with capsys.disabled():
        print(
            f"\n[{len(world)} ranks] median check {cost['check']:.3f} ms, "
            f"2-word all_reduce {cost['all_reduce_2']:.3f} ms, "
            f"local digest {cost['local']:.3f} ms; 10k steps in "
            f"{max(r['healthy']['seconds'] for r in world):.1f} s"
        )
    assert cost["check"] < 4 * cost["all_reduce_2"] + cost["local"] + 2.0


# ---------------------------------------------------------------------------
# the worker (runs in each spawned process)


def _worker(rank: int, size: int, port: int, out_dir: Path) -> None:  # pragma: no cover
    from datetime import timedelta

    import torch.distributed as dist
    from divergence_workload import Replica, run_steps

    from hicache_existence.config import DivergenceSection
    from hicache_existence.replicas.divergence import (
        DivergenceChecker,
        DivergenceError,
        TorchGlooGroup,
    )

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    last = size - 1
    report: dict[str, Any] = {"rank": rank}

    def checker(rep: Replica, cfg: DivergenceSection) -> DivergenceChecker:
        group = TorchGlooGroup.create(timeout_s=cfg.timeout_s)
        assert group is not None
        return DivergenceChecker(rep.digest, group, cfg, cache=rep.cache)

    # 1. identical streams
    rep = Replica()
    chk = checker(rep, DivergenceSection(interval_steps=INTERVAL, audit_every_checks=5))
    statuses: Counter[str] = Counter()

    def count(_step: int) -> None:
        r = chk.on_step()
        if r is not None:
            statuses[r.status] += 1

    t0 = time.monotonic()
    run_steps(rep, HEALTHY_STEPS, count)
    kv = rep.cache.pool("kv").stats()
    report["healthy"] = {
        "statuses": dict(statuses),
        "stats": _stats(chk),
        "seconds": time.monotonic() - t0,
        "kv_evictions": kv.evictions,
        "kv_invalidations": kv.invalidations,
    }

    # 2. each fault, policy log
    report["faults"] = {}
    for fault in FAULTS:
        rep = Replica()
        chk = checker(rep, DivergenceSection(interval_steps=INTERVAL))
        results: list[Any] = []
        run_steps(
            rep,
            FAULT_STEPS,
            lambda _s, c=chk, out=results: out.append(c.on_step()),  # type: ignore[misc]
            INJECT_AT,
            fault,
            faulty=rank == last,
        )
        done = [r for r in results if r is not None]
        first = next(r for r in done if r.status == "diverged")
        report["faults"][fault] = {
            "first_detection": first.step,
            "statuses_before": [r.status for r in done if r.step < INJECT_AT],
            "event": first.event,
        }

    # 3. heal
    rep = Replica()
    chk = checker(rep, DivergenceSection(interval_steps=INTERVAL, policy="heal"))
    heal_results: list[Any] = []
    run_steps(
        rep,
        FAULT_STEPS,
        lambda _s: heal_results.append(chk.on_step()),
        INJECT_AT,
        "extra_add",
        faulty=rank == last,
    )
    kv = rep.cache.pool("kv").stats()
    done = [r for r in heal_results if r is not None]
    report["heal"] = {
        "statuses": {str(r.step): r.status for r in done},
        "stats": _stats(chk),
        "kv_clears": kv.clears,
        "kv_cleared_misses": kv.misses_by_reason["cleared"],
        "event": next(r.event for r in done if r.status == "diverged"),
    }

    # 4. abort
    rep = Replica()
    chk = checker(rep, DivergenceSection(interval_steps=INTERVAL, policy="abort"))
    try:
        run_steps(
            rep,
            FAULT_STEPS,
            lambda _s: chk.on_step(),
            INJECT_AT,
            "missed_invalidate",
            faulty=rank == last,
        )
        report["abort"] = {"raised": None}
    except DivergenceError as exc:
        report["abort"] = {"raised": type(exc).__name__, "step": chk.step}

    # 5. configuration mismatches
    report["mismatch"] = {}
    for case, odd in (
        ("interval", DivergenceSection(interval_steps=INTERVAL * 5)),
        ("enabled", DivergenceSection(interval_steps=INTERVAL, enabled=False)),
    ):
        cfg = (
            odd
            if rank == (last if case == "interval" else 0)
            else DivergenceSection(interval_steps=INTERVAL)
        )
        rep = Replica()
        events: list[dict[str, Any]] = []
        group = TorchGlooGroup.create(timeout_s=cfg.timeout_s)
        assert group is not None
        chk = DivergenceChecker(rep.digest, group, cfg, cache=rep.cache, on_event=events.append)
        run_steps(rep, 1_000, lambda _s, c=chk: c.on_step())  # type: ignore[misc]
        s = chk.stats()
        report["mismatch"][case] = {
            "active": s.active,
            "checks": s.checks,
            "config_mismatches": s.config_mismatches,
            "differing": sorted(events[0]["differing"]) if events else [],
        }

    # 5b. the same through ExistenceRuntime, the wiring every host uses: rank 0 with
    #     checks on, the others off (their runtime builds a checker all the same)
    from hicache_existence.config import Config
    from hicache_existence.runtime import ExistenceRuntime

    runtime_config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "off"},
            "divergence": {"enabled": rank == 0, "interval_steps": INTERVAL},
        }
    )
    group = TorchGlooGroup.create(timeout_s=runtime_config.divergence.timeout_s)
    assert group is not None
    runtime = ExistenceRuntime(runtime_config, group=group)
    for _ in range(INTERVAL * 3):
        runtime.step()
    s = runtime.checker.stats()
    report["mismatch"]["runtime"] = {
        "active": s.active,
        "checks": s.checks,
        "config_mismatches": s.config_mismatches,
        "failures": s.failures,
        "exports_divergence": any(
            spec.source == "divergence" for spec in runtime.telemetry.series_reader.feature_specs()
        ),
    }
    runtime.close()

    # 6. what one check costs (for the notes): checks back to back, interval 1
    rep = Replica()
    run_steps(rep, 2_000, lambda _s: None)
    cfg = DivergenceSection(interval_steps=1, audit_every_checks=0)
    group = TorchGlooGroup.create(timeout_s=cfg.timeout_s)
    assert group is not None
    chk = DivergenceChecker(rep.digest, group, cfg, cache=rep.cache)
    chk.start()
    costs: dict[str, list[float]] = {"check": [], "all_reduce_2": [], "local": []}
    for _ in range(20):
        chk.check()
    for _ in range(200):
        group.all_reduce_max([0, 0])  # lines the ranks up before each sample
        t = time.perf_counter()
        result = chk.check()
        costs["check"].append(time.perf_counter() - t)
        assert result.status == "ok"
        group.all_reduce_max([0, 0])
        t = time.perf_counter()
        group.all_reduce_max([rank, -rank])
        costs["all_reduce_2"].append(time.perf_counter() - t)
        t = time.perf_counter()
        chk._vector(0, rep.digest.pool_digests(rep.cache))
        costs["local"].append(time.perf_counter() - t)
    report["cost_ms"] = {k: 1000 * sorted(v)[len(v) // 2] for k, v in costs.items()}

    # 7. a rank stops calling the checker (last: it leaves the group unusable)
    rep = Replica()
    chk = checker(rep, DivergenceSection(interval_steps=INTERVAL, timeout_s=TIMEOUT_S))
    if rank == last:
        run_steps(rep, 150, lambda _s: chk.on_step())
        report["timeout"] = {"stopped_at": chk.step}
    else:
        failed: list[Any] = []

        def watch(_step: int) -> None:
            r = chk.on_step()
            if r is not None and r.status == "failed":
                failed.append(r)

        run_steps(rep, 300, watch)
        report["timeout"] = {
            "status": failed[0].status if failed else None,
            "step": failed[0].step if failed else None,
            "duration_s": failed[0].duration_s if failed else None,
            "event": failed[0].event if failed else None,
            "steps_completed": chk.step,
            "stats": _stats(chk),
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, default=str))
    # Every rank keeps its connections open until all have reported (the stalled
    # one too, without calling the checker): a rank leaving early would close them
    # under a peer still waiting, an error rather than the timeout under test.
    deadline = time.monotonic() + TIMEOUT_S + 60
    everyone = [out_dir / f"rank{r}.json" for r in range(size)]
    while time.monotonic() < deadline and not all(p.exists() for p in everyone):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown: the timed-out group cannot be joined cleanly


def _stats(chk: Any) -> dict[str, Any]:  # pragma: no cover - worker side
    stats = chk.stats()
    data = {f.name: getattr(stats, f.name) for f in fields(stats)}
    data["divergences_by_pool"] = dict(data["divergences_by_pool"])
    data["failures"] = stats.failures
    return data


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
