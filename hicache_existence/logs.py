"""Structured log events: loggers, stable event names, rate limiting, CLI setup.

The library only *asks* for loggers: applications (SGLang, the CLI) decide where
events go.  An event is a stable name plus key-value fields, sent through
structlog when the application configured it (an optional extra), else to the
stdlib logger of the same name as ``"<event> key=value ..."`` with the name and
fields also on the record (``hicache_event``, ``hicache_fields``), so SGLang's own
handlers show it.

``configure_logging`` is for the CLI only.  ``configure_package_logging`` applies
the ``logging`` settings inside a host application (the SGLang plugin): a level and
optionally a JSON handler on the ``hicache_existence`` logger, never the root one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from functools import partialmethod
from typing import IO, Any

from hicache_existence.core import _validate

try:  # optional extra
    import structlog as _structlog
except ImportError:  # pragma: no cover - exercised by the bare-import check
    _structlog = None  # type: ignore[assignment]

# -- event names (stable: dashboards, log queries and runbooks match on them) --
#: Start-up configuration (redacted), generation, deployment labels, version.
STARTUP = "hicache_existence.startup"
#: A pool reached its cap for the first time (fields: pool, entries, capacity).
CACHE_AT_CAPACITY = "hicache_existence.cache_at_capacity"
#: Evictions in one interval exceeded the burst threshold (rate-limited).
EVICTION_BURST = "hicache_existence.eviction_burst"
#: A pool was cleared (fields: pool, clears, cleared_pages).
CACHE_CLEARED = "hicache_existence.cache_cleared"
#: One sampled page miss with its reason (debug level, rate-limited).
MISS_TRACED = "hicache_existence.miss_traced"
#: The standalone /metrics server is listening (fields: host, port).
METRICS_SERVER_STARTED = "hicache_existence.metrics_server_started"
#: An exporter failed and skipped a flush or scrape (rate-limited).
EXPORTER_ERROR = "hicache_existence.exporter_error"

EVENTS: tuple[str, ...] = (
    STARTUP,
    CACHE_AT_CAPACITY,
    EVICTION_BURST,
    CACHE_CLEARED,
    MISS_TRACED,
    METRICS_SERVER_STARTED,
    EXPORTER_ERROR,
)


def _logfmt(fields: Mapping[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if not isinstance(value, str) or not value or any(c in value for c in ' "=\n'):
            value = json.dumps(value, default=str)  # strings: only when empty or not one word
        parts.append(f"{key}={value}")
    return " ".join(parts)


class EventLogger:
    """Logs ``event`` with keyword fields; see the module docstring for routing.
    ``name``: a stdlib logger name under ``hicache_existence``."""

    __slots__ = ("_stdlib", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._stdlib = logging.getLogger(name)

    def _emit(self, level: int, event: str, /, **fields: Any) -> None:
        if _structlog is not None and _structlog.is_configured():
            _structlog.get_logger(self.name).log(level, event, **fields)
            return
        logger = self._stdlib
        if logger.isEnabledFor(level):
            message = f"{event} {_logfmt(fields)}" if fields else event
            logger.log(
                level,
                "%s",
                message,
                extra={"hicache_event": event, "hicache_fields": fields},
            )

    #: ``debug(event, **fields)`` and so on: one method per level.
    debug = partialmethod(_emit, logging.DEBUG)
    info = partialmethod(_emit, logging.INFO)
    warning = partialmethod(_emit, logging.WARNING)
    error = partialmethod(_emit, logging.ERROR)

    def is_enabled_for_debug(self) -> bool:
        """Whether a debug event would be emitted (cheap; lets callers skip work)."""
        if _structlog is not None and _structlog.is_configured():
            check = getattr(_structlog.get_logger(self.name), "is_enabled_for", None)
            return bool(check(logging.DEBUG)) if callable(check) else True
        return self._stdlib.isEnabledFor(logging.DEBUG)


def get_logger(name: str = "hicache_existence") -> EventLogger:
    """The event logger ``name`` (a stdlib logger name under ``hicache_existence``)."""
    return EventLogger(name)


class RateLimiter:
    """A token bucket: ``rate`` events per second, bursts of up to ``burst``.

    Not thread-safe by design: each limiter belongs to one thread's code path.
    """

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens", "suppressed")

    def __init__(
        self, rate: float, burst: float = 1.0, clock: Callable[[], float] | None = None
    ) -> None:
        if not _validate.number(rate, "rate") >= 0:
            raise ValueError(f"rate must be >= 0, got {rate}")
        if not _validate.number(burst, "burst") >= 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self._rate = float(rate)
        self._burst = float(burst)
        self._clock = clock or time.monotonic
        self._tokens = float(burst)
        self._last = self._clock()
        #: Events refused since the last allowed one (reported with the next).
        self.suppressed = 0

    def allow(self) -> bool:
        """Take a token if one is available."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        """Events refused since the last call (then reset to 0)."""
        count, self.suppressed = self.suppressed, 0
        return count


# -- CLI only --------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per stdlib record (used when structlog is not installed)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "hicache_event", None) or record.getMessage(),
        }
        fields = getattr(record, "hicache_fields", None)
        if isinstance(fields, dict):  # any record reaches a root handler
            for key, value in fields.items():
                out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


_LEVELS = {
    n: getattr(logging, n.upper()) for n in ("debug", "info", "warning", "error", "critical")
}


def configure_logging(
    level: str = "info", *, json_output: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    """Route every log record (stdlib and structlog) to ``stream`` (stderr).

    For the CLI only: it replaces the root logger's handlers and, when structlog
    is installed, structlog's global configuration.  Returns the handler.
    """
    if not isinstance(level, str) or level.lower() not in _LEVELS:
        raise ValueError(f"level must be one of {sorted(_LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(stream)  # None: stderr
    if _structlog is not None:
        shared: list[Any] = [
            _structlog.stdlib.add_log_level,
            _structlog.stdlib.add_logger_name,
            _structlog.processors.TimeStamper(fmt="iso", utc=True),
        ]
        renderer: Any = (
            _structlog.processors.JSONRenderer()
            if json_output
            else _structlog.dev.ConsoleRenderer(colors=False)
        )
        handler.setFormatter(
            _structlog.stdlib.ProcessorFormatter(
                processors=[
                    _hoist_stdlib_fields,
                    _structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    renderer,
                ],
                foreign_pre_chain=shared,
            )
        )
        _structlog.configure(
            processors=[
                _structlog.stdlib.filter_by_level,
                *shared,
                _structlog.processors.format_exc_info,
                _structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
            ],
            logger_factory=_structlog.stdlib.LoggerFactory(),
            wrapper_class=_structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=False,
        )
    elif json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_LEVELS[level.lower()])
    return handler


#: The logger every event of the package descends from.
PACKAGE_LOGGER = "hicache_existence"


class _PackageHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The JSON handler ``configure_package_logging`` owns (found again by type)."""


def configure_package_logging(
    level: str = "", *, json_output: bool = False, stream: IO[str] | None = None
) -> None:
    """Apply the ``logging`` section to the ``hicache_existence`` logger only.

    For integrations inside someone else's process (SGLang): ``level`` sets the
    package logger's level ("" leaves it to the root level); ``json_output`` gives
    the package its own JSON-lines handler on ``stream`` (stderr) and stops its
    records from also reaching the application's handlers (each event printed
    once).  Other loggers and structlog are left alone.  Idempotent: a second call
    replaces what the first set.
    """
    if not isinstance(level, str) or (level and level.lower() not in _LEVELS):
        raise ValueError(f"level must be '' or one of {sorted(_LEVELS)}, got {level!r}")
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(_LEVELS[level.lower()] if level else logging.NOTSET)
    for old in [h for h in logger.handlers if isinstance(h, _PackageHandler)]:
        logger.removeHandler(old)
    if json_output:
        handler = _PackageHandler(stream)  # None: stderr
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
        logger.propagate = False
    else:
        logger.propagate = True


def _hoist_stdlib_fields(
    logger: Any, method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A stdlib record carrying an event name and fields renders like a structlog event."""
    record = event_dict.get("_record")
    name = getattr(record, "hicache_event", None)
    if name:
        event_dict["event"] = name
        fields = getattr(record, "hicache_fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                event_dict.setdefault(key, value)
    return event_dict
