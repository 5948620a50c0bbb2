"""prometheus_client multiprocess mode (SGLang --enable-metrics): real worker
processes feed batched counters and gauges, a real MultiProcessCollector
aggregates them, and the totals equal the sum of the processes' accounting."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

import hicache_existence as he
from hicache_existence import logs
from hicache_existence.core.stats import COUNTER_FIELDS
from hicache_existence.exporters.catalog import CATALOG, DeploymentLabels
from hicache_existence.exporters.multiprocess import MultiprocessFeeder, multiprocess_active
from hicache_existence.exporters.series import SeriesReader

TESTS = str(Path(__file__).resolve().parent)

#: One scheduler process: a workload in steps, a flush per step, then what must
#: add up: a plain reference model's counters driven by the same calls
#: (tests/reference_models.py, exact miss reasons), the write calls the child
#: made, tallied by the child itself, and the gauges' final values.
CHILD = textwrap.dedent(
    """
    import json, random, sys
    sys.path.insert(0, sys.argv[4])
    from reference_models import ExactMissMemory, RefCache
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
    ghosts = GhostFactory(300)  # only for the miss-memory gauge
    ghosts("kv"), ghosts("swa")
    cache = StorageExistenceCache(300, miss_memory=lambda pool: ExactMissMemory())
    ref = RefCache(300)
    writes = WriteAccounting(page_size_bytes=512)
    tally = {}
    def count(pool, what, n):
        t = tally.setdefault(pool, dict.fromkeys(
            ("written", "avoided", "redundant", "acknowledged", "failed", "believed"), 0
        ))
        t[what] = t.get(what, 0) + n
    feeder = MultiprocessFeeder(
        SeriesReader(cache, writes=writes, ghosts=ghosts, initial_pools=("kv", "swa")),
        DeploymentLabels(model_name="m", engine_type="prefill", tp_rank=rank),
        flush_interval_s=0.0,
    )
    chains = workload.chains(12, 40, f"mp{seed}")
    def both(name, pool, *args):
        getattr(ref.pool(pool), name)(*args)
        return getattr(cache.pool(pool), name)(*args)
    for step in range(steps):
        for _ in range(5):
            chain = rng.choice(chains)
            pool = rng.choice(["kv", "kv", "swa"])
            if rng.random() < 0.2:
                both("track_inflight", pool, chain)  # unbelieved pages get rescued
            if not both("covered", pool, chain):
                both("add", pool, chain)
                count(pool, "written", len(chain))
                if rng.random() < 0.5:  # ground truth at write time
                    already = rng.randrange(3)
                    writes.written(pool, len(chain), already_stored=already)
                    count(pool, "redundant", already)
                else:  # the storage ack: stored / failed, the backend's own answer
                    writes.written(pool, len(chain))
                    failed = rng.randrange(3)
                    stored = len(chain) - failed
                    already = rng.randrange(min(stored, 3) + 1)
                    believed = rng.randrange(already + 1)
                    writes.acked(pool, stored, failed, already_stored=already, believed=believed)
                    for what, n in (("acknowledged", stored), ("failed", failed),
                                    ("redundant", already), ("believed", believed)):
                        count(pool, what, n)
                    if already:  # every acked redundant page gets one cause
                        cause = rng.choice(["recompute", "prefetch_shortfall", "other_instance"])
                        writes.redundant_cause(pool, cause, already)
                        count(pool, "cause:" + cause, already)
            else:
                writes.avoided(pool, len(chain))
                count(pool, "avoided", len(chain))
            both("contains_all", pool, chain[:20])
            if rng.random() < 0.3:
                both("untrack_inflight", pool, chain)
            if rng.random() < 0.1:
                both("invalidate_beyond", pool, chain, 10)
        if step == steps // 2:
            both("clear", "kv")
            both("clear_inflight", "swa")
        assert feeder.flush()
    out = {"ref": ref.stats(),
           "reasons": {name: p.miss_reasons for name, p in ref.pools.items()},
           "tally": tally,
           "entries": {name: len(cache.pool(name)) for name in ("kv", "swa")},
           "miss_memory": ghosts.nbytes_by_pool()}
    print(json.dumps(out))
    """
)

#: Exposed cache counter -> the reference model's counter it must equal: every
#: declared ``PoolStats`` counter, by the catalog's mapping (read here, so a new
#: counter is checked without an edit; tests/test_catalog.py checks that each
#: family's name says its field, tests/test_declarations.py that the catalog
#: exports exactly the declared counters).  ``page_misses`` is checked by reason.
CACHE_COUNTERS = {
    spec.exposed_name: spec.field
    for spec in CATALOG
    if spec.source == "cache" and spec.kind == "counter" and spec.field in COUNTER_FIELDS
}
#: Exposed write counter -> (the child's own tally, bytes per page or 1).
WRITE_COUNTERS = {
    "hicache_existence_written_pages_total": ("written", 1),
    "hicache_existence_written_bytes_total": ("written", 512),
    "hicache_existence_write_avoided_pages_total": ("avoided", 1),
    "hicache_existence_write_avoided_bytes_total": ("avoided", 512),
    "hicache_existence_redundant_written_pages_total": ("redundant", 1),
    "hicache_existence_redundant_written_bytes_total": ("redundant", 512),
    "hicache_existence_write_acknowledged_pages_total": ("acknowledged", 1),
    "hicache_existence_write_acknowledged_bytes_total": ("acknowledged", 512),
    "hicache_existence_write_failed_pages_total": ("failed", 1),
    "hicache_existence_write_failed_bytes_total": ("failed", 512),
    "hicache_existence_redundant_believed_pages_total": ("believed", 1),
}
REASONS = ("cold", "evicted", "invalidated", "cleared")


def run_child(tmp_path, rank, seed, steps=20):
    """Run one worker process in multiprocess mode; return its own accounting."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(rank), str(seed), str(steps), TESTS],
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
    """Three worker processes (tp_rank 0..2): every aggregated counter per pool
    equals the sum of an independent reference model's counters (or the child's
    own write tally), every miss reason was exercised and adds up, and each
    rank's gauges equal that rank's final values."""
    children = [run_child(tmp_path, rank, seed=100 + rank) for rank in range(3)]
    agg = aggregate(tmp_path)
    counters = {s.exposed_name for s in CATALOG if s.kind == "counter"}
    causes = "hicache_existence_redundant_cause_pages_total"
    covered = {*CACHE_COUNTERS, *WRITE_COUNTERS, "hicache_existence_page_misses_total", causes}
    assert counters == covered, "a catalog counter has no independent expectation here"
    assert sorted(CACHE_COUNTERS.values()) == sorted({*COUNTER_FIELDS} - {"page_misses"})
    for pool in ("kv", "swa"):
        for name, field in CACHE_COUNTERS.items():
            want = sum(c["ref"][pool][field] for c in children)
            got = sum(series(agg, name, pool=pool))
            assert got == want, (name, pool, got, want)
        for name, (field, scale) in WRITE_COUNTERS.items():
            want = scale * sum(c["tally"].get(pool, {}).get(field, 0) for c in children)
            got = sum(series(agg, name, pool=pool))
            assert got == want, (name, pool, got, want)
        for reason in (*REASONS, "unclassified"):
            want = sum(c["reasons"][pool].get(reason, 0) for c in children)
            got = sum(series(agg, "hicache_existence_page_misses_total", pool=pool, reason=reason))
            assert got == want, (pool, reason, got, want)
        for cause in ("recompute", "prefetch_shortfall", "other_instance"):
            want = sum(c["tally"].get(pool, {}).get("cause:" + cause, 0) for c in children)
            assert sum(series(agg, causes, pool=pool, cause=cause)) == want, (pool, cause)
        assert sum(series(agg, causes, pool=pool, cause="believed_node")) == 0
        misses = sum(c["ref"][pool]["page_misses"] for c in children)
        assert sum(series(agg, "hicache_existence_page_misses_total", pool=pool)) == misses
    for reason in REASONS:  # the workload exercised every reason
        assert sum(series(agg, "hicache_existence_page_misses_total", reason=reason)) > 0, reason
    for name in (*CACHE_COUNTERS, *WRITE_COUNTERS):  # and every counter
        assert sum(series(agg, name)) > 0, name
    for rank, child in enumerate(children):
        for pool in ("kv", "swa"):
            (entries,) = series(agg, "hicache_existence_entries", pool=pool, tp_rank=rank)
            assert entries == child["ref"][pool]["entries"] == child["entries"][pool]
            (inflight,) = series(agg, "hicache_existence_inflight_pages", pool=pool, tp_rank=rank)
            assert inflight == child["ref"][pool]["inflight"]
            (cap,) = series(agg, "hicache_existence_capacity_entries", pool=pool, tp_rank=rank)
            assert cap == 300
            (mem,) = series(agg, "hicache_existence_miss_memory_bytes", pool=pool, tp_rank=rank)
            assert mem == child["miss_memory"][pool]
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
    assert adds == first["ref"]["kv"]["adds"] + second["ref"]["kv"]["adds"]
    (entries,) = series(agg, "hicache_existence_entries", pool="kv")
    assert entries == second["ref"]["kv"]["entries"]


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


def test_a_flush_writes_only_the_series_that_moved():
    """Between two flushes most series do not move (an idle scheduler: none):
    an unchanged counter or gauge is neither looked up nor written; a moved one
    is, and the registry shows every value."""
    cache = he.StorageExistenceCache(10)
    registry = CollectorRegistry()
    feeder = MultiprocessFeeder(SeriesReader(cache), DeploymentLabels(), registry=registry)
    kv = cache.pool("kv")
    kv.add(["a", "b"])
    assert feeder.flush(force=True)
    touched: list[str] = []
    child = feeder._child

    def counted(name, key):
        touched.append(name)
        return child(name, key)

    feeder._child = counted  # type: ignore[method-assign]
    assert feeder.flush(force=True)
    assert touched == []  # nothing moved
    kv.add(["c"])
    assert feeder.flush(force=True)
    assert "hicache_existence_page_inserts" in touched
    assert "hicache_existence_entries" in touched
    assert "hicache_existence_capacity_entries" not in touched  # a gauge that did not move
    labels = {**DeploymentLabels().as_dict(), "pool": "kv"}
    assert registry.get_sample_value("hicache_existence_entries", labels) == 3
    assert registry.get_sample_value("hicache_existence_capacity_entries", labels) == 10
    assert registry.get_sample_value("hicache_existence_page_inserts_total", labels) == 3
