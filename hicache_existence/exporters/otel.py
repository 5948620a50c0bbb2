"""OpenTelemetry export through ``opentelemetry-api`` only (the SDK is the
application's choice, an optional extra here).

Every catalog metric becomes an observable counter or gauge whose callback reads
the ``SeriesReader`` values the Prometheus exporters render.  A callback takes a
fresh snapshot only when its own instrument has already read the current one, so
a collection costs one O(pools) snapshot plus O(pools) observations per
instrument, whatever order the SDK calls the callbacks in.

Spans: ``span()`` wraps slow, rare work only (a reconcile pass, a divergence
check), never a lookup; a no-op without opentelemetry or a recording tracer provider.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from hicache_existence._version import __version__ as _version
from hicache_existence.exporters.catalog import DeploymentLabels, MetricSpec
from hicache_existence.exporters.series import Samples, SeriesReader

try:  # optional extra
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised by the bare-import check
    _metrics = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

INSTRUMENTATION_NAME = "hicache_existence"
#: Tracer providers whose spans record nothing.
_SILENT: tuple[type, ...] = (
    (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider) if _trace is not None else ()
)

#: Span names (stable).
SPAN_RECONCILE = "hicache_existence.reconcile"
SPAN_DIVERGENCE_CHECK = "hicache_existence.divergence_check"


class OTelExporter:
    """Observable instruments for every catalog metric, on ``meter_provider``
    (default: the global provider, a no-op until the application sets one)."""

    def __init__(
        self,
        series_reader: SeriesReader,
        labels: DeploymentLabels | None = None,
        *,
        meter_provider: Any = None,
    ) -> None:
        if _metrics is None:
            raise RuntimeError(
                "OpenTelemetry export needs opentelemetry-api: "
                "pip install 'hicache-existence[otel]'"
            )
        self.series_reader = series_reader
        self._deployment = (labels or DeploymentLabels()).as_dict()
        provider = meter_provider if meter_provider is not None else _metrics.get_meter_provider()
        meter = provider.get_meter(INSTRUMENTATION_NAME, _version)
        self._lock = threading.Lock()
        self._samples: Samples | None = None
        self._consumed: set[str] = set()
        self.snapshots = 0
        self.instruments: list[Any] = []
        specs: list[MetricSpec] = [
            *series_reader.specs,
            # Histograms are left to Prometheus: an observable instrument cannot
            # carry pre-bucketed counts.
            *(f for f in series_reader.feature_specs() if f.kind != "histogram"),
        ]
        for spec in specs:
            counter = spec.kind == "counter"
            create = meter.create_observable_counter if counter else meter.create_observable_gauge
            callbacks = [partial(self._observe, spec)]
            self.instruments.append(
                create(spec.name, callbacks=callbacks, unit=spec.otel_unit, description=spec.help)
            )

    def _current(self, name: str) -> Samples:
        with self._lock:
            if self._samples is None or name in self._consumed:
                self._samples = self.series_reader.sample()
                self._consumed = set()
                self.snapshots += 1
            self._consumed.add(name)
            return self._samples

    def _observe(self, spec: MetricSpec, options: Any) -> list[Any]:
        """The instrument's callback: its observations from the shared snapshot."""
        assert _metrics is not None
        samples = self._current(spec.name)
        return [
            _metrics.Observation(value, {**self._deployment, **dict(zip(spec.labels, key))})
            for key, value in samples.get(spec.name, {}).items()
        ]


@contextmanager
def span(name: str, *, tracer_provider: Any = None, **attributes: Any) -> Iterator[Any]:
    """A span around slow work (``SPAN_RECONCILE``, ``SPAN_DIVERGENCE_CHECK``) on
    ``tracer_provider`` (default: the global one); yields the span, or ``None``
    without opentelemetry or while no provider that records is set."""
    if not isinstance(name, str) or not name:
        raise TypeError("name must be a non-empty str span name")
    if _trace is None:  # pragma: no cover - exercised by the bare-import check
        yield None
        return
    provider = tracer_provider
    if provider is None or isinstance(provider, _trace.ProxyTracerProvider):
        # The proxy forwards to the application's provider once one is set.
        provider = _trace.get_tracer_provider()
    if isinstance(provider, _SILENT):
        # No provider set yet (the API's proxy) or the no-op one: the span would
        # record nothing, and starting it costs ~15 us (a tracer, a context switch)
        # on the scheduler thread at every divergence check.  Asked at every call,
        # so a provider the application sets later is used from then on.
        yield None
        return
    tracer = provider.get_tracer(INSTRUMENTATION_NAME, _version)
    with tracer.start_as_current_span(name, attributes=attributes or None) as current:
        yield current
