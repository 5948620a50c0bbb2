"""The ledger on Redis Cluster: hash-tagged keys, one slot per (shard, pool).

Key schema (``redis+cluster://`` URLs; the standalone schema is unchanged)::

    {<namespace>:<shard>:<pool>}                "<token> <unix seconds>"  the epoch
    {<namespace>:<shard>:<pool>}:<page hash>    "1", optional TTL

Every key of one (shard, pool) carries the same hash tag, so it lives in one
slot on one primary.  That keeps the chain query at one round trip to one node
(the same Lua script as standalone, stopping at the first absent page) and puts
the epoch beside the pages it vouches for: a primary that comes back empty, or a
replica promoted without them, loses the epoch together with the pages, so its
answers become ``ledger_empty`` errors instead of false absences.  The other
way, keys spread over every slot and queried in per-node batches, was measured
slower on every chain length (docs/reconciler.md, ``benchmarks/ledger_cluster.py``)
and cannot stop at the first absent page.  The cost: one (shard, pool) is not
spread over the cluster's primaries; a deployment's shards are (one per TP rank
and pool).

A failover can lose the last writes a primary acknowledged before it died
(replication is asynchronous), so after the primary serving a tag changes under
a reader, and after any error reading it, absence is not evidence for
``failover_distrust_s`` seconds (``reconciler.failover_distrust_s``, default 30;
presence still teaches).  The cluster client is
built on first use: a cluster that is down at start is an error to count, not a
crash of the storage backend that records into it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruthError,
    TruthUnavailable,
    check_chain,
)
from hicache_existence.reconcile.redis_truth import (
    LUA_LEADING_PRESENT,
    LedgerSettings,
    RedisLedger,
    _escape_glob,
    _joined,
    _new_epoch,
    _pair,
    client_options,
    cluster_seeds,
    is_cluster_url,
    map_error,
    redis_errors,
)

logger = logging.getLogger(__name__)

#: Records ``ARGV[4]`` (page hashes joined by newlines) under prefix ``ARGV[2]``
#: with a TTL of ``ARGV[3]`` ms (0: none) and creates the epoch ``KEYS[1]`` if
#: missing; every key shares the epoch's hash tag, so one node runs it.
LUA_RECORD = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local prefix = ARGV[2]
local px = tonumber(ARGV[3])
local n = 0
for h in string.gmatch(ARGV[4], '[^\\n]+') do
  if px > 0 then
    redis.call('SET', prefix .. h, '1', 'PX', px)
  else
    redis.call('SET', prefix .. h, '1')
  end
  n = n + 1
end
return n
"""

#: Presence of every page of ``ARGV[2]`` under prefix ``ARGV[1]``: {epoch or
#: nil, {0|1, ...}} (redis-py refuses MGET in a cluster pipeline; one round trip).
LUA_PRESENT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {false, {}} end
local prefix = ARGV[1]
local flags = {}
for h in string.gmatch(ARGV[2], '[^\\n]+') do
  flags[#flags + 1] = redis.call('EXISTS', prefix .. h)
end
return {epoch, flags}
"""

_CHUNK = 1024


def build_cluster_client(settings: LedgerSettings) -> Any:
    """A ``redis.cluster.RedisCluster`` for a ``redis+cluster://`` URL: every
    listed node is a seed; credentials, TLS and query parameters apply to every
    node; explicit timeouts; bounded cluster-level retry.  Connects (it reads the
    slot map), so it raises when no seed answers."""
    import redis.cluster

    seeds = cluster_seeds(settings.url, "url")
    scheme, rest = settings.url.split("://", 1)
    base = "rediss" if scheme.startswith("rediss") else "redis"
    netloc, sep, tail = rest.partition("/")
    if "?" in netloc:  # a query without a path: host:port?ssl_...
        netloc, _, query = netloc.partition("?")
        tail = "?" + query
        sep = "/"
    userinfo = netloc.rpartition("@")[0]
    host, port = seeds[0]
    shown = f"[{host}]" if ":" in host else host
    first = f"{base}://{userinfo + '@' if userinfo else ''}{shown}:{port}{sep}{tail}"
    return redis.cluster.RedisCluster.from_url(
        first,
        startup_nodes=[
            redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
            for h, p in seeds[1:]
        ],
        **client_options(settings),
    )


class _LazyCluster:
    """Builds the cluster client on first use (and again after a failed build)."""

    def __init__(self, settings: LedgerSettings, factory: Callable[[], Any] | None) -> None:
        self._settings = settings
        self._factory = factory or (lambda: build_cluster_client(settings))
        self._lock = threading.Lock()
        self._client: Any = None

    def get(self) -> Any:
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._factory()
                except GroundTruthError:
                    raise
                except Exception as exc:
                    raise TruthUnavailable(
                        f"cluster at {self._settings.redacted_url()} unreachable: {map_error(exc)}"
                    ) from None
            return self._client

    def built(self) -> Any:
        return self._client

    def close(self) -> None:
        """Close the client if it was ever built (never connect just to close)."""
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def register_script(self, script: str) -> Callable[..., Any]:
        holder: list[Any] = []

        def call(keys: Sequence[str], args: Sequence[Any]) -> Any:
            if not holder:
                holder.append(self.get().register_script(script))
            return holder[0](keys=keys, args=args)

        return call


class RedisClusterLedger(RedisLedger):
    """``RedisLedger`` on a Redis Cluster (``redis+cluster://`` URL): hash-tagged
    keys per (shard, pool), an epoch per tag, failover-aware trust."""

    def __init__(
        self,
        settings: LedgerSettings,
        *,
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not is_cluster_url(settings.url):
            raise ValueError(
                f"RedisClusterLedger needs a redis+cluster:// URL, got {settings.redacted_url()}"
            )
        for arg in ("namespace", "shard"):
            if any(c in getattr(settings, arg) for c in "{}"):
                raise ValueError(f"{arg} must not contain '{{' or '}}' on Redis Cluster")
        self._lazy = _LazyCluster(settings, (lambda: client) if client is not None else None)
        super().__init__(settings, client=self._lazy, clock=clock)
        self._record = self._lazy.register_script(LUA_RECORD)
        self._presence = self._lazy.register_script(LUA_PRESENT)
        self.failover_distrust_s = float(settings.failover_distrust_s)
        #: Primary (host:port) last seen serving each tag.
        self._owners: dict[str, str] = {}
        #: Failovers (a tag's primary changed) this reader observed.
        self.failovers = 0

    def tag(self, pool: str) -> str:
        """``{<namespace>:<shard>:<pool>}``: the hash tag (and epoch key) of a pool."""
        return f"{{{self._shard_prefix}{pool}}}"

    def prefix(self, pool: str) -> str:
        return f"{self.tag(pool)}:"

    def epoch_key(self, pool: str) -> str:
        return self.tag(pool)

    @contextlib.contextmanager
    def _reading(self, pool: str) -> Iterator[None]:
        """The base's, plus failover detection: after an error, and after the
        primary serving the tag changed, absence is not evidence for a while."""
        try:
            with redis_errors():
                yield
        except GroundTruthError:
            self._distrust(pool, "error")
            raise
        self._check_owner(pool)

    def _mget(self, pool: str, seq: Sequence[str]) -> tuple[Any, list[bool]]:
        reply = self._presence(keys=[self.epoch_key(pool)], args=[self.prefix(pool), _joined(seq)])
        epoch, flags = _pair(reply)
        if epoch is None:
            return None, []
        if not isinstance(flags, list) or len(flags) != len(seq):
            raise GarbageAnswer(f"presence reply for {len(seq)} pages is {type(flags).__name__}")
        if any(f not in (0, 1) for f in flags):
            raise GarbageAnswer("presence flags outside {0, 1}")
        return epoch, [f == 1 for f in flags]

    def _check_owner(self, pool: str) -> None:
        """A local lookup in the client's slot map (no I/O): a different primary
        serving the tag means a failover happened since the last read."""
        key = self.tag(pool)
        client = self._lazy.built()
        try:
            node = client.get_node_from_key(key)
            owner = f"{node.host}:{node.port}"
        except Exception:
            return
        with self._lock:
            seen = self._owners.get(key)
            self._owners[key] = owner
        if seen is not None and seen != owner:
            self.failovers += 1
            self._distrust(pool, "failover")

    def _distrust(self, pool: str, why: str) -> None:
        if self.failover_distrust_s <= 0:
            return
        until = self._clock() + self.failover_distrust_s
        with self._lock:
            if until > self._distrust_until:
                self._distrust_until = until
        if why == "failover":
            logger.warning(
                "hicache-existence ledger %s: the primary of %s changed (failover): "
                "absence is not evidence for %.0f s",
                self.settings.redacted_url(),
                self.tag(pool),
                self.failover_distrust_s,
            )

    # -- writes ----------------------------------------------------------------------
    def record_stored(self, pool: str, hashes: Iterable[str]) -> int:
        """Record pages written to L3: one script call per ``write_batch`` pages
        (redis-py refuses MSET in a cluster pipeline; the script also sets the
        TTL server-side); returns the pages recorded."""
        name, seq = check_chain(pool, hashes)
        if not seq:
            return 0
        px = max(1, int(self.settings.ttl_s * 1000)) if self.settings.ttl_s > 0 else 0
        batch = self.settings.write_batch
        keys = [self.epoch_key(name)]
        prefix = self.prefix(name)
        with redis_errors():
            for start in range(0, len(seq), batch):
                blob = _joined(seq[start : start + batch])
                self._record(keys=keys, args=[_new_epoch(), prefix, px, blob])
        return len(seq)

    def _shard_pattern(self) -> str:
        """``{<shard prefix>*}:*``: every page key of the shard, never an epoch key."""
        return "{" + _escape_glob(self._shard_prefix) + "*}:*"


__all__ = [
    "LUA_LEADING_PRESENT",
    "LUA_PRESENT",
    "LUA_RECORD",
    "RedisClusterLedger",
    "build_cluster_client",
]
