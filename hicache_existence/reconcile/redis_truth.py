"""The Redis ledger: ground truth mirrored from successful L3 writes
(``storage_adapters.LedgerRecordingStorage`` records them; redis-py is imported
only when a ledger is built).  Key schema: docs/reconciler.md, "Key schema"::

    <namespace>:epoch                          "<token> <unix seconds>", no TTL
    <namespace>:<shard>:<pool>:<page hash>     "1", optional TTL (ttl_s)

No epoch: the ledger never saw a write or lost its data, so no answer is
evidence.  An epoch that changes under a reader means Redis restarted empty while
L3 kept its pages: absence is not evidence for ``trust_after_reset_s``.
``leading_present`` costs one round trip (a Lua script stopping at the first
absent page; ``method="pipeline"`` for servers that forbid scripting).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from hicache_existence.config import (
    KEY_PART_RULE,
    URL_PARSE_ERROR,
    ConfigError,
    ReconcilerSection,
    key_part_ok,
    masked_repr,
    redact_url,
    split_url,
)
from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruthError,
    LedgerEmpty,
    ServerError,
    TruthTimeout,
    TruthUnavailable,
    check_chain,
)

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
#: Schemes of a Redis Cluster URL: ``redis+cluster://[user:password@]host:port[,host:port...]``
#: (every listed node is a seed for discovering the cluster).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: Walks ``ARGV[2]`` (page hashes joined by newlines) under prefix ``ARGV[1]`` and
#: stops at the first absent page.  Returns {epoch or nil, leading count}.
LUA_LEADING_PRESENT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {false, 0} end
local prefix = ARGV[1]
local n = 0
for h in string.gmatch(ARGV[2], '[^\\n]+') do
  if redis.call('EXISTS', prefix .. h) == 0 then break end
  n = n + 1
end
return {epoch, n}
"""

#: Keys per MGET / MSET / UNLINK command.
_CHUNK = 1024


def validate_redis_url(url: str, arg: str = "redis_url") -> str:
    """Return ``url`` if it is a redis://, rediss:// or unix:// URL, else raise
    ``ConfigError`` naming ``arg`` (the message never shows the password)."""
    if not isinstance(url, str):
        raise ConfigError(f"{arg} must be a string, got {type(url).__name__}")
    if not url:
        raise ConfigError(f"{arg} is empty")
    if is_cluster_url(url):
        cluster_seeds(url, arg)
        return url
    parts = split_url(url)
    if parts is None:
        raise ConfigError(f"{arg} is not a valid URL ({redact_url(url)}): {URL_PARSE_ERROR}")
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"{arg} must use one of {list(SCHEMES + CLUSTER_SCHEMES)}, got {parts.scheme!r} "
            f"({redact_url(url)})"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"{arg} has no host ({redact_url(url)})")
    return url


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def cluster_seeds(url: str, arg: str = "redis_url") -> list[tuple[str, int]]:
    """The ``(host, port)`` seeds of a cluster URL, or ``ConfigError`` naming
    ``arg`` (never showing the password).  The netloc is
    ``[user[:password]@]host[:port][,host[:port]...]`` (IPv6 hosts in brackets,
    port 6379 by default); the path may only be empty, ``/`` or ``/0`` (a cluster
    has one database); query parameters (``ssl_ca_certs``, ...) pass to every node."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"{arg} is not a valid URL ({shown}): {exc}") from None
    if parts.path not in ("", "/", "/0") or parse_qs(parts.query).get("db", ["0"]) != ["0"]:
        raise ConfigError(f"{arg}: a Redis Cluster has only database 0 ({shown})")
    hosts = parts.netloc.rpartition("@")[2]
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            if rest and not rest.startswith(":"):
                host = ""
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ConfigError(f"{arg} has an empty host in its node list ({shown})")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise ConfigError(f"{arg} has a bad port {port_text!r} ({shown})")
        seeds.append((host, port))
    return seeds


def _label(text: str, arg: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{arg} must be a str, got {type(text).__name__}")
    if not key_part_ok(text):  # a clear_shard could delete another deployment's pages
        raise ValueError(f"{arg} must {KEY_PART_RULE}, got {text!r}")
    return text


def shard_id(
    model_name: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    is_mla: bool = False,
    attn_cp_rank: int = 0,
    attn_cp_size: int = 1,
    dcp_rank: int = 0,
    dcp_size: int = 1,
) -> str:
    """The ledger shard of one rank: the L3 key space it writes, named like
    SGLang's file backend suffixes (``<model>_<tp_rank>_<tp_size>``, or
    ``<model>`` alone for MLA, whose KV every rank shares)."""
    model = re.sub(r"[\s:/]+", "-", model_name or "") or "model"
    shard = model if is_mla else f"{model}_{tp_rank}_{tp_size}"
    if pp_size > 1:
        shard += f"_{pp_size}_{pp_rank}"
    if attn_cp_size > 1:
        shard += f"_cp{attn_cp_rank}_{attn_cp_size}"
    if dcp_size > 1:  # MLA decode context parallel: one key space per DCP rank
        shard += f"_dcp{dcp_rank}_{dcp_size}"
    return shard


def shard_from_storage_config(storage_config: Any) -> str:
    """``shard_id`` of an SGLang ``HiCacheStorageConfig`` (read by attribute;
    a missing ``*_rank`` reads 0, a missing ``*_size`` 1)."""
    ranks = {
        f"{group}_{part}": int(getattr(storage_config, f"{group}_{part}", part == "size"))
        for group in ("tp", "pp", "attn_cp", "dcp")
        for part in ("rank", "size")
    }
    model = getattr(storage_config, "model_name", None)
    return shard_id(model, is_mla=bool(getattr(storage_config, "is_mla_model", False)), **ranks)


@dataclass(frozen=True)
class LedgerSettings:
    """How to reach and lay out the ledger (timeouts in seconds).  The URL and
    labels are checked here (a storage backend's extra config sets them too), the
    numbers where they enter (``ReconcilerSection``)."""

    url: str
    namespace: str = "hicache"
    shard: str = "default"
    ttl_s: float = 0.0
    socket_timeout_s: float = 0.05
    connect_timeout_s: float = 0.05
    retries: int = 1
    retry_backoff_s: float = 0.005
    retry_backoff_max_s: float = 0.1
    write_batch: int = 512
    method: Literal["lua", "pipeline"] = "lua"
    #: Seconds after an observed ledger reset during which absence is not
    #: evidence; ``None``: ``ttl_s`` when set, else forever.
    trust_after_reset_s: float | None = None
    #: Redis Cluster only: seconds absence is not evidence after a failed read
    #: or a failover seen by this reader.
    failover_distrust_s: float = 30.0

    def __post_init__(self) -> None:
        validate_redis_url(self.url, "url")
        _label(self.namespace, "namespace")
        _label(self.shard, "shard")

    @classmethod
    def from_section(cls, section: ReconcilerSection, shard: str = "default") -> LedgerSettings:
        """Settings from the ``reconciler`` configuration section."""
        return cls(
            url=section.redis_url,
            namespace=section.namespace,
            shard=shard,
            ttl_s=section.ttl_s,
            socket_timeout_s=section.timeout_ms / 1000.0,
            connect_timeout_s=section.connect_timeout_ms / 1000.0,
            retries=section.retries,
            retry_backoff_s=section.retry_backoff_ms / 1000.0,
            retry_backoff_max_s=max(section.retry_backoff_ms / 1000.0, 0.1),
            write_batch=section.write_batch,
            method=section.method,
            failover_distrust_s=section.failover_distrust_s,
        )

    def redacted_url(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        return masked_repr(self, "url")


def build_client(settings: LedgerSettings) -> Any:
    """A redis-py client (no I/O: a Redis down at start is not an error yet)."""
    import redis

    return redis.Redis.from_url(settings.url, health_check_interval=30, **client_options(settings))


def client_options(settings: LedgerSettings) -> dict[str, Any]:
    """What every ledger client (standalone or cluster) is built with: explicit
    timeouts, a bounded retry with exponential backoff, a name in CLIENT LIST."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return {
        "socket_timeout": settings.socket_timeout_s or None,
        "socket_connect_timeout": settings.connect_timeout_s or None,
        "retry": Retry(
            ExponentialBackoff(cap=settings.retry_backoff_max_s, base=settings.retry_backoff_s),
            settings.retries,
        ),
        "client_name": "hicache-existence",
    }


def map_error(exc: BaseException) -> GroundTruthError:
    """Translate a redis-py (or socket) exception into a ``GroundTruthError``."""
    import redis.exceptions as rx

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, rx.TimeoutError | TimeoutError):
        return TruthTimeout(text)
    # Redis Cluster: a failover or resharding in progress, or no node reachable.
    if isinstance(exc, rx.ClusterError | rx.TryAgainError | rx.AskError | rx.RedisClusterException):
        return TruthUnavailable(text)
    if isinstance(exc, rx.InvalidResponse):
        return GarbageAnswer(text)
    if isinstance(exc, rx.ConnectionError | ConnectionError | OSError):
        return TruthUnavailable(text)
    if isinstance(exc, rx.RedisError):  # ResponseError included: script error, busy, auth
        return ServerError(text)
    return GarbageAnswer(text)


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """Inside: a redis-py (or socket) exception leaves as ``map_error``'s
    ``GroundTruthError``; a ``GroundTruthError`` raised inside passes unchanged."""
    try:
        yield
    except GroundTruthError:
        raise
    except Exception as exc:
        raise map_error(exc) from None


class RedisLedger:
    """Ground truth read from, and the writer API of, the Redis ledger.
    Thread-safe (redis-py pools connections); nothing retries beyond the
    client's own bounded retry."""

    def __init__(
        self,
        settings: LedgerSettings,
        *,
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._client = client if client is not None else build_client(settings)
        self._script = self._client.register_script(LUA_LEADING_PRESENT)
        self._clock = clock
        self._epoch_key = f"{settings.namespace}:epoch"
        self._shard_prefix = f"{settings.namespace}:{settings.shard}:"
        self._lock = threading.Lock()
        #: The epoch seen last, per epoch key (one key per namespace here).
        self._epochs: dict[str, bytes] = {}
        self._distrust_until = 0.0
        #: Ledger resets this reader observed (epoch changed under it).
        self.resets = 0
        if settings.trust_after_reset_s is not None:
            self._reset_distrust = float(settings.trust_after_reset_s)
        else:
            self._reset_distrust = settings.ttl_s if settings.ttl_s > 0 else math.inf

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"{type(self).__name__}(url={s.redacted_url()!r}, namespace={s.namespace!r}, "
            f"shard={s.shard!r}, method={s.method!r})"
        )

    def prefix(self, pool: str) -> str:
        """``<namespace>:<shard>:<pool>:``, the prefix of a pool's page keys."""
        return f"{self._shard_prefix}{pool}:"

    # -- reads ---------------------------------------------------------------
    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        name, seq = check_chain(pool, hashes)
        if not seq:
            return 0
        blob = _joined(seq)
        with self._reading(name):
            if self.settings.method == "lua":
                reply = self._script(keys=[self.epoch_key(name)], args=[self.prefix(name), blob])
                epoch, count = _pair(reply)
            else:
                epoch, flags = self._mget(name, seq)
                count = next((i for i, v in enumerate(flags) if not v), len(seq))
            self._see_epoch(epoch, name)
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(seq):
                raise GarbageAnswer(f"leading count {count!r} outside [0, {len(seq)}]")
        return count

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        name, seq = check_chain(pool, hashes)
        if not seq:
            return []
        _joined(seq)
        with self._reading(name):
            epoch, flags = self._mget(name, seq)
            self._see_epoch(epoch, name)
        return flags

    def _reading(self, pool: str) -> contextlib.AbstractContextManager[None]:
        """Around one read of ``pool``: errors leave as ``GroundTruthError``s
        (the cluster ledger also watches for failovers here)."""
        return redis_errors()

    def _mget(self, pool: str, seq: Sequence[str]) -> tuple[Any, list[bool]]:
        prefix = self.prefix(pool)
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self.epoch_key(pool))
        for i in range(0, len(seq), _CHUNK):
            pipe.mget([prefix + h for h in seq[i : i + _CHUNK]])
        replies = pipe.execute()
        if not isinstance(replies, list) or len(replies) < 2:
            raise GarbageAnswer(f"pipeline reply of type {type(replies).__name__}")
        flags: list[bool] = []
        for part in replies[1:]:
            if not isinstance(part, list):
                raise GarbageAnswer(f"MGET reply of type {type(part).__name__}")
            flags.extend(v is not None for v in part)
        if len(flags) != len(seq):
            raise GarbageAnswer(f"MGET returned {len(flags)} values for {len(seq)} keys")
        return replies[0], flags

    def epoch_key(self, pool: str) -> str:
        """The epoch key that vouches for ``pool``'s entries (one per namespace here)."""
        return self._epoch_key

    def _see_epoch(self, epoch: Any, pool: str) -> None:
        key = self.epoch_key(pool)
        if epoch is None:
            raise LedgerEmpty(f"no {key!r} in the ledger")
        if not isinstance(epoch, bytes | str):
            raise GarbageAnswer(f"epoch of type {type(epoch).__name__}")
        value = epoch.encode() if isinstance(epoch, str) else epoch
        with self._lock:
            known = self._epochs.get(key)
            self._epochs[key] = value
            if known is None or value == known:
                return
            self.resets += 1
            self._distrust_until = self._clock() + self._reset_distrust
        logger.warning(
            "hicache-existence ledger %s was reset (epoch changed): absence is not "
            "evidence for %.0f s",
            self.settings.redacted_url(),
            self._reset_distrust,
        )

    def missed_writes(self) -> None:
        """A record of pages stored in L3 could not be written: like a reset, the
        ledger now lacks pages L3 holds, so absence is not evidence for the
        reset's distrust period."""
        with self._lock:
            self._distrust_until = max(self._distrust_until, self._clock() + self._reset_distrust)

    def absence_is_evidence(self) -> bool:
        """False while the ledger is recovering from an observed reset."""
        with self._lock:
            return self._clock() >= self._distrust_until

    # -- writes --------------------------------------------------------------
    def record_stored(self, pool: str, hashes: Iterable[str]) -> int:
        """Record pages written to L3, ``write_batch`` pages per round trip;
        returns the pages recorded.  Raises ``GroundTruthError``."""
        name, seq = check_chain(pool, hashes)
        batch = self.settings.write_batch
        with redis_errors():
            for start in range(0, len(seq), batch):
                reply = self._record(name, seq[start : start + batch])
                # The epoch the records went under (``reply[1]``): a reset between
                # two writes is seen even by a reader that has not read yet.
                if isinstance(reply, list) and len(reply) > 1 and isinstance(reply[1], bytes | str):
                    self._see_epoch(reply[1], name)
        return len(seq)

    def _record(self, pool: str, chunk: Sequence[str]) -> Any:
        """One pipeline: the epoch (SET NX, then GET), then the pages."""
        prefix, ttl = self.prefix(pool), self.settings.ttl_s
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self.epoch_key(pool), _new_epoch(), nx=True)
        pipe.get(self.epoch_key(pool))
        if ttl > 0:
            px = max(1, int(ttl * 1000))
            for h in chunk:
                pipe.set(prefix + h, b"1", px=px)
        else:
            pipe.mset({prefix + h: b"1" for h in chunk})
        return pipe.execute()

    def record_removed(self, pool: str, hashes: Iterable[str]) -> int:
        """Record pages that left L3; returns the ledger entries removed."""
        name, seq = check_chain(pool, hashes)
        if not seq:
            return 0
        prefix = self.prefix(name)
        batch = self.settings.write_batch
        with redis_errors():  # one UNLINK per batch (on a cluster the keys share a slot)
            return sum(
                int(self._client.unlink(*[prefix + h for h in seq[i : i + batch]]))
                for i in range(0, len(seq), batch)
            )

    def clear_shard(self) -> int:
        """Forget every page of this shard (its L3 was cleared); returns keys
        removed.  Epochs stay: the shard's history is now "nothing"."""
        removed = 0
        with redis_errors():
            keys = self._client.scan_iter(match=self._shard_pattern(), count=1000)
            while batch := list(islice(keys, _CHUNK)):
                removed += int(self._client.unlink(*batch))
        return removed

    def _shard_pattern(self) -> str:
        """SCAN's pattern for every page key of this shard, never an epoch key."""
        return _escape_glob(self._shard_prefix) + "*"

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except Exception:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


def _joined(seq: Sequence[str]) -> str:
    blob = "\n".join(seq)
    if blob.count("\n") != len(seq) - 1 or "" in seq:
        raise ValueError("hashes must be non-empty page hashes without newlines")
    return blob


def _pair(reply: Any) -> tuple[Any, Any]:
    if not isinstance(reply, list | tuple) or len(reply) != 2:
        raise GarbageAnswer(f"script reply {type(reply).__name__} is not a pair")
    return reply[0], reply[1]


def _escape_glob(text: str) -> str:
    return "".join("\\" + c if c in "\\*?[]" else c for c in text)


def _new_epoch() -> str:
    return f"{secrets.token_hex(8)} {int(time.time())}"
