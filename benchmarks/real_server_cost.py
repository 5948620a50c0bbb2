"""The package's cost inside a real SGLang server (issue 13, item 4): not a timed test.

Two real CPU servers run side by side (``tests/real_server/harness.py``): one with the
package installed but not enabled, one with ``--enable-hicache-existence`` and every
default feature. The same stream of Mooncake trace requests goes through both in
alternating rounds (the order flips every round; a device flush before each round
so every round writes and loads back through L3 the same way). A test-only probe
(``tests/real_server/standins/hx_probes.py``, ``cost``) reports, per scheduler
process, the CPU time of the scheduler thread and the time spent inside the package
on that thread.

Reported per round and as medians: the scheduler's busy time (loop iterations that
ran a batch or processed a batch's result; the loop polls without sleeping in
between) for both servers, and the package's share of the enabled server's busy
time (``busy_share``: an upper bound, net of the timers' own cost). Also the
per-step hook's cost in a polling iteration and the share of all scheduler CPU,
polling included. Target (issue 31): the share of busy time at most 0.3%, the hook at
most 0.5 us per polling iteration. The server without the package has its upstream
existence cache timed too (``upstream.``): the package's share net of the cache it
replaces (paired by round) is what enabling it adds.

``--recorder`` compares instead two enabled servers, the trace recorder off and on
(``recorder.sample_rate`` from ``--recorder-rate``), in alternating rounds: the
recorder's own scheduler-thread time (its methods timed by the probe, net of the
timers) as a share of busy time, and the difference of the package's share between
the two servers. ``--recorder-toggle`` runs one enabled server whose recorder the
probe attaches and detaches between rounds (``HX_PROBE_RECORDER_TOGGLE``): the
package's share of busy time with and without it in the same process, round after
round (no server-to-server variance, no nested timers). Target: at most 0.05% of busy
time.

``--events`` compares two enabled servers, storage-tier KV events (issue 30) off and
on, side by side: each one's share of busy time and the difference (same target).

    python benchmarks/real_server_cost.py [--rounds 6] [--requests 40] [--json]
    python benchmarks/real_server_cost.py --recorder [--recorder-rate 0.02]
    python benchmarks/real_server_cost.py --recorder-toggle [--rounds 6]
    python benchmarks/real_server_cost.py --events [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "real_server"))

from harness import (  # noqa: E402
    Server,
    ServerSpec,
    TraceRequest,
    free_port,
    launch,
    trace_requests,
)


def read_cost(out_dir: Path) -> dict[str, Any]:
    """Sum over the server's scheduler processes (one without TP)."""
    total: dict[str, Any] = {
        "sched_cpu_ns": 0,
        "pkg_ns": 0,
        "pkg_calls": 0,
        "hook_ns": 0,
        # [iterations, thread ns, package ns, calls, nested calls]
        "busy": [0, 0, 0, 0, 0],
        # [iterations, thread ns, package ns, calls, hook ns, nested calls, in the hook]
        "poll": [0, 0, 0, 0, 0, 0, 0],
        "timer_ns": 0.0,
        "passthrough_ns": 0.0,
        "rec_busy": [0, 0],
        "rec_poll": [0, 0],
        "ctrl_busy": [0, 0],
        "ctrl_poll": [0, 0],
        "actrl_busy": [0, 0, 0],
        "actrl_poll": [0, 0, 0],
        "sctrl_busy": [0, 0],
        "sctrl_poll": [0, 0],
    }
    by_name: dict[str, list[int]] = {}
    files = sorted(out_dir.glob("cost-*.json"))
    if not files:
        raise RuntimeError(f"no cost probe output in {out_dir}")
    for f in files:
        rec = json.loads(f.read_text())
        for k in ("sched_cpu_ns", "pkg_ns", "pkg_calls", "hook_ns"):
            total[k] += int(rec[k])
        for k in (
            "busy",
            "poll",
            "rec_busy",
            "rec_poll",
            "ctrl_busy",
            "ctrl_poll",
            *_ACTRL,
            *_SCTRL,
        ):
            got = list(rec.get(k, ())) + [0] * len(total[k])  # older probes: fewer fields
            total[k] = [a + int(b) for a, b in zip(total[k], got)]
        total["timer_ns"] = max(total["timer_ns"], float(rec.get("timer_ns_per_call", 0.0)))
        total["passthrough_ns"] = max(
            total["passthrough_ns"], float(rec.get("passthrough_ns_per_call", 0.0))
        )
        for name, counts in rec.get("by_name", {}).items():
            # [ns, calls, (current iteration's ns, calls,) busy ns, calls, poll ns, calls]
            counts = [*counts[:2], *counts[4:8]] if len(counts) >= 8 else [*counts[:2], 0, 0, 0, 0]
            slot = by_name.setdefault(name, [0] * 6)
            for j, v in enumerate(counts):
                slot[j] += int(v)
    total["by_name"] = by_name
    # A probe with the per-site control records it even where no call ran one (cache
    # mode, whose top-level calls are the per-step and AROUND hooks).
    total["site"] = all("sctrl_busy" in json.loads(f.read_text()) for f in files)
    states = {json.loads(f.read_text()).get("recorder_on") for f in files}
    total["recorder_on"] = states.pop() if len(states) == 1 else None
    return total


#: The per-step hook's control's fields (``hx_probes._control``).
_CTRL = ("ctrl_busy", "ctrl_poll")
#: The AROUND control's fields (``hx_probes._around_control``).
_ACTRL = ("actrl_busy", "actrl_poll")
#: The per-site control's fields (``hx_probes._site_control``).
_SCTRL = ("sctrl_busy", "sctrl_poll")


def call_controls(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[int]]:
    """A round's AROUND and per-site control readings (none from a probe that
    records none)."""
    keys = [
        *(_ACTRL if any(after.get("actrl_busy", ())) else ()),
        *(_SCTRL if after["site"] else ()),
    ]
    return {k: [a - b for a, b in zip(after[k], before[k])] for k in keys}


def fresh_cost(out_dir: Path) -> dict[str, Any]:
    """A reading at least one probe period (0.5 s) after now."""
    stamp = time.time()
    while True:
        recs = [json.loads(f.read_text()) for f in out_dir.glob("cost-*.json")]
        if recs and all(r["t"] > stamp for r in recs):
            return read_cost(out_dir)
        time.sleep(0.1)


def one_round(
    srv: Server, out_dir: Path, stream: list[TraceRequest], recorder: bool | None = None
) -> dict[str, Any]:
    srv.flush_cache()
    srv.wait_writes_settled(quiet_s=1.0)
    before = fresh_cost(out_dir)
    if recorder is not None:  # --recorder-toggle: wait until the probe has switched it
        deadline = time.monotonic() + 120
        while before.get("recorder_on") is not recorder:
            if time.monotonic() > deadline:
                raise RuntimeError("the probe did not switch the recorder")
            time.sleep(0.2)
            before = fresh_cost(out_dir)
    t0 = time.perf_counter()
    for r in stream:
        srv.generate(r.input_ids, r.output_length)
    wall = time.perf_counter() - t0
    srv.wait_writes_settled(quiet_s=1.0)
    after = fresh_cost(out_dir)
    return {
        "wall_s": wall,
        "sched_cpu_ms": (after["sched_cpu_ns"] - before["sched_cpu_ns"]) / 1e6,
        "pkg_ms": (after["pkg_ns"] - before["pkg_ns"]) / 1e6,
        "pkg_calls": after["pkg_calls"] - before["pkg_calls"],
        # [iterations, thread ns, package ns, package calls(, hook ns)] of this round
        "busy": [a - b for a, b in zip(after["busy"], before["busy"])],
        "poll": [a - b for a, b in zip(after["poll"], before["poll"])],
        "rec_busy": [a - b for a, b in zip(after["rec_busy"], before["rec_busy"])],
        "rec_poll": [a - b for a, b in zip(after["rec_poll"], before["rec_poll"])],
        # [thread ns, calls] of the empty hook timed beside the per-step hook
        "ctrl_busy": [a - b for a, b in zip(after["ctrl_busy"], before["ctrl_busy"])],
        "ctrl_poll": [a - b for a, b in zip(after["ctrl_poll"], before["ctrl_poll"])],
        # [thread ns, calls, real AROUND hook calls] of the empty AROUND hook
        **call_controls(before, after),
        "timer_ns_per_call": after["timer_ns"],
        "passthrough_ns_per_call": after["passthrough_ns"],
        "by_name_ms": {
            name: round((counts[0] - before["by_name"].get(name, [0])[0]) / 1e6, 3)
            for name, counts in after["by_name"].items()
        },
        "by_name_split": by_name_split(before, after),
    }


def by_name_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[int]]:
    """Per function, this round's ``[busy ns, busy calls, poll ns, poll calls]``
    (top-level calls, timers included) in the iterations that ran a batch and in
    the polling ones."""
    out: dict[str, list[int]] = {}
    for name, counts in after["by_name"].items():
        prev = before["by_name"].get(name, [0] * 6)
        diff = [a - b for a, b in zip(counts[2:6], prev[2:6])]
        if any(diff):
            out[name] = diff
    return out


def breakdown(recs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per function, medians over ``recs`` (rounds) of the busy and poll time per
    round (ms, net of the timers: calls x the timer's own cost) and the calls per
    round, the costliest first: where the package's time goes."""
    med = statistics.median
    names = sorted({n for r in recs for n in r.get("by_name_split", {})})
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        cols = [r.get("by_name_split", {}).get(name, [0, 0, 0, 0]) for r in recs]
        timer = [r["timer_ns_per_call"] for r in recs]
        rows[name] = {
            "busy_ms": round(med(max(0.0, c[0] - c[1] * t) for c, t in zip(cols, timer)) / 1e6, 3),
            "busy_calls": med(c[1] for c in cols),
            "poll_ms": round(med(max(0.0, c[2] - c[3] * t) for c, t in zip(cols, timer)) / 1e6, 3),
            "poll_calls": med(c[3] for c in cols),
        }
    return dict(sorted(rows.items(), key=lambda kv: -(kv[1]["busy_ms"] + kv[1]["poll_ms"])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-blocks", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--recorder",
        action="store_true",
        help="compare two enabled servers, the trace recorder off and on",
    )
    ap.add_argument("--recorder-rate", type=float, default=0.02)
    ap.add_argument(
        "--recorder-toggle",
        action="store_true",
        help="one enabled server, its recorder attached and detached in alternating rounds",
    )
    ap.add_argument(
        "--no-recorder-probe",
        action="store_true",
        help="--recorder without timing the recorder's calls (no nested timers: the "
        "recorder's cost is then only the difference of the package's share)",
    )
    ap.add_argument(
        "--events",
        action="store_true",
        help="compare two enabled servers, storage-tier KV events (events.enabled, the "
        "package's own publisher on a free port) off and on",
    )
    ap.add_argument(
        "--inner",
        action="store_true",
        help="also time the per-step hook's due work (HX_PROBE_COST_INNER: the step's "
        "due path, the metrics flush, cache mode's ack reaping) in the breakdown",
    )
    ap.add_argument(
        "--detail",
        action="store_true",
        help="also time the write accounting's methods inside the hooks (HX_PROBE_COST_DETAIL: "
        "a breakdown; each nested timer adds its cold cost to the totals)",
    )
    args = ap.parse_args(argv)

    stream = trace_requests(limit=args.requests, max_blocks=args.max_blocks, max_new_tokens=4)
    if args.recorder_toggle:
        return run_toggle(args, stream)
    names = (
        ("recorder_off", "recorder_on")
        if args.recorder
        else ("events_off", "events_on")
        if args.events
        else ("disabled", "enabled")
    )
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hx-cost-")))
        servers: dict[str, tuple[Server, Path]] = {}
        for name in names:
            probe_dir = root / f"{name}-probe"
            probe_dir.mkdir()
            env = {"HX_PROBE_COST_DIR": str(probe_dir)}
            if args.inner:
                env["HX_PROBE_COST_INNER"] = "1"
            if args.detail:
                env["HX_PROBE_COST_DETAIL"] = "1"
            config = None
            if name == "recorder_on":
                if not args.no_recorder_probe:
                    env["HX_PROBE_RECORDER"] = "1"
                config = {
                    "recorder": {
                        "enabled": True,
                        "path": str(root / "trace"),
                        "sample_rate": args.recorder_rate,
                    }
                }
            if name == "events_on":
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                config = {"events": {"enabled": True, "endpoint": endpoint}}
            spec = ServerSpec(existence=name != "disabled", env=env, config=config)
            srv = stack.enter_context(launch(spec, root / name))
            servers[name] = (srv, probe_dir)
        for i in range(args.rounds):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                srv, probe_dir = servers[name]
                rec = one_round(srv, probe_dir, stream)
                rounds[name].append(rec)
                busy = busy_share(rec)
                if not args.json:
                    print(
                        f"round {i} {name:8s} scheduler cpu {rec['sched_cpu_ms']:8.1f} ms"
                        f"  busy {busy['busy_ms']:7.1f} ms ({busy['busy_iterations']} it)"
                        f"  package {busy['package_busy_ms']:6.2f} ms ({100 * busy['share']:.2f}%)"
                        f"  wall {rec['wall_s']:.2f} s"
                        + (
                            f"  recorder {1e3 * recorder_share(rec)['recorder_busy_ms']:.1f} us"
                            f" ({100 * recorder_share(rec)['share']:.3f}%)"
                            if name == "recorder_on" and not args.no_recorder_probe
                            else ""
                        ),
                        flush=True,
                    )
    result = (
        summarize_recorder(rounds, args)
        if args.recorder
        else summarize_pair(rounds, args)
        if args.events
        else summarize(rounds, args)
    )
    return report(rounds, result, args)


def report(rounds: Any, result: dict[str, Any], args: Any) -> int:
    """Print the summary (or every round and the summary as JSON)."""
    if args.json:
        print(json.dumps({"rounds": rounds, "summary": result}, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


def busy_share(r: dict[str, Any]) -> dict[str, float]:
    """The package's share of one round's busy scheduler time (thread CPU).

    Busy time is the scheduler loop's iterations that ran a batch or processed a
    batch's result. The package's time counted against it: everything it did in
    those iterations, plus what it did for requests in the other (poll)
    iterations (write acknowledgements, admissions), net of the timers' own cost;
    the per-step hook's bare cost in poll iterations is idle time and is reported
    apart. An upper bound: upstream's own work in those poll iterations is not in
    the busy time the package's work there is divided by.  Also net of the probe's
    wrappers around nested calls (a timed method calling another passes through its
    wrapper inside the interval), at their hot start-up calibration, which
    under-subtracts."""
    timer = r["timer_ns_per_call"]
    through = r.get("passthrough_ns_per_call", 0.0)
    it_b, ns_b, pkg_b, calls_b, *more_b = r["busy"]
    it_p, ns_p, pkg_p, calls_p, hook_p, *more_p = r["poll"]
    nested_b = more_b[0] if more_b else 0
    nested_p, nested_hook = (more_p[0], more_p[1]) if len(more_p) >= 2 else (0, 0)
    busy_pkg = max(0.0, pkg_b - calls_b * timer - nested_b * through)
    poll_work = max(
        0.0,
        (pkg_p - hook_p) - max(0, calls_p - it_p) * timer - (nested_p - nested_hook) * through,
    )
    poll_hook = max(0.0, hook_p - it_p * timer - nested_hook * through)
    # The same net of the in-situ control (an empty hook timed beside each call of
    # the per-step hook, in the same cold state): the timers' cost there, not the
    # start-up calibration's, which runs hot.
    ctrl_ns, ctrl_calls = r.get("ctrl_poll", [0, 0])
    poll_hook_insitu = hook_p - ctrl_ns * (it_p / ctrl_calls) if ctrl_calls else None
    # The share with every timed call net of the in-situ control of its kind of
    # iteration (busy or polling) instead of the start-up calibration.
    ctrl_b_ns, ctrl_b_calls = r.get("ctrl_busy", [0, 0])
    share_insitu = None
    if ctrl_calls and ctrl_b_calls and ns_b:
        timer_b, timer_p = ctrl_b_ns / ctrl_b_calls, ctrl_ns / ctrl_calls
        busy_in = pkg_b - calls_b * timer_b - nested_b * through
        poll_in = (
            (pkg_p - hook_p) - max(0, calls_p - it_p) * timer_p - (nested_p - nested_hook) * through
        )
        share_insitu = max(0.0, busy_in + max(0.0, poll_in)) / ns_b
    # And net of the AROUND control too (probes that record it): an empty AROUND
    # hook timed with every real one (beside it in earlier probes, nested with it
    # around the same upstream call now); what it records beyond the empty function's
    # control is the pause's cost, counted in every AROUND hook's time.
    a_b, a_p = r.get("actrl_busy"), r.get("actrl_poll")
    share_around = around_b = None
    if share_insitu is not None and a_b and a_p and a_b[1] and ctrl_b_calls:
        around_b = max(0.0, a_b[0] / a_b[1] - ctrl_b_ns / ctrl_b_calls)
        around_p = max(0.0, a_p[0] / a_p[1] - ctrl_ns / ctrl_calls) if a_p[1] else around_b
        busy_a = busy_in - a_b[2] * around_b
        poll_a = poll_in - a_p[2] * around_p
        share_around = max(0.0, busy_a + max(0.0, poll_a)) / ns_b
    # And every timed call net of a control at its own call site (probes that record
    # it): the per-step hook's, each AROUND hook's and every other call's (methods,
    # AFTER hooks: ``sctrl``), each run beside the call it stands for; what is left is
    # the calls' own time, with no timer calibration (nested calls' wrappers are still
    # netted at theirs).
    s_b, s_p = r.get("sctrl_busy"), r.get("sctrl_poll")
    share_site = site_b = uncontrolled = None
    if s_b is not None and ctrl_b_calls:
        a_b, a_p = a_b or [0, 0, 0], a_p or [0, 0, 0]
        around_mean_b = a_b[0] / a_b[1] if a_b[1] else 0.0
        around_mean_p = a_p[0] / a_p[1] if a_p[1] else around_mean_b
        busy_s = pkg_b - nested_b * through - ctrl_b_ns - a_b[2] * around_mean_b - s_b[0]
        poll_s = (
            (pkg_p - hook_p)
            - (nested_p - nested_hook) * through
            - a_p[2] * around_mean_p
            - (s_p[0] if s_p else 0)
        )
        share_site = max(0.0, busy_s + max(0.0, poll_s)) / ns_b
        site_b = s_b[0] / s_b[1] if s_b[1] else None
        # Every top-level call has one control beside it: none left over.
        uncontrolled = (calls_b - ctrl_b_calls - a_b[2] - s_b[1]) + (
            max(0, calls_p - ctrl_calls) - a_p[2] - (s_p[1] if s_p else 0)
        )
    return {
        "busy_iterations": it_b,
        "busy_ms": ns_b / 1e6,
        "package_busy_ms": (busy_pkg + poll_work) / 1e6,
        "share": (busy_pkg + poll_work) / ns_b if ns_b else 0.0,
        "poll_iterations": it_p,
        "poll_ms": ns_p / 1e6,
        "poll_us_per_iteration": ns_p / it_p / 1e3 if it_p else 0.0,
        "hook_us_per_poll_iteration": poll_hook / it_p / 1e3 if it_p else 0.0,
        "hook_us_per_poll_iteration_insitu": (
            (poll_hook_insitu - nested_hook * through) / it_p / 1e3
            if it_p and poll_hook_insitu is not None
            else None
        ),
        "nested_calls": nested_b + nested_p,
        "timer_us_insitu_poll": ctrl_ns / ctrl_calls / 1e3 if ctrl_calls else None,
        "timer_us_insitu_busy": ctrl_b_ns / ctrl_b_calls / 1e3 if ctrl_b_calls else None,
        "share_insitu": share_insitu,
        "share_insitu_around": share_around,
        "around_extra_us_insitu_busy": around_b / 1e3 if around_b is not None else None,
        "share_insitu_site": share_site,
        "timer_us_site_busy": site_b / 1e3 if site_b is not None else None,
        "site_uncontrolled_calls": uncontrolled,
    }


def insitu_summary(be: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures net of the in-situ timer control (probes that record it: an empty
    hook timed beside every per-step hook call, in the iteration's own cold state),
    beside those net of the start-up calibration, which runs hot and so leaves part
    of the timers' cost in every timed call."""
    med = statistics.median
    if not be or any(x["share_insitu"] is None for x in be):
        return {}
    return {
        "package_share_of_busy_insitu_timer_median": (
            f"{100 * med(x['share_insitu'] for x in be):.2f}%"
        ),
        "hook_us_per_poll_iteration_insitu_median": round(
            med(x["hook_us_per_poll_iteration_insitu"] for x in be), 3
        ),
        "timer_us_insitu_poll_median": round(med(x["timer_us_insitu_poll"] for x in be), 3),
        "timer_us_insitu_busy_median": round(med(x["timer_us_insitu_busy"] for x in be), 3),
        **(
            {}
            if any(x.get("share_insitu_around") is None for x in be)
            else {
                "package_share_of_busy_insitu_around_median": (
                    f"{100 * med(x['share_insitu_around'] for x in be):.2f}%"
                ),
                "around_extra_us_insitu_busy_median": round(
                    med(x["around_extra_us_insitu_busy"] for x in be), 3
                ),
            }
        ),
        **(
            {}
            if any(x.get("share_insitu_site") is None for x in be)
            else {
                "package_share_of_busy_insitu_site_median": (
                    f"{100 * med(x['share_insitu_site'] for x in be):.2f}%"
                ),
                "package_share_of_busy_insitu_site_max": (
                    f"{100 * max(x['share_insitu_site'] for x in be):.2f}%"
                ),
                **(
                    {}
                    if any(x["timer_us_site_busy"] is None for x in be)
                    else {
                        "timer_us_site_busy_median": round(
                            med(x["timer_us_site_busy"] for x in be), 3
                        )
                    }
                ),
                "site_uncontrolled_calls_max": max(x["site_uncontrolled_calls"] for x in be),
            }
        ),
    }


def run_toggle(args: Any, stream: list[TraceRequest]) -> int:
    """``--recorder-toggle``: one server, the recorder on and off in alternating rounds."""
    rounds: dict[str, list[dict[str, Any]]] = {"recorder_on": [], "recorder_off": []}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hx-cost-")))
        probe_dir = root / "probe"
        probe_dir.mkdir()
        toggle = root / "recorder-on"
        env = {"HX_PROBE_COST_DIR": str(probe_dir), "HX_PROBE_RECORDER_TOGGLE": str(toggle)}
        config = {
            "recorder": {
                "enabled": True,
                "path": str(root / "trace"),
                "sample_rate": args.recorder_rate,
            }
        }
        srv = stack.enter_context(launch(ServerSpec(env=env, config=config), root / "server"))
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for on in order:
                if on:
                    toggle.touch()
                else:
                    toggle.unlink(missing_ok=True)
                rec = one_round(srv, probe_dir, stream, recorder=on)
                name = "recorder_on" if on else "recorder_off"
                rounds[name].append(rec)
                busy = busy_share(rec)
                if not args.json:
                    print(
                        f"round {i} {name:12s} busy {busy['busy_ms']:7.1f} ms "
                        f"({busy['busy_iterations']} it)  package {busy['package_busy_ms']:6.2f} ms"
                        f" ({100 * busy['share']:.3f}%)  wall {rec['wall_s']:.2f} s",
                        flush=True,
                    )
    on = [busy_share(r) for r in rounds["recorder_on"][1:]]
    off = [busy_share(r) for r in rounds["recorder_off"][1:]]
    med = statistics.median
    paired = [a["share"] - b["share"] for a, b in zip(on, off)]
    paired_ms = [a["package_busy_ms"] - b["package_busy_ms"] for a, b in zip(on, off)]
    result = {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "recorder_rate": args.recorder_rate,
        "busy_ms_median_recorder_on": round(med(x["busy_ms"] for x in on), 1),
        "busy_ms_median_recorder_off": round(med(x["busy_ms"] for x in off), 1),
        "package_ms_median_recorder_on": round(med(x["package_busy_ms"] for x in on), 3),
        "package_ms_median_recorder_off": round(med(x["package_busy_ms"] for x in off), 3),
        "package_share_of_busy_median_recorder_on": f"{100 * med(x['share'] for x in on):.3f}%",
        "package_share_of_busy_median_recorder_off": f"{100 * med(x['share'] for x in off):.3f}%",
        "recorder_share_of_busy_paired_median": f"{100 * med(paired):.3f}%",
        "recorder_share_of_busy_paired": [f"{100 * d:.3f}%" for d in paired],
        "recorder_ms_per_round_paired_median": round(med(paired_ms), 3),
        "target": "recorder_share_of_busy <= 0.05% (issue 31)",
    }
    if all(x["share_insitu_site"] is not None for x in (*on, *off)):
        # The same pairs, every timed call net of the control beside it: the timers'
        # own cost, which moves with each call's cold state, out of both sides.
        site = [a["share_insitu_site"] - b["share_insitu_site"] for a, b in zip(on, off)]
        result["recorder_share_of_busy_paired_median_insitu_site"] = f"{100 * med(site):.3f}%"
        result["recorder_share_of_busy_paired_insitu_site"] = [f"{100 * d:.3f}%" for d in site]
    return report(rounds, result, args)


def recorder_share(r: dict[str, Any]) -> dict[str, float]:
    """The recorder's own scheduler-thread time in one round: its methods in busy
    iterations and in the poll iterations (acks, admissions done there), net of its
    timers, as a share of the round's busy time."""
    timer = r["timer_ns_per_call"]
    ns_b = r["busy"][1]
    own = sum(max(0.0, ns - calls * timer) for ns, calls in (r["rec_busy"], r["rec_poll"]))
    return {
        "recorder_busy_ms": own / 1e6,
        "share": own / ns_b if ns_b else 0.0,
        "recorder_calls": float(r["rec_busy"][1] + r["rec_poll"][1]),
    }


def summarize_recorder(rounds: dict[str, list[dict[str, Any]]], args: Any) -> dict[str, Any]:
    """``--recorder``: the recorder's share of busy time, directly and as the
    difference of the package's share between the two servers (round 0 left out)."""
    on = rounds["recorder_on"][1:]
    off = rounds["recorder_off"][1:]
    med = statistics.median
    direct = [recorder_share(r) for r in on]
    pkg_on = [busy_share(r)["share"] for r in on]
    pkg_off = [busy_share(r)["share"] for r in off]
    out: dict[str, Any] = {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "recorder_rate": args.recorder_rate,
        "recorder_probe": not args.no_recorder_probe,
        "busy_ms_median_recorder_on": round(med(busy_share(r)["busy_ms"] for r in on), 1),
        "busy_ms_median_recorder_off": round(med(busy_share(r)["busy_ms"] for r in off), 1),
        "package_share_of_busy_median_recorder_on": f"{100 * med(pkg_on):.3f}%",
        "package_share_of_busy_median_recorder_off": f"{100 * med(pkg_off):.3f}%",
        "package_share_difference_median": f"{100 * (med(pkg_on) - med(pkg_off)):.3f}%",
        "timer_ns_per_call": round(on[-1]["timer_ns_per_call"]),
        "target": "recorder_share_of_busy <= 0.05% (issue 31)",
    }
    if not args.no_recorder_probe:
        out.update(
            {
                "recorder_calls_per_round_median": med(d["recorder_calls"] for d in direct),
                "recorder_ms_per_round_median": round(
                    med(d["recorder_busy_ms"] for d in direct), 3
                ),
                "recorder_share_of_busy_median": f"{100 * med(d['share'] for d in direct):.3f}%",
                "recorder_share_of_busy_max": f"{100 * max(d['share'] for d in direct):.3f}%",
            }
        )
    return out


def summarize_pair(rounds: dict[str, list[dict[str, Any]]], args: Any) -> dict[str, Any]:
    """``--events``: the package's share of busy time and the hook per polling
    iteration of each enabled server, side by side, and the difference of the
    shares' medians (what the feature costs)."""
    med = statistics.median
    out: dict[str, Any] = {"requests_per_round": args.requests, "rounds": args.rounds}
    shares: dict[str, float] = {}
    for name, recs in rounds.items():
        be = [busy_share(r) for r in recs[1:]]
        shares[name] = med(x["share"] for x in be)
        out[name] = {
            "busy_ms_median": round(med(x["busy_ms"] for x in be), 1),
            "package_busy_ms_median": round(med(x["package_busy_ms"] for x in be), 2),
            "package_share_of_busy_median": f"{100 * shares[name]:.2f}%",
            "package_share_of_busy_max": f"{100 * max(x['share'] for x in be):.2f}%",
            "hook_us_per_poll_iteration_median": round(
                med(x["hook_us_per_poll_iteration"] for x in be), 3
            ),
            **insitu_summary(be),
            "package_ms_by_function_per_round": breakdown(recs[1:]),
        }
    off, on = shares.values()
    out["feature_share_of_busy"] = f"{100 * (on - off):.3f}%"
    out["target"] = "feature_share_of_busy <= 0.05% (issue 31, opt-in features)"
    return out


def replaced_ms(r: dict[str, Any]) -> float:
    """Upstream's own existence cache in one round of the server without the
    package (the probe's ``upstream.`` functions), busy and polling iterations, net
    of the timers: the work the package's cache replaces, which the package's share
    counts whole (its cache answers the same calls from the same sites)."""
    timer = r["timer_ns_per_call"]
    ns = 0.0
    for name, (b_ns, b_calls, p_ns, p_calls) in r.get("by_name_split", {}).items():
        if name.startswith("upstream."):
            ns += max(0.0, b_ns - b_calls * timer) + max(0.0, p_ns - p_calls * timer)
    return ns / 1e6


def summarize(rounds: dict[str, list[dict[str, Any]]], args: Any) -> dict[str, Any]:
    # Round 0 warms both servers up (first compilation of every shape): left out.
    d = [r["sched_cpu_ms"] for r in rounds["disabled"][1:]]
    e = [r["sched_cpu_ms"] for r in rounds["enabled"][1:]]
    bd = [busy_share(r)["busy_ms"] for r in rounds["disabled"][1:]]
    be = [busy_share(r) for r in rounds["enabled"][1:]]
    pkg = [r["pkg_ms"] for r in rounds["enabled"][1:]]
    # The timers' own share: calls x what one timed empty call records.
    net = [
        max(0.0, r["pkg_ms"] - r["pkg_calls"] * r["timer_ns_per_call"] / 1e6)
        for r in rounds["enabled"][1:]
    ]
    net_shares = [p / c for p, c in zip(net, e) if c > 0]
    names: dict[str, float] = {}
    for r in rounds["enabled"][1:]:
        for name, ms in r["by_name_ms"].items():
            names[name] = names.get(name, 0.0) + ms
    shares = [b["share"] for b in be]
    # Paired by round (the same stream through both servers): what enabling the
    # package adds over the cache it replaces.
    replaced = [replaced_ms(r) for r in rounds["disabled"][1:]]
    net_of_replaced = [
        (b["package_busy_ms"] - u) / b["busy_ms"] for b, u in zip(be, replaced) if b["busy_ms"]
    ]
    med = statistics.median
    upstream = {
        name: row
        for name, row in breakdown(rounds["disabled"][1:]).items()
        if name.startswith("upstream.")
    }
    return {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "busy_ms_median_disabled": round(med(bd), 1),
        "busy_ms_median_enabled": round(med(x["busy_ms"] for x in be), 1),
        "busy_iterations_median_enabled": med(x["busy_iterations"] for x in be),
        "package_busy_ms_median": round(med(x["package_busy_ms"] for x in be), 2),
        "package_share_of_busy_median": f"{100 * med(shares):.2f}%",
        "package_share_of_busy_max": f"{100 * max(shares):.2f}%",
        "replaced_cache_ms_median_disabled": round(med(replaced), 2),
        "package_share_of_busy_net_of_replaced_cache_median": (
            f"{100 * med(net_of_replaced):.2f}%" if net_of_replaced else "-"
        ),
        "package_share_of_busy_net_of_replaced_cache_max": (
            f"{100 * max(net_of_replaced):.2f}%" if net_of_replaced else "-"
        ),
        "poll_us_per_iteration_median": round(med(x["poll_us_per_iteration"] for x in be), 2),
        "hook_us_per_poll_iteration_median": round(
            med(x["hook_us_per_poll_iteration"] for x in be), 3
        ),
        **insitu_summary(be),
        "scheduler_cpu_ms_median_disabled": round(med(d), 1),
        "scheduler_cpu_ms_median_enabled": round(med(e), 1),
        "scheduler_cpu_ratio_enabled_over_disabled": round(med(e) / med(d), 3),
        "package_share_of_all_scheduler_cpu_net_of_timers_median": f"{100 * med(net_shares):.2f}%",
        "package_ms_median": round(med(pkg), 2),
        "timer_ns_per_call": round(rounds["enabled"][-1]["timer_ns_per_call"]),
        "passthrough_ns_per_nested_call": round(
            rounds["enabled"][-1].get("passthrough_ns_per_call", 0.0)
        ),
        "nested_calls_per_round_median": med(x["nested_calls"] for x in be),
        "package_ms_by_function_top5": dict(
            sorted(((k, round(v, 2)) for k, v in names.items()), key=lambda kv: -kv[1])[:5]
        ),
        "package_ms_by_function_per_round": breakdown(rounds["enabled"][1:]),
        "replaced_cache_ms_by_function_per_round": upstream,
        "target": "package_share_of_busy <= 0.3%, hook_us_per_poll_iteration <= 0.5 (issue 31)",
    }


if __name__ == "__main__":
    raise SystemExit(main())
