"""``hicache-existence reconcile-bench``: the ledger's round-trip costs, Lua vs pipeline.

Runs against ``--redis-url`` (a password in it is never printed) or, with
``--spawn``, a private redis-server started on a free loopback port in a temp
directory and stopped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

NAME = "reconcile-bench"
HELP = "measure the Redis ledger's leading_present round trips (Lua vs pipeline)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis-url", help="redis://, rediss:// or unix:// URL of a Redis")
    where.add_argument(
        "--spawn", action="store_true", help="start a private redis-server on 127.0.0.1"
    )
    parser.add_argument(
        "--pages", default="64,256,1024", help="chain sizes, comma separated (default 64,256,1024)"
    )
    parser.add_argument("--reps", type=int, default=50, help="calls per method and case")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _spawn(stack: contextlib.ExitStack) -> str:
    """A private redis-server's URL; ``stack`` stops it and removes its directory."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    workdir = stack.enter_context(
        tempfile.TemporaryDirectory(prefix="hicache-existence-redis-", ignore_cleanup_errors=True)
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stack.callback(proc.wait, 10)
    stack.callback(proc.kill)
    from hicache_existence.reconcile.measure import wait_ready

    url = f"redis://127.0.0.1:{port}/0"
    if not wait_ready(url, 10.0):
        raise SystemExit("the spawned redis-server did not answer PING")
    return url


def run(args: argparse.Namespace) -> int:
    from hicache_existence.config import ConfigError, redact_url
    from hicache_existence.reconcile import measure
    from hicache_existence.reconcile.ground_truth import GroundTruthError
    from hicache_existence.reconcile.redis_truth import validate_redis_url

    try:
        sizes = [int(x) for x in str(args.pages).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"--pages must be integers separated by commas, got {args.pages!r}"
        ) from None
    if not sizes or min(sizes) < 1 or args.reps < 1:
        raise SystemExit("--pages and --reps must be >= 1")
    import importlib.util

    if importlib.util.find_spec("redis") is None:  # before a redis-server is spawned
        raise SystemExit(
            "reconcile-bench needs the Redis client: pip install 'hicache-existence[redis]'"
        )
    with contextlib.ExitStack() as stack:
        if args.spawn:
            url = _spawn(stack)
        else:
            try:
                url = validate_redis_url(args.redis_url, "--redis-url")
            except ConfigError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        try:
            rows = measure.measure_reads(url, sizes, args.reps)
            writes: dict[str, Any] = {
                "record_stored_pages_per_s": measure.measure_writes(url),
                "record_stored_ttl_pages_per_s": measure.measure_writes(url, ttl_s=60.0),
                "ledger_bytes_per_page": measure.measure_memory(url),
                "ledger_bytes_per_page_ttl": measure.measure_memory(url, ttl_s=3600.0),
            }
        except GroundTruthError as exc:
            print(f"error: {redact_url(url)}: {exc.kind}: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"rows": [asdict(r) for r in rows], **writes}, indent=2))
        else:
            print(f"redis: {redact_url(url)}")
            print(measure.format_rows(rows))
            for k, v in writes.items():
                print(f"{k}: {v:,.0f}")
        return 0
