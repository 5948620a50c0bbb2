"""The cost probe's hook timer (``tests/real_server/standins/hx_probes.py``), which
the cost benchmarks' figures rest on: an AROUND hook counts its own frames, not
upstream's call inside it, and the package's methods upstream calls in between
count as the top-level calls they are without the hook.  CPU time is measured, so
the test spins rather than sleeps, and compares with wide margins."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_server" / "standins"))
import hx_probes  # test-only code beside the real-server stand-ins


def _spin(ms: float) -> None:
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


@pytest.fixture
def cost() -> Any:
    c = hx_probes._COST
    saved = (c.main, c.ns, c.calls, c.depth, dict(c.by_name), c.timer_ns)
    c.main, c.ns, c.calls, c.depth, c.timer_ns = threading.get_ident(), 0, 0, 0, 0.0
    c.actrl_ns = c.actrl_calls = c.around_calls = c.sctrl_ns = c.sctrl_calls = 0
    yield c
    c.main, c.ns, c.calls, c.depth, by_name, c.timer_ns = saved
    c.actrl_ns = c.actrl_calls = c.around_calls = c.sctrl_ns = c.sctrl_calls = 0
    c.by_name.clear()
    c.by_name.update(by_name)
    c.touched.clear()


def test_an_around_hook_counts_its_own_time_not_upstreams(cost: Any) -> None:
    """2 ms of the hook's own work around 20 ms of upstream's: about 2 ms counted
    (fails if the pause is dropped: 22 ms), and the package method upstream calls
    (4 ms, timed as the probe times the cache's methods) counts once, top-level."""
    method = hx_probes._timed(lambda: _spin(4), "")

    def upstream(x: int) -> int:
        _spin(16)
        method()
        return x + 1

    def hook(original: Any, x: int) -> int:
        _spin(1)
        out = original(x)
        _spin(1)
        return int(out)

    timed = hx_probes._hook_timed(hook, "AROUND", "probe_test_around")
    assert timed(upstream, 1) == 2
    slot = cost.by_name["hook:probe_test_around"]
    assert slot[1] == 1
    assert 1.5e6 < slot[0] < 6e6, slot[0]
    assert cost.calls == 2  # the hook and the method inside upstream, each top-level
    assert 5e6 < cost.ns < 12e6, cost.ns
    assert cost.depth == 0


def test_an_after_hook_counts_whole_and_other_threads_not_at_all(cost: Any) -> None:
    timed = hx_probes._hook_timed(lambda result, x: _spin(3), "AFTER", "probe_test_after")
    timed(None, 1)
    slot = cost.by_name["hook:probe_test_after"]
    assert slot[1] == 1 and 2.5e6 < slot[0] < 9e6
    worker = threading.Thread(target=timed, args=(None, 1))
    worker.start()
    worker.join()
    assert slot[1] == 1  # not the scheduler thread: not counted


def _nesting() -> str:
    """Which of the real hook (``hook``) and the AROUND control's empty hook
    (``empty_hook``) is nearer the upstream call running this."""
    names = []
    frame = sys._getframe(1)
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return "control inside" if names.index("empty_hook") < names.index("hook") else "hook inside"


def test_every_around_call_nests_the_around_control_with_it(cost: Any) -> None:
    """Each timed AROUND call runs the empty AROUND control once, around the same
    upstream call: inside the hook one call, outside it the next (so each runs its
    tail cold after upstream as often as the other).  The control's time is its own,
    never the package's, and it records the pause's timers, not upstream inside it."""
    seen = []

    def upstream(x: int) -> int:
        seen.append(_nesting())
        return x + 1

    def hook(original: Any, x: int) -> int:
        _spin(1)
        return int(original(x))

    timed = hx_probes._hook_timed(hook, "AROUND", "probe_test_control")
    for _ in range(4):
        assert timed(upstream, 1) == 2
    assert seen == ["control inside", "hook inside"] * 2
    assert (cost.actrl_calls, cost.around_calls, cost.calls) == (4, 4, 4)
    assert 0 < cost.actrl_ns < 4 * 0.5e6, cost.actrl_ns  # far below the hooks' 4 ms
    assert 3.5e6 < cost.ns < 12e6, cost.ns
    assert cost.depth == 0


def test_the_share_nets_out_what_the_around_control_records() -> None:
    """``busy_share``: AROUND hook calls are net of what the AROUND control records
    beyond the empty function's control, per iteration kind; a probe without the
    AROUND control gives no such figure."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from real_server_cost import busy_share

    r: dict[str, Any] = {
        "timer_ns_per_call": 0.0,
        # 10 busy iterations, 1e9 ns, package 1e6 ns in 100 calls
        "busy": [10, 1_000_000_000, 1_000_000, 100, 0],
        "poll": [5, 1_000_000, 0, 5, 0, 0, 0],
        "ctrl_busy": [2_000, 10],  # 200 ns an empty function
        "ctrl_poll": [1_000, 5],
    }
    base = busy_share(r)
    assert base["share_insitu_around"] is None
    assert base["share_insitu"] == (1_000_000 - 100 * 200) / 1e9
    # The AROUND control: 1,200 ns a call, 1,000 more than the empty function; 20
    # real AROUND calls in busy iterations take 20,000 ns more off.
    r.update(actrl_busy=[12_000, 10, 20], actrl_poll=[0, 0, 0])
    got = busy_share(r)
    assert got["around_extra_us_insitu_busy"] == 1.0
    assert got["share_insitu_around"] == (1_000_000 - 100 * 200 - 20 * 1_000) / 1e9


def test_every_other_top_level_call_runs_the_site_control_beside_it(cost: Any) -> None:
    """A method or AFTER hook timed at top level runs the empty per-site control once
    (before it one call, after it the next), outside its own interval; a nested
    call, upstream's cache, the per-step hook (its own control) and an AROUND hook
    (the AROUND control) run none."""
    seen: list[tuple[Any, ...]] = []

    def method(x: int) -> int:
        _spin(1)
        seen.append((x, cost.sctrl_calls))
        return x + 1

    timed = hx_probes._timed(method)
    for i in range(4):
        assert timed(i) == i + 1
    # before the call, after it, before, after: what the method saw when it ran
    assert [n for _, n in seen] == [1, 1, 3, 3]
    assert (cost.sctrl_calls, cost.calls) == (4, 4)
    assert 0 < cost.sctrl_ns < 4 * 0.5e6, cost.sctrl_ns  # not the method's 4 ms
    assert 3.5e6 < cost.ns < 12e6, cost.ns

    outer = hx_probes._timed(lambda: timed(0))  # the inner call is nested: no control
    upstream = hx_probes._timed(lambda: None, "upstream.")

    def after_check_hicache_events() -> None:
        return None

    # as the integration names it (``hooks._HOOK``)
    after_check_hicache_events.__qualname__ = "after_check_hicache_events"
    step = hx_probes._timed(after_check_hicache_events)
    around = hx_probes._hook_timed(lambda original: original(), "AROUND", "probe_test_site")
    outer()
    upstream()
    step()
    around(lambda: None)
    assert cost.sctrl_calls == 5  # the outer call's only
    after = hx_probes._hook_timed(lambda result: _spin(1), "AFTER", "probe_test_site_after")
    after(None)
    after(None)
    assert cost.sctrl_calls == 7


def test_the_share_nets_every_call_at_the_control_beside_it() -> None:
    """``share_insitu_site``: the package's busy and polling-iteration time, each
    timed call net of its own kind of control (the per-step hook's, the AROUND
    hooks', the per-site one), with no calibration; every call has one beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from real_server_cost import busy_share

    r: dict[str, Any] = {
        "timer_ns_per_call": 100.0,
        # busy: 10 iterations, 1e9 ns, package 1e6 ns in 100 calls (10 of them the
        # per-step hook, 20 AROUND hooks, 70 others)
        "busy": [10, 1_000_000_000, 1_000_000, 100, 0],
        # poll: 5 iterations, package 60,000 ns in 9 calls (5 per-step hook calls,
        # 10,000 ns of them, 4 others), nothing nested
        "poll": [5, 1_000_000, 60_000, 9, 10_000, 0, 0],
        "ctrl_busy": [2_000, 10],
        "ctrl_poll": [1_000, 5],
        "actrl_busy": [30_000, 20, 20],
        "actrl_poll": [0, 0, 0],
    }
    assert busy_share(r)["share_insitu_site"] is None  # no per-site control recorded
    r.update(sctrl_busy=[140_000, 70], sctrl_poll=[8_000, 4])
    got = busy_share(r)
    busy = 1_000_000 - 2_000 - 30_000 - 140_000
    poll = 60_000 - 10_000 - 8_000
    assert got["share_insitu_site"] == (busy + poll) / 1e9
    assert got["timer_us_site_busy"] == 2.0
    assert got["site_uncontrolled_calls"] == 0
    r["busy"][3] = 103  # three calls with no control beside them
    assert busy_share(r)["site_uncontrolled_calls"] == 3
    # A probe with the control, where no call ran one (cache mode: the per-step and
    # AROUND hooks are all its top-level calls): the share is still net of theirs.
    r.update(
        busy=[10, 1_000_000_000, 1_000_000, 30, 0], poll=[5, 1_000_000, 10_000, 5, 10_000, 0, 0]
    )
    r.update(sctrl_busy=[0, 0], sctrl_poll=[0, 0])
    got = busy_share(r)
    assert got["share_insitu_site"] == (1_000_000 - 2_000 - 30_000) / 1e9
    assert got["timer_us_site_busy"] is None and got["site_uncontrolled_calls"] == 0


def test_the_recorder_bracket_counts_its_own_time_not_the_insert(cost: Any) -> None:
    """``Recorder.bracket`` as the probe times it (``hook:insert``, an AROUND hook):
    the bracket's own 1 ms counts, the insert's 8 ms does not, and a package method
    the insert calls counts once, top-level; the AROUND control runs beside it."""
    import types

    method = hx_probes._timed(lambda: _spin(2), "")

    class Recorder:
        def bracket(self, insert: Any) -> Any:
            def bracketed(*a: Any, **kw: Any) -> Any:
                _spin(1)
                return insert(*a, **kw)

            bracketed.hx_brackets = insert  # type: ignore[attr-defined]
            return bracketed

    def insert(x: int) -> int:
        _spin(6)
        method()
        return x + 1

    hx_probes._probe_cost_recorder_bracket(types.SimpleNamespace(Recorder=Recorder))
    bracketed = Recorder().bracket(insert)
    assert bracketed.hx_brackets.__name__ == "upstream"  # the paused insert
    assert bracketed(1) == 2
    slot = cost.by_name["hook:insert"]
    assert slot[1] == 1 and 0.5e6 < slot[0] < 4e6, slot[0]  # not the insert's 8 ms
    assert cost.calls == 2 and cost.around_calls == 1 and cost.actrl_calls == 1
    assert cost.depth == 0
    # The next call nests the control outside the bracket: the same counts again.
    assert bracketed(2) == 3
    assert slot[1] == 2 and 1e6 < slot[0] < 8e6, slot[0]
    assert cost.calls == 4 and cost.around_calls == 2 and cost.actrl_calls == 2
    assert 0 < cost.actrl_ns < 2 * 0.5e6, cost.actrl_ns  # not the insert's
    assert cost.depth == 0


def test_a_compiled_hook_s_control_calls_upstream_from_c(cost: Any) -> None:
    """The control beside the compiled recorder bracket runs a C call into upstream
    (``operator.call``), as the bracket does, not a Python hook frame."""
    control = hx_probes._around_control(compiled=True)
    control()
    control()
    assert cost.actrl_calls == 2 and cost.actrl_ns > 0 and cost.depth == 0


def test_the_around_control_benchmark_runs_both_arrangements() -> None:
    """``benchmarks/around_control.py`` (the evidence for nesting the control) runs
    every hook in both arrangements, the compiled bracket too where it is built; a
    run of four calls, for its shape only (its figures are measured, not tested)."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "around_control.py"
    done = subprocess.run(
        [sys.executable, str(script), "--calls", "4", "--evict-mb", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(done.stdout)
    hooks = [row["hook"] for row in out["hooks"]]
    assert hooks[:3] == ["empty Python hook", "empty C call (operator.call)", "small Python hook"]
    for row in out["hooks"]:
        for arrangement in ("beside", "nested"):
            r = row[arrangement]
            assert r["net_ns"] == r["own_ns"] - r["control_ns"] and r["control_ns"] > 0
    from hicache_existence.accounting import recorder

    if recorder.Tap is not recorder.PyTap:
        assert hooks[3:] == ["recorder bracket (C)"]
    bad = subprocess.run(
        [sys.executable, str(script), "--calls", "1"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--calls must be >= 2" in bad.stderr


def test_the_bracket_parts_benchmark_times_every_way() -> None:
    """``benchmarks/bracket_parts.py`` (where the insert bracket's time goes) times each
    way of calling insert against the direct call; a run of three calls, for its shape
    only (its figures are measured, not tested)."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bracket_parts.py"
    done = subprocess.run(
        [sys.executable, str(script), "--calls", "3", "--evict-mb", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(done.stdout)
    from hicache_existence.accounting import recorder

    bracket = "bracket (C)" if recorder.Tap is not recorder.PyTap else "bracket (PyTap)"
    assert list(out["extra_ns"]) == ["C into Python", bracket, "Python wrapper", "Python bracket"]
    assert out["calls"] == 3 and out["direct_ns"]["median"] > 0
    bad = subprocess.run(
        [sys.executable, str(script), "--calls", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--calls must be >= 1" in bad.stderr
