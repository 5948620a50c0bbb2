"""The foundation benchmark: our caches against the seed and upstream, side by side.

Workload (issue "Foundation"): 1024-page chains of 64-hex hashes, caches filled to
512K entries, accounting on.  Lookups are measured in two regimes because their
cost is dominated by memory, not code:

* ``hot``: a small working set of chains queried repeatedly (a shared system
  prompt, a multi-turn session), so the touched structures sit in CPU caches and
  the per-page *code* cost decides;
* ``spread``: every query picks one of all 512 chains at random, so most page
  lookups miss the CPU caches and DRAM latency, the same for every
  implementation, dominates.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence_bench import noacct, workload
from hicache_existence_bench.harness import (
    Comparison,
    RoundFn,
    add_round,
    compare,
    compare_balanced,
    lookup_round,
)
from hicache_existence_bench.seed import SeedStorageExistenceCache
from hicache_existence_bench.upstream import UpstreamModule


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of the foundation benchmark."""

    entries: int = 512 * 1024
    chain_pages: int = 1024
    rounds: int = 15
    queries_per_round: int = 32
    hot_chains: int = 8
    adds_per_round: int = 4
    seed: int = 20261129
    #: Wire export into our caches (miss-reason memories, a multiprocess feeder
    #: flushed every round, a concurrent scrape thread): the observability
    #: issue's "the foundation ratios still hold with export wired in".
    wired: bool = False

    @property
    def chains(self) -> int:
        return max(2, self.entries // self.chain_pages)


QUICK = BenchConfig(entries=32 * 1024, chain_pages=256, rounds=3, queries_per_round=8)


@dataclass(frozen=True)
class Target:
    """One acceptance target of the foundation issue."""

    name: str
    metric: str
    op: str  # ">=" or "<="
    bound: float

    def met(self, value: float) -> bool:
        return value >= self.bound if self.op == ">=" else value <= self.bound


TARGETS: tuple[Target, ...] = (
    Target("flat.kv.contains_all", "speedup", ">=", 2.0),
    Target("flat.kv.covers_all", "speedup", ">=", 2.0),
    Target("flat.second_pool.contains_all", "speedup", ">=", 1.3),
    Target("flat.second_pool.covers_all", "speedup", ">=", 1.3),
    Target("flat.add_steady", "speedup", ">=", 1.2),
    Target("flat.memory_per_entry", "ratio", "<=", 0.6),
    Target("current.contains_all", "speedup", ">=", 1.1),
    Target("current.covered", "speedup", ">=", 1.1),
    Target("current.covered_inflight_present", "speedup", ">=", 1.1),
    Target("current.add_steady", "speedup", ">=", 1.0),
    Target("current.memory_per_entry", "ratio", "<=", 1.0),
    Target("accounting.flat.contains_all", "overhead", "<=", 0.05),
    Target("accounting.flat.add_steady", "overhead", "<=", 0.05),
    Target("accounting.current.contains_all", "overhead", "<=", 0.05),
    Target("accounting.current.add_steady", "overhead", "<=", 0.05),
)


@dataclass
class BenchResult:
    """Everything one run measured, plus the targets' verdicts."""

    config: BenchConfig
    comparisons: list[Comparison] = field(default_factory=list)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    upstream: dict[str, str] | None = None
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    #: Concurrent scrapes during a wired run (``BenchConfig.wired``).
    wired: dict[str, int] | None = None


# ---------------------------------------------------------------------------
# round functions


def _query_plans(
    rng: random.Random, cached: list[list[str]], cfg: BenchConfig, rounds: int
) -> dict[str, list[list[list[str]]]]:
    hot = rng.sample(cached, min(cfg.hot_chains, len(cached)))
    return {
        "hot": [[hot[i % len(hot)] for i in range(cfg.queries_per_round)] for _ in range(rounds)],
        "spread": [
            [rng.choice(cached) for _ in range(cfg.queries_per_round)] for _ in range(rounds)
        ],
    }


def _memory_per_entry(
    make_empty: Callable[[], Any], fill: Callable[[Any], None], entries: int
) -> float:
    """Bytes allocated per entry while filling an already-built empty cache
    (tracemalloc; the page-hash strings exist beforehand and are excluded, as
    callers share them; a cache object's fixed size is excluded too)."""
    obj = make_empty()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fill(obj)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del obj
    return (after - before) / entries


# ---------------------------------------------------------------------------
# suites


def run_foundation(
    cfg: BenchConfig,
    upstream: UpstreamModule | None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> BenchResult:
    """Run every comparison of the foundation issue."""
    rng = random.Random(cfg.seed)
    result = BenchResult(cfg)
    total_rounds = cfg.rounds + 1  # + warm-up
    progress(f"generating {cfg.chains} x {cfg.chain_pages}-page chains")
    kv = workload.chains(cfg.chains, cfg.chain_pages, "kv")
    half = cfg.chains // 2
    swa = workload.chains(half, cfg.chain_pages, "swa")
    fresh_needed = total_rounds * cfg.adds_per_round
    fresh_a = workload.chains(fresh_needed, cfg.chain_pages, "fresh-a")
    fresh_b = workload.chains(fresh_needed, cfg.chain_pages, "fresh-b")
    add_plan_a = [
        fresh_a[i * cfg.adds_per_round : (i + 1) * cfg.adds_per_round] for i in range(total_rounds)
    ]
    add_plan_b = [
        fresh_b[i * cfg.adds_per_round : (i + 1) * cfg.adds_per_round] for i in range(total_rounds)
    ]
    cap = cfg.chains * cfg.chain_pages
    stripped = noacct.stripped_classes()
    # A daemon scrape thread when wired; stopped below (and dies with the process).
    wiring = _Wiring(cfg.wired)

    # -- seed generation ----------------------------------------------------
    progress("seed generation: filling caches")
    seed_cache = SeedStorageExistenceCache(cap)
    ours_flat = wiring.flat(cap)
    for c in kv:
        seed_cache.add("kv", c)
        ours_flat.add("kv", c)
    plans = _query_plans(rng, kv, cfg, total_rounds)
    for regime, plan in plans.items():
        for op in ("contains_all", "covers_all"):
            progress(f"flat.kv.{op} [{regime}]")
            result.comparisons.append(
                compare(
                    f"flat.kv.{op}[{regime}]",
                    ("seed", lookup_round(getattr(seed_cache, op), "kv", plan)),
                    ("ours", wiring.round(lookup_round(getattr(ours_flat, op), "kv", plan))),
                    cfg.rounds,
                )
            )
    progress("flat.add_steady")
    result.comparisons.append(
        compare(
            "flat.add_steady",
            ("seed", add_round(seed_cache.add, "kv", add_plan_a)),
            ("ours", wiring.round(add_round(ours_flat.add, "kv", add_plan_a))),
            cfg.rounds,
        )
    )
    del seed_cache, ours_flat

    progress("seed generation: second pool")
    seed_cache = SeedStorageExistenceCache(cap)
    ours_flat = wiring.flat(cap)
    for a, b in zip(kv[:half], swa):
        for cache in (seed_cache, ours_flat):
            cache.add("kv", a)
            cache.add("swa", b)
    plans = _query_plans(rng, swa, cfg, total_rounds)
    for regime, plan in plans.items():
        for op in ("contains_all", "covers_all"):
            progress(f"flat.second_pool.{op} [{regime}]")
            result.comparisons.append(
                compare(
                    f"flat.second_pool.{op}[{regime}]",
                    ("seed", lookup_round(getattr(seed_cache, op), "swa", plan)),
                    ("ours", wiring.round(lookup_round(getattr(ours_flat, op), "swa", plan))),
                    cfg.rounds,
                )
            )
    del seed_cache, ours_flat

    progress("seed generation: memory")

    def fill_flat(cache: Any) -> None:
        for c in kv:
            cache.add("kv", c)

    seed_mem = _memory_per_entry(lambda: SeedStorageExistenceCache(cap), fill_flat, cap)
    flat_mem = _memory_per_entry(lambda: FlatStorageExistenceCache(cap), fill_flat, cap)
    result.memory["flat.memory_per_entry"] = {
        "baseline_bytes": seed_mem,
        "ours_bytes": flat_mem,
        "ratio": flat_mem / seed_mem,
    }

    # -- current generation -------------------------------------------------
    ours_cur = wiring.current(cap).pool("kv")
    up_pool: Any = None
    if upstream is not None:
        result.upstream = {"origin": upstream.origin, "sha256": upstream.sha256}
        up_pool = upstream.module.StorageExistenceCache(cap).pool("kv")
    progress("current generation: filling caches")
    for c in kv:
        ours_cur.add(c)
        if up_pool is not None:
            up_pool.add(c)
    plans = _query_plans(rng, kv, cfg, total_rounds)
    if up_pool is not None:
        for regime, plan in plans.items():
            for op in ("contains_all", "covered"):
                progress(f"current.{op} [{regime}]")
                result.comparisons.append(
                    compare(
                        f"current.{op}[{regime}]",
                        ("upstream", lookup_round(getattr(up_pool, op), None, plan)),
                        ("ours", wiring.round(lookup_round(getattr(ours_cur, op), None, plan))),
                        cfg.rounds,
                    )
                )
        # Write-through keeps some content in flight most of the time; then
        # upstream's covered() takes its Python loop for every query.
        inflight = workload.chain(10**6, 64, "inflight")
        up_pool.track_inflight(inflight)
        ours_cur.track_inflight(inflight)
        for regime, plan in plans.items():
            progress(f"current.covered_inflight_present [{regime}]")
            result.comparisons.append(
                compare(
                    f"current.covered_inflight_present[{regime}]",
                    ("upstream", lookup_round(up_pool.covered, None, plan)),
                    ("ours", wiring.round(lookup_round(ours_cur.covered, None, plan))),
                    cfg.rounds,
                )
            )
        up_pool.clear_inflight()
        ours_cur.clear_inflight()
        progress("current.add_steady")
        result.comparisons.append(
            compare(
                "current.add_steady",
                ("upstream", add_round(up_pool.add, None, add_plan_a)),
                ("ours", wiring.round(add_round(ours_cur.add, None, add_plan_a))),
                cfg.rounds,
            )
        )
    del ours_cur, up_pool

    if upstream is not None:
        up_mod = upstream.module

        def fill_pool(pool: Any) -> None:
            for c in kv:
                pool.add(c)

        up_mem = _memory_per_entry(
            lambda: up_mod.StorageExistenceCache(cap).pool("kv"), fill_pool, cap
        )
        cur_mem = _memory_per_entry(lambda: StorageExistenceCache(cap).pool("kv"), fill_pool, cap)
        result.memory["current.memory_per_entry"] = {
            "baseline_bytes": up_mem,
            "ours_bytes": cur_mem,
            "ratio": cur_mem / up_mem,
        }

    wiring.stop()
    if cfg.wired:
        result.wired = {"scrapes": wiring.scrapes, "scrape_errors": wiring.scrapes_failed}

    # -- accounting: ours against the same code with its counters stripped ---
    # Two instances a side, built in ABBA order (see ``compare_balanced``), all
    # with identical histories: the fill, then the same spread lookups that
    # scatter the LRU order, then the same adds.  What differs is the accounting.
    for gen, ours_cls, bare_cls, bind in (
        ("flat", FlatStorageExistenceCache, stripped["FlatStorageExistenceCache"], _bind_flat),
        ("current", StorageExistenceCache, stripped["StorageExistenceCache"], _bind_current),
    ):
        progress(f"accounting.{gen}")
        quad = [bind(cls(cap)) for cls in (ours_cls, bare_cls, bare_cls, ours_cls)]  # ABBA
        for c in kv:
            for add, _ in quad:
                add(c)
        for queries in plans["spread"]:
            for c in queries:
                for _, look in quad:
                    look(c)
        mine, bare = (quad[0], quad[3]), (quad[1], quad[2])
        labels = ("no-accounting", "ours")
        result.comparisons.append(
            compare_balanced(
                f"accounting.{gen}.contains_all[hot]",
                [lookup_round(look, None, plans["hot"]) for _, look in bare],
                [lookup_round(look, None, plans["hot"]) for _, look in mine],
                labels,
                cfg.rounds,
            )
        )
        result.comparisons.append(
            compare_balanced(
                f"accounting.{gen}.add_steady",
                [add_round(add, None, add_plan_b) for add, _ in bare],
                [add_round(add, None, add_plan_b) for add, _ in mine],
                labels,
                cfg.rounds,
            )
        )
        del quad, mine, bare

    result.verdicts = evaluate(result)
    return result


class _Wiring:
    """Export wired into "our" caches, as in a serving process with metrics on:
    a miss-reason memory per pool, a multiprocess feeder flushed after every
    round (a scheduler step; rate-limited as in production), and a thread
    rendering a standalone registry every 50 ms.  A no-op when not ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._registries: list[Any] = []
        self._scraper: Any = None
        #: The feeder of the most recently wired cache (``round`` flushes it).
        self._current: Any = None
        self.scrapes = 0
        self.scrapes_failed = 0

    def _wire(self, cache: Any, ghosts: Any) -> None:
        from hicache_existence.exporters.multiprocess import MultiprocessFeeder
        from hicache_existence.exporters.prometheus import registry_for, render
        from hicache_existence.exporters.series import SeriesReader
        from hicache_existence_bench.observability import _ScrapeThread

        series_reader = SeriesReader(cache, ghosts=ghosts)
        self._current = MultiprocessFeeder(series_reader, registry=None)
        self._registries.append(registry_for(series_reader))
        if self._scraper is None:
            registries = self._registries
            self._scraper = _ScrapeThread(lambda: b"".join(map(render, registries)), 0.05)
            self._scraper.start()

    def flat(self, cap: int) -> FlatStorageExistenceCache:
        if not self.enabled:
            return FlatStorageExistenceCache(cap)
        from hicache_existence.accounting.ghosts import GhostFactory

        ghosts = GhostFactory(cap)
        cache = FlatStorageExistenceCache(cap, miss_memory=ghosts)
        self._wire(cache, ghosts)
        return cache

    def current(self, cap: int) -> StorageExistenceCache:
        if not self.enabled:
            return StorageExistenceCache(cap)
        from hicache_existence.accounting.ghosts import GhostFactory

        ghosts = GhostFactory(cap)
        cache = StorageExistenceCache(cap, miss_memory=ghosts)
        self._wire(cache, ghosts)
        return cache

    def round(self, fn: RoundFn) -> RoundFn:
        """``fn`` followed by a flush of the most recently wired cache's feeder."""
        if not self.enabled:
            return fn
        feeder = self._current

        def run(r: int) -> int:
            pages = fn(r)
            feeder.flush()
            return pages

        return run

    def stop(self) -> None:
        if self._scraper is not None:
            self._scraper.stop()
            self.scrapes = self._scraper.scrapes
            self.scrapes_failed = self._scraper.errors
            self._scraper = None


def _bind_flat(cache: Any) -> tuple[Callable[[list[str]], None], Callable[[list[str]], bool]]:
    """(add, contains_all) of a seed-generation cache, on pool ``kv``."""
    return (lambda c: cache.add("kv", c)), (lambda c: cache.contains_all("kv", c))


def _bind_current(cache: Any) -> tuple[Callable[[list[str]], None], Callable[[list[str]], bool]]:
    """(add, contains_all) of a current-generation cache's pool ``kv``."""
    pool = cache.pool("kv")
    return pool.add, pool.contains_all


def _values_for(result: BenchResult, target: Target) -> dict[str, float]:
    if target.metric == "ratio":
        mem = result.memory.get(target.name)
        return {"": mem["ratio"]} if mem else {}
    out: dict[str, float] = {}
    for comp in result.comparisons:
        base, _, regime = comp.scenario.partition("[")
        if base != target.name:
            continue
        key = regime.rstrip("]")
        out[key] = comp.speedup if target.metric == "speedup" else 1.0 / comp.speedup - 1.0
    return out


def evaluate(result: BenchResult) -> list[dict[str, Any]]:
    """Each target with its measured value(s) per regime and whether it is met."""
    verdicts = []
    for target in TARGETS:
        values = _values_for(result, target)
        verdicts.append(
            {
                "target": target.name,
                "metric": target.metric,
                "bound": f"{target.op} {target.bound}",
                "values": values,
                "met": bool(values) and all(target.met(v) for v in values.values()),
                "measured": bool(values),
            }
        )
    return verdicts
