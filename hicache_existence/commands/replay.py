"""``hicache-existence replay``: what would each existence-cache cap give on a trace?

The exact belief-only curve and (by default) the buffer-mode write-path model at
every cap, or fleet mode; a table, JSON and a PNG plot (docs/replay.md).  The trace
is fully validated first: a bad trace gives an error with its line number and no
output files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAME = "replay"
HELP = "replay a request trace and report hit ratio and writes for a sweep of caps"


def _checked(parse: str) -> Callable[[str], Any]:
    """``replay.sweep``'s ``parse`` (imported when a flag is read) as an argparse type."""

    def convert(text: str) -> Any:
        # The module (the package re-exports the function ``sweep`` under its name).
        sweep = importlib.import_module("hicache_existence.replay.sweep")

        try:
            return getattr(sweep, parse)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _listed(
    text: str, convert: Callable[[str], float], noun: str, bounds: str, ok: Callable[[float], bool]
) -> tuple[Any, ...]:
    """A comma-separated list of distinct values, sorted; an empty list is an error."""
    out: set[Any] = set()
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            value = convert(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {part!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{bounds}, got {part.strip()}")
        out.add(value)
    if not out:
        raise argparse.ArgumentTypeError(f"no {noun.split(' ', 1)[1]} given")
    return tuple(sorted(out))


def _counts(text: str) -> tuple[int, ...]:
    from hicache_existence.replay.fleet import MAX_INSTANCES

    bounds = f"instance counts must be 1..{MAX_INSTANCES}"
    return _listed(text, int, "an instance count", bounds, lambda v: 1 <= v <= MAX_INSTANCES)


def _rates(text: str) -> tuple[float, ...]:
    return _listed(text, float, "a rate", "rates must be within [0, 1]", lambda v: 0.0 <= v <= 1.0)


def _millis(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


#: The sizes of the trace and the model: (flag, smallest value, default, help).
_SIZES = (
    ("--page-size", 1, None, "tokens per page (default: a page trace's declared size, else 64)"),
    ("--block-tokens", 1, 512, "tokens per Mooncake hash id (default 512)"),
    ("--node-pages", 1, 8, "model node size for page traces (default 8)"),
    ("--device-pages", 0, 16384, "device prefix-cache capacity in pages (default 16384; 0: none)"),
    ("--l3-pages", 0, 0, "L3 capacity in pages (default 0: unbounded)"),
    ("--prefetch-threshold", 0, 256, "shortest device miss (tokens) that queries L3 (default 256)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        type=Path,
        metavar="TRACE",
        help="JSONL trace file (.jsonl or .jsonl.gz), or a recorder directory "
        "(recorder.path: its *.jsonl.gz files, read as one trace)",
    )
    parser.add_argument(
        "--format",
        choices=("auto", "mooncake", "pages"),
        default="auto",
        help="trace format (default: detected from the first line)",
    )
    parser.add_argument(
        "--model",
        choices=("buffer", "belief-only"),
        default="buffer",
        help="buffer: also replay the write path per cap (default); "
        "belief-only: only the exact one-pass curve",
    )
    parser.add_argument(
        "--caps",
        type=_checked("parse_caps"),
        help="caps to report, e.g. 16K..2M (doubling, the default) or 64K,512K,1M",
    )
    parser.add_argument(
        "--current-cap",
        type=_checked("parse_cap"),
        help="the cap marked as current (default 512K, upstream's)",
    )
    for flag, minimum, default, text in _SIZES:
        parser.add_argument(flag, type=_count(minimum), default=default, help=text)
    parser.add_argument(
        "--partial-pages",
        choices=("ceil", "floor"),
        default="ceil",
        help="pages of a request's partial last block: ceil (default) or "
        "floor (only full pages, as SGLang stores)",
    )
    parser.add_argument(
        "--ack-latency-ms",
        type=_millis,
        default=0.0,
        help="write launch to storage ack (default 0: before the next request)",
    )
    parser.add_argument(
        "--no-heal", action="store_true", help="do not heal beliefs from prefetch hit queries"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("replay-out"),
        help="directory for replay.json and replay.png (default ./replay-out)",
    )
    parser.add_argument("--json", type=Path, help="JSON path (default OUT/replay.json)")
    parser.add_argument("--plot", type=Path, help="PNG path (default OUT/replay.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    parser.add_argument(
        "--jobs", type=_count(1), help="processes for the model runs (default: the usable CPUs)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    fleet = parser.add_argument_group(
        "fleet mode", "N prefill instances behind a router sharing one L3 (docs/replay.md)"
    )
    fleet.add_argument(
        "--fleet",
        type=_counts,
        metavar="N[,N...]",
        help="replay as fleets of these instance counts (e.g. 1,2,4,8,16,32,64) instead "
        "of a cap sweep",
    )
    fleet.add_argument(
        "--router",
        choices=("round-robin", "prefix-affinity", "both"),
        default="both",
        help="how requests are spread over instances (default: both, one row each)",
    )
    fleet.add_argument(
        "--learn-rate",
        type=_rates,
        default=(0.0, 0.01),
        metavar="R[,R...]",
        help="ledger learning: fraction of lookups verified against the shared ledger "
        "(default 0,0.01: off, and the reconciler's default rate)",
    )
    fleet.add_argument(
        "--instance-cap",
        type=_checked("parse_cap"),
        help="existence-cache cap of every instance (default 512K)",
    )
    fleet.add_argument(
        "--affinity-pages",
        type=_count(1),
        default=8,
        help="leading pages that pick the instance under prefix-affinity (default 8)",
    )


def run(args: argparse.Namespace) -> int:
    from hicache_existence.replay import report
    from hicache_existence.replay.pages import DEFAULT_PAGE_SIZE, expand
    from hicache_existence.replay.sweep import DEFAULT_CAPS, DEFAULT_CURRENT_CAP, sweep, throttled
    from hicache_existence.replay.trace import TraceError, read_trace

    started = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"... [{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    current = args.current_cap or DEFAULT_CURRENT_CAP
    # The current cap always gets a row: it is the one the table and plot compare against.
    caps = tuple(sorted({*(args.caps or DEFAULT_CAPS), current}))
    json_path = args.json or args.out / ("fleet.json" if args.fleet else "replay.json")
    plot_path = None if args.no_plot or args.fleet else (args.plot or args.out / "replay.png")
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and (path.is_dir() or _blocked(path.parent)):
            print(f"error: {flag} {path}: not a writable file location", file=sys.stderr)
            return 2
    tick = throttled(progress)
    try:
        progress(f"reading {args.trace}")
        trace = read_trace(args.trace, args.format, block_tokens=args.block_tokens)
        for note in trace.notes:  # what was left out, said even with --quiet
            print(f"warning: {note}", file=sys.stderr)
        if trace.version >= 2:
            return _run_recorded(args, trace, caps, json_path, progress)
        page_size = args.page_size or trace.page_size or DEFAULT_PAGE_SIZE
        progress(f"expanding {len(trace.requests):,} requests to {page_size}-token pages")
        pages = expand(
            trace,
            page_size,
            partial_pages=args.partial_pages,
            node_pages=args.node_pages,
            progress=lambda done, total: tick(f"expanding: {done}/{total} requests"),
        )
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    expand_s = time.perf_counter() - started
    config = _model_config(args)
    if args.fleet:
        return _run_fleet(args, pages, config, json_path, progress)
    result = sweep(
        pages,
        caps,
        model=args.model,
        config=config,
        current_cap=current,
        jobs=args.jobs,
        progress=progress,
    )
    result.timings["read_and_expand_s"] = expand_s
    print(report.format_table(result))
    status = _written(json_path, lambda: report.write_json(result, json_path))
    if status or plot_path is None:
        return status
    return _written(plot_path, lambda: report.write_plot(result, plot_path))


def _model_config(args: argparse.Namespace, rate: float = 1.0) -> Any:
    """The flags' write-path model; sizes scaled by a recorded trace's sample rate."""
    from hicache_existence.replay.model import ModelConfig
    from hicache_existence.replay.recorded import scaled

    return ModelConfig(
        device_pages=scaled(args.device_pages, rate),
        l3_pages=scaled(args.l3_pages, rate),
        ack_latency_ms=args.ack_latency_ms,
        prefetch_threshold_tokens=round(args.prefetch_threshold * rate),
        heal=not args.no_heal,
    )


def _run_fleet(
    args: argparse.Namespace,
    pages: Any,
    config: Any,
    json_path: Path,
    progress: Callable[[str], None],
) -> int:
    from hicache_existence.replay import report
    from hicache_existence.replay.fleet import ROUTERS, FleetConfig, run_fleet
    from hicache_existence.replay.sweep import DEFAULT_CURRENT_CAP

    cap = args.instance_cap or DEFAULT_CURRENT_CAP
    routers = ROUTERS if args.router == "both" else (args.router,)
    results = []
    for router, rate, n in itertools.product(routers, args.learn_rate, args.fleet):
        fleet = FleetConfig(
            instances=n, router=router, learn_rate=rate, affinity_pages=args.affinity_pages
        )
        progress(f"fleet: {n} x cap {cap}, {router}, learn rate {rate:g}")
        results.append(run_fleet(pages, cap, config, fleet))
    print(report.format_fleet_table(results, config))
    return _written(json_path, lambda: report.write_fleet_json(results, config, json_path))


def _run_recorded(
    args: argparse.Namespace,
    trace: Any,
    caps: tuple[int, ...],
    json_path: Path,
    progress: Callable[[str], None],
) -> int:
    """A recorded (version 2) trace: the recorded stream's curves at every cap, then
    the buffer-mode model (or the fleet) on its requests, sizes scaled by the rate."""
    from hicache_existence.replay import report
    from hicache_existence.replay.pages import DEFAULT_PAGE_SIZE, expand
    from hicache_existence.replay.recorded import format_curves, recorded_curves, scaled, to_json
    from hicache_existence.replay.sweep import DEFAULT_CURRENT_CAP, format_cap, sweep

    rate = trace.sample_rate
    progress(f"recorded trace: {len(trace.events):,} events, sample rate {rate:g}")
    curves = recorded_curves(trace, caps)
    out: dict[str, Any] = {"recorded": to_json(trace, curves)}
    if not args.fleet:
        print(format_curves(curves, format_cap))
    page_size = args.page_size or trace.page_size or DEFAULT_PAGE_SIZE
    config = _model_config(args, rate)
    note = (
        ""
        if rate >= 1
        else f"(sizes scaled by the sample rate {rate:g}: caps, device and L3 pages, the prefetch "
        "threshold, node size and affinity prefix run as value x rate; the cap column shows "
        "the scaled cap; page counts and pages/s are of the sample: divide them by the rate)"
    )
    pages = expand(trace, page_size, node_pages=scaled(args.node_pages, rate) or 1)
    if not pages.requests:
        print("note: the trace has no request records (no insert walks): no model run")
    elif args.fleet:
        if note:
            print(note)
        args.instance_cap = scaled(args.instance_cap or DEFAULT_CURRENT_CAP, rate)
        # The router's key is a recorded page too: the prefix it stands for scales alike.
        args.affinity_pages = scaled(args.affinity_pages, rate)
        return _run_fleet(args, pages, config, json_path, progress)
    elif args.model == "buffer":
        current = scaled(args.current_cap or DEFAULT_CURRENT_CAP, rate)
        names = trace.instances or ("",)
        sweeps: dict[str, Any] = {}
        for index, name in enumerate(names):
            # Each instance has its own cache: its requests alone (TP replicas recorded
            # with ranks "all" would otherwise replay every request once per rank).  A
            # page trace expands request by request, in order.
            mine = tuple(p for p, r in zip(pages.requests, trace.requests) if r.instance == index)
            if not mine:
                continue
            result = sweep(
                dataclasses.replace(pages, requests=mine),
                [*(scaled(c, rate) for c in caps), current],
                model="buffer",
                config=config,
                current_cap=current,
                jobs=args.jobs,
                progress=progress,
            )
            print()
            if note:
                print(note)
            if len(names) > 1:
                print(f"instance {name}:")
            print(report.format_table(result))
            sweeps[name] = report.to_json(result)
        if len(names) > 1:
            out["sweeps"] = sweeps
        else:
            out["sweep"] = sweeps[names[0]]
    return _written(json_path, lambda: report.write_document(out, json_path))


def _written(path: Path, write: Callable[[], str | None]) -> int:
    """Run ``write`` (of ``path``): 0 and a line saying so (or the note it returns
    instead of writing), or 1 and the error."""
    try:
        problem = write()
    except OSError as exc:
        print(f"error: cannot write the report: {exc}", file=sys.stderr)
        return 1
    if problem:
        print(f"note: {problem}", file=sys.stderr)
    else:
        print(f"wrote {path}")
    return 0


def _blocked(directory: Path) -> bool:
    """Whether ``directory`` cannot be created or written (an ancestor is a file...)."""
    for parent in (directory, *directory.parents):
        if parent.exists():
            return not parent.is_dir() or not os.access(parent, os.W_OK)
    return False
