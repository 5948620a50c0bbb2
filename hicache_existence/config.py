"""Everything the package can be told, in one ``Config`` (frozen dataclasses, one
section per feature), loaded from defaults, ``HICACHE_EXISTENCE_CONFIG``, the
``HICACHE_EXISTENCE_<SECTION>__<FIELD>`` variables and explicit values, later wins
(docs/enable.md).  Unknown keys and wrongly typed values raise ``ConfigError`` naming
the key, so a typo never silently falls back to a default.  Secrets (a Redis password
in a URL) are kept as given but ``redacted()`` masks them for logs and metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from hicache_existence.core import _validate

ENV_PREFIX = "HICACHE_EXISTENCE_"
ENV_CONFIG = "HICACHE_EXISTENCE_CONFIG"
#: Variables with the prefix that are not settings: tooling switches (test runner,
#: benchmark) and the index backend switch read once at import (``core.lru``).
ENV_NOT_SETTINGS = frozenset(
    {
        "HICACHE_EXISTENCE_CACHE_DIR",
        "HICACHE_EXISTENCE_MOONCAKE_TRACE",
        "HICACHE_EXISTENCE_PYTHON",
        "HICACHE_EXISTENCE_BACKEND",  # == hicache_existence.core.lru.ENV_BACKEND (tested)
    }
)
#: Prefixes of tooling variables (test runner, test environment builder, the
#: interpreters of tests/run-all.sh's matrix: HICACHE_EXISTENCE_PYTHON_3_11).
ENV_NOT_SETTINGS_PREFIXES = (
    "HICACHE_EXISTENCE_REQUIRE_",
    "HICACHE_EXISTENCE_ENV_",
    "HICACHE_EXISTENCE_PYTHON_",
)


def is_setting_variable(key: str) -> bool:
    """Whether ``key`` is a setting's variable, not the JSON blob or tooling."""
    return (
        key.startswith(ENV_PREFIX)
        and key != ENV_CONFIG
        and key not in ENV_NOT_SETTINGS
        and not key.startswith(ENV_NOT_SETTINGS_PREFIXES)
    )


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or out of range."""


#: ``recorder.path`` by default: fixed and absolute (docs/replay.md, "Recording a trace").
RECORDER_DEFAULT_PATH = "/tmp/hicache-existence-trace"
#: Settings naming a file or directory: made absolute (``~`` expanded; empty stays empty)
#: where they are loaded, never later in a process that may run elsewhere.
_PATHS = frozenset({"recorder.path"})
#: The recorder needs room for two files of at least one flush chunk each.
RECORDER_MIN_BYTES = 128 * 1024
_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

# Range rules, annotated on the fields they check (``_check_ranges``): each takes
# the value and returns what the setting must do instead, or "" when it is in range.
_Rule = Callable[[Any], str]


def _rule(ok: Callable[[Any], bool], must: str) -> _Rule:
    return lambda v: "" if ok(v) else must.format(v)


def _at_least(low: int) -> _Rule:
    return _rule(lambda v: v >= low, f"be >= {low}, got {{}}")


def _at_most(high: int) -> _Rule:
    return _rule(lambda v: v <= high, f"be <= {high}, got {{}}")


_within_0_1 = _rule(lambda v: 0.0 <= v <= 1.0, "be within [0, 1], got {}")
#: The smallest recorder.sample_rate: the bound is resolved to 2^-32, so below
#: 1e-6 the rate recorded parts from the rate replay scales by by more than 0.03%.
RECORDER_MIN_RATE = 1e-6
_recordable = _rule(lambda v: v >= RECORDER_MIN_RATE, f"be >= {RECORDER_MIN_RATE:g}, got {{}}")
_not_empty = _rule(bool, "not be empty")
#: What one part of a ledger key must be (``reconcile/redis_truth.py`` checks its own).
KEY_PART_RULE = "be non-empty without whitespace or ':'"


def key_part_ok(text: str) -> bool:
    """Whether ``text`` can be one part of a ledger key: ':' separates the parts, so
    namespace ``a:b`` would share keys with namespace ``a``, shard ``b``."""
    return bool(text) and ":" not in text and not any(c.isspace() for c in text)


_key_part = _rule(key_part_ok, KEY_PART_RULE + ", got {!r}")
_Count = Annotated[int, _at_least(1)]
_NonNegativeInt = Annotated[int, _at_least(0)]
_NonNegative = Annotated[float, _at_least(0)]
_Positive = Annotated[float, _rule(lambda v: v > 0, "be > 0, got {}")]
_Fraction = Annotated[float, _within_0_1]


@dataclass(frozen=True)
class CacheSection:
    """The cache itself."""

    #: Entries per pool (current generation) or shared (seed generation).
    max_entries: _Count = 512 * 1024
    #: ``auto`` matches the installed sglang's API shape; or force one.
    generation: Literal["auto", "current", "flat"] = "auto"


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus export."""

    enabled: bool = True
    #: ``auto``: multiprocess when ``PROMETHEUS_MULTIPROC_DIR`` is set (SGLang
    #: ``--enable-metrics``), else a standalone ``/metrics`` server.
    mode: Literal["auto", "multiprocess", "standalone", "off"] = "auto"
    host: str = "127.0.0.1"
    port: Annotated[int, _at_least(0), _at_most(65535)] = 9464
    #: Pools beyond this many distinct names are reported as ``other``.
    max_pools: _Count = 16
    #: Minimum seconds between two flushes of counters in multiprocess mode.
    flush_interval_s: _NonNegative = 1.0
    #: Bytes of one page in L3 (all layers), for the write accounting in bytes.
    page_size_bytes: _NonNegativeInt = 0
    model_name: str = ""
    storage_backend: str = ""
    #: Comma-separated pools whose series exist (at 0) before first use.
    initial_pools: str = "kv"


@dataclass(frozen=True)
class MissReasonSection:
    """Classification of misses (cold / evicted / invalidated / cleared)."""

    enabled: bool = True
    #: Memory of recent evictions as a fraction of the cache's own memory.
    memory_fraction: _Fraction = 0.10
    #: Sampled debug events per second per pool (0 disables them).
    debug_events_per_s: _NonNegative = 1.0
    #: One miss in this many is considered for a debug event.
    sample_every: _Count = 16


@dataclass(frozen=True)
class DivergenceSection:
    """Cross-rank replica checks (docs/tp-divergence.md).  Every rank must use the
    same values; a start-up handshake, which ranks with checks off join too,
    stops the checks on every rank otherwise."""

    enabled: bool = True
    #: Scheduler steps between checks (one ~0.5 ms gloo all-reduce each).
    interval_steps: _Count = 1000
    #: ``log`` an error event; ``heal`` by clearing the diverged pools on every
    #: rank; ``abort`` by raising (canaries, CI).
    policy: Literal["log", "heal", "abort"] = "log"
    #: Seconds a check waits for the other ranks before it gives up (> 0).
    timeout_s: _Positive = 30.0
    #: Every this many checks, also fold an exact O(entries) audit of changed pools
    #: (membership, in-flight refs; ~23 ms per 512K-entry pool with the compiled
    #: index, ~85-150 ms on the pure-Python one); 0 never audits.
    audit_every_checks: _NonNegativeInt = 100
    #: Fixed slots that pools hash into, to name diverged pools (1..1024).
    pool_slots: Annotated[int, _at_least(1), _at_most(1024)] = 16


@dataclass(frozen=True)
class ReconcilerSection:
    """Ground-truth reconciliation against L3 (Redis ledger); docs/reconciler.md."""

    enabled: bool = False
    #: redis://[user:password@]host:port/db, rediss:// (TLS) or unix://; a Redis
    #: Cluster as redis+cluster://[user:password@]host:port[,host:port...]
    #: (rediss+cluster:// for TLS); secret.
    redis_url: str = ""
    #: First component of every ledger key (deployments sharing one Redis).
    namespace: Annotated[str, _key_part] = "hicache"
    #: Ledger entry lifetime mirroring L3 retention (0: no expiry).
    ttl_s: _NonNegative = 0.0
    #: Budget: verifications admitted per second (agreed clock), burst of 1 s.
    verifications_per_s: _NonNegative = 50.0
    #: Budget: leading pages of a chain verified by one query.
    pages_per_query: _Count = 1024
    #: Budget: fraction of cache lookups whose chain is a verification candidate.
    sampling_rate: _Fraction = 0.01
    #: Per-query timeout (scheduler side) and Redis socket timeout (0 would be none:
    #: a hung Redis would hold the worker and the ledger writer for good).
    timeout_ms: _Positive = 50.0
    #: Timeout of opening a Redis connection (the client's socket connect timeout).
    connect_timeout_ms: _Positive = 50.0
    #: Redis client retries (exponential backoff from retry_backoff_ms).
    retries: _NonNegativeInt = 1
    retry_backoff_ms: _NonNegative = 5.0
    #: Queries admitted but not yet applied, at most.
    queue_size: _Count = 256
    #: Verdicts agreed and applied per agreement, at most (the vector's size).
    max_verdicts_per_step: _Count = 8
    #: Scheduler steps between two agreements (one gloo MIN all-reduce each).
    agree_interval_steps: _Count = 4
    #: Circuit breaker: consecutive errors to open, first and longest backoff.
    breaker_failures: _Count = 5
    breaker_backoff_s: _Positive = 1.0
    breaker_backoff_max_s: _NonNegative = 60.0
    #: Learn presence (all-pages pools) when ground truth shows pages beliefs lack.
    learn: bool = True
    #: Ledger writes per pipelined round trip.
    write_batch: _Count = 512
    #: ``lua`` (one script, stops at the first absent page) or ``pipeline``.
    method: Literal["lua", "pipeline"] = "lua"
    #: Redis Cluster: seconds absence is not evidence after a failed read or a
    #: failover (the new primary may lack the last records).
    failover_distrust_s: _NonNegative = 30.0

    def __repr__(self) -> str:
        return masked_repr(self, "redis_url")


@dataclass(frozen=True)
class AdvisorSection:
    """Live miss-ratio-curve estimation (capacity advice, docs/capacity.md)."""

    enabled: bool = True
    #: Fraction of page hashes sampled (SHARDS); 0 turns the advisor off.  Accuracy
    #: needs cap x rate >= ~2600 at the smallest cap asked about.
    sampling_rate: _Fraction = 0.02
    #: Sampled pages tracked per pool: bounds memory and the largest cap estimated
    #: (max_sampled_pages / sampling_rate entries).
    max_sampled_pages: _Count = 131072
    #: Page references after which a reference weighs half (0: the whole history).
    half_life_references: _NonNegativeInt = 0
    #: SHARDS-adj correction of the sample total (off: the plain ratio was more
    #: accurate on chained page streams, see docs/capacity.md).
    adjust: bool = False


@dataclass(frozen=True)
class CacheModeSection:
    """HiCache's default host memory mode, ``--hicache-host-memory-mode cache``
    (docs/enable.md): the package counts its L3 writes there; with ``dedup`` it
    also consults the existence cache before each write and skips believed pages."""

    #: Skip the L3 write of pages believed stored (opt-in; off: writes exactly as upstream).
    #: Ignored, with a warning, in buffer_only mode or without an L3 storage backend.
    dedup: bool = False


@dataclass(frozen=True)
class RecorderSection:
    """A sampled trace of the existence cache's traffic in the live server, written
    for ``hicache-existence replay`` (docs/replay.md, "Recording a trace").  Off by
    default; the scheduler only hands records to a writer thread, which compresses,
    rotates and bounds the files, and drops (and counts) what it cannot write."""

    #: Record (opt-in).
    enabled: bool = False
    #: Directory of the trace files (created if missing); each recording scheduler
    #: writes its own rotated ``*.jsonl.gz`` files there, named after its instance.
    #: Absolute by default (like SGLang's diagnostics under /tmp), whichever directory
    #: a supervisor starts the server in; a relative path (or ``~``) is made absolute
    #: once, at load, against that process's working directory.  Logged at start.
    path: Annotated[str, _not_empty] = RECORDER_DEFAULT_PATH
    #: Share of pages recorded, chosen by page hash (the first 32 bits of SGLang's
    #: hex hash below rate x 2^32): a page is recorded at every reference or never,
    #: on every rank and across restarts.  1: every page; at least 1e-6.
    sample_rate: Annotated[float, _within_0_1, _recordable] = 0.02
    #: Bytes on disk at most, over this instance's rotated files (oldest dropped first).
    max_bytes: Annotated[int, _at_least(RECORDER_MIN_BYTES)] = 256 * 1024 * 1024
    #: A file is closed and the next one started past this size (at most max_bytes / 2).
    file_bytes: Annotated[int, _at_least(RECORDER_MIN_BYTES)] = 16 * 1024 * 1024
    #: Records (request ends among them) waiting for the writer thread at most; beyond,
    #: dropped (counted), never waited for.
    queue_records: _Count = 65536
    #: Seconds between the writer thread's flushes to disk.
    flush_interval_s: _Positive = 1.0
    #: Which schedulers record: ``first`` (TP and PP rank 0 of each DP replica; the
    #: other ranks' replicas see the same traffic) or ``all``.
    ranks: Literal["first", "all"] = "first"


@dataclass(frozen=True)
class EventsSection:
    """Storage-tier KV events for routers and KV indexers (docs/kv-events.md):
    ``BlockStored`` when L3 acknowledges a write, ``BlockRemoved`` only when a
    verdict proves a page absent (or L3 is emptied), in SGLang's ``KVEventBatch``
    format.  Published by TP and PP rank 0 of each DP replica."""

    #: Publish the events (opt-in).
    enabled: bool = False
    #: ZeroMQ PUB endpoint of the package's own publisher, bound when SGLang runs
    #: without ``--kv-events-config`` (with it, SGLang's own publisher carries the
    #: events); the port is offset by the DP rank, as SGLang offsets its own (port
    #: ``0`` or ``*``: each replica binds a free port, named in its start-up line).
    endpoint: Annotated[str, _not_empty] = "tcp://127.0.0.1:5560"
    #: ``auto``: ``DISK`` for the file backend, ``EXTERNAL`` for every other one.
    medium: Literal["auto", "DISK", "EXTERNAL"] = "auto"
    #: Event lists waiting for the publisher thread at most; beyond it events are
    #: dropped and counted, never waited for.
    queue_size: _Count = 4096
    #: Published blocks remembered (for "once until removed" and for removals);
    #: the oldest confirmed are forgotten first.
    max_blocks: _Count = 1 << 20


@dataclass(frozen=True)
class LoggingSection:
    """The package's own log events (the ``hicache_existence`` loggers), in the
    SGLang processes it runs in and in the ``hicache-existence`` command line."""

    #: Level of the ``hicache_existence`` loggers; empty: the application's (SGLang's
    #: ``--log-level``; ``warning`` in the CLI, where ``--log-level`` overrides it).
    level: Literal["", "debug", "info", "warning", "error"] = ""
    #: One JSON object per event on stderr (in SGLang: a handler on the package's
    #: logger only, so SGLang's own lines keep their format); the CLI's ``--log-json``.
    json: bool = False


@dataclass(frozen=True)
class Config:
    """Every setting of hicache-existence."""

    enabled: bool = False
    cache: CacheSection = field(default_factory=CacheSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    miss_reasons: MissReasonSection = field(default_factory=MissReasonSection)
    divergence: DivergenceSection = field(default_factory=DivergenceSection)
    reconciler: ReconcilerSection = field(default_factory=ReconcilerSection)
    advisor: AdvisorSection = field(default_factory=AdvisorSection)
    cache_mode: CacheModeSection = field(default_factory=CacheModeSection)
    recorder: RecorderSection = field(default_factory=RecorderSection)
    events: EventsSection = field(default_factory=EventsSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    # -- construction --------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Config | None = None) -> Config:
        """``base`` (default: defaults) updated with the nested mapping ``data``."""
        return _merge(base or cls(), data, "")

    @classmethod
    def from_json(cls, text: str, base: Config | None = None) -> Config:
        """Parse JSON text, a path to a JSON file, or ``@path``."""
        return cls.from_mapping(_load_json(text), base)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, base: Config | None = None) -> Config:
        """Apply ``HICACHE_EXISTENCE_CONFIG`` then ``HICACHE_EXISTENCE_*`` variables."""
        env = os.environ if env is None else env
        blob = env.get(ENV_CONFIG)
        config = cls.from_json(blob, base) if blob else base
        return cls.from_mapping(_env_updates(env), config)

    @classmethod
    def load(cls, text: str | None = None, env: Mapping[str, str] | None = None) -> Config:
        """Defaults, then the environment, then ``text`` (JSON or a file)."""
        config = cls.from_env(env)
        return cls.from_json(text, config) if text else config

    @staticmethod
    def given_keys(text: str | None = None, env: Mapping[str, str] | None = None) -> frozenset[str]:
        """The dotted keys (``cache.max_entries``) ``load(text, env)`` takes from a source,
        not the defaults: the cap yields to sglang's variable unless the operator chose it."""
        env = os.environ if env is None else env
        keys = set(_dotted(_env_updates(env), ""))
        for blob in (env.get(ENV_CONFIG), text):
            if blob:
                keys.update(_dotted(_load_json(blob), ""))
        return frozenset(k.replace("-", "_") for k in keys)

    # -- output --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def redacted(self) -> dict[str, Any]:
        """``to_dict()`` with credentials masked, for logs and start-up events."""
        data = self.to_dict()
        data["reconciler"]["redis_url"] = redact_url(self.reconciler.redis_url)
        # Masked as in the storage_backend label (it may be an address with credentials).
        data["metrics"]["storage_backend"] = redact_url(self.metrics.storage_backend)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


#: Query parameters that carry a secret (redis-py reads ``?password=`` on every
#: scheme, and it is the only way to give a unix socket's password).
_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "token", "auth"})


def masked_repr(obj: Any, url_field: str) -> str:
    """A dataclass's repr with its URL field redacted: the generated one would show
    the password wherever the object is logged or raised with."""
    parts = []
    for f in dataclasses.fields(obj):
        if f.repr:
            value = getattr(obj, f.name)
            parts.append(f"{f.name}={redact_url(value) if f.name == url_field else value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


#: Why a URL did not parse, said without the parser's words (they may quote a
#: piece of the password).
URL_PARSE_ERROR = "a bad port, or a password with / ? # or @ not percent-encoded"


def split_url(url: str) -> SplitResult | None:
    """``urlsplit`` with its port read; None when either fails (say
    ``URL_PARSE_ERROR``, not the exception's text)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    return parts


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``, and
    ``?password=secret`` -> ``?password=***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    out = url
    rest = url.partition("://")[2]
    if ":" in parts.netloc and "@" in rest[len(parts.netloc) :]:
        # A password with an unencoded "/", "?" or "#" ends the netloc early
        # (``redis://:pa/ss@host``, ``redis://:p@ss/word@host``): mask up to the
        # last "@", whatever it hides.
        return f"{parts.scheme}://***@{rest.rpartition('@')[2]}"
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        masked = f"{user}:***@{hostport}" if user else f"***@{hostport}"
        out = urlunsplit((parts.scheme, masked, parts.path, parts.query, parts.fragment))
    items = parts.query.split("&")
    for i, item in enumerate(items):
        name, eq, _ = item.partition("=")
        if eq and unquote(name).lower() in _SECRET_PARAMS:
            items[i] = f"{name}=***"
    query = "&".join(items)
    if query != parts.query:  # splice, so that a unix:// URL keeps its form
        head, _, rest = out.partition("?")
        out = f"{head}?{query}{rest[len(parts.query) :]}"
    return out


class _EnvText(str):
    """A value that came from an environment variable: parsed by target type."""


def _env_updates(env: Mapping[str, str]) -> dict[str, Any]:
    """The setting variables of ``env`` as a nested mapping of ``_EnvText``."""
    updates: dict[str, Any] = {}
    for key, raw in env.items():
        if is_setting_variable(key):
            *sections, name = key[len(ENV_PREFIX) :].lower().split("__")
            node = updates
            for part in sections:
                node = node.setdefault(part, {})
            node[name] = _EnvText(raw)
    return updates


def _load_json(text: str) -> Mapping[str, Any]:
    text = text.strip()
    if text.startswith("@") or not text.startswith(("{", "[")):
        path = Path(text[1:] if text.startswith("@") else text)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(
                f"configuration is neither JSON nor a readable file: {str(path)[:80]!r} ({why})"
            ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"configuration is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("configuration JSON must be an object")
    return data


def _dotted(data: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


_T = TypeVar("_T")


def _merge(obj: _T, data: Mapping[str, Any], prefix: str) -> _T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'configuration'} must be an object")
    hints = typing.get_type_hints(type(obj))  # the fields, by name
    changes: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            raise ConfigError(f"unknown configuration key {prefix}{key!r}; known: {sorted(hints)}")
        current = getattr(obj, name)
        if is_dataclass(current):
            changes[name] = _merge(current, value, f"{prefix}{name}.")
        else:
            changes[name] = value = _coerce(value, hints[name], f"{prefix}{name}")
            if value and f"{prefix}{name}" in _PATHS:
                changes[name] = os.path.abspath(os.path.expanduser(value))
    result = dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    _check_ranges(result, prefix)
    return result


#: How a setting's type is named in errors, and what a source other than the
#: environment (JSON, explicit values) must give for it.
_TYPES: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    int: ("an integer", _validate.is_int),
    float: ("a number", _validate.is_number),
    str: ("a string", lambda v: isinstance(v, str)),
}
_ENV_BOOLS = {"1": True, "true": True, "yes": True, "on": True}
_ENV_BOOLS.update(dict.fromkeys(("0", "false", "no", "off", ""), False))


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if typing.get_origin(hint) is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return str(value)
    word, accepts = _TYPES[hint]
    if isinstance(value, _EnvText) and hint is not str:  # text parsed by the target type
        try:
            out = _ENV_BOOLS[value.strip().lower()] if hint is bool else hint(value)
        except (KeyError, ValueError):
            raise ConfigError(f"{key} must be {word}, got {value!r}") from None
    elif not accepts(value):
        raise ConfigError(f"{key} must be {word}, got {type(value).__name__}")
    else:
        out = hint(value)
    if hint is float and not math.isfinite(out):  # durations, rates: inf breaks their users
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return out


def _check_ranges(obj: Any, prefix: str) -> None:
    """The range rules annotated on ``obj``'s fields, then the rules across fields."""
    for name, hint in typing.get_type_hints(type(obj), include_extras=True).items():
        for rule in getattr(hint, "__metadata__", ()):
            if error := rule(getattr(obj, name)):
                raise ConfigError(f"{prefix}{name} must {error}")
    if prefix == "reconciler.":
        scheme = obj.redis_url.split("://", 1)[0] if "://" in obj.redis_url else ""
        if obj.redis_url and scheme not in _REDIS_SCHEMES:
            raise ConfigError(
                "reconciler.redis_url must be a redis://, rediss://, unix://, "
                "redis+cluster:// or rediss+cluster:// URL, "
                f"got {redact_url(obj.redis_url)!r}"
            )
        if obj.breaker_backoff_max_s < obj.breaker_backoff_s:
            raise ConfigError(
                "reconciler.breaker_backoff_max_s must be >= reconciler.breaker_backoff_s, "
                f"got {obj.breaker_backoff_max_s}"
            )
