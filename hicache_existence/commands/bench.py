"""``hicache-existence bench``: the foundation benchmark, side by side."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

NAME = "bench"
HELP = "time the caches against the seed's code and upstream's, side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run, not figures)")
    parser.add_argument("--entries", type=int, help="cache size (default 524288)")
    parser.add_argument("--chain-pages", type=int, help="pages per chain (default 1024)")
    parser.add_argument("--rounds", type=int, help="timed rounds per comparison (default 15)")
    parser.add_argument(
        "--upstream-wheel",
        type=Path,
        help="an sglang wheel to take upstream's StorageExistenceCache from "
        "(default: an installed sglang, else a wheel cached by --fetch-upstream)",
    )
    parser.add_argument(
        "--fetch-upstream",
        action="store_true",
        help="download the newest sglang wheel (no dependencies) with pip if none is cached",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a target is not met or not measured"
    )


def _table(result: Any) -> str:
    lines = [
        f"{'scenario':44} {'baseline':>14} {'ns/page':>9} {'ours ns/page':>13} {'speedup':>8}",
        "-" * 92,
    ]
    for c in result.comparisons:
        lines.append(
            f"{c.scenario:44} {c.baseline.name:>14} {c.baseline.ns_per_page:9.1f} "
            f"{c.candidate.ns_per_page:13.1f} {c.speedup:7.2f}x"
        )
    for name, mem in result.memory.items():
        lines.append(
            f"{name:44} {'bytes/entry':>14} {mem['baseline_bytes']:9.1f} "
            f"{mem['ours_bytes']:13.1f} {mem['ratio']:7.2f}r"
        )
    lines.append("")
    lines.append("targets:")
    for v in result.verdicts:
        status = "met" if v["met"] else ("NOT MEASURED" if not v["measured"] else "NOT MET")
        values = ", ".join(f"{k or 'value'}={val:.3f}" for k, val in sorted(v["values"].items()))
        lines.append(f"  [{status:>12}] {v['target']:40} {v['metric']} {v['bound']:>8}  {values}")
    if result.upstream is None:
        lines.append(
            "  (upstream's class was not available: install sglang, pass --upstream-wheel, "
            "or run with --fetch-upstream)"
        )
    return "\n".join(lines)


def _as_json(result: Any) -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(result.config),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "upstream": result.upstream,
        "comparisons": [
            {
                "scenario": c.scenario,
                "baseline": dataclasses.asdict(c.baseline),
                "candidate": dataclasses.asdict(c.candidate),
                "speedup": c.speedup,
            }
            for c in result.comparisons
        ],
        "memory": result.memory,
        "targets": result.verdicts,
    }


def run(args: argparse.Namespace) -> int:
    from hicache_existence.bench import suites, upstream

    cfg = suites.QUICK if args.quick else suites.BenchConfig()
    overrides = {
        k: v
        for k, v in (
            ("entries", args.entries),
            ("chain_pages", args.chain_pages),
            ("rounds", args.rounds),
        )
        if v is not None
    }
    for key, value in overrides.items():
        if value < 1:
            print(f"error: --{key.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    cfg = dataclasses.replace(cfg, **overrides)
    wheel = args.upstream_wheel
    if wheel is not None and not wheel.is_file():
        print(f"error: --upstream-wheel {wheel}: no such file", file=sys.stderr)
        return 2
    if wheel is None and args.fetch_upstream and upstream.load_upstream() is None:
        wheel = upstream.fetch_wheel()
    up = upstream.load_upstream(wheel)

    def progress(msg: str) -> None:
        if not args.json:
            print(f"... {msg}", file=sys.stderr, flush=True)

    result = suites.run_foundation(cfg, up, progress)
    if args.json:
        print(json.dumps(_as_json(result), indent=2))
    else:
        print(_table(result))
    if args.check and not all(v["met"] for v in result.verdicts):
        return 1
    return 0
