"""Run a trace at a set of caps: the exact belief-only curve, and the write-path model.

The belief-only figures for every cap come from one Mattson pass.  The model
needs one run per cap; runs are independent, so they are spread over processes
(``fork`` where available, so workers inherit the expanded trace instead of
receiving a copy; otherwise the trace is sent to each worker once).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Literal

from hicache_existence.replay.mattson import BeliefCurve, belief_only_curves
from hicache_existence.replay.model import ModelConfig, ModelResult, bytes_per_entry, run_model
from hicache_existence.replay.pages import PageTrace

ModelName = Literal["belief-only", "buffer"]
Progress = Callable[[str], None]

#: 16K .. 2M entries, doubling (upstream's cap is 512K).
DEFAULT_CAPS: tuple[int, ...] = tuple(1 << k for k in range(14, 22))
DEFAULT_CURRENT_CAP = 512 * 1024
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_CAP = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)
MAX_CAP = 1 << 40


def parse_cap(text: str) -> int:
    """``"512K"`` -> 524288 (K, M, G are powers of 1024)."""
    match = _CAP.match(text)
    if not match:
        raise ValueError(f"not a cap: {text!r} (use e.g. 65536, 64K or 2M)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if not 1 <= value <= MAX_CAP:
        raise ValueError(f"cap {text!r} must be within 1..{MAX_CAP}")
    return value


def parse_caps(text: str) -> tuple[int, ...]:
    """``"16K,64K,1M"`` or a doubling range ``"16K..2M"``; sorted, duplicates removed."""
    caps: set[int] = set()
    for part in text.split(","):
        if not part.strip():
            continue
        if ".." in part:
            low_text, _, high_text = part.partition("..")
            low, high = parse_cap(low_text), parse_cap(high_text)
            if low > high:
                raise ValueError(f"cap range {part.strip()!r} goes down")
            cap = low
            while cap <= high:
                caps.add(cap)
                cap *= 2
        else:
            caps.add(parse_cap(part))
    if not caps:
        raise ValueError("no caps given")
    if len(caps) > 256:
        raise ValueError(f"too many caps ({len(caps)}); at most 256")
    return tuple(sorted(caps))


def format_cap(cap: int) -> str:
    """524288 -> ``"512K"``; caps that are not round stay digits."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if cap >= unit and cap % unit == 0:
            return f"{cap // unit}{suffix}"
    return str(cap)


@dataclass
class SweepResult:
    """Everything one replay produced."""

    source: str
    format: str
    page_size: int
    model: ModelName
    caps: tuple[int, ...]
    current_cap: int
    requests: int
    references: int
    curves: dict[str, BeliefCurve]
    bytes_per_entry: float
    config: ModelConfig | None = None
    model_rows: list[ModelResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def belief_rows(self, pool: str) -> list[dict[str, Any]]:
        """The belief-only figures of ``pool`` at every cap of the sweep."""
        curve = self.curves[pool]
        rows = []
        for cap in self.caps:
            misses = curve.misses(cap)
            entries = curve.entries(cap)
            rows.append(
                {
                    "cap": cap,
                    "belief_hit_ratio": curve.hit_ratio(cap),
                    "writes_issued": misses,
                    "writes_avoided": curve.hits(cap),
                    "redundant_writes": misses - curve.cold,
                    "stale_skips": 0,
                    "evictions": curve.evictions(cap),
                    "peak_entries": entries,
                    "memory_bytes": int(entries * self.bytes_per_entry),
                }
            )
        return rows


# In a worker: the trace, the model and where to send progress lines (the parent
# prints them).  A forked worker inherits them unpickled.
_WORKER: tuple[PageTrace, ModelConfig, Any] | None = None


def _init_worker(trace: PageTrace, config: ModelConfig, queue: Any) -> None:
    global _WORKER
    _WORKER = (trace, config, queue)


def _run_cap(cap: int) -> ModelResult:
    assert _WORKER is not None, "worker started without a trace"
    trace, config, queue = _WORKER
    tick = throttled(queue.put, 2.0)

    def report(done: int, total: int) -> None:
        tick(f"model: cap {format_cap(cap)}: {done}/{total} requests")

    return run_model(trace, cap, config, report)


def throttled(say: Progress, interval_s: float = 1.0) -> Progress:
    """``say`` limited to one message per ``interval_s`` (for per-request ticks)."""
    last = time.monotonic()

    def tick(msg: str) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= interval_s:
            last = now
            say(msg)

    return tick


def default_jobs() -> int:
    """Processes for the model: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def sweep(
    trace: PageTrace,
    caps: Sequence[int],
    *,
    model: ModelName = "buffer",
    config: ModelConfig | None = None,
    current_cap: int = DEFAULT_CURRENT_CAP,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> SweepResult:
    """The belief-only curve at ``caps`` and, with ``model="buffer"``, one model run per cap."""
    caps = tuple(sorted(set(caps)))
    jobs = jobs or default_jobs()
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}

    started = time.perf_counter()
    say(f"belief-only: one Mattson pass over {trace.references:,} page references")
    tick = throttled(say)
    curves = belief_only_curves(
        trace, (lambda done, total: tick(f"belief-only: {done}/{total} requests"))
    )
    timings["mattson_s"] = time.perf_counter() - started
    timings["mattson_refs_per_s"] = trace.references / max(timings["mattson_s"], 1e-9)
    result = SweepResult(
        source=trace.source,
        format=trace.format,
        page_size=trace.page_size,
        model=model,
        caps=caps,
        current_cap=current_cap,
        requests=len(trace.requests),
        references=trace.references,
        curves=curves,
        bytes_per_entry=bytes_per_entry(),
        timings=timings,
    )
    if model == "buffer":
        config = config or ModelConfig()
        result.config = config
        started = time.perf_counter()
        result.model_rows = _run_model_caps(trace, caps, config, jobs, say)
        timings["model_s"] = time.perf_counter() - started
        timings["model_jobs"] = float(min(jobs, len(caps)))
        cpu = sum(r.elapsed_s for r in result.model_rows)
        timings["model_refs_per_s_per_core"] = trace.references * len(caps) / max(cpu, 1e-9)
    return result


def _run_model_caps(
    trace: PageTrace, caps: tuple[int, ...], config: ModelConfig, jobs: int, say: Progress
) -> list[ModelResult]:
    total = len(caps)
    if jobs == 1 or total == 1:
        rows = []
        tick = throttled(say)
        for index, cap in enumerate(caps, 1):

            def report(done: int, all_requests: int, cap: int = cap, index: int = index) -> None:
                tick(f"model: cap {format_cap(cap)} ({index}/{total}): {done}/{all_requests}")

            rows.append(run_model(trace, cap, config, report))
            say(f"model: cap {format_cap(cap)} done ({index}/{total})")
        return rows
    forked = "fork" in multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if forked else "spawn")
    # Largest caps first: they take longest, so the tail of the run stays parallel.
    order = sorted(caps, reverse=True)
    say(f"model: {total} caps on {min(jobs, total)} processes")
    by_cap: dict[int, ModelResult] = {}
    queue = ctx.Queue()
    try:
        with ctx.Pool(min(jobs, total), _init_worker, (trace, config, queue)) as pool:
            running = {cap: pool.apply_async(_run_cap, (cap,)) for cap in order}
            while running:
                with contextlib.suppress(Empty):
                    say(queue.get(timeout=0.25))
                for cap, pending in list(running.items()):
                    if pending.ready():
                        row = pending.get()  # re-raises a worker's exception here
                        del running[cap]
                        by_cap[row.cap] = row
                        say(f"model: cap {format_cap(cap)} done ({len(by_cap)}/{total})")
    finally:
        queue.close()
    return [by_cap[cap] for cap in caps]
