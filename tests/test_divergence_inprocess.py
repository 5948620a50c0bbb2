"""The divergence checker over an in-process group (threads): fast tests of the same
code the gloo tests run across real processes."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from divergence_workload import FAULTS, Replica, run_steps

from hicache_existence.config import Config, DivergenceSection
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.replicas.digest import ReplicaDigest, SharedLruDigest, slot_of
from hicache_existence.replicas.divergence import (
    EVENT_CHECK_FAILED,
    EVENT_CONFIG_MISMATCH,
    EVENT_DETECTED,
    CheckGroup,
    CheckResult,
    DivergenceChecker,
    DivergenceConfigError,
    DivergenceError,
    DivergenceTimeoutError,
    GroupError,
    GroupTimeout,
    InProcessWorld,
)


@dataclass
class RankOutcome:
    results: list[CheckResult] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    replica: Replica | None = None
    checker: DivergenceChecker | None = None
    error_step: int = 0


def run_world(
    size: int,
    steps: int,
    configs: list[DivergenceSection] | DivergenceSection,
    *,
    fault: str | None = None,
    faulty_rank: int | None = None,
    inject_at: int | None = None,
    stop_rank: int | None = None,
    stop_at: int | None = None,
    timeout_s: float = 10.0,
) -> list[RankOutcome]:
    """Run ``size`` replicas in threads; each calls its checker after every step."""
    world = InProcessWorld(size, timeout_s=timeout_s)
    outcomes = [RankOutcome() for _ in range(size)]
    per_rank = configs if isinstance(configs, list) else [configs] * size

    def body(rank: int) -> None:
        out = outcomes[rank]
        replica = Replica()
        out.replica = replica
        checker = DivergenceChecker(
            replica.digest,
            world.group(rank),
            per_rank[rank],
            cache=replica.cache,
            on_event=out.events.append,
        )
        out.checker = checker

        def on_step(step: int) -> None:
            if stop_rank == rank and stop_at is not None and step >= stop_at:
                return
            result = checker.on_step()
            if result is not None:
                out.results.append(result)

        try:
            run_steps(replica, steps, on_step, inject_at, fault, faulty=(rank == faulty_rank))
        except BaseException as exc:  # recorded for the test to inspect
            out.error = exc
            out.error_step = checker.step

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a rank hung"
    return outcomes


def first_detection(out: RankOutcome) -> CheckResult | None:
    return next((r for r in out.results if r.status == "diverged"), None)


def test_identical_streams_never_alarm() -> None:
    """Four replicas applying the same stream for 3,000 steps (audits on) agree at every check."""
    cfg = DivergenceSection(interval_steps=10, audit_every_checks=3)
    outcomes = run_world(4, 3000, cfg)
    for out in outcomes:
        assert out.error is None
        assert [r.status for r in out.results] == ["ok"] * 300
        s = out.checker.stats()  # type: ignore[union-attr]
        assert (s.checks, s.divergences, s.failures, s.last_check_step) == (300, 0, 0, 3000)
        assert s.active
    # The workload really evicts, invalidates and tracks in-flight pages.
    kv = outcomes[0].replica.cache.pool("kv").stats()  # type: ignore[union-attr]
    assert kv.evictions > 0 and kv.invalidations > 0 and kv.inflight_released > 0


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_detected_within_one_interval(fault: str) -> None:
    """Each injected fault is reported by every rank at the first check after it,
    naming the faulty rank and the pool."""
    interval = 25
    inject_at = 111
    outcomes = run_world(
        3,
        300,
        DivergenceSection(interval_steps=interval),
        fault=fault,
        faulty_rank=2,
        inject_at=inject_at,
    )
    expected_pool = "probe" if fault == "touch_order" else "kv"
    for out in outcomes:
        assert out.error is None
        hit = first_detection(out)
        assert hit is not None, f"{fault} not detected"
        assert hit.step == 125 and hit.step - inject_at <= interval
        event = hit.event
        assert event is not None and event["event"] == EVENT_DETECTED
        assert event["diverged_ranks"] == [2] and event["reference_ranks"] == [0, 1]
        assert expected_pool in event["diverged_pools"]
        assert event["kinds"] == ["state"]
        assert all(r.status == "ok" for r in out.results if r.step < inject_at)


def test_touch_order_fault_changes_a_later_eviction() -> None:
    """The touch-order fault is a real divergence: the faulty rank evicted another page."""
    outcomes = run_world(
        2,
        50,
        DivergenceSection(interval_steps=50),
        fault="touch_order",
        faulty_rank=1,
        inject_at=10,
    )
    keys = [set(o.replica.cache.pool("probe").lru_keys()) for o in outcomes]  # type: ignore[union-attr]
    assert len(keys[0]) == len(keys[1]) == 2 and keys[0] != keys[1]


def test_log_policy_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    """``log`` records a structured error event (ranks, digests, sizes, step) and the
    counters, and keeps checking."""
    caplog.set_level(logging.ERROR, logger="hicache_existence.replicas.divergence")
    outcomes = run_world(
        2,
        100,
        DivergenceSection(interval_steps=20),
        fault="extra_add",
        faulty_rank=1,
        inject_at=30,
    )
    s = outcomes[0].checker.stats()  # type: ignore[union-attr]
    assert s.checks == 5 and s.divergences == 4 and s.heals == 0
    assert s.last_divergence_step == 100 and s.last_check_step == 100
    assert dict(s.divergences_by_pool) == {"kv": 4}
    detected = [
        {"event": r.hicache_event, **r.hicache_fields}  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "hicache_event", None) == EVENT_DETECTED
    ]
    assert len(detected) == 8  # 4 checks x 2 ranks
    first = min(detected, key=lambda e: e["step"])
    assert first["step"] == 40 and first["action"] == "logged"
    slot = str(slot_of("kv", 16))
    sizes = {tuple(r["ranks"]): r["slots"][slot]["entries"] for r in first["replicas"]}
    assert set(sizes) == {(0,), (1,)}
    assert all(len(r["digest"]) == 16 for r in first["replicas"])
    assert first["local"]["kv"]["entries"] == sizes[(first["rank"],)]


def test_heal_clears_affected_pools_on_every_rank_at_the_same_step() -> None:
    """``heal``: every rank clears the diverged pool at the detecting check, checks
    agree afterwards, and the misses that follow count as ``cleared``."""
    outcomes = run_world(
        3,
        200,
        DivergenceSection(interval_steps=20, policy="heal"),
        fault="extra_add",
        faulty_rank=0,
        inject_at=50,
    )
    for out in outcomes:
        statuses = {r.step: r.status for r in out.results}
        assert statuses[60] == "diverged"
        assert all(v == "ok" for k, v in statuses.items() if k != 60)
        s = out.checker.stats()  # type: ignore[union-attr]
        assert (s.divergences, s.heals) == (1, 1)
        kv = out.replica.cache.pool("kv").stats()  # type: ignore[union-attr]
        swa = out.replica.cache.pool("swa").stats()  # type: ignore[union-attr]
        assert kv.clears == 1 and swa.clears == 0
        assert kv.misses_by_reason["cleared"] > 0
        event = statuses and next(r.event for r in out.results if r.status == "diverged")
        assert event["action"] == "healed: cleared kv"  # type: ignore[index]


def test_heal_on_flat_cache_clears_everything() -> None:
    """``heal`` on the seed generation (one shared LRU) clears the whole cache and
    its digests, after which replicas agree."""
    world = InProcessWorld(2, timeout_s=10)
    results: dict[int, list[str]] = {}

    def body(rank: int) -> None:
        digest = SharedLruDigest()
        cache = FlatStorageExistenceCache(8, observer=digest)
        checker = DivergenceChecker(
            digest,
            world.group(rank),
            DivergenceSection(interval_steps=1, policy="heal"),
            cache=cache,
        )
        statuses = []
        for step in range(6):
            cache.add("kv", [f"{step:064x}"])
            cache.add("swa", [f"{step + 100:064x}"])
            if step == 2 and rank == 1:
                cache.add("kv", ["f" * 64])
            r = checker.on_step()
            statuses.append(r.status if r else "none")
            if step == 2:
                statuses.append(str(len(cache)))
        results[rank] = statuses

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = ["ok", "ok", "diverged", "0", "ok", "ok", "ok"]
    assert results[0] == expected and results[1] == expected


def test_abort_raises_on_every_rank() -> None:
    """``abort`` raises ``DivergenceError`` (with the event) on every rank at the check."""
    outcomes = run_world(
        2,
        100,
        DivergenceSection(interval_steps=10, policy="abort"),
        fault="missed_untrack",
        faulty_rank=1,
        inject_at=33,
    )
    for out in outcomes:
        assert isinstance(out.error, DivergenceError)
        assert out.error_step == 40
        assert out.error.event["diverged_ranks"] == [1]  # a 1:1 tie: rank 0 is the reference
        assert "diverged at step 40" in str(out.error)


@pytest.mark.parametrize(
    "field_name, value",
    [("interval_steps", 500), ("enabled", False), ("policy", "heal"), ("pool_slots", 8)],
)
def test_config_mismatch_disables_every_rank_at_start(field_name: str, value: object) -> None:
    """Ranks whose settings differ (interval, enabled, policy, slots) all stay
    inactive after the one start-up handshake, with an event; nothing hangs."""
    base = DivergenceSection(interval_steps=10)
    other = Config.from_mapping({"divergence": {field_name: value}}).divergence
    other = DivergenceSection(**{**base.__dict__, field_name: getattr(other, field_name)})
    outcomes = run_world(3, 60, [base, base, other], timeout_s=5)
    for out in outcomes:
        assert out.error is None and out.results == []
        s = out.checker.stats()  # type: ignore[union-attr]
        assert s.config_mismatches == 1 and not s.active and s.checks == 0
        events = [e for e in out.events if e["event"] == EVENT_CONFIG_MISMATCH]
        assert len(events) == 1 and field_name in events[0]["differing"]


def test_config_mismatch_raises_under_abort() -> None:
    """With ``abort``, a settings mismatch raises ``DivergenceConfigError`` at start."""
    a = DivergenceSection(interval_steps=10, policy="abort")
    b = DivergenceSection(interval_steps=20, policy="abort")
    outcomes = run_world(2, 5, [a, b])
    for out in outcomes:
        assert isinstance(out.error, DivergenceConfigError)
        assert "interval_steps" in out.error.event["differing"]


def test_all_disabled_does_one_handshake_and_nothing_else() -> None:
    """Disabled on every rank: one handshake, then no collectives and no checks."""
    outcomes = run_world(2, 50, DivergenceSection(enabled=False, interval_steps=5))
    for out in outcomes:
        s = out.checker.stats()  # type: ignore[union-attr]
        assert (s.active, s.checks, s.config_mismatches, s.steps) == (False, 0, 0, 50)


def test_rank_that_stops_checking_times_out_the_others_without_hanging() -> None:
    """A rank that stops calling the checker makes the others fail the next check
    with a timeout after ``timeout_s``, stop checking, and carry on."""
    t0 = time.monotonic()
    outcomes = run_world(
        3, 60, DivergenceSection(interval_steps=10), stop_rank=2, stop_at=15, timeout_s=1.0
    )
    elapsed = time.monotonic() - t0
    assert elapsed < 10
    for out in outcomes[:2]:
        assert out.error is None
        failed = [r for r in out.results if r.status == "failed"]
        assert len(failed) == 1 and failed[0].step == 20
        assert failed[0].event is not None and failed[0].event["timeout"] is True
        assert failed[0].event["event"] == EVENT_CHECK_FAILED
        assert "timed out" in failed[0].event["error"]
        s = out.checker.stats()  # type: ignore[union-attr]
        assert (s.active, s.timeouts, s.errors, s.failures, s.checks) == (False, 1, 0, 1, 1)
    assert outcomes[2].checker.stats().checks == 1  # type: ignore[union-attr]


def test_timeout_raises_under_abort() -> None:
    """With ``abort``, a check that times out raises ``DivergenceTimeoutError``."""
    outcomes = run_world(
        2,
        30,
        DivergenceSection(interval_steps=10, policy="abort"),
        stop_rank=1,
        stop_at=5,
        timeout_s=0.5,
    )
    assert isinstance(outcomes[0].error, DivergenceTimeoutError)
    assert outcomes[0].error_step == 10
    assert outcomes[0].error.event["timeout"] is True
    assert outcomes[1].error is None


def test_rank_whose_digest_fails_still_takes_part() -> None:
    """A rank whose digest computation raises still joins the collective, so the
    others report a ``digest_error`` instead of waiting for it."""

    class Broken(ReplicaDigest):
        def pool_digests(self, *args: object, **kwargs: object) -> Any:
            raise RuntimeError("boom")

    world = InProcessWorld(2, timeout_s=5)
    results: dict[int, CheckResult | None] = {}

    def body(rank: int) -> None:
        digest = Broken() if rank == 1 else ReplicaDigest()
        checker = DivergenceChecker(digest, world.group(rank), DivergenceSection(interval_steps=1))
        results[rank] = checker.on_step()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in (0, 1):
        r = results[rank]
        assert r is not None and r.status == "diverged"
        assert r.event is not None and "digest_error" in r.event["kinds"]


def test_a_world_of_one_counts_its_checks_without_a_digest_or_a_collective() -> None:
    """One rank has no other replica to differ from: its checks are ok at once and
    counted, and neither the digest nor the group is asked (a digest that raises
    and a group without collectives after the handshake show it)."""

    class Counting(ReplicaDigest):
        calls = 0

        def pool_digests(self, *args: Any, **kwargs: Any) -> Any:
            Counting.calls += 1
            raise RuntimeError("a world of one must not compute its digest")

    group = InProcessWorld(1, timeout_s=5).group(0)
    checker = DivergenceChecker(Counting(), group, DivergenceSection(interval_steps=3))
    assert checker.start()
    group.all_reduce_max = group.all_gather = None  # type: ignore[assignment,method-assign]
    results = [r for r in (checker.on_step() for _ in range(30)) if r is not None]
    assert [(r.step, r.status) for r in results] == [(s, "ok") for s in range(3, 31, 3)]
    s = checker.stats()
    assert (s.active, s.checks, s.failures, s.last_check_step) == (True, 10, 0, 30)
    assert Counting.calls == 0


def test_more_pools_than_slots_still_names_them() -> None:
    """Forty pools in four slots: the collectives stay fixed-size (a two-word
    all-reduce when healthy, a 3 + 3 x slots gather on divergence) and a divergence
    in one pool names the pools of its slot."""
    world = InProcessWorld(2, timeout_s=5)
    events: dict[int, dict[str, Any]] = {}
    sizes: list[tuple[str, int]] = []

    def body(rank: int) -> None:
        replica = Replica()
        group = world.group(rank)
        reduce, gather = group.all_reduce_max, group.all_gather

        def spy_reduce(values: Any) -> list[int]:
            sizes.append(("reduce", len(values)))
            return reduce(values)

        def spy_gather(values: Any) -> list[list[int]]:
            sizes.append(("gather", len(values)))
            return gather(values)

        group.all_reduce_max = spy_reduce  # type: ignore[method-assign]
        group.all_gather = spy_gather  # type: ignore[method-assign]
        checker = DivergenceChecker(
            replica.digest,
            group,
            DivergenceSection(interval_steps=1, pool_slots=4),
            cache=replica.cache,
        )
        for i in range(40):
            replica.cache.pool(f"pool{i}").add([f"{i:064x}"])
        assert checker.on_step() is not None  # handshake + a healthy check
        if rank == 1:
            replica.cache.pool("pool7").add(["e" * 64])
        r = checker.on_step()
        assert r is not None and r.event is not None
        events[rank] = r.event

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(set(sizes)) == [("gather", 3 + 3 * 4), ("reduce", 2), ("reduce", 14)]
    named = events[0]["diverged_pools"]
    assert "pool7" in named and all(slot_of(p, 4) == slot_of("pool7", 4) for p in named)
    assert events[0]["diverged_slots"] == [slot_of("pool7", 4)]


def test_single_member_group_checks_alone() -> None:
    """A group of one never diverges and counts its checks."""
    replica = Replica()
    checker = DivergenceChecker(
        replica.digest,
        InProcessWorld(1).group(0),
        DivergenceSection(interval_steps=3),
        cache=replica.cache,
    )
    run_steps(replica, 30, lambda _s: checker.on_step())
    s = checker.stats()
    assert (s.checks, s.divergences, s.active) == (10, 0, True)


def test_broken_event_sink_does_not_reach_the_scheduler() -> None:
    """An ``on_event`` sink that raises is swallowed; the check result still comes back."""

    def sink(_event: dict[str, Any]) -> None:
        raise RuntimeError("sink down")

    replica = Replica()
    checker = DivergenceChecker(
        replica.digest,
        InProcessWorld(1).group(0),
        DivergenceSection(interval_steps=1),
        cache=replica.cache,
        on_event=sink,
    )
    assert checker.on_step() is not None


def test_unexpected_group_error_does_not_reach_the_scheduler() -> None:
    """A group that raises something unexpected is logged, not raised (policy log)."""

    class Weird:
        rank, size, ranks, timeout_s = 0, 1, (0,), 1.0

        def all_reduce_max(self, values: Any) -> list[int]:
            raise ZeroDivisionError("bug")

        def all_gather(self, values: Any) -> list[list[int]]:
            raise ZeroDivisionError("bug")

    assert isinstance(Weird(), CheckGroup)
    checker = DivergenceChecker(ReplicaDigest(), Weird(), DivergenceSection(interval_steps=1))
    assert checker.on_step() is None
    assert checker.on_step() is None


def test_bad_arguments_are_named() -> None:
    """Bad constructor arguments raise errors naming the argument."""
    group = InProcessWorld(1).group(0)
    with pytest.raises(TypeError, match="digest"):
        DivergenceChecker("x", group)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group must provide"):
        DivergenceChecker(ReplicaDigest(), object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        DivergenceChecker(ReplicaDigest(), group, {"policy": "log"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache"):
        DivergenceChecker(ReplicaDigest(), group, DivergenceSection(policy="heal"))
    with pytest.raises(ValueError, match="size"):
        InProcessWorld(0)
    with pytest.raises(TypeError, match="size"):
        InProcessWorld(True)
    with pytest.raises(ValueError, match="timeout_s"):
        InProcessWorld(2, timeout_s=0)
    with pytest.raises(ValueError, match="rank"):
        InProcessWorld(2).group(2)


def test_in_process_group_errors_are_group_errors() -> None:
    """A member that never arrives turns into ``GroupTimeout`` for the waiting one."""
    group = InProcessWorld(2, timeout_s=0.2).group(0)
    with pytest.raises(GroupTimeout, match="timed out"):
        group.all_reduce_max([1])
    with pytest.raises(GroupError):
        group.all_gather([1])


@pytest.mark.parametrize(
    "data, match",
    [
        ({"timeout_s": 0}, "divergence.timeout_s"),
        ({"pool_slots": 0}, "divergence.pool_slots"),
        ({"pool_slots": 4096}, "divergence.pool_slots"),
        ({"interval_steps": 0}, "divergence.interval_steps"),
        ({"audit_every_checks": -1}, "divergence.audit_every_checks"),
        ({"policy": "panic"}, "divergence.policy"),
    ],
)
def test_divergence_settings_are_validated(data: dict[str, Any], match: str) -> None:
    """Out-of-range divergence settings raise ``ConfigError`` naming the key."""
    from hicache_existence.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        Config.from_mapping({"divergence": data})


def test_divergence_settings_from_the_environment() -> None:
    """``HICACHE_EXISTENCE_DIVERGENCE__*`` variables set the section."""
    cfg = Config.from_env(
        {
            "HICACHE_EXISTENCE_DIVERGENCE__POLICY": "heal",
            "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "500",
            "HICACHE_EXISTENCE_DIVERGENCE__TIMEOUT_S": "2.5",
        }
    ).divergence
    assert (cfg.policy, cfg.interval_steps, cfg.timeout_s) == ("heal", 500, 2.5)
    assert (cfg.audit_every_checks, cfg.pool_slots) == (100, 16)


def test_ranks_that_disagree_on_which_pools_exist_are_told_apart() -> None:
    """A hybrid model whose ranks disagree on the pools (rank 1 has a sliding-window
    pool rank 0 never created, with the same KV beliefs): every rank reports the
    divergence, the rank that has the pool names it and the other says which slot
    holds a pool it lacks; no rank raises (policy ``log``)."""
    world = InProcessWorld(2, timeout_s=5)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            replica = Replica()
            checker = DivergenceChecker(
                replica.digest,
                world.group(rank),
                DivergenceSection(interval_steps=1),
                cache=replica.cache,
            )
            replica.cache.pool("kv").add([f"{i:064x}" for i in range(8)])
            assert checker.on_step() is not None  # handshake + a healthy check
            if rank == 1:
                replica.cache.pool("swa").add(["5" * 64])
            results[rank] = checker.on_step()
        except BaseException as exc:  # the test fails below with it
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    events = {rank: results[rank].event for rank in (0, 1)}
    assert all(e is not None for e in events.values())
    assert events[1]["diverged_pools"] == ["swa"] and events[1]["unnamed_slots"] == []
    # rank 0 has no such pool: it cannot name it, and says which slot it is in
    assert events[0]["diverged_pools"] == []
    assert events[0]["unnamed_slots"] == [slot_of("swa", DivergenceSection().pool_slots)]
    assert events[0]["diverged_ranks"] == events[1]["diverged_ranks"] == [1]


def test_a_failure_that_is_not_a_timeout_counts_as_an_error() -> None:
    """A collective that fails otherwise (a peer's connection reset) counts in
    ``errors``, not ``timeouts``; ``failures`` is their sum, and the exported
    family's two labels are read from the two counters (neither can be seen to
    fall between two increments)."""
    from hicache_existence.exporters.features import _divergence

    class Echo:
        """Two members that always agree, until the peer goes."""

        rank, size, ranks, timeout_s = 0, 2, (0, 1), 1.0
        broken = False

        def all_reduce_max(self, values: Any) -> list[int]:
            if self.broken:
                raise GroupError("all_reduce failed: Connection reset by peer")
            return list(values)

        def all_gather(self, values: Any) -> list[list[int]]:
            return [list(values), list(values)]

    group = Echo()
    checker = DivergenceChecker(ReplicaDigest(), group, DivergenceSection(interval_steps=2))
    results = [checker.on_step() for _ in range(4)]
    assert [r.status for r in results if r is not None] == ["ok", "ok"]
    group.broken = True
    failed = [r for r in (checker.on_step() for _ in range(2)) if r is not None]
    assert [r.status for r in failed] == ["failed"]
    s = checker.stats()
    assert (s.active, s.timeouts, s.errors, s.failures) == (False, 0, 1, 1)
    assert _divergence(s)["failures"] == {("timeout",): 0.0, ("error",): 1.0}
