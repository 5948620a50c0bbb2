"""Present a sweep: a text table, a JSON document and a PNG plot.

Files are written atomically (a temporary file in the same directory, then a
rename), so an interrupted or failed run never leaves a half-written report.
The plot needs matplotlib (the ``plot`` extra); without it the table and JSON are
still produced and the caller is told why there is no plot.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_existence.replay.sweep import SweepResult, format_cap

if TYPE_CHECKING:
    from hicache_existence.replay.fleet import FleetResult

JSON_SCHEMA = "hicache-existence-replay/1"
NO_MATPLOTLIB = (
    "matplotlib is not installed, so no plot was written "
    "(pip install 'hicache-existence[plot]'); the table and JSON are complete"
)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def format_table(result: SweepResult) -> str:
    """The sweep as aligned text tables (belief-only, then the model)."""
    out: list[str] = [
        f"trace {result.source}: {result.requests:,} requests, "
        f"{result.references:,} page references (page size {result.page_size} tokens)",
    ]
    for pool, curve in result.curves.items():
        ceiling = 1 - curve.cold / max(curve.references, 1)
        head = (
            f"{'cap':>7} {'hit ratio':>9} {'writes':>11} {'redundant':>11} "
            f"{'avoided':>11} {'evictions':>11} {'MiB':>7}"
        )
        out += [
            "",
            f"belief-only, pool {pool}: {curve.references:,} references, "
            f"{curve.distinct:,} distinct pages, ceiling {ceiling:.4f}",
            head,
            "-" * len(head),
        ]
        for row in result.belief_rows(pool):
            mark = "  <- current cap" if row["cap"] == result.current_cap else ""
            out.append(
                f"{format_cap(row['cap']):>7} {row['belief_hit_ratio']:9.4f} "
                f"{row['writes_issued']:11,} {row['redundant_writes']:11,} "
                f"{row['writes_avoided']:11,} {row['evictions']:11,} "
                f"{_mib(row['memory_bytes']):>7}{mark}"
            )
    cfg = result.config
    if result.model_rows and cfg:
        head = (
            f"{'cap':>7} {'hit ratio':>9} {'writes':>11} {'redundant':>10} {'avoided':>11} "
            f"{'stale':>8} {'dropped':>8} {'evictions':>11} {'healed':>8} {'MiB':>7}"
        )
        out += [
            "",
            f"buffer-mode write path (device {cfg.device_pages:,} pages, L3 "
            f"{'unbounded' if not cfg.l3_pages else f'{cfg.l3_pages:,} pages'}, "
            f"ack latency {cfg.ack_latency_ms:g} ms, prefetch threshold "
            f"{cfg.prefetch_threshold_tokens} tokens, healing {'on' if cfg.heal else 'off'})",
            head,
            "-" * len(head),
        ]
        for r in result.model_rows:
            mark = "  <- current cap" if r.cap == result.current_cap else ""
            out.append(
                f"{format_cap(r.cap):>7} {r.belief_hit_ratio:9.4f} {r.writes_issued:11,} "
                f"{r.redundant_writes:10,} {r.writes_avoided:11,} {r.stale_skips:8,} "
                f"{r.dropped_writes:8,} {r.evictions:11,} {r.heal_invalidations:8,} "
                f"{_mib(r.memory_bytes):>7}{mark}"
            )
    t = result.timings
    line = (
        f"belief-only pass: {t.get('mattson_s', 0):.2f} s "
        f"({t.get('mattson_refs_per_s', 0):,.0f} page refs/s)"
    )
    if "model_s" in t:
        line += (
            f"; model: {t['model_s']:.2f} s wall on {t['model_jobs']:.0f} processes "
            f"({t['model_refs_per_s_per_core']:,.0f} page refs/s per core)"
        )
    out += ["", line]
    return "\n".join(out)


def to_json(result: SweepResult) -> dict[str, Any]:
    """The sweep as a JSON-ready document (``schema`` names its layout)."""
    return {
        "schema": JSON_SCHEMA,
        "trace": {
            "source": result.source,
            "format": result.format,
            "requests": result.requests,
            "page_references": result.references,
            "page_size": result.page_size,
        },
        "model": result.model,
        "caps": list(result.caps),
        "current_cap": result.current_cap,
        "bytes_per_entry": result.bytes_per_entry,
        "model_config": asdict(result.config) if result.config else None,
        "belief_only": {
            pool: {
                "references": curve.references,
                "distinct_pages": curve.distinct,
                "cold_references": curve.cold,
                "rows": result.belief_rows(pool),
            }
            for pool, curve in result.curves.items()
        },
        "buffer_model": [r.as_dict() for r in result.model_rows] or None,
        "timings": result.timings,
        "python": platform.python_version(),
    }


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        # mkstemp creates 0600; give the report the permissions a plain open() would.
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_document(doc: dict[str, Any], path: Path) -> None:
    """``doc`` as indented JSON, atomically."""
    text = json.dumps(doc, indent=2) + "\n"
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(result: SweepResult, path: Path) -> None:
    write_document(to_json(result), path)


def _curve_points(result: SweepResult, pool: str) -> tuple[list[int], list[float]]:
    """The exact belief-only curve at ~96 log-spaced caps spanning the sweep."""
    curve = result.curves[pool]
    low = max(1, min(result.caps) // 2)
    high = max(max(result.caps) * 2, result.current_cap)
    xs: list[int] = []
    x = float(low)
    while x <= high:
        xs.append(int(x))
        x *= 2 ** (1 / 8)
    xs = sorted(set(xs))
    return xs, [curve.hit_ratio(c) for c in xs]


def write_plot(result: SweepResult, path: Path) -> str | None:
    """Hit ratio and redundant writes against cap, current cap marked.  Returns a
    message instead of writing when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return NO_MATPLOTLIB
    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log", base=2)
    # Every row of the sweep (belief-only and model) is at ``result.caps``.
    caps, model = result.caps, result.model_rows
    rows = {pool: result.belief_rows(pool) for pool in result.curves}
    for pool in result.curves:
        xs, ys = _curve_points(result, pool)
        ax.plot(xs, ys, "-", lw=1.8, label=f"belief-only hit ratio ({pool}, exact)")
        hits = [r["belief_hit_ratio"] for r in rows[pool]]
        ax.plot(caps, hits, "o", ms=4, color=ax.lines[-1].get_color())
    if model:
        hits = [r.belief_hit_ratio for r in model]
        ax.plot(caps, hits, "s--", ms=5, label="buffer model: admission hit ratio")
    ax.set_xlabel("existence-cache cap (entries per pool)")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    for pool, pool_rows in rows.items():
        redundant = [r["redundant_writes"] for r in pool_rows]
        label = f"belief-only: redundant writes ({pool})"
        ax2.plot(caps, redundant, "^:", color="tab:red", ms=5, label=label)
    if model:
        redundant = [r.redundant_writes for r in model]
        label = "buffer model: redundant writes"
        ax2.plot(caps, redundant, "v-.", color="tab:purple", ms=5, label=label)
    ax2.set_ylabel("redundant writes (pages, symlog)", color="tab:red")
    ax2.set_yscale("symlog", linthresh=10)
    ax2.set_ylim(bottom=0)
    ax.axvline(result.current_cap, color="black", ls="--", lw=1)
    ax.annotate(
        f"current cap {format_cap(result.current_cap)}",
        (result.current_cap, 0.03),
        rotation=90,
        ha="right",
        va="bottom",
        fontsize=8,
    )
    ticks = sorted(set(result.caps) | {result.current_cap})
    ax.set_xticks(ticks, [format_cap(c) for c in ticks])
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax.set_title(
        f"{Path(result.source).name}: hit ratio and redundant writes by cap "
        f"(page size {result.page_size})",
        fontsize=10,
    )
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return None


FLEET_JSON_SCHEMA = "hicache-existence-replay-fleet/1"


def format_fleet_table(results: Sequence[FleetResult], config: Any) -> str:
    """Fleet runs as one aligned table: writes, redundant writes, learning and
    ledger traffic per instance per second of trace time."""
    if not results:
        return "no fleet runs"
    first = results[0]
    l3 = f"{config.l3_pages:,} pages" if config.l3_pages else "unbounded"
    out = [
        f"fleet replay: {first.model.requests:,} requests over {first.span_s:,.0f} s of trace "
        f"time, cap {format_cap(first.cap)} per instance, device {config.device_pages:,} "
        f"pages per instance, L3 {l3}, ack latency {config.ack_latency_ms:g} ms",
        "",
        f"{'router':>15} {'learn':>6} {'N':>3} {'writes':>9} {'redundant':>9} {'red %':>6} "
        f"{'avoided':>9} {'learnt':>8} {'rec/s/i':>8} {'pages/s/i':>9} {'q/s/i':>7} "
        f"{'max red share':>13}",
    ]
    for r in results:
        m = r.model
        ops = r.ledger_ops_per_s_per_instance()
        share = max(r.redundant_share(), default=0.0)
        red = 100.0 * m.redundant_writes / m.writes_issued if m.writes_issued else 0.0
        out.append(
            f"{r.config.router:>15} {r.config.learn_rate:>6g} {r.config.instances:>3} "
            f"{m.writes_issued:>9,} {m.redundant_writes:>9,} {red:>6.2f} {m.writes_avoided:>9,} "
            f"{r.pages_learnt:>8,} {ops['record_calls']:>8.2f} {ops['record_pages']:>9.1f} "
            f"{ops['queries']:>7.3f} {share:>13.2f}"
        )
    out += [
        "",
        "rec/s/i: ledger record round trips per instance per second; pages/s/i: pages "
        "recorded; q/s/i: verification queries (learning); max red share: the largest "
        "instance's share of the fleet's redundant writes",
    ]
    return "\n".join(out)


def write_fleet_json(results: Sequence[FleetResult], config: Any, path: Path) -> None:
    """Every fleet run with its per-instance shares, atomically."""
    doc = {
        "schema": FLEET_JSON_SCHEMA,
        "model_config": asdict(config),
        "runs": [r.as_dict() for r in results],
        "environment": {"python": platform.python_version()},
    }
    write_document(doc, path)
