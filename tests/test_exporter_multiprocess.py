"""prometheus_client multiprocess mode (SGLang --enable-metrics): real worker
processes feed batched counters and gauges, a real MultiProcessCollector
aggregates them, and the totals equal the sum of the processes' accounting."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

import hicache_existence as he
from hicache_existence import logs
from hicache_existence.exporters.catalog import CATALOG, DeploymentLabels
from hicache_existence.exporters.multiprocess import MultiprocessFeeder, multiprocess_active
from hicache_existence.exporters.series import SeriesReader

#: One scheduler process: a workload in steps, a flush per step, then its own
#: accounting (what the aggregation must add up to) as JSON on stdout.
CHILD = textwrap.dedent(
    """
    import json, random, sys
    from hicache_existence import StorageExistenceCache
    from hicache_existence_bench import workload
    from hicache_existence.exporters.catalog import DeploymentLabels
    from hicache_existence.exporters.multiprocess import MultiprocessFeeder, multiprocess_active
    from hicache_existence.exporters.series import SeriesReader
    from hicache_existence.accounting.ghosts import GhostFactory
    from hicache_existence.accounting.writes import WriteAccounting

    rank, seed, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    assert multiprocess_active(), "prometheus_client is not in multiprocess mode"
    rng = random.Random(seed)
    ghosts = GhostFactory(300)
    cache = StorageExistenceCache(300, miss_memory=ghosts)
    writes = WriteAccounting(page_size_bytes=512)
    feeder = MultiprocessFeeder(
        SeriesReader(cache, writes=writes, ghosts=ghosts, initial_pools=("kv", "swa")),
        DeploymentLabels(model_name="m", engine_type="prefill", tp_rank=rank),
        flush_interval_s=0.0,
    )
    chains = workload.chains(12, 40, f"mp{seed}")
    for step in range(steps):
        for _ in range(5):
            chain = rng.choice(chains)
            pool = cache.pool(rng.choice(["kv", "kv", "swa"]))
            if not pool.covered(chain):
                pool.add(chain)
                writes.written(pool.name, len(chain), already_stored=rng.randrange(3))
            else:
                writes.avoided(pool.name, len(chain))
            if rng.random() < 0.1:
                pool.invalidate_beyond(chain, 10)
        if step == steps // 2:
            cache.pool("kv").clear()
        assert feeder.flush()
    out = {"cache": cache.stats().as_dict()["pools"], "writes": writes.stats().as_dict(),
           "miss_memory": ghosts.nbytes_by_pool()}
    print(json.dumps(out))
    """
)


def run_child(tmp_path, rank, seed, steps=20):
    """Run one worker process in multiprocess mode; return its own accounting."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(rank), str(seed), str(steps)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def aggregate(path):
    """What SGLang's /metrics shows: MultiProcessCollector over the directory."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(samples, name, **labels):
    """Values of ``name`` whose labels include ``labels``."""
    return [
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == str(w) for k, w in labels.items())
    ]


@pytest.mark.multiprocess
def test_aggregated_totals_equal_the_sum_of_processes(tmp_path):
    """Three worker processes (tp_rank 0..2); every counter's aggregated value per
    pool equals the sum of the processes' own accounting, and each rank's gauges
    equal that rank's final values."""
    children = [run_child(tmp_path, rank, seed=100 + rank) for rank in range(3)]
    agg = aggregate(tmp_path)
    for spec in CATALOG:
        if spec.source == "memory" or spec.kind == "gauge":
            continue
        for pool in ("kv", "swa"):
            if spec.source == "writes":
                want = sum(c["writes"].get(pool, {}).get(spec.field, 0) for c in children)
            elif spec.field == "misses_by_reason":
                for reason in ("cold", "evicted", "invalidated", "cleared"):
                    want = sum(c["cache"][pool][f"misses_{reason}"] for c in children)
                    got = sum(series(agg, spec.exposed_name, pool=pool, reason=reason))
                    assert got == want, (spec.name, pool, reason)
                continue
            else:
                want = sum(c["cache"][pool][spec.field] for c in children)
            got = sum(series(agg, spec.exposed_name, pool=pool))
            assert got == want, (spec.name, pool, got, want)
    for rank, child in enumerate(children):
        for pool in ("kv", "swa"):
            (entries,) = series(agg, "hicache_existence_entries", pool=pool, tp_rank=rank)
            assert entries == child["cache"][pool]["entries"]
            (mem,) = series(agg, "hicache_existence_miss_memory_bytes", pool=pool, tp_rank=rank)
            assert mem == child["miss_memory"][pool]
    # Sanity: the workload exercised evictions, every reason and redundant writes.
    assert sum(series(agg, "hicache_existence_evictions_total")) > 0
    assert sum(series(agg, "hicache_existence_page_misses_total", reason="evicted")) > 0
    assert sum(series(agg, "hicache_existence_redundant_written_pages_total")) > 0
    # No pid label: gauges are aggregated per label set (mostrecent).
    assert not any("pid" in dict(ls) for (_, ls) in agg)


@pytest.mark.multiprocess
def test_restarted_rank_counters_add_and_gauges_take_the_newest(tmp_path):
    """A rank that restarts (a new pid, same labels) keeps counting from the dead
    process's total, and its gauges show the new process's value."""
    first = run_child(tmp_path, 0, seed=7, steps=20)
    second = run_child(tmp_path, 0, seed=8, steps=6)
    agg = aggregate(tmp_path)
    (adds,) = series(agg, "hicache_existence_add_calls_total", pool="kv")
    assert adds == first["cache"]["kv"]["adds"] + second["cache"]["kv"]["adds"]
    (entries,) = series(agg, "hicache_existence_entries", pool="kv")
    assert entries == second["cache"]["kv"]["entries"]


def test_flush_is_rate_limited_and_applies_deltas():
    """flush() does nothing inside flush_interval_s, then applies the delta since
    the previous flush; force bypasses the interval."""
    now = [0.0]
    cache = he.StorageExistenceCache(10)
    registry = CollectorRegistry()
    feeder = MultiprocessFeeder(
        SeriesReader(cache),
        DeploymentLabels(),
        flush_interval_s=1.0,
        clock=lambda: now[0],
        registry=registry,
    )
    kv = cache.pool("kv")
    kv.add(["a", "b"])
    assert feeder.flush() is True
    kv.add(["c"])
    now[0] = 0.5
    assert feeder.flush() is False

    def inserts():
        return registry.get_sample_value(
            "hicache_existence_page_inserts_total", {**DeploymentLabels().as_dict(), "pool": "kv"}
        )

    assert inserts() == 2
    now[0] = 1.6
    assert feeder.flush() is True
    assert inserts() == 3
    kv.add(["d"])
    assert feeder.flush(force=True) is True
    assert inserts() == 4
    assert not multiprocess_active()


def test_flush_never_raises_into_the_scheduler(caplog):
    """A failing snapshot makes flush() return False and log one exporter_error."""

    class Flaky:
        broken = False

        def stats(self):
            if self.broken:
                raise RuntimeError("boom")
            return he.StorageExistenceCache(1).stats()

    source = Flaky()
    feeder = MultiprocessFeeder(SeriesReader(source), registry=CollectorRegistry())
    source.broken = True
    with caplog.at_level(logging.ERROR, logger="hicache_existence.exporters"):
        assert feeder.flush(force=True) is False
        assert feeder.flush(force=True) is False
    events = [r for r in caplog.records if getattr(r, "hicache_event", "") == logs.EXPORTER_ERROR]
    assert len(events) == 1 and "boom" in events[0].hicache_fields["error"]
