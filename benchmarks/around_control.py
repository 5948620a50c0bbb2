"""How well the cost probe's AROUND control nets an AROUND hook's timers, in process.

The real-server probe (``tests/real_server/standins/hx_probes.py``) times an AROUND
hook with its timer paused during upstream's call, and nets each call at an empty
AROUND hook timed the same way (the AROUND control).  What the timers and frames
record after upstream returns depends on the state upstream leaves: a real upstream
call (a radix-tree insert, a storage write) leaves the caches cold.  This compares,
around an upstream that evicts the caches, the control run *beside* the hook (after
an empty upstream: the probe before issue 31's last change) with the control
*nested* with the hook around the same upstream call, inside it one call and outside
it the next (the probe now).  Hooks: an empty Python hook and an empty C call
(``operator.call``), whose true cost is about nothing, so their net figure is the
control's error; a small Python hook; the recorder's compiled bracket (when built).

    python benchmarks/around_control.py [--calls 2000] [--evict-mb 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "real_server" / "standins"))
import hx_probes  # noqa: E402  (test-only code beside the real-server stand-ins)


def _evicting(mb: int) -> Any:
    """An upstream call that leaves the caches cold (copies ``mb`` MB)."""
    src, dst = bytearray(mb << 20), bytearray(mb << 20)

    def upstream(*_: Any) -> None:
        dst[:] = src

    return upstream


def _beside(hook: Any, compiled: bool, upstream: Any, calls: int) -> tuple[float, float]:
    """The earlier arrangement: the control after an empty upstream, before the hook
    one call and after it the next.  Mean ns a call: the hook's own, the control's."""
    cost = hx_probes._COST
    control = hx_probes._around_control(compiled)
    account = hx_probes._accounter("around_control:beside")
    slot = cost.by_name["around_control:beside"]
    perf = time.thread_time_ns
    for i in range(calls):
        if i % 2 == 0:
            control()
        hx_probes._paused(perf, account, hook, upstream, (), {})
        if i % 2:
            control()
    return slot[0] / slot[1], cost.actrl_ns / cost.actrl_calls


def _nested(hook: Any, compiled: bool, upstream: Any, calls: int) -> tuple[float, float]:
    """The probe's arrangement, as it runs it (``_hook_timed``; a compiled hook's
    control a C call too).  Mean ns a call: the hook's own, the control's."""
    cost = hx_probes._COST
    timed = hx_probes._hook_timed(hook, "AROUND", "around_control:nested", compiled)
    for _ in range(calls):
        timed(upstream)
    slot = cost.by_name["hook:around_control:nested"]
    return slot[0] / slot[1], cost.actrl_ns / cost.actrl_calls


def _bracket(tap: Any, upstream: Any, calls: int) -> dict[str, Any]:
    """The recorder's compiled bracket around upstream, as the probe times the tree's
    bracketed insert (``_probe_cost_recorder_bracket``: nested), and the same timing
    with the control beside it."""
    import types

    cost = hx_probes._COST
    perf = time.thread_time_ns
    row: dict[str, Any] = {"hook": "recorder bracket (C)"}

    _reset()
    control = hx_probes._around_control(True)
    spent = [0]

    def paused_upstream() -> None:
        u0 = perf()
        try:
            upstream()
        finally:
            spent[0] += perf() - u0

    bracketed = tap.bracket(paused_upstream)
    own = 0
    for i in range(calls):
        if i % 2 == 0:
            control()
        spent[0] = 0
        t0 = perf()
        bracketed()
        own += max(0, perf() - t0 - spent[0] - int(cost.timer_ns))
        if i % 2:
            control()
    control_ns = cost.actrl_ns / cost.actrl_calls
    row["beside"] = {"own_ns": round(own / calls), "control_ns": round(control_ns)}

    _reset()
    recorder = types.SimpleNamespace(Recorder=type("Recorder", (), {"bracket": _tap_bracket(tap)}))
    hx_probes._probe_cost_recorder_bracket(recorder)
    timed = recorder.Recorder().bracket(upstream)
    for _ in range(calls):
        timed()
    slot = cost.by_name["hook:insert"]
    row["nested"] = {
        "own_ns": round(slot[0] / slot[1]),
        "control_ns": round(cost.actrl_ns / cost.actrl_calls),
    }
    for arrangement in ("beside", "nested"):
        r = row[arrangement]
        r["net_ns"] = r["own_ns"] - r["control_ns"]

    return row


def _tap_bracket(tap: Any) -> Any:
    def bracket(self: Any, insert: Any) -> Any:
        return tap.bracket(insert)

    return bracket


def _reset() -> None:
    cost = hx_probes._COST
    cost.main = threading.get_ident()
    cost.depth = 0
    cost.actrl_ns = cost.actrl_calls = cost.around_calls = 0
    cost.by_name.clear()
    cost.touched.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--evict-mb", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.calls < 2 or args.evict_mb < 1:
        parser.error("--calls must be >= 2 and --evict-mb >= 1")

    perf = time.thread_time_ns
    start = perf()
    for _ in range(20_000):
        perf()
    hx_probes._COST.timer_ns = (perf() - start) / 20_000
    upstream = _evicting(args.evict_mb)

    class _State:
        seen = 0

    state = _State()

    def empty_hook(original: Any) -> Any:
        return original()

    def small_hook(original: Any) -> Any:  # a few attribute reads and writes
        state.seen += 1
        try:
            return original()
        finally:
            state.seen -= 1

    hooks: list[tuple[str, Any, bool]] = [
        ("empty Python hook", empty_hook, False),
        ("empty C call (operator.call)", operator.call, True),
        ("small Python hook", small_hook, False),
    ]
    rows = []
    for label, hook, compiled in hooks:
        row: dict[str, Any] = {"hook": label}
        for arrangement, run in (("beside", _beside), ("nested", _nested)):
            _reset()
            own, control = run(hook, compiled, upstream, args.calls)
            row[arrangement] = {
                "own_ns": round(own),
                "control_ns": round(control),
                "net_ns": round(own) - round(control),
            }
        rows.append(row)
    try:
        from hicache_existence.accounting import _recorder
    except ImportError:  # not built: the Python hooks only
        pass
    else:
        tap = _recorder.Tap("05000000", 10**9, time.monotonic)
        rows.append(_bracket(tap, upstream, args.calls))
    out = {
        "calls": args.calls,
        "evict_mb": args.evict_mb,
        "timer_ns_per_call": round(hx_probes._COST.timer_ns),
        "hooks": rows,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"timer calibration {out['timer_ns_per_call']} ns; upstream copies {args.evict_mb} MB")
    for row in rows:
        b, n = row["beside"], row["nested"]
        print(
            f"{row['hook']:30s} net of the control beside it {b['net_ns']:6d} ns, "
            f"nested {n['net_ns']:6d} ns"
        )


if __name__ == "__main__":
    main()
