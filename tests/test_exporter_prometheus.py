"""Standalone Prometheus export: a scripted workload's exact values on a real
/metrics endpoint, bounded pool labels, series at 0 from the start, both cache
generations, promtool's lint, and the Telemetry wiring."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hicache_existence as he
from hicache_existence.accounting.causes import CAUSES
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.core import lru
from hicache_existence.exporters import Telemetry
from hicache_existence.exporters.catalog import CATALOG, DeploymentLabels
from hicache_existence.exporters.prometheus import PrometheusCollector, serve
from hicache_existence.exporters.series import SeriesReader
from hicache_existence_bench import workload

LABELS = DeploymentLabels(
    model_name="llama", engine_type="prefill", tp_rank=1, storage_backend="file"
)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, pool="kv", **extra):
    """The value of one series with the test's deployment labels."""
    labels = {**LABELS.as_dict(), "pool": pool, **extra}
    return samples[(name, tuple(sorted(labels.items())))]


def scripted():
    """A known workload: 2 chains of 60 pages into a 100-entry pool, then lookups,
    a heal, in-flight refs, writes and a clear of a second pool."""
    ghosts = GhostFactory(100, memory_fraction=1.0)
    cache = he.StorageExistenceCache(100, miss_memory=ghosts)
    writes = WriteAccounting(page_size_bytes=4096)
    kv = cache.pool("kv")
    a, b = workload.chain(1, 60, "prom"), workload.chain(2, 60, "prom")
    kv.add(a)
    kv.add(b)  # 20 evictions (a[:20])
    assert not kv.contains_all(a)  # evicted miss at a[0]
    assert kv.contains_all(b)  # 60 hits
    kv.invalidate_beyond(b, 55)  # 5 invalidations
    kv.track_inflight(b[55:])
    assert kv.covered(b)  # 55 hits + 5 rescues
    assert not kv.contains("f" * 64)  # cold
    swa = cache.pool("swa")
    swa.add(["s1", "s2"])
    swa.clear()
    writes.written("kv", 60, already_stored=2)
    writes.avoided("kv", 55)
    cache.settle()  # the per-step hook classifies the step's misses
    return cache, writes, ghosts


def test_scripted_workload_values_over_http():
    """GET /metrics on a real server returns every catalog metric with the values
    the scripted workload implies."""
    cache, writes, ghosts = scripted()
    series_reader = SeriesReader(cache, writes=writes, ghosts=ghosts)
    with (
        serve(series_reader, LABELS, host="127.0.0.1", port=0) as server,
        urllib.request.urlopen(server.url, timeout=10) as response,
    ):
        assert response.status == 200
        text = response.read().decode()
    s = parse(text)
    assert value(s, "hicache_existence_add_calls_total") == 2
    assert value(s, "hicache_existence_page_inserts_total") == 120
    assert value(s, "hicache_existence_evictions_total") == 20
    assert value(s, "hicache_existence_queries_total") == 4
    assert value(s, "hicache_existence_query_hits_total") == 2
    assert value(s, "hicache_existence_page_hits_total") == 115
    assert value(s, "hicache_existence_page_rescues_total") == 5
    assert value(s, "hicache_existence_page_misses_total", reason="evicted") == 1
    assert value(s, "hicache_existence_page_misses_total", reason="cold") == 1
    assert value(s, "hicache_existence_page_misses_total", reason="unclassified") == 0
    assert value(s, "hicache_existence_invalidations_total") == 5
    assert value(s, "hicache_existence_inflight_pages") == 5
    assert value(s, "hicache_existence_entries") == 95
    assert value(s, "hicache_existence_capacity_entries") == 100
    assert value(s, "hicache_existence_clears_total", pool="swa") == 1
    assert value(s, "hicache_existence_cleared_pages_total", pool="swa") == 2
    assert value(s, "hicache_existence_written_pages_total") == 60
    assert value(s, "hicache_existence_written_bytes_total") == 60 * 4096
    assert value(s, "hicache_existence_write_avoided_bytes_total") == 55 * 4096
    assert value(s, "hicache_existence_redundant_written_pages_total") == 2
    mem = ghosts.nbytes_by_pool()["kv"]
    assert value(s, "hicache_existence_miss_memory_bytes") == mem
    estimate = 95 * lru.BYTES_PER_ENTRY + mem
    assert value(s, "hicache_existence_memory_bytes") == pytest.approx(estimate)
    exposed = {name for name, _ in s}
    assert exposed >= {spec.exposed_name for spec in CATALOG}


def test_every_series_exists_at_zero_before_any_traffic():
    """Declared pools have every metric (every miss reason, every cause of a
    redundant write) at 0 at once."""
    series_reader = SeriesReader(he.StorageExistenceCache(10), initial_pools=("kv", "swa"))
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(series_reader, LABELS))
    s = parse(generate_latest(registry).decode())
    for spec in CATALOG:
        for pool in ("kv", "swa"):
            reasons = ["cold", "evicted", "invalidated", "cleared", "unclassified"]
            extras: list[dict[str, str]] = [{}]
            if spec.extra_labels == ("reason",):
                extras = [{"reason": r} for r in reasons]
            elif spec.extra_labels == ("cause",):
                extras = [{"cause": c} for c in CAUSES]
            for extra in extras:
                assert value(s, spec.exposed_name, pool=pool, **extra) == 0


def test_pool_label_cardinality_is_bounded():
    """Pools beyond max_pools are summed under pool="other"; assignment is sticky."""
    cache = he.StorageExistenceCache(10)
    series_reader = SeriesReader(cache, max_pools=2, initial_pools=("kv",))
    for name in ("kv", "swa", "mamba", "draft"):
        cache.pool(name).add([f"{name}-1", f"{name}-2"])
    samples = series_reader.sample()["hicache_existence_page_inserts"]
    assert samples == {("kv",): 2, ("swa",): 2, ("other",): 4}
    cache.pool("late").add(["x"])
    assert series_reader.sample()["hicache_existence_page_inserts"][("other",)] == 5


def test_flat_generation_exports_shared_capacity_and_reasons():
    """The seed generation exports per-pool counters and its one shared cap."""
    ghosts = GhostFactory(50, memory_fraction=1.0)
    cache = he.FlatStorageExistenceCache(50, miss_memory=ghosts)
    a = workload.chain(1, 40, "flatprom")
    cache.add("kv", a)
    cache.add("swa", workload.chain(2, 40, "flatprom"))  # evicts 30 kv pages
    assert not cache.contains_all("kv", a)
    series_reader = SeriesReader(cache, ghosts=ghosts, max_pools=1)
    series_reader.settle()
    out = series_reader.sample()
    assert out["hicache_existence_capacity_entries"] == {("kv",): 50, ("other",): 50}
    assert out["hicache_existence_evictions"][("kv",)] == 30
    assert out["hicache_existence_page_misses"][("kv", "evicted")] == 1


def test_collector_never_fails_registration_and_describes_catalog():
    """describe() lists every family without taking a snapshot."""

    class Exploding:
        def stats(self):
            raise AssertionError("snapshot taken at registration")

    collector = PrometheusCollector(SeriesReader(Exploding()))
    CollectorRegistry().register(collector)
    assert [m.name for m in collector.describe()] == [spec.name for spec in CATALOG]


@pytest.mark.prometheus
def test_exposition_passes_promtool_lint():
    """promtool check metrics accepts the exposition (names, units, help)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1":
            pytest.fail("promtool is required (apt-get install prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    cache, writes, ghosts = scripted()
    registry = CollectorRegistry()
    registry.register(
        PrometheusCollector(SeriesReader(cache, writes=writes, ghosts=ghosts), LABELS)
    )
    run = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout.decode() + run.stderr.decode()


def test_telemetry_standalone_serves_configured_address():
    """Telemetry in standalone mode serves on metrics.host:port and step() feeds
    the monitor at most once per flush interval."""
    now = [0.0]
    config = Config.from_mapping(
        {"metrics": {"mode": "standalone", "host": "127.0.0.1", "port": 0, "flush_interval_s": 10}}
    )
    cache = he.StorageExistenceCache(4)
    t = Telemetry(cache, config, LABELS, clock=lambda: now[0])
    t.start()
    try:
        assert t.server is not None and t.server.host == "127.0.0.1" and t.server.port > 0
        assert t.step() is True
        assert t.step() is False
        now[0] = 11.0
        assert t.step() is True
        with urllib.request.urlopen(t.server.url, timeout=10) as response:
            assert b"hicache_existence_entries" in response.read()
    finally:
        t.close()


def test_idle_connections_do_not_hold_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standalone server runs a thread per connection in the scheduler process:
    a client that sends nothing is dropped after CONNECTION_TIMEOUT_S."""
    import socket
    import threading
    import time

    from hicache_existence.exporters import prometheus

    monkeypatch.setattr(prometheus, "CONNECTION_TIMEOUT_S", 0.5)
    server = serve(SeriesReader(he.StorageExistenceCache(16)), port=0)
    socks = []
    try:
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(16)]
        deadline = time.monotonic() + 10
        while threading.active_count() - before > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() - before <= 2
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200  # a real scrape still answers
    finally:
        for s in socks:
            s.close()
        server.close()


def test_the_startup_line_masks_storage_backend_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """storage_backend is masked in its label; the start-up line masks it too."""
    import logging

    cfg = Config.from_json(
        '{"metrics": {"mode": "off", "storage_backend": "redis://svc:hunter2@l3:6379/0"}}'
    )
    telemetry = Telemetry(he.StorageExistenceCache(16), cfg)
    assert "hunter2" not in str(telemetry.labels.values())
    with caplog.at_level(logging.INFO, logger="hicache_existence"):
        telemetry.start()
    try:
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "hicache_existence.startup" in text and "hunter2" not in text
        assert (
            Config.from_json('{"metrics": {"storage_backend": "file"}}').redacted()["metrics"][
                "storage_backend"
            ]
            == "file"
        )
    finally:
        telemetry.close()


def test_a_shared_cap_reached_by_the_pools_together_is_at_capacity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The seed generation's pools share one cap, which no single pool reaches:
    cache_at_capacity is logged when their sum does (docs/runbooks.md)."""
    import logging

    from hicache_existence.core.flat import FlatStorageExistenceCache
    from hicache_existence.exporters.monitor import Monitor

    cache = FlatStorageExistenceCache(100)
    cache.add("kv", [f"{i:064x}" for i in range(60)])
    cache.add("swa", [f"{i + 1000:064x}" for i in range(60)])
    with caplog.at_level(logging.INFO, logger="hicache_existence"):
        Monitor().observe(cache.stats())
    assert any("cache_at_capacity" in r.getMessage() for r in caplog.records)


def test_an_idle_connection_times_out_silently(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The timeout drops the connection without a traceback on the scheduler's stderr."""
    import socket
    import time

    from hicache_existence.exporters import prometheus

    monkeypatch.setattr(prometheus, "CONNECTION_TIMEOUT_S", 0.3)
    server = prometheus.MetricsServer(CollectorRegistry(), host="127.0.0.1", port=0)
    with server, socket.create_connection((server.host, server.port)):
        time.sleep(1.0)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("generation, scope", [("current", "pool"), ("flat", "shared")])
def test_mode_info_says_whether_the_pools_share_their_cap(generation: str, scope: str) -> None:
    """The seed generation's pools fill one cap together: mode_info's capacity_scope
    lets the fill recording rule and the doctor read it right."""
    from hicache_existence.runtime import ExistenceRuntime

    runtime = ExistenceRuntime(
        Config.from_json('{"metrics": {"mode": "off"}}'), generation=generation
    )
    try:
        out = runtime.telemetry.series_reader.sample()
        (labels,) = out["hicache_existence_mode_info"]
        assert labels[-1] == scope
    finally:
        runtime.close()
