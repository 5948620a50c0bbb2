"""HiCache cache mode with ``cache_mode.dedup`` off and on, in real servers (issue 21,
item 5): not a timed test.

Two real CPU servers run side by side (``tests/real_server/harness.py``), both in
``--hicache-host-memory-mode cache`` over the file backend with
``--enable-hicache-existence``, one with ``cache_mode.dedup`` off and one with it on.
The same multi-turn conversation stream (``harness.conversation_requests``: 12
conversations of 8 turns, interleaved turn by turn) goes through both in
alternating rounds (the order flips every round), each round after
``/flush_cache`` (device and host memory emptied, L3 kept): the first round writes
L3, the later ones find the stream's prefixes there, load the long ones back and
compute (and write) the short ones again.  Two memory pressures: ``low`` (a
16,384-token device pool, host twice that: a round's conversations fit) and ``high``
(a 4,096-token device pool, host twice that: prefixes also leave host memory within
a round).

Reported per pressure and setting, summed over the rounds after the first (the
warm-up): L3 pages and bytes written (ours, and SGLang's own backed-up count),
redundant pages and their share of written, pages avoided, SGLang's prefetch hit
tokens, and the package's share of the scheduler's busy time (the test-only cost
probe of ``tests/real_server/standins/hx_probes.py``, read as
``benchmarks/real_server_cost.py`` does; target: at most 0.3%, issue 31).

    python benchmarks/cache_mode_dedup.py [--rounds 5] [--conversations 12] [--turns 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "real_server"))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import (  # noqa: E402
    Server,
    ServerSpec,
    conversation_requests,
    launch,
    settle,
    sglang_total,
)
from real_server_cost import (  # noqa: E402
    breakdown,
    busy_share,
    by_name_split,
    call_controls,
    fresh_cost,
    insitu_summary,
)

PAGE = 16
P = "hicache_existence_"
PRESSURES = {"low": 16384, "high": 4096}
COUNTERS = (
    "written_pages",
    "written_bytes",
    "redundant_written_pages",
    "redundant_written_bytes",
    "write_avoided_pages",
)


def counters(srv: Server) -> dict[str, float]:
    fams = srv.metrics()
    out = {name: fams[P + name].total("_total") for name in COUNTERS}
    out["sglang_backuped_pages"] = sglang_total(fams, "sglang:backuped_tokens") / PAGE
    out["prefetch_hit_tokens"] = sglang_total(fams, "sglang:storage_prefetch_hit_tokens")
    out["files"] = float(len(srv.l3_pages()))
    return out


def one_round(srv: Server, probe: Path, stream: list[Any]) -> dict[str, Any]:
    srv.flush_cache()
    srv.wait_writes_settled(quiet_s=1.0)
    before_cost = fresh_cost(probe)
    before = counters(srv)
    for turn in stream:
        srv.generate(turn.input_ids, max_new_tokens=2)
    srv.wait_writes_settled(quiet_s=1.0)
    after = settle(lambda: counters(srv), quiet_s=2.0)
    after_cost = fresh_cost(probe)
    rec: dict[str, Any] = {k: after[k] - before[k] for k in after}
    rec.update(
        busy=[a - b for a, b in zip(after_cost["busy"], before_cost["busy"])],
        poll=[a - b for a, b in zip(after_cost["poll"], before_cost["poll"])],
        ctrl_busy=[a - b for a, b in zip(after_cost["ctrl_busy"], before_cost["ctrl_busy"])],
        ctrl_poll=[a - b for a, b in zip(after_cost["ctrl_poll"], before_cost["ctrl_poll"])],
        **call_controls(before_cost, after_cost),
        timer_ns_per_call=after_cost["timer_ns"],
        passthrough_ns_per_call=after_cost["passthrough_ns"],
        by_name_split=by_name_split(before_cost, after_cost),
    )
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--pressures", default="low,high")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--inner", action="store_true", help="time the per-step hook's due work too")
    ap.add_argument(
        "--detail", action="store_true", help="time the write accounting's methods inside the hooks"
    )
    args = ap.parse_args(argv)

    results: dict[str, Any] = {}
    for pressure in args.pressures.split(","):
        rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        with ExitStack() as stack:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hx-dedup-")))
            servers: dict[str, tuple[Server, Path]] = {}
            for name, dedup in (("off", False), ("on", True)):
                probe = root / f"{name}-probe"
                probe.mkdir()
                spec = ServerSpec(
                    host_memory_mode="cache",
                    max_total_tokens=PRESSURES[pressure],
                    hicache_ratio=2.0,
                    config={"cache_mode": {"dedup": dedup}},
                    env={"HX_PROBE_COST_DIR": str(probe)}
                    | ({"HX_PROBE_COST_INNER": "1"} if args.inner else {})
                    # the cache's methods (nested in the hooks) timed only for a breakdown
                    | (
                        {"HX_PROBE_COST_DETAIL": "1"}
                        if args.detail
                        else {"HX_PROBE_COST_CACHE": "0"}
                    ),
                )
                servers[name] = (stack.enter_context(launch(spec, root / name)), probe)
            stream = conversation_requests(
                conversations=args.conversations,
                turns=args.turns,
                system_tokens=64,
                user_tokens=(16, 96),
                reply_tokens=(16, 64),
            )
            for i in range(args.rounds):
                for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    srv, probe = servers[name]
                    rec = one_round(srv, probe, stream)
                    rounds[name].append(rec)
                    if not args.json:
                        share = busy_share(rec)["share"]
                        print(
                            f"{pressure} round {i} dedup {name:3s}"
                            f" written {rec['written_pages']:6.0f}"
                            f" redundant {rec['redundant_written_pages']:5.0f}"
                            f" avoided {rec['write_avoided_pages']:5.0f}"
                            f" prefetch hit tokens {rec['prefetch_hit_tokens']:7.0f}"
                            f" package {100 * share:.2f}% of busy",
                            flush=True,
                        )
        results[pressure] = summarize(rounds)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for pressure, summary in results.items():
            print(f"== {pressure}")
            for k, v in summary.items():
                print(f"  {k}: {v}")
    return 0


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Totals over the rounds after the warm-up round, per setting."""
    out: dict[str, Any] = {}
    for name, recs in rounds.items():
        kept = recs[1:]
        total = {k: sum(r[k] for r in kept) for k in (*COUNTERS, "sglang_backuped_pages")}
        total["prefetch_hit_tokens"] = sum(r["prefetch_hit_tokens"] for r in kept)
        written = total["written_pages"]
        shares = [busy_share(r)["share"] for r in kept]
        out[name] = {
            "written_pages": int(written),
            "written_bytes": int(total["written_bytes"]),
            "sglang_backuped_pages": int(total["sglang_backuped_pages"]),
            "redundant_pages": int(total["redundant_written_pages"]),
            "redundant_share": f"{total['redundant_written_pages'] / written:.2%}"
            if written
            else "-",
            "avoided_pages": int(total["write_avoided_pages"]),
            "prefetch_hit_tokens": int(total["prefetch_hit_tokens"]),
            "package_share_of_busy_median": f"{100 * statistics.median(shares):.2f}%",
            "package_share_of_busy_max": f"{100 * max(shares):.2f}%",
            "hook_us_per_poll_iteration_median": round(
                statistics.median(busy_share(r)["hook_us_per_poll_iteration"] for r in kept), 3
            ),
            **insitu_summary([busy_share(r) for r in kept]),
            "package_ms_by_function_per_round": breakdown(kept),
        }
    out["target"] = "package_share_of_busy <= 0.3% (issue 31)"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
