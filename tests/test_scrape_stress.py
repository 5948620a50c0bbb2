"""Scrapes on other threads while the scheduler thread mutates the cache (pools
appearing beyond the label bound, clears, heals, writes, flushes): no exception,
and no counter ever goes backwards."""

from __future__ import annotations

import random
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hicache_existence as he
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.exporters.catalog import CATALOG
from hicache_existence.exporters.multiprocess import MultiprocessFeeder
from hicache_existence.exporters.prometheus import PrometheusCollector
from hicache_existence.exporters.series import SeriesReader
from hicache_existence_bench import workload

COUNTERS = {spec.exposed_name for spec in CATALOG if spec.kind == "counter"}


class Scraper(threading.Thread):
    """Scrapes a registry in a loop and checks every counter is monotonic."""

    def __init__(self, registry: CollectorRegistry, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.registry, self.stop = registry, stop
        self.last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.scrapes = 0
        self.errors: list[BaseException] = []
        self.backwards: list[tuple[object, float, float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                text = generate_latest(self.registry).decode()
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name not in COUNTERS:
                            continue
                        key = (s.name, tuple(sorted(s.labels.items())))
                        before = self.last.get(key, 0.0)
                        if s.value < before:
                            self.backwards.append((key, before, s.value))
                        self.last[key] = s.value
                self.scrapes += 1
            except BaseException as exc:
                self.errors.append(exc)
                return


def mutate(cache, writes, feeder, seconds: float, generation: str) -> int:
    """The scheduler thread: a random stream of every operation for ``seconds``."""
    rng = random.Random(5)
    chains = workload.chains(40, 32, "stress")
    pools = ["kv", "swa", "mamba"] + [f"extra{i}" for i in range(30)]
    deadline = time.monotonic() + seconds
    ops = 0
    while time.monotonic() < deadline:
        name = rng.choice(pools[: 3 + ops // 200])  # new pools keep appearing
        chain = rng.choice(chains)
        roll = rng.random()
        if generation == "current":
            pool = cache.pool(name)
            if roll < 0.4:
                pool.add(chain)
                writes.written(name, len(chain), already_stored=rng.randrange(2))
            elif roll < 0.8:
                if pool.covered(chain):
                    writes.avoided(name, len(chain))
            elif roll < 0.9:
                pool.invalidate_beyond(chain, rng.randrange(len(chain)))
            elif roll < 0.95:
                pool.track_inflight(chain[:4])
                pool.untrack_inflight(chain[:4])
            elif roll < 0.97:
                cache.clear()
            else:
                pool.clear()
        else:
            if roll < 0.45:
                cache.add(name, chain)
            elif roll < 0.9:
                cache.covers_all(name, chain)
            elif roll < 0.98:
                cache.invalidate_beyond(name, chain, rng.randrange(len(chain)))
            else:
                cache.clear()
        feeder.flush()
        ops += 1
    return ops


def run_stress(cache, generation, ghosts, seconds=2.0):
    """Two scrape threads on the collector, one on the feeder's registry."""
    writes = WriteAccounting(page_size_bytes=64)
    series_reader = SeriesReader(cache, writes=writes, ghosts=ghosts, max_pools=8)
    standalone = CollectorRegistry()
    standalone.register(PrometheusCollector(series_reader))
    fed = CollectorRegistry()
    feeder = MultiprocessFeeder(
        SeriesReader(cache, writes=writes, ghosts=ghosts, max_pools=8),
        flush_interval_s=0.01,
        registry=fed,
    )
    stop = threading.Event()
    scrapers = [Scraper(standalone, stop), Scraper(standalone, stop), Scraper(fed, stop)]
    for s in scrapers:
        s.start()
    try:
        ops = mutate(cache, writes, feeder, seconds, generation)
    finally:
        stop.set()
        for s in scrapers:
            s.join(timeout=30)
    for s in scrapers:
        assert not s.errors, s.errors
        assert not s.backwards, s.backwards[:5]
        assert s.scrapes >= 3
    assert ops > 500
    labels = {dict(k[1])["pool"] for k in scrapers[0].last}
    assert "other" in labels and len(labels) <= 9


def test_concurrent_scrapes_current_generation():
    """Current generation: pools appear, clears, heals, in-flight refs under scrapes."""
    ghosts = GhostFactory(200)
    run_stress(he.StorageExistenceCache(200, miss_memory=ghosts), "current", ghosts)


def test_concurrent_scrapes_flat_generation():
    """Seed generation: shared-cap evictions across pools under scrapes."""
    ghosts = GhostFactory(200)
    run_stress(he.FlatStorageExistenceCache(200, miss_memory=ghosts), "flat", ghosts)
