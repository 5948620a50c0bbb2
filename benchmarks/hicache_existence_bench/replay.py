"""Replay throughput in page references per second per core, side by side.

* **belief-only, one pass**: ``replay.mattson`` over the whole trace (every cap at
  once), against the obvious alternative: feeding the real ``PoolBeliefs`` once
  per cap (the same numbers, checked equal here, for one cap per pass);
* **expansion**: Mooncake blocks to chained SHA-256 page hashes;
* **buffer-mode model**: one run at one cap (the sweep runs one per cap, over cores).

Every figure is a median over rounds, timed with this thread's CPU clock so a
shared machine's other processes do not count; the garbage collector is off
while timing.  Target (issue #8): belief-only >= 500,000 page references/s/core.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.replay.mattson import belief_only_curves
from hicache_existence.replay.model import ModelConfig, run_model
from hicache_existence.replay.pages import PageTrace, expand
from hicache_existence.replay.synthetic import long_context_trace
from hicache_existence.replay.trace import Trace, read_trace

Progress = Callable[[str], None]
#: Issue #8: belief-only replay throughput per core.
TARGET_BELIEF_ONLY_REFS_PER_S = 500_000.0
#: The Mooncake trace in a source checkout (``tests/data/traces``, with its licence).
_REPO_TRACE = (
    Path(__file__).resolve().parents[2] / "tests/data/traces/mooncake_synthetic_trace.jsonl"
)
#: The sample the demo bundles (a slice of the same trace, with its licence).
_BUNDLED_SAMPLE = (
    Path(__file__).resolve().parents[2] / "hicache_existence/demo/data/mooncake_sample.jsonl"
)


def default_trace(progress: Progress = lambda _msg: None) -> Trace | PageTrace:
    """The trace the figures are taken on: ``$HICACHE_EXISTENCE_MOONCAKE_TRACE``, else the
    Mooncake trace of a source checkout (tests/data/traces), else the demo's bundled sample,
    else the synthetic long-context workload."""
    candidates = [
        os.environ.get("HICACHE_EXISTENCE_MOONCAKE_TRACE"),
        _REPO_TRACE,
        _BUNDLED_SAMPLE,
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            progress(f"trace: {candidate}")
            return read_trace(candidate)
    progress("trace: none found, using the synthetic long-context workload")
    return long_context_trace()


@dataclass(frozen=True)
class ReplayBenchConfig:
    """Sizes of the replay benchmark."""

    rounds: int = 5
    #: The cap of the per-cap comparisons (real cache, model).
    cap: int = 128 * 1024
    model_rounds: int = 3


QUICK = ReplayBenchConfig(rounds=2, model_rounds=1)


@dataclass
class ReplayBenchResult:
    """Throughput figures (page references per second of one core)."""

    config: ReplayBenchConfig
    references: int = 0
    figures: dict[str, float] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def target_met(self) -> bool:
        return self.figures.get("belief_only_refs_per_s", 0.0) >= TARGET_BELIEF_ONLY_REFS_PER_S

    @property
    def verdicts(self) -> list[dict[str, Any]]:
        """The issue's target in the ``bench`` command's verdict shape."""
        value = self.figures.get("belief_only_refs_per_s")
        return [
            {
                "target": "replay.belief_only",
                "metric": "page_refs_per_s_per_core",
                "bound": f">= {TARGET_BELIEF_ONLY_REFS_PER_S:.0f}",
                "values": {"": value} if value is not None else {},
                "measured": value is not None,
                "met": self.target_met,
            }
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "references": self.references,
            "figures": self.figures,
            "checks": self.checks,
            "targets": self.verdicts,
        }


def _cpu_median(fn: Callable[[], object], rounds: int) -> tuple[float, object]:
    samples = []
    out: object = None
    was_enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            gc.collect()
            gc.disable()
            start = time.thread_time()
            out = fn()
            samples.append(time.thread_time() - start)
            gc.enable()
    finally:
        if not was_enabled:
            gc.disable()
    return statistics.median(samples), out


def run_replay_bench(
    trace: Trace | PageTrace,
    cfg: ReplayBenchConfig | None = None,
    progress: Progress = lambda _msg: None,
) -> ReplayBenchResult:
    """Time expansion (for a block trace), the one-pass curve, the per-cap real cache and
    the model on ``trace`` (e.g. the Mooncake trace, or ``synthetic.long_context_trace()``)."""
    cfg = cfg or ReplayBenchConfig()
    result = ReplayBenchResult(cfg)
    if isinstance(trace, PageTrace):
        pages = trace
        expand_s = 0.0
    else:
        block_trace = trace
        progress("replay bench: expanding the trace to pages")
        expand_s, pages_out = _cpu_median(lambda: expand(block_trace), cfg.rounds)
        pages = pages_out if isinstance(pages_out, PageTrace) else expand(block_trace)
    refs = pages.references
    result.references = refs
    progress("replay bench: belief-only, one Mattson pass")
    mattson_s, curves_out = _cpu_median(lambda: belief_only_curves(pages), cfg.rounds)
    curves = curves_out if isinstance(curves_out, dict) else belief_only_curves(pages)

    def one_cap() -> int:
        pool = StorageExistenceCache(cfg.cap).pool("kv")
        for r in pages.requests:
            pool.add(r.pages)
        return pool.stats().refreshes

    progress(f"replay bench: belief-only with the real cache at one cap ({cfg.cap})")
    real_s, refreshes = _cpu_median(one_cap, cfg.rounds)
    progress(f"replay bench: buffer-mode model at one cap ({cfg.cap})")
    model_s, _ = _cpu_median(lambda: run_model(pages, cfg.cap, ModelConfig()), cfg.model_rounds)
    exact = sum(c.hits(cfg.cap) for c in curves.values())
    result.figures = {
        "expand_refs_per_s": refs / expand_s if expand_s else 0.0,
        "belief_only_refs_per_s": refs / mattson_s,
        "belief_only_with_expand_refs_per_s": refs / (mattson_s + expand_s),
        "real_cache_one_cap_refs_per_s": refs / real_s,
        "model_one_cap_refs_per_s": refs / model_s,
        "mattson_s": mattson_s,
        "expand_s": expand_s,
        "real_cache_one_cap_s": real_s,
        "model_one_cap_s": model_s,
    }
    result.checks = {
        "cap": cfg.cap,
        "real_cache_hits": refreshes,
        "mattson_hits": exact,
        "equal": refreshes == exact,
    }
    return result


def format_replay_bench(result: ReplayBenchResult) -> str:
    """The figures as text."""
    f = result.figures
    c = result.checks
    status = "met" if result.target_met else "NOT MET"
    return "\n".join(
        [
            f"replay throughput ({result.references:,} page references; thread CPU time, "
            "page refs/s per core):",
            f"  expansion to page hashes     {f['expand_refs_per_s']:>12,.0f}"
            + ("  (a page trace: nothing to expand)" if not f["expand_s"] else ""),
            f"  belief-only one pass (all caps) {f['belief_only_refs_per_s']:>9,.0f}  "
            f"[{status}: >= {TARGET_BELIEF_ONLY_REFS_PER_S:,.0f}]",
            f"  ... including expansion      {f['belief_only_with_expand_refs_per_s']:>12,.0f}",
            f"  real cache, one cap per pass {f['real_cache_one_cap_refs_per_s']:>12,.0f}  "
            f"(hits at {c['cap']}: real {c['real_cache_hits']:,}, Mattson "
            f"{c['mattson_hits']:,}, {'equal' if c['equal'] else 'DIFFERENT'})",
            f"  buffer-mode model, one cap   {f['model_one_cap_refs_per_s']:>12,.0f}",
        ]
    )


def run_for_cli(
    quick: bool = False, progress: Progress = lambda _msg: None
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """``(table, JSON record, verdicts)`` for ``hicache-existence bench --suite replay``."""
    result = run_replay_bench(default_trace(progress), QUICK if quick else None, progress)
    return format_replay_bench(result), result.as_dict(), result.verdicts
