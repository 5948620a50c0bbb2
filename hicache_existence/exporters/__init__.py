"""Exporters: Prometheus (standalone and multiprocess), OpenTelemetry, log events.

All of them read snapshots through one ``SeriesReader`` (``exporters.series``), never
the cache's internals.  ``Telemetry`` wires them from a ``Config`` for one
scheduler process; the SGLang integration calls ``Telemetry.step()`` once per
scheduler step (after ``check_hicache_events``), which does nothing until
``metrics.flush_interval_s`` has passed.

Heavy dependencies are imported only by the exporter that needs them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from hicache_existence import logs
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.exporters.features import FeatureSources
from hicache_existence.exporters.monitor import Monitor
from hicache_existence.exporters.series import PoolLabeler, SeriesReader, StatsSource

__all__ = [
    "FeatureSources",
    "PoolLabeler",
    "SeriesReader",
    "Telemetry",
    "parse_pools",
    "resolve_mode",
]


def parse_pools(text: str) -> tuple[str, ...]:
    """``"kv, swa"`` -> ``("kv", "swa")`` (the ``metrics.initial_pools`` setting)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def resolve_mode(mode: str, env: dict[str, str] | None = None) -> str:
    """``auto`` -> ``multiprocess`` when ``PROMETHEUS_MULTIPROC_DIR`` is set
    (SGLang ``--enable-metrics``), else ``standalone``; ``mode`` is
    ``metrics.mode``, one of its values (Config checks it)."""
    if mode != "auto":
        return mode
    environ = os.environ if env is None else env
    return "multiprocess" if environ.get("PROMETHEUS_MULTIPROC_DIR") else "standalone"


class Telemetry:
    """Metrics and log events for one cache in one process.

    ``start()`` binds the standalone server (if that is the mode); ``step()`` is
    the per-scheduler-step hook; ``close()`` releases the port.  Nothing here
    raises into the scheduler after construction.
    """

    def __init__(
        self,
        cache: StatsSource,
        config: Config | None = None,
        labels: DeploymentLabels | None = None,
        *,
        writes: WriteAccounting | None = None,
        ghosts: GhostFactory | None = None,
        clock: Callable[[], float] | None = None,
        env: dict[str, str] | None = None,
        features: FeatureSources | None = None,
        write_families: bool = True,
    ) -> None:
        self.config = config or Config()
        section = self.config.metrics
        self.labels = labels or DeploymentLabels(
            model_name=section.model_name, storage_backend=section.storage_backend
        )
        self.mode = resolve_mode(section.mode, env) if section.enabled else "off"
        self._clock = clock or time.monotonic
        self.series_reader = SeriesReader(
            cache,
            writes=writes,
            ghosts=ghosts,
            max_pools=section.max_pools,
            initial_pools=parse_pools(section.initial_pools),
            features=features,
            write_families=write_families,
        )
        self.monitor = Monitor(clock=self._clock)
        self.feeder: Any = None
        self.server: Any = None
        self._cache = cache
        # The clock value from which the next flush is due (the first step flushes).
        # One float compare per scheduler step is all a step between flushes costs.
        self._interval = section.flush_interval_s
        self._due = -math.inf
        self._logger = logs.get_logger("hicache_existence.exporters")
        self._errors = logs.RateLimiter(1 / 60, clock=self._clock)
        if self.mode == "multiprocess":
            from hicache_existence.exporters.multiprocess import MultiprocessFeeder

            self.feeder = MultiprocessFeeder(
                self.series_reader, self.labels, flush_interval_s=0.0, clock=self._clock
            )

    def start(self) -> None:
        """Serve ``/metrics`` on ``metrics.host:metrics.port`` in standalone mode
        and log the start-up configuration (credentials redacted)."""
        section = self.config.metrics
        if self.mode == "standalone" and self.server is None:
            from hicache_existence.exporters.prometheus import serve

            self.server = serve(
                self.series_reader, self.labels, host=section.host, port=section.port
            )
        self._logger.info(
            logs.STARTUP,
            mode=self.mode,
            labels=self.labels.as_dict(),
            config=self.config.redacted(),
        )

    @property
    def due_at(self) -> float:
        """The clock value from which ``step`` flushes again."""
        return self._due

    def step(self) -> bool:
        """Flush metrics and derive log events if ``flush_interval_s`` passed."""
        now = self._clock()
        if now < self._due:
            return False
        self._due = now + self._interval
        try:
            self.series_reader.settle()
            flushed = self.feeder is not None and self.feeder.flush(force=True)
            stats = self.series_reader.last_cache_stats if flushed else None  # what it exported
            self.monitor.observe(stats if stats is not None else self._cache.stats())
            return True
        except Exception as exc:  # never raise into the scheduler
            if self._errors.allow():
                self._logger.error(logs.EXPORTER_ERROR, exporter="telemetry", error=repr(exc))
            return False

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
