"""Observability benchmark: what miss reasons and export cost, and how well the
miss-reason memory classifies.

Two parts, each callable from the ``bench`` command:

* ``run_costs``: side by side in one process, the bare cache against the same
  cache with miss-reason memory, the standalone collector registered, a
  multiprocess-style feeder flushed once per round (a scheduler step) and a
  scrape thread rendering ``/metrics`` concurrently, for hits, misses (a chain
  lookup that misses, and a one-page ``contains`` miss) and steady-state adds.
* ``run_accuracy``: replays a workload on a cache whose miss memory is compared,
  miss by miss, with an exact unbounded reference; reports the confusion between
  reasons (e.g. evicted misses reported cold, and cold misses reported evicted).
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache_existence.accounting.ghosts import (
    CACHE_BYTES_PER_ENTRY,
    FingerprintGhosts,
    GhostFactory,
)
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.stats import COLD, EVICTED, MISS_REASONS
from hicache_existence_bench import workload
from hicache_existence_bench.harness import Comparison, compare, compare_balanced

# ---------------------------------------------------------------------------
# costs


@dataclass(frozen=True)
class CostConfig:
    """Sizes of the cost comparison."""

    entries: int = 512 * 1024
    chain_pages: int = 1024
    rounds: int = 15
    queries_per_round: int = 32
    hot_chains: int = 8
    adds_per_round: int = 4
    #: Pages believed before the missing page in a chain-miss lookup.
    miss_prefix_pages: int = 64
    #: Seconds between two scrapes of the concurrent scrape thread.
    scrape_interval_s: float = 0.05
    #: The feeder's rate limit (``metrics.flush_interval_s``).
    flush_interval_s: float = 1.0
    seed: int = 20261130


QUICK_COSTS = CostConfig(entries=32 * 1024, chain_pages=256, rounds=3, queries_per_round=8)


@dataclass
class CostResult:
    config: CostConfig
    comparisons: list[Comparison] = field(default_factory=list)
    scrapes: int = 0
    scrape_errors: int = 0
    #: Median seconds of one full multiprocess flush and of one scrape render.
    flush_s: float = 0.0
    scrape_s: float = 0.0
    miss_memory_bytes_per_entry: float = 0.0

    def overheads(self) -> dict[str, float]:
        """Scenario -> extra time of the wired cache over the bare one (0.05 = +5%)."""
        return {c.scenario: 1.0 / c.speedup - 1.0 for c in self.comparisons}

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "comparisons": [
                {
                    "scenario": c.scenario,
                    "bare_ns": c.baseline.ns_per_page,
                    "wired_ns": c.candidate.ns_per_page,
                    "overhead": 1.0 / c.speedup - 1.0,
                    "unit": c.notes.get("unit", "page"),
                }
                for c in self.comparisons
            ],
            "scrapes": self.scrapes,
            "scrape_errors": self.scrape_errors,
            "flush_s": self.flush_s,
            "scrape_s": self.scrape_s,
            "miss_memory_bytes_per_entry": self.miss_memory_bytes_per_entry,
        }


class _ScrapeThread(threading.Thread):
    """Renders the registry's text exposition every ``interval`` seconds."""

    def __init__(self, render: Callable[[], bytes], interval: float) -> None:
        super().__init__(name="hicache-existence-bench-scrape", daemon=True)
        self._render = render
        self._interval = interval
        self._stop_event = threading.Event()
        self.scrapes = 0
        self.errors = 0

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            try:
                self._render()
                self.scrapes += 1
            except Exception:
                self.errors += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def run_costs(
    cfg: CostConfig = CostConfig(), progress: Callable[[str], None] = lambda _m: None
) -> CostResult:
    """Time the bare cache against the fully wired one, side by side."""
    from hicache_existence.exporters.multiprocess import MultiprocessFeeder
    from hicache_existence.exporters.prometheus import registry_for, render
    from hicache_existence.exporters.series import SeriesReader

    rng = random.Random(cfg.seed)
    result = CostResult(cfg)
    n_chains = max(2, cfg.entries // cfg.chain_pages)
    cap = n_chains * cfg.chain_pages
    total_rounds = cfg.rounds + 1
    progress(f"generating {n_chains} x {cfg.chain_pages}-page chains")
    kv = workload.chains(n_chains, cfg.chain_pages, "obs-kv")
    # Pages that were added once and evicted: the misses that need classifying.
    gone = workload.chains(2, cfg.chain_pages, "obs-gone")
    fresh = workload.chains(total_rounds * cfg.adds_per_round, cfg.chain_pages, "obs-fresh")

    # Two caches a side, built and filled in ABBA order (wired, bare, bare,
    # wired): instances of one class differ on memory-bound work by where their
    # tables landed (see ``harness.compare_balanced``).  Lookups compare the
    # first pair; steady-state adds, the most placement-sensitive, all four.
    def wired_cache() -> tuple[Any, MultiprocessFeeder, Any]:
        ghosts = GhostFactory(cap)
        cache = StorageExistenceCache(cap, miss_memory=ghosts)
        series_reader = SeriesReader(cache, ghosts=ghosts)
        # Flushed every round (a scheduler step) and rate-limited as configured
        # in production; a full flush's own cost is timed separately below.
        feeder = MultiprocessFeeder(
            series_reader, flush_interval_s=cfg.flush_interval_s, registry=None
        )
        return cache, feeder, (registry_for(series_reader), ghosts)

    w1, feeder, (registry, ghosts) = wired_cache()
    bare, bare2 = StorageExistenceCache(cap), StorageExistenceCache(cap)
    w2, feeder2, _ = wired_cache()
    b_pool, w_pool = bare.pool("kv"), w1.pool("kv")
    pools = (w_pool, b_pool, bare2.pool("kv"), w2.pool("kv"))
    progress("filling the caches")
    for c in (*gone, *kv):
        for pool in pools:
            pool.add(c)
    result.miss_memory_bytes_per_entry = ghosts.nbytes_by_pool()["kv"] / cap

    hot = rng.sample(kv, min(cfg.hot_chains, len(kv)))
    gone_pages = [p for c in gone for p in c]
    hit_plan = [[hot[i % len(hot)] for i in range(cfg.queries_per_round)]] * total_rounds
    miss_plan = [
        [
            [*hot[rng.randrange(len(hot))][: cfg.miss_prefix_pages], rng.choice(gone_pages)]
            for _ in range(cfg.queries_per_round)
        ]
        for _ in range(total_rounds)
    ]
    single_plan = [
        [rng.choice(gone_pages) for _ in range(cfg.queries_per_round * 16)]
        for _ in range(total_rounds)
    ]

    def lookups(pool: Any, plan: Sequence[list[list[str]]], step: bool) -> Callable[[int], int]:
        def run(r: int) -> int:
            contains_all = pool.contains_all
            pages = 0
            for chain in plan[r % len(plan)]:
                if not contains_all(chain):
                    raise AssertionError("hit scenario missed")
                pages += len(chain)
            if step:
                feeder.flush()
            return pages

        return run

    def misses(pool: Any, plan: Sequence[list[list[str]]], step: bool) -> Callable[[int], int]:
        def run(r: int) -> int:
            covered = pool.covered
            for chain in plan[r % len(plan)]:
                if covered(chain):
                    raise AssertionError("miss scenario hit")
            if step:
                feeder.flush()
            return len(plan[r % len(plan)])

        return run

    def single(pool: Any, plan: Sequence[list[str]], step: bool) -> Callable[[int], int]:
        def run(r: int) -> int:
            contains = pool.contains
            for page in plan[r % len(plan)]:
                if contains(page):
                    raise AssertionError("single miss scenario hit")
            if step:
                feeder.flush()
            return len(plan[r % len(plan)])

        return run

    def adds(pool: Any, offset: int, flush: MultiprocessFeeder | None) -> Callable[[int], int]:
        def run(r: int) -> int:
            add = pool.add
            pages = 0
            base = offset + r * cfg.adds_per_round
            for chain in fresh[base : base + cfg.adds_per_round]:
                add(chain)
                pages += len(chain)
            if flush is not None:
                flush.flush()
            return pages

        return run

    scraper = _ScrapeThread(lambda: render(registry), cfg.scrape_interval_s)
    scraper.start()
    try:
        progress("hit: contains_all on hot chains")
        result.comparisons.append(
            compare(
                "observability.hit[contains_all]",
                ("bare", lookups(b_pool, hit_plan, False)),
                ("wired", lookups(w_pool, hit_plan, True)),
                cfg.rounds * 2,
                unit="page",
            )
        )
        progress("miss: covered() of a chain missing after its prefix")
        result.comparisons.append(
            compare(
                f"observability.miss[covered,{cfg.miss_prefix_pages + 1}p]",
                ("bare", misses(b_pool, miss_plan, False)),
                ("wired", misses(w_pool, miss_plan, True)),
                cfg.rounds * 2,
                unit="query",
            )
        )
        progress("miss: one-page contains()")
        result.comparisons.append(
            compare(
                "observability.miss[contains]",
                ("bare", single(b_pool, single_plan, False)),
                ("wired", single(w_pool, single_plan, True)),
                cfg.rounds * 2,
                unit="query",
            )
        )
        progress("add: steady state (every page evicts one)")
        # Every cache adds the same fresh chains, so all four keep equal histories.
        result.comparisons.append(
            compare_balanced(
                "observability.add_steady",
                [adds(pools[1], 0, None), adds(pools[2], 0, None)],
                [adds(pools[0], 0, feeder), adds(pools[3], 0, feeder2)],
                ("bare", "wired"),
                cfg.rounds,
                unit="page",
            )
        )
    finally:
        scraper.stop()
    result.scrapes = scraper.scrapes
    result.scrape_errors = scraper.errors
    result.flush_s = _median_seconds(lambda: feeder.flush(force=True))
    result.scrape_s = _median_seconds(lambda: render(registry))
    return result


def _median_seconds(fn: Callable[[], object], repeats: int = 21) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------
# accuracy


class _ExactMemory:
    """The reference: the last reason of every page that ever left, unbounded,
    plus the departure sequence number to measure how long ago it left."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] = {}
        self.departures = 0

    def remember(self, keys: Sequence[str], reason: int) -> None:
        start = self.departures
        for i, key in enumerate(keys):
            self.last[key] = (reason, start + i)
        self.departures += len(keys)

    def lookup(self, key: str) -> tuple[int, int]:
        reason, seq = self.last.get(key, (COLD, -1))
        return reason, (self.departures - seq if seq >= 0 else -1)


class _Comparing:
    """A ``MissMemory`` answering with the approximate memory while recording,
    for every miss, what the exact reference says."""

    def __init__(self, approx: FingerprintGhosts, exact: _ExactMemory, cap: int) -> None:
        self.approx = approx
        self.exact = exact
        self.cap = cap
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.evicted_by_age: Counter[tuple[str, bool]] = Counter()

    def remember(self, keys: Sequence[str], reason: int) -> None:
        self.approx.remember(keys, reason)
        self.exact.remember(keys, reason)

    def classify(self, keys: Sequence[str]) -> list[int]:
        return [self.reason(key) for key in keys]

    def reason(self, key: str) -> int:
        got = self.approx.reason(key)
        want, age = self.exact.lookup(key)
        self.pairs[(MISS_REASONS[want], MISS_REASONS[got])] += 1
        if want == EVICTED:
            if age <= self.cap:
                bucket = "<=1x cap"
            else:
                bucket = "<=4x cap" if age <= 4 * self.cap else ">4x cap"
            self.evicted_by_age[(bucket, got == EVICTED)] += 1
        return got


@dataclass
class AccuracyResult:
    workload: str
    capacity: int
    requests: int
    slots: int
    memory_fraction: float
    #: (exact reason, reported reason) -> misses.
    pairs: dict[tuple[str, str], int]
    #: (age bucket of the eviction, reported evicted?) -> misses.
    evicted_by_age: dict[tuple[str, bool], int]

    @property
    def misses(self) -> int:
        return sum(self.pairs.values())

    def rate(self, actual: str, reported: str) -> float:
        """Fraction of misses whose exact reason is ``actual`` reported as ``reported``."""
        total = sum(n for (a, _), n in self.pairs.items() if a == actual)
        return self.pairs.get((actual, reported), 0) / total if total else 0.0

    @property
    def misclassified(self) -> float:
        """Fraction of all misses reported with another reason than the exact one."""
        wrong = sum(n for (a, r), n in self.pairs.items() if a != r)
        return wrong / self.misses if self.misses else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "capacity": self.capacity,
            "requests": self.requests,
            "slots": self.slots,
            "memory_fraction": self.memory_fraction,
            "misses": self.misses,
            "pairs": {f"{a}->{r}": n for (a, r), n in sorted(self.pairs.items())},
            "evicted_by_age": {
                f"{b}:{'evicted' if ok else 'other'}": n
                for (b, ok), n in sorted(self.evicted_by_age.items())
            },
            "evicted_reported_cold": self.rate("evicted", "cold"),
            "cold_reported_evicted": self.rate("cold", "evicted"),
            "misclassified": self.misclassified,
        }


def synthetic_requests(
    conversations: int, chain_pages: int, requests: int, seed: int, zipf_s: float = 1.1
) -> Iterator[list[str]]:
    """Prefill requests: Zipf-popular conversations, each a fixed page chain."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(conversations)]
    cache: dict[int, list[str]] = {}
    for index in rng.choices(range(conversations), weights, k=requests):
        chain = cache.get(index)
        if chain is None:
            chain = cache[index] = workload.chain(index, chain_pages, "obs-acc")
        yield chain


def mooncake_requests(path: Path, limit: int | None = None) -> Iterator[list[str]]:
    """The Mooncake trace: one page per 512-token block, equal ids equal pages."""
    names: dict[int, str] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                return
            ids = json.loads(line)["hash_ids"]
            chain = []
            for block in ids:
                name = names.get(block)
                if name is None:
                    name = names[block] = hashlib.sha256(f"mooncake:{block}".encode()).hexdigest()
                chain.append(name)
            yield chain


def run_accuracy(
    requests: Sequence[list[str]] | Iterator[list[str]],
    capacity: int,
    *,
    name: str = "synthetic",
    memory_fraction: float = 0.10,
    heal_every: int = 50,
    clear_at: int | None = None,
    seed: int = 7,
) -> AccuracyResult:
    """Replay ``requests`` as a prefill server would: ``covered(chain)``; on a miss
    at page ``k`` write ``chain[k:]`` (``add``).  Every ``heal_every``-th hit is
    healed (``invalidate_beyond`` at a random boundary) and the cache is cleared
    once at request ``clear_at``: every reason occurs."""
    rng = random.Random(seed)
    factory = GhostFactory(capacity, memory_fraction=memory_fraction, debug_events_per_s=0)
    exact = _ExactMemory()
    holder: dict[str, _Comparing] = {}

    def make(pool: str) -> _Comparing:
        holder[pool] = _Comparing(factory(pool), exact, capacity)
        return holder[pool]

    cache = StorageExistenceCache(capacity, miss_memory=make)
    pool = cache.pool("kv")
    count = hits = 0
    for count, chain in enumerate(requests, 1):
        if clear_at is not None and count == clear_at:
            cache.clear()
        if pool.covered(chain):
            hits += 1
            if heal_every and hits % heal_every == 0:
                pool.invalidate_beyond(chain, rng.randrange(len(chain) + 1))
            continue
        stop = next(i for i, page in enumerate(chain) if page not in pool._entries)
        pool.add(chain[stop:])
    comparing = holder["kv"]
    return AccuracyResult(
        workload=name,
        capacity=capacity,
        requests=count,
        slots=factory.slots,
        memory_fraction=memory_fraction,
        pairs=dict(comparing.pairs),
        evicted_by_age=dict(comparing.evicted_by_age),
    )


def default_accuracy_runs(trace: Path | None = None, quick: bool = False) -> list[AccuracyResult]:
    """The runs reported in docs/metrics.md.  A ``trace`` that is not a readable
    file raises instead of silently dropping the Mooncake rows."""
    if trace is not None and not trace.is_file():
        raise FileNotFoundError(f"Mooncake trace not found: {trace}")
    runs = []
    conversations, pages, requests = (400, 64, 4000) if quick else (4000, 128, 60000)
    capacity = conversations * pages // 4
    runs.append(
        run_accuracy(
            list(synthetic_requests(conversations, pages, requests, seed=11)),
            capacity,
            name=f"synthetic zipf {conversations}x{pages}p, cap {capacity}",
            clear_at=requests // 2,
        )
    )
    if trace is not None:
        chains = list(mooncake_requests(trace, 800 if quick else None))
        distinct = len({p for c in chains for p in c})
        for divisor in (4, 8):
            capacity = max(64, distinct // divisor)
            runs.append(
                run_accuracy(chains, capacity, name=f"mooncake {len(chains)} req, cap {capacity}")
            )
    return runs


def format_costs(result: CostResult) -> str:
    lines = [f"{'scenario':40} {'bare':>10} {'wired':>10} {'unit':>6} {'overhead':>9}"]
    for c in result.comparisons:
        lines.append(
            f"{c.scenario:40} {c.baseline.ns_per_page:10.1f} {c.candidate.ns_per_page:10.1f} "
            f"{c.notes.get('unit', 'page'):>6} {1.0 / c.speedup - 1.0:+8.1%}"
        )
    lines.append(
        f"one full flush {result.flush_s * 1e3:.2f} ms, one scrape render "
        f"{result.scrape_s * 1e3:.2f} ms (at most once per flush_interval_s / scrape interval)"
    )
    lines.append(
        f"scrapes during timing: {result.scrapes} ({result.scrape_errors} errors); "
        f"miss memory {result.miss_memory_bytes_per_entry:.2f} B/entry "
        f"({result.miss_memory_bytes_per_entry / CACHE_BYTES_PER_ENTRY:.1%} of the cache)"
    )
    return "\n".join(lines)


def format_accuracy(results: Sequence[AccuracyResult]) -> str:
    lines = []
    for r in results:
        d = r.as_dict()
        lines.append(
            f"{r.workload}: {r.misses} misses; evicted->cold {d['evicted_reported_cold']:.2%}, "
            f"cold->evicted {d['cold_reported_evicted']:.2%}, any wrong {d['misclassified']:.2%}"
        )
        lines.append(f"  pairs: {d['pairs']}")
        lines.append(f"  evicted misses by eviction age: {d['evicted_by_age']}")
    return "\n".join(lines)
