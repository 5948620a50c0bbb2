"""What the TP-divergence digest costs, side by side (issue #4).

The same cache class is timed with and without a ``ReplicaDigest`` observer on
identical inputs in one process, rounds interleaved (``harness.compare``):
hit lookups on 1024-page chains of a cache filled to 512K entries (target:
at most 5% slower) and steady-state ``add`` of fresh 1024-page chains into the
full cache, so that every add evicts as much as it inserts (target: at most 10%).
Short 16-page lookups are reported too, without a target: the digest's work is
per call, so its share grows as chains shrink.

Besides the ratios it times what a check adds on the scheduler thread: reading
every pool's digest word, an exact audit of a full pool, and the per-step call
of a checker when no check is due.  Call ``run_digest`` from the ``bench``
command; ``python -m hicache_existence_bench.digest [--quick]`` runs it alone.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.replicas.digest import ReplicaDigest, SharedLruDigest, audit_pool
from hicache_existence_bench import workload
from hicache_existence_bench.harness import Comparison, RoundFn, Timing, add_round, lookup_round


@dataclass(frozen=True)
class DigestBenchConfig:
    """Sizes of the digest benchmark."""

    entries: int = 512 * 1024
    chain_pages: int = 1024
    short_chain_pages: int = 16
    rounds: int = 61
    queries_per_round: int = 32
    hot_chains: int = 8
    adds_per_round: int = 2
    seed: int = 20261204

    @property
    def chains(self) -> int:
        return max(2, self.entries // self.chain_pages)


QUICK = DigestBenchConfig(entries=32 * 1024, chain_pages=256, rounds=5, queries_per_round=8)

#: scenario -> the largest acceptable overhead (candidate time / baseline - 1).
TARGETS: dict[str, float] = {
    "digest.current.contains_all": 0.05,
    "digest.current.covered": 0.05,
    "digest.flat.contains_all": 0.05,
    "digest.flat.covers_all": 0.05,
    "digest.current.add_steady": 0.10,
    "digest.flat.add_steady": 0.10,
}


@dataclass
class DigestBenchResult:
    """Every comparison, the per-check costs, and the targets' verdicts."""

    config: DigestBenchConfig
    comparisons: list[Comparison] = field(default_factory=list)
    #: name -> microseconds (median), for the costs a check adds.
    check_costs_us: dict[str, float] = field(default_factory=dict)
    #: name -> nanoseconds (median) of the digest's own work, timed alone.
    isolated_ns: dict[str, float] = field(default_factory=dict)
    verdicts: list[dict[str, Any]] = field(default_factory=list)


def overhead(comp: Comparison) -> float:
    """Candidate (with digest) time over baseline time, minus one: the median of
    the per-round ratios when paired, else the ratio of the medians."""
    paired = comp.notes.get("paired_overhead")
    if isinstance(paired, float):
        return paired
    return comp.candidate.ns_per_page / comp.baseline.ns_per_page - 1.0


_WARMUP = 2


def paired_compare(
    scenario: str,
    baseline: tuple[str, RoundFn],
    candidate: tuple[str, RoundFn],
    rounds: int,
) -> Comparison:
    """Like ``harness.compare``, but the overhead is the median of per-round
    ratios: both sides run back to back in every round (alternating which goes
    first), so load from other processes mostly hits both sides of a ratio."""
    ratios: list[float] = []
    samples: dict[str, list[float]] = {baseline[0]: [], candidate[0]: []}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(_WARMUP + rounds):
            order = (baseline, candidate) if r % 2 == 0 else (candidate, baseline)
            per_page: dict[str, float] = {}
            for name, fn in order:
                start = time.perf_counter_ns()
                pages = fn(r)
                per_page[name] = (time.perf_counter_ns() - start) / max(1, pages)
            if r >= _WARMUP:
                ratios.append(per_page[candidate[0]] / per_page[baseline[0]])
                for name, value in per_page.items():
                    samples[name].append(value)
    finally:
        if was_enabled:
            gc.enable()

    def timing(name: str) -> Timing:
        values = samples[name]
        return Timing(name, statistics.median(values), min(values), max(values), len(values))

    ratio = statistics.median(ratios)
    return Comparison(
        scenario,
        timing(baseline[0]),
        timing(candidate[0]),
        1.0 / ratio,
        {"paired_overhead": ratio - 1.0},
    )


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


def run_digest(
    cfg: DigestBenchConfig = DigestBenchConfig(),
    progress: Callable[[str], None] = lambda _msg: None,
) -> DigestBenchResult:
    """Time every scenario of the digest benchmark."""
    rng = random.Random(cfg.seed)
    result = DigestBenchResult(cfg)
    total_rounds = cfg.rounds + _WARMUP
    progress(f"generating {cfg.chains} x {cfg.chain_pages}-page chains")
    kv = workload.chains(cfg.chains, cfg.chain_pages, "kv")
    fresh = workload.chains(4 * total_rounds * cfg.adds_per_round, cfg.chain_pages, "fresh")
    hot = rng.sample(kv, min(cfg.hot_chains, len(kv)))
    plan = [[hot[i % len(hot)] for i in range(cfg.queries_per_round)] for _ in range(total_rounds)]
    short_plan = [[c[: cfg.short_chain_pages] for c in chains] for chains in plan]

    def add_plan(k: int) -> list[list[list[str]]]:
        base = k * total_rounds * cfg.adds_per_round
        return [
            fresh[base + i * cfg.adds_per_round : base + (i + 1) * cfg.adds_per_round]
            for i in range(total_rounds)
        ]

    _current_suite(cfg, result, kv, plan, short_plan, add_plan, progress)
    _flat_suite(cfg, result, kv, plan, add_plan, progress)
    result.verdicts = evaluate(result)
    return result


# One cache per generation; the two candidates of a comparison run on the *same*
# object, one with the core's ``_observer`` slot set to the digest and one with it
# set to None, so the memory layout of the 512K entries, which dominates lookup
# cost, is identical for both sides.


def _toggled(target: Any, observer: object | None, fn: RoundFn) -> RoundFn:
    def run(r: int) -> int:
        target._observer = observer
        return fn(r)

    return run


def _current_suite(
    cfg: DigestBenchConfig,
    result: DigestBenchResult,
    kv: list[list[str]],
    plan: list[list[list[str]]],
    short_plan: list[list[list[str]]],
    add_plan: Callable[[int], list[list[list[str]]]],
    progress: Callable[[str], None],
) -> None:
    progress("current generation: filling the cache")
    digest = ReplicaDigest()
    cache = StorageExistenceCache(cfg.chains * cfg.chain_pages, observer=digest)
    pool = cache.pool("kv")
    for c in kv:
        pool.add(c)

    def side_by_side(name: str, bare: RoundFn, observed: RoundFn) -> None:
        progress(name)
        result.comparisons.append(
            paired_compare(
                name,
                ("no-digest", _toggled(pool, None, bare)),
                ("digest", _toggled(pool, digest, observed)),
                cfg.rounds,
            )
        )

    for op in ("contains_all", "covered"):
        fn = lookup_round(getattr(pool, op), None, plan)
        side_by_side(f"digest.current.{op}", fn, fn)
    fn = lookup_round(pool.contains_all, None, short_plan)
    side_by_side(f"digest.current.contains_all_{cfg.short_chain_pages}p", fn, fn)
    side_by_side(
        "digest.current.add_steady",
        add_round(pool.add, None, add_plan(0)),
        add_round(pool.add, None, add_plan(1)),
    )
    pool._observer = digest
    progress("isolated costs")
    result.isolated_ns.update(_isolated_costs(kv[0]))
    progress("check costs")
    result.check_costs_us.update(_check_costs(digest, cache, cfg.chains * cfg.chain_pages))


def _flat_suite(
    cfg: DigestBenchConfig,
    result: DigestBenchResult,
    kv: list[list[str]],
    plan: list[list[list[str]]],
    add_plan: Callable[[int], list[list[list[str]]]],
    progress: Callable[[str], None],
) -> None:
    progress("seed generation: filling the cache")
    shared = SharedLruDigest()
    flat = FlatStorageExistenceCache(cfg.chains * cfg.chain_pages, observer=shared)
    for c in kv:
        flat.add("kv", c)
    for op in ("contains_all", "covers_all"):
        progress(f"digest.flat.{op}")
        fn = lookup_round(getattr(flat, op), "kv", plan)
        result.comparisons.append(
            paired_compare(
                f"digest.flat.{op}",
                ("no-digest", _toggled(flat, None, fn)),
                ("digest", _toggled(flat, shared, fn)),
                cfg.rounds,
            )
        )
    progress("digest.flat.add_steady")
    result.comparisons.append(
        paired_compare(
            "digest.flat.add_steady",
            ("no-digest", _toggled(flat, None, add_round(flat.add, "kv", add_plan(2)))),
            ("digest", _toggled(flat, shared, add_round(flat.add, "kv", add_plan(3)))),
            cfg.rounds,
        )
    )
    flat._observer = shared


def _isolated_costs(chain: list[str], calls: int = 20_000) -> dict[str, float]:
    """Nanoseconds of the digest's own work per call, outside any cache: the
    steadier figure when the machine is noisy (lookups cost it once per call)."""
    digest = ReplicaDigest()
    shared = SharedLruDigest()
    n = len(chain)
    out = {}

    def touch() -> None:
        digest.touched("kv", chain, n)

    def add() -> None:
        digest.added("kv", chain)

    def touch_shared() -> None:
        shared.touched("kv", chain, n)

    cases: tuple[tuple[str, Callable[[], None], int], ...] = (
        (f"touched ({n}-page chain), per call", touch, 1),
        (f"added ({n} pages), per page", add, n),
        (f"touched ({n}-page chain), per call, seed generation", touch_shared, 1),
    )
    for name, fn, pages in cases:
        samples = []
        for _ in range(5):
            start = time.perf_counter_ns()
            for _ in range(calls // pages + 1):
                fn()
            samples.append((time.perf_counter_ns() - start) / ((calls // pages + 1) * pages))
        out[name] = statistics.median(samples)
    return out


def _check_costs(digest: ReplicaDigest, cache: StorageExistenceCache, cap: int) -> dict[str, float]:
    """Microseconds a check adds on the scheduler thread, besides its collective."""
    gc.collect()
    pool = cache.pool("kv")
    return {
        "pool_digests (1 pool, no audit)": _median_us(lambda: digest.pool_digests(cache), 51),
        f"audit of a full pool ({cap} entries)": _median_us(lambda: audit_pool(pool), 5),
        "checker.on_step() when no check is due": _on_step_us(),
    }


def _on_step_us() -> float:
    """Microseconds of ``DivergenceChecker.on_step()`` between checks."""
    from hicache_existence.config import DivergenceSection
    from hicache_existence.replicas.divergence import DivergenceChecker, InProcessWorld

    checker = DivergenceChecker(
        ReplicaDigest(),
        InProcessWorld(1).group(0),
        DivergenceSection(interval_steps=10**9),
        cache=StorageExistenceCache(16),
    )
    checker.start()
    n = 100_000
    start = time.perf_counter_ns()
    for _ in range(n):
        checker.on_step()
    return (time.perf_counter_ns() - start) / n / 1000


def evaluate(result: DigestBenchResult) -> list[dict[str, Any]]:
    """Each target with its measured overhead and whether it is met."""
    by_name = {c.scenario: c for c in result.comparisons}
    verdicts = []
    for name, bound in TARGETS.items():
        comp = by_name.get(name)
        value = overhead(comp) if comp is not None else None
        verdicts.append(
            {
                "target": name,
                "metric": "overhead",
                "bound": f"<= {bound}",
                "value": value,
                "measured": value is not None,
                "met": value is not None and value <= bound,
            }
        )
    return verdicts


def format_table(result: DigestBenchResult) -> str:
    """A plain-text table of the comparisons, check costs and targets."""
    lines = [
        f"{'scenario':36} {'no-digest ns/page':>18} {'digest ns/page':>15} {'overhead':>9}",
        "-" * 81,
    ]
    for c in result.comparisons:
        lines.append(
            f"{c.scenario:36} {c.baseline.ns_per_page:18.1f} {c.candidate.ns_per_page:15.1f} "
            f"{overhead(c):+8.1%}"
        )
    lines.append("")
    lines.append("the digest's own work, timed alone (median):")
    for name, ns in result.isolated_ns.items():
        lines.append(f"  {name:56} {ns:10.1f} ns")
    lines.append("")
    lines.append("check costs (median):")
    for name, us in result.check_costs_us.items():
        lines.append(f"  {name:56} {us:10.2f} us")
    lines.append("")
    lines.append("targets:")
    for v in result.verdicts:
        status = "met" if v["met"] else ("NOT MEASURED" if not v["measured"] else "NOT MET")
        value = "-" if v["value"] is None else f"{v['value']:+.1%}"
        lines.append(f"  [{status:>12}] {v['target']:36} overhead {v['bound']:>8}  {value}")
    return "\n".join(lines)


def as_json(result: DigestBenchResult) -> dict[str, Any]:
    """The result as plain JSON-serialisable data."""
    return {
        "config": asdict(result.config),
        "comparisons": [
            {
                "scenario": c.scenario,
                "baseline": asdict(c.baseline),
                "candidate": asdict(c.candidate),
                "overhead": overhead(c),
            }
            for c in result.comparisons
        ],
        "check_costs_us": result.check_costs_us,
        "isolated_ns": result.isolated_ns,
        "targets": result.verdicts,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the digest benchmark alone and print its table (or JSON)."""
    import json
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--rounds", type=int, help="timed rounds per comparison")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else DigestBenchConfig()
    if args.rounds is not None:
        if args.rounds < 1:
            print("error: --rounds must be >= 1", file=sys.stderr)
            return 2
        cfg = DigestBenchConfig(**{**asdict(cfg), "rounds": args.rounds})
    result = run_digest(cfg, lambda m: print(f"... {m}", file=sys.stderr, flush=True))
    print(json.dumps(as_json(result), indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
