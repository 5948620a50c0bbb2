"""Standalone Prometheus export: a collector that reads the accounting at scrape
time (one O(pools) ``stats()`` snapshot on the scrape thread, which never locks
the cache), and a ``/metrics`` HTTP server.  For SGLang *without*
``--enable-metrics``; with it, prometheus_client's multiprocess mode does not
aggregate custom collectors: ``exporters.multiprocess`` feeds it instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hicache_existence import logs
from hicache_existence.exporters.catalog import DeploymentLabels, MetricSpec
from hicache_existence.exporters.series import SeriesReader

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
#: Seconds a /metrics connection may stay silent (request not sent, response not read).
CONNECTION_TIMEOUT_S = 10.0


_FAMILIES = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
}


def _family(spec: MetricSpec) -> Any:
    return _FAMILIES[spec.kind](spec.name, spec.help, labels=spec.label_names, unit=spec.unit)


class PrometheusCollector(Collector):
    """Renders the catalog from a ``SeriesReader`` at each scrape."""

    def __init__(self, series_reader: SeriesReader, labels: DeploymentLabels | None = None) -> None:
        self.series_reader = series_reader
        self._deployment = (labels or DeploymentLabels()).values()

    def _specs(self) -> tuple[MetricSpec, ...]:
        return (*self.series_reader.specs, *self.series_reader.feature_specs())

    def describe(self) -> Iterable[Metric]:
        """Families without samples: registration does not take a snapshot."""
        return [_family(spec) for spec in self._specs()]

    def collect(self) -> Iterator[Metric]:
        samples, histograms = self.series_reader.sample_all()
        deployment = list(self._deployment)
        for spec in self._specs():
            family = _family(spec)
            if spec.kind == "histogram":
                for key, (bounds, cumulative, total) in histograms.get(spec.name, {}).items():
                    buckets = [(repr(float(b)), float(c)) for b, c in zip(bounds, cumulative)]
                    buckets.append(("+Inf", float(cumulative[-1] if cumulative else 0)))
                    family.add_metric([*deployment, *key], buckets, total)
            else:
                for key, value in samples.get(spec.name, {}).items():
                    family.add_metric([*deployment, *key], value)
            yield family


class MetricsServer:
    """A ``/metrics`` endpoint serving one registry from a daemon thread."""

    def __init__(
        self, registry: CollectorRegistry, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT
    ) -> None:
        # host and port are metrics.host / metrics.port, checked by Config.
        self.registry = registry
        self._httpd: Any
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        # One thread per connection: without a socket timeout a client that sends
        # nothing (or never reads) holds its thread in this scheduler process forever.
        handler = self._httpd.RequestHandlerClass

        def handle(request_handler: Any) -> None:
            try:
                handler.handle(request_handler)
            except OSError:  # timed out or gone: no traceback on the scheduler's stderr
                request_handler.close_connection = True

        self._httpd.RequestHandlerClass = type(
            handler.__name__, (handler,), {"timeout": CONNECTION_TIMEOUT_S, "handle": handle}
        )
        address = self._httpd.server_address
        self.host = str(address[0])
        self.port = int(address[1])
        logs.get_logger("hicache_existence.exporters").info(
            logs.METRICS_SERVER_STARTED, host=self.host, port=self.port
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def registry_for(
    series_reader: SeriesReader, labels: DeploymentLabels | None = None
) -> CollectorRegistry:
    """A fresh registry holding one collector for ``series_reader``."""
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(series_reader, labels))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry`` (what a scrape receives)."""
    return bytes(generate_latest(registry))


def serve(
    series_reader: SeriesReader,
    labels: DeploymentLabels | None = None,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
) -> MetricsServer:
    """Serve a fresh registry holding a collector for ``series_reader`` on
    ``host:port`` (port 0 picks a free port; see ``.port``)."""
    return MetricsServer(registry_for(series_reader, labels), host, port)
