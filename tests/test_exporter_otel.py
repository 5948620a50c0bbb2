"""OpenTelemetry export through the API, read with the SDK's in-memory reader:
same values as the Prometheus exporters, one snapshot per collection, spans."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel-sdk extra is needed for this test")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

import hicache_existence as he
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.exporters import otel
from hicache_existence.exporters.catalog import CATALOG, DeploymentLabels
from hicache_existence.exporters.series import SeriesReader
from hicache_existence_bench import workload

LABELS = DeploymentLabels(model_name="m", tp_rank=2)


def points(reader):
    """{(metric name, sorted attributes): value} of one collection."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    out[(metric.name, tuple(sorted(p.attributes.items())))] = p.value
    return out


def setup():
    """A cache with traffic, write accounting and an exporter on an SDK provider."""
    ghosts = GhostFactory(50, memory_fraction=1.0)
    cache = he.StorageExistenceCache(50, miss_memory=ghosts)
    writes = WriteAccounting(page_size_bytes=100)
    chain = workload.chain(1, 60, "otel")
    cache.pool("kv").add(chain)  # 10 evictions
    cache.pool("kv").contains_all(chain)  # evicted miss
    writes.written("kv", 60)
    series_reader = SeriesReader(cache, writes=writes, ghosts=ghosts, initial_pools=("kv", "swa"))
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = otel.OTelExporter(series_reader, LABELS, meter_provider=provider)
    return cache, series_reader, reader, exporter


def test_instruments_report_the_sampler_values():
    """Every catalog metric is observed with the SeriesReader's values and labels as attributes."""
    _, series_reader, reader, _ = setup()
    got = points(reader)
    expected = series_reader.sample()
    base = LABELS.as_dict()
    for spec in CATALOG:
        extra = ("pool", *spec.extra_labels)
        for key, value in expected[spec.name].items():
            attrs = tuple(sorted({**base, **dict(zip(extra, key))}.items()))
            assert got[(spec.name, attrs)] == value, (spec.name, key)
    kv = tuple(sorted({**base, "pool": "kv"}.items()))
    assert got[("hicache_existence_evictions", kv)] == 10
    assert got[("hicache_existence_written_bytes", kv)] == 6000


def test_one_snapshot_per_collection_and_counters_advance():
    """A collection takes one snapshot whatever the callback order; the next one
    sees new traffic."""
    cache, _, reader, exporter = setup()
    points(reader)
    assert exporter.snapshots == 1
    cache.pool("kv").add(["new"])
    got = points(reader)
    assert exporter.snapshots == 2
    kv = tuple(sorted({**LABELS.as_dict(), "pool": "kv"}.items()))
    assert got[("hicache_existence_evictions", kv)] == 11


def test_span_wraps_slow_work_with_attributes():
    """span() records one span with its name and attributes on the SDK tracer."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with otel.span(otel.SPAN_RECONCILE, tracer_provider=provider, pool="kv", pages=12) as current:
        assert current is not None
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "hicache_existence.reconcile"
    assert dict(finished.attributes) == {"pool": "kv", "pages": 12}
    with pytest.raises(TypeError, match="name"), otel.span(""):
        pass


def test_span_records_nothing_and_starts_nothing_without_a_provider():
    """No provider (the API's proxy) or the no-op one: span() yields ``None`` (no
    tracer, no context switch on the scheduler thread); a real one gets the span."""
    from opentelemetry import trace

    with otel.span(otel.SPAN_RECONCILE, tracer_provider=trace.NoOpTracerProvider()) as current:
        assert current is None
    with otel.span(otel.SPAN_RECONCILE, tracer_provider=trace.ProxyTracerProvider()) as current:
        assert current is None
    with otel.span(otel.SPAN_RECONCILE, tracer_provider=TracerProvider()) as current:
        assert current is not None and current.is_recording()


#: A runtime checking every 5 steps: 10 steps before the application sets its global
#: tracer provider, 10 after.  Its own process: the global provider is set once.
_RUNTIME_SPANS = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from hicache_existence.config import Config
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.runtime import ExistenceRuntime

env = {"HICACHE_EXISTENCE_ENABLED": "1", "HICACHE_EXISTENCE_METRICS__MODE": "off",
       "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "5"}
runtime = ExistenceRuntime(Config.load(None, env), DeploymentLabels(), generation="current")
for _ in range(10):
    runtime.step()
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
for _ in range(10):
    runtime.step()
print(runtime.checker.stats().checks)
for s in exporter.get_finished_spans():
    print(s.name, s.attributes["step"])
"""


def test_a_provider_set_after_start_up_gets_the_divergence_check_spans():
    """The runtime's divergence checks are spans once the application sets a global
    tracer provider, not before (span() asks at every call)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _RUNTIME_SPANS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    checks, *spans = proc.stdout.split("\n")[:-1]
    assert checks == "4"
    assert spans == [f"{otel.SPAN_DIVERGENCE_CHECK} 15", f"{otel.SPAN_DIVERGENCE_CHECK} 20"]


def test_every_family_but_histograms_is_an_instrument_and_the_doc_says_so():
    """With every feature on, OTel has one instrument per catalog family except the
    histograms, and docs/metrics.md names each histogram as Prometheus-only."""
    from pathlib import Path

    from hicache_existence.exporters.catalog import FEATURE_CATALOG
    from hicache_existence.exporters.features import FeatureSources

    def unused():  # no reader is attached, so no callback ever runs
        raise AssertionError("collected")

    sources = FeatureSources(
        divergence=unused,
        reconciler=unused,
        advisor=unused,
        mode=unused,
        recorder=unused,
        events=unused,
    )
    cache = he.StorageExistenceCache(10)
    reader = SeriesReader(cache, features=sources)
    exporter = otel.OTelExporter(reader, meter_provider=MeterProvider())
    names = {instrument.name for instrument in exporter.instruments}
    histograms = {f.name for f in FEATURE_CATALOG if f.kind == "histogram"}
    assert histograms, "the catalog has a histogram family"
    expected = {s.name for s in CATALOG} | {f.name for f in FEATURE_CATALOG} - histograms
    assert names == expected
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    intro = doc.split("## Labels", 1)[0]
    for name in histograms:
        assert f"`{name}` is exported through Prometheus only" in intro, name
