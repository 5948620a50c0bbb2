"""Prometheus export inside SGLang ``--enable-metrics`` (prometheus_client
multiprocess mode).

SGLang's HTTP server aggregates each scheduler process's mmap files in
``PROMETHEUS_MULTIPROC_DIR`` with ``MultiProcessCollector``, which ignores custom
collectors; so this feeds ordinary metric objects, never per page: a ``flush()``
applies one O(pools x metrics) batch of counter increments and gauge sets.  One
feeder per process: two with the same label set in one process would share mmap
entries.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from hicache_existence import logs
from hicache_existence.exporters.catalog import (
    GAUGE_MULTIPROCESS_MODE,
    DeploymentLabels,
    MetricSpec,
)
from hicache_existence.exporters.features import HistogramSamples, HistogramValue
from hicache_existence.exporters.series import Samples, SeriesKey, SeriesReader


def multiprocess_active() -> bool:
    """Whether prometheus_client writes values to multiprocess files (decided
    when prometheus_client was first imported, as SGLang arranges)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False)) and bool(
        os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    )


class MultiprocessFeeder:
    """Feeds prometheus_client metrics from a ``SeriesReader`` in rate-limited
    batches; ``registry=None`` registers nothing in-process (the values live in
    the mmap files)."""

    def __init__(
        self,
        series_reader: SeriesReader,
        labels: DeploymentLabels | None = None,
        *,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.series_reader = series_reader
        self.flush_interval_s = float(flush_interval_s)
        self._clock = clock or time.monotonic
        self._deployment = (labels or DeploymentLabels()).values()
        self._registry = registry
        specs = (*series_reader.specs, *series_reader.feature_specs())
        # Histograms are created at their first sample, which carries their buckets.
        self._histograms = tuple(s for s in specs if s.kind == "histogram")
        self._metrics: dict[str, Any] = {
            s.name: self._make(s) for s in specs if s.kind != "histogram"
        }
        self._children: dict[tuple[str, SeriesKey], Any] = {}
        #: The value last applied per series: a counter's total, a gauge's value.
        self._previous: dict[tuple[str, SeriesKey], float] = {}
        #: (name, is a gauge) of every scalar family, in catalog order.
        self._scalars = tuple((s.name, s.kind == "gauge") for s in specs if s.kind != "histogram")
        self._previous_hist: dict[tuple[str, SeriesKey], tuple[tuple[int, ...], float]] = {}
        self._last: float | None = None
        self._errors = logs.RateLimiter(1 / 60, clock=self._clock)
        self._logger = logs.get_logger("hicache_existence.exporters")
        # Every series of the pools known now exists at 0 from the start.
        self._apply(*series_reader.sample_all(), counters=False)

    def _make(self, spec: MetricSpec, **options: Any) -> Any:
        """The prometheus_client metric of one family (gauges: ``mostrecent``)."""
        if spec.kind == "gauge":
            options["multiprocess_mode"] = GAUGE_MULTIPROCESS_MODE
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[spec.kind]
        return cls(
            spec.name,
            spec.help,
            spec.label_names,
            unit=spec.unit,
            registry=self._registry,
            **options,
        )

    def flush(self, *, force: bool = False) -> bool:
        """Apply the accounting since the last flush if ``flush_interval_s`` has
        passed (or ``force``).  Never raises; returns whether it flushed."""
        try:
            now = self._clock()
            if not force and self._last is not None and now - self._last < self.flush_interval_s:
                return False
            self._last = now
            self.series_reader.settle()  # flush runs on the scheduler thread
            self._apply(*self.series_reader.sample_all(), counters=True)
            return True
        except Exception as exc:  # observability never raises into the scheduler
            if self._errors.allow():
                self._logger.error(
                    logs.EXPORTER_ERROR,
                    exporter="multiprocess",
                    error=repr(exc),
                    suppressed=self._errors.take_suppressed(),
                )
            return False

    def _child(self, name: str, key: SeriesKey) -> Any:
        child = self._children.get((name, key))
        if child is None:
            child = self._metrics[name].labels(*self._deployment, *key)
            self._children[(name, key)] = child
        return child

    def _apply(self, samples: Samples, histograms: HistogramSamples, *, counters: bool) -> None:
        """Write what changed since the previous flush: a counter's increment, a
        gauge whose value moved.  An unchanged series costs a dict lookup and a
        compare (a flush runs on the scheduler thread, and between two flushes
        most series do not move), and its child is not even looked up."""
        previous = self._previous
        get = previous.get
        for name, gauge in self._scalars:
            series = samples.get(name)
            if not series:
                continue
            for key, value in series.items():
                slot = (name, key)
                if gauge:
                    if get(slot) != value or slot not in self._children:
                        self._child(name, key).set(value)
                        previous[slot] = value
                elif not counters:
                    self._child(name, key)  # the child exists at 0; the first flush adds it all
                else:
                    delta = value - get(slot, 0.0)
                    if delta > 0:
                        self._child(name, key).inc(delta)
                        previous[slot] = value
        for spec in self._histograms:
            self._apply_histogram(spec, histograms.get(spec.name, {}), counters)

    def _apply_histogram(
        self, spec: MetricSpec, series: dict[SeriesKey, HistogramValue], counters: bool
    ) -> None:
        """Feed a histogram by bucket deltas.  prometheus_client's Histogram only
        offers observe(); its per-bucket values are incremented directly so the
        multiprocess files hold exactly the source's counts and sum."""
        for key, (bounds, cumulative, total) in series.items():
            if spec.name not in self._metrics:
                self._metrics[spec.name] = self._make(spec, buckets=bounds)
            child = self._child(spec.name, key)
            if not counters:
                continue
            per_bucket = [b - a for a, b in zip((0, *cumulative[:-1]), cumulative)]
            slot = (spec.name, key)
            old_counts, old_sum = self._previous_hist.get(slot, ((0,) * len(per_bucket), 0.0))
            for value, delta in zip(child._buckets, map(int.__sub__, per_bucket, old_counts)):
                if delta > 0:
                    value.inc(delta)
            if total - old_sum > 0:
                child._sum.inc(total - old_sum)
            self._previous_hist[slot] = (tuple(per_bucket), total)
