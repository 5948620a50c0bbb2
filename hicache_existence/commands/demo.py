"""``hicache-existence demo``: a simulated prefill server, end to end.

Replays a trace (a bundled Mooncake sample by default) through simulated TP ranks
(two gloo processes when torch is installed) that call the cache exactly where
SGLang's buffer-mode write path does, with metrics, TP-divergence checks, the
reconciler and the capacity advisor on, and serves the aggregated ``/metrics``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "demo"
HELP = "run a simulated prefill server end to end and serve /metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", type=Path, help="Mooncake or page JSONL trace (default: bundled)"
    )
    parser.add_argument(
        "--ranks", type=int, default=2, help="TP ranks (default 2; 1 without torch)"
    )
    parser.add_argument("--steps", type=int, default=0, help="scheduler steps (default: one pass)")
    parser.add_argument("--requests-per-step", type=int, default=4)
    parser.add_argument(
        "--steps-per-s", type=float, default=40.0, help="pace (0: as fast as possible)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="/metrics address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9464, help="/metrics port (0: any free port)")
    parser.add_argument("--cap", type=int, default=16384, help="existence-cache cap per pool")
    parser.add_argument("--l3-pages", type=int, default=12000, help="L3 shard capacity in pages")
    parser.add_argument(
        "--redis-url", default="", help="use a Redis ledger as the reconciler's ground truth"
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="loop over the trace until interrupted (for Prometheus/Grafana to scrape)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")


def _error(text: str) -> int:
    print(text, file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from hicache_existence.demo.run import DemoOptions, preflight, run_demo

    for name in ("ranks", "requests_per_step", "cap", "l3_pages"):
        if getattr(args, name) < 1:
            return _error(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.steps < 0 or args.steps_per_s < 0 or not 0 <= args.port <= 65535:
        return _error("error: --steps and --steps-per-s must be >= 0, --port within 0..65535")
    if args.trace is not None and not args.trace.is_file():
        return _error(f"error: --trace {args.trace}: no such file")
    flags: tuple[str, ...] = ("trace", "ranks", "steps", "requests_per_step", "steps_per_s")
    flags += ("host", "port", "cap", "l3_pages", "redis_url", "keep_running")
    opts = DemoOptions(
        **{name: getattr(args, name) for name in flags},
        progress=not args.no_progress,
        log_level=getattr(args, "log_level", None) or "",
        log_json=bool(getattr(args, "log_json", False)),
    )
    problem = preflight(opts)
    if problem is not None:
        return _error(problem)
    return run_demo(opts)
