"""The ledger on Redis Cluster: hash-tagged keys, one slot per (shard, pool).

Key schema (``redis+cluster://`` URLs; docs/reconciler.md, "Redis Cluster")::

    {<namespace>:<shard>:<pool>}                "<token> <unix seconds>"  the epoch
    {<namespace>:<shard>:<pool>}:<page hash>    "1", optional TTL

The shared hash tag keeps a chain query at one round trip to one node and puts
the epoch beside the pages it vouches for: a primary that comes back empty loses
both, so its answers become ``ledger_empty`` errors instead of false absences.
Replication is asynchronous, so a failover can lose the last acknowledged
writes: after the primary serving a tag changes under a reader, and after any
error reading it, absence is not evidence for ``failover_distrust_s`` seconds.
The client is built on first use: a cluster down at start is an error to count,
not a crash of the backend that records into it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruthError,
    TruthUnavailable,
)
from hicache_existence.reconcile.redis_truth import (
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
#: missing; every key shares the epoch's hash tag, so one node runs it.  Returns
#: {pages recorded, the epoch they went under}.
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
return {n, redis.call('GET', KEYS[1])}
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


def build_cluster_client(settings: LedgerSettings) -> Any:
    """A ``redis.cluster.RedisCluster``: every listed node a seed, credentials, TLS
    and query parameters for every node.  Connects (it reads the slot map), so it
    raises when no seed answers."""
    import redis.cluster

    seeds = cluster_seeds(settings.url, "url")
    scheme, rest = settings.url.split("://", 1)
    base = "rediss" if scheme.startswith("rediss") else "redis"
    # The node list ends at the path or, without one, at the query (whose values,
    # e.g. ssl_ca_certs=/etc/..., may hold a '/').
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if not tail.startswith("/"):
        tail = "/" + tail
    userinfo = netloc.rpartition("@")[0]
    host, port = seeds[0]
    shown = f"[{host}]" if ":" in host else host
    first = f"{base}://{userinfo + '@' if userinfo else ''}{shown}:{port}{tail}"
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

    def __init__(self, settings: LedgerSettings, client: Any) -> None:
        self._settings = settings
        self._given = client  # a client to use instead of building one (tests)
        self._lock = threading.Lock()
        #: The client once built (None before).
        self.built: Any = None

    def get(self) -> Any:
        client = self.built
        if client is not None:
            return client
        with self._lock:
            if self.built is None:
                try:
                    given = self._given
                    built = given if given is not None else build_cluster_client(self._settings)
                    self.built = built
                except Exception as exc:
                    raise TruthUnavailable(
                        f"cluster at {self._settings.redacted_url()} unreachable: {map_error(exc)}"
                    ) from None
            return self.built

    def close(self) -> None:
        """Close the client if it was ever built (never connect just to close)."""
        if self.built is not None:
            self.built.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def register_script(self, script: str) -> Callable[..., Any]:
        registered = functools.cache(lambda: self.get().register_script(script))
        return lambda keys, args: registered()(keys=keys, args=args)


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
        self._lazy = _LazyCluster(settings, client)
        super().__init__(settings, client=self._lazy, clock=clock)
        self._record_script = self._lazy.register_script(LUA_RECORD)
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
            self._distrust()
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
        client = self._lazy.built
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
            if self._distrust():
                logger.warning(
                    "hicache-existence ledger %s: the primary of %s changed (failover): "
                    "absence is not evidence for %.0f s",
                    self.settings.redacted_url(),
                    key,
                    self.failover_distrust_s,
                )

    def _distrust(self) -> bool:
        """Absence is not evidence for ``failover_distrust_s`` from now (False: off)."""
        if self.failover_distrust_s <= 0:
            return False
        until = self._clock() + self.failover_distrust_s
        with self._lock:
            self._distrust_until = max(self._distrust_until, until)
        return True

    def _record(self, pool: str, chunk: Sequence[str]) -> Any:
        """One script call (redis-py refuses MSET in a cluster pipeline; the
        script sets the TTL server-side)."""
        ttl = self.settings.ttl_s
        px = max(1, int(ttl * 1000)) if ttl > 0 else 0
        args = [_new_epoch(), self.prefix(pool), px, _joined(chunk)]
        return self._record_script(keys=[self.epoch_key(pool)], args=args)

    def _shard_pattern(self) -> str:
        """``{<shard prefix>*}:*``: every page key of the shard, never an epoch key."""
        return "{" + _escape_glob(self._shard_prefix) + "*}:*"
