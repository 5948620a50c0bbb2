"""SGLang storage adapters: ground truth from any HiCache backend
(``BackendGroundTruth``, over SGLang's ``batch_exists(keys, extra_info=None)``),
and ``LedgerRecordingStorage``, a ``HiCacheStorage`` loadable with
``--hicache-storage-backend dynamic`` that builds the real backend, delegates
every call to it, and records successful writes (and, with a TTL, reads) into
the Redis ledger from a background thread, so prefill instances sharing one L3
learn what the others stored.  That class is built on first access, importing
sglang only then (without sglang: a plain class with the same behaviour).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hicache_existence.config import ENV_CONFIG, ENV_PREFIX, Config, ReconcilerSection
from hicache_existence.core import _validate
from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruthError,
    ServerError,
    UnsupportedPool,
    check_chain,
)
from hicache_existence.reconcile.ledger_writer import LedgerWriter
from hicache_existence.reconcile.ledgers import open_ledger
from hicache_existence.reconcile.mooncake_truth import KV, is_mooncake_backend
from hicache_existence.reconcile.redis_truth import LedgerSettings, shard_from_storage_config

logger = logging.getLogger(__name__)


class BackendGroundTruth:
    """Ground truth from a storage backend's ``batch_exists``: the KV pool only,
    unless ``key_for(pool, page_hash)`` maps another pool's pages to the backend's
    keys.  Calls run on the reconciler's worker thread, concurrently with the
    backend's own prefetch and backup threads, as upstream's own calls do."""

    def __init__(self, backend: Any, *, key_for: Callable[[str, str], str] | None = None) -> None:
        if not callable(getattr(backend, "batch_exists", None)):
            raise TypeError(
                "backend must have batch_exists(keys, extra_info=None), got "
                f"{type(backend).__name__}"
            )
        self._backend = backend
        self._key_for = key_for

    def _keys(self, pool: str, seq: Sequence[str]) -> list[str]:
        if self._key_for is not None:
            return [self._key_for(pool, h) for h in seq]
        if pool != KV:
            raise UnsupportedPool(f"no key mapping for pool {pool!r}")
        return list(seq)

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        name, seq = check_chain(pool, hashes)
        keys = self._keys(name, seq)
        if not keys:
            return 0
        try:
            count = self._backend.batch_exists(keys, None)
        except GroundTruthError:
            raise
        except Exception as exc:
            raise ServerError(f"batch_exists raised {type(exc).__name__}: {exc}") from None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(keys):
            raise GarbageAnswer(f"batch_exists returned {count!r} for {len(keys)} keys")
        return count

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        name, seq = check_chain(pool, hashes)
        keys = self._keys(name, seq)
        exists = getattr(self._backend, "exists", None) or (
            lambda key: self._backend.batch_exists([key], None) == 1
        )
        try:
            return [bool(exists(key)) for key in keys]
        except Exception as exc:
            raise ServerError(f"exists raised {type(exc).__name__}: {exc}") from None


#: Keys of ``--hicache-storage-backend-extra-config`` read by the wrapper; every
#: other key is passed to the real backend.
WRAPPER_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "inner_backend",
        "inner_extra_config",
        "inner_backend_name",
        "inner_module_path",
        "inner_class_name",
        "ledger_redis_url",
        "ledger_namespace",
        "ledger_ttl_s",
        "ledger_shard",
        "ledger_learn_absence",
    }
)

#: Built-in backends whose constructor needs the host memory pool, which a
#: dynamic backend only receives through ``register_mem_pool_host``.
NEEDS_HOST_POOL = frozenset(
    {"mooncake", "npu_memcache", "aibrix", "hf3fs", "eic", "simm", "mori", "shm", "seaweedfs"}
)


def _successes(keys: Iterable[str] | None, results: Any) -> list[str]:
    if not keys or not isinstance(results, list | tuple):
        return []
    return [k for k, ok in zip(keys, results) if ok]


class _LedgerRecordingMixin:
    """``LedgerRecordingStorage``'s behaviour (mixed over sglang's ``HiCacheStorage``)."""

    def __init__(
        self,
        storage_config: Any,
        kwargs: Any = None,
        *,
        inner: Any = None,
        ledger: Any = None,
    ) -> None:
        #: The real backend this one delegates to (None until it is created).
        self.inner_backend: Any = inner
        self._pending_inner: tuple[str, Any] | None = None
        #: Successful writes recorded so far (under ``_record_lock``): an absence
        #: learnt from a ``batch_exists`` that overlapped one of them is not recorded.
        self._record_lock = threading.Lock()
        self._writes_recorded = 0
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        section = _reconciler_section_from_env()
        #: How long a reconciler question waits for the records offered before it
        #: (the reconciler drops an answer later than its own timeout anyway).
        self._truth_wait_s = max(section.timeout_ms, 1) / 1000.0
        self._ttl = float(extra.get("ledger_ttl_s", section.ttl_s))
        learn = extra.get("ledger_learn_absence")
        #: None: on, except for backends whose batch_exists reads errors as absence.
        self._learn_absence: bool | None = None if learn is None else bool(learn)
        if ledger is None:
            url = str(extra.get("ledger_redis_url") or section.redis_url)
            if not url:
                raise ValueError(
                    "LedgerRecordingStorage needs a Redis URL: set "
                    "HICACHE_EXISTENCE_RECONCILER__REDIS_URL (preferred: keeps the password "
                    "off the command line) or ledger_redis_url in the extra config"
                )
            section = dataclasses.replace(
                section,
                redis_url=url,
                namespace=str(extra.get("ledger_namespace", section.namespace)),
                ttl_s=self._ttl,
            )
            shard = str(extra.get("ledger_shard") or shard_from_storage_config(storage_config))
            ledger = open_ledger(LedgerSettings.from_section(section, shard))
        self._ledger = ledger
        self._writer = LedgerWriter(
            ledger, batch_pages=getattr(getattr(ledger, "settings", None), "write_batch", 512)
        )
        if inner is None:
            self._create_inner(storage_config, extra)
        logger.info("hicache-existence: recording L3 writes into %r", ledger)

    # -- construction of the real backend ------------------------------------------
    def _create_inner(self, storage_config: Any, extra: dict[str, Any]) -> None:
        name = extra.get("inner_backend")
        if not name:
            raise ValueError("LedgerRecordingStorage needs 'inner_backend' in the extra config")
        inner_extra = extra.get("inner_extra_config")
        if inner_extra is None:
            inner_extra = {k: v for k, v in extra.items() if k not in WRAPPER_KEYS}
        inner_extra = dict(inner_extra)
        for key in ("backend_name", "module_path", "class_name"):
            if "inner_" + key in extra:
                inner_extra[key] = extra["inner_" + key]
        if dataclasses.is_dataclass(storage_config) and not isinstance(storage_config, type):
            inner_config = dataclasses.replace(storage_config, extra_config=inner_extra)
        else:
            inner_config = storage_config
        if name in NEEDS_HOST_POOL:
            self._pending_inner = (str(name), inner_config)
            return
        self.inner_backend = _create_backend(str(name), inner_config, None)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        if self._pending_inner is not None:
            name, config = self._pending_inner
            self.inner_backend = _create_backend(name, config, mem_pool_host)
            self._pending_inner = None
        self._backend().register_mem_pool_host(mem_pool_host)

    def _backend(self) -> Any:
        inner = self.inner_backend
        if inner is None:
            raise RuntimeError("the real storage backend is not created yet (no host pool)")
        return inner

    def ledger_ground_truth(self) -> Any:
        """The ledger this backend records into, as a reconciler's ground truth that
        waits (``reconciler.timeout_ms`` at most) for the writes acked before a question."""
        return self._writer.truth(self._truth_wait_s)

    def ledger_counts(self) -> dict[str, dict[str, int]]:
        """The writer's counters (pages by op/result, errors by kind)."""
        return self._writer.counts()

    def flush_ledger(self, timeout_s: float = 5.0) -> bool:
        """Wait until every recorded write reached the ledger (tests, shutdown)."""
        return self._writer.flush(timeout_s)

    # -- recording helpers (never raise into the storage path) -----------------------
    def _stored(self, pool: Any, keys: Iterable[str], since: int | None = None) -> None:
        """Record ``keys`` stored or, given ``since`` (the write count before the
        backend was asked), removed unless a write was recorded meanwhile."""
        try:
            name = _validate.pool_name(pool)  # the pool name comes from upstream
            with self._record_lock:  # a removal and a write of a page keep their order
                if since is None:
                    self._writes_recorded += 1
                    self._writer.stored(name, keys)
                elif since == self._writes_recorded:
                    self._writer.removed(name, keys)
        except Exception:
            logger.debug("ledger record failed", exc_info=True)

    # -- HiCacheStorage: every call delegated ----------------------------------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self._backend().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self._backend().on_host_pools_registered()

    def batch_exists_v2(self, keys: Any, pool_transfers: Any = None, extra_info: Any = None) -> Any:
        return self._backend().batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        results = self._backend().batch_get_v2(transfers, extra_info)
        if self._ttl > 0 and isinstance(results, dict):
            for t in transfers or ():
                self._stored(t.name, _successes(t.keys, results.get(t.name)))
        return results

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        results = self._backend().batch_set_v2(transfers, extra_info)
        if isinstance(results, dict):
            for t in transfers or ():
                self._stored(t.name, _successes(t.keys, results.get(t.name)))
        return results

    def batch_get_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> Any:
        results = self._backend().batch_get_v1(keys, host_indices, extra_info)
        if self._ttl > 0:
            self._stored(KV, _successes(keys, results))
        return results

    def batch_set_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> Any:
        results = self._backend().batch_set_v1(keys, host_indices, extra_info)
        self._stored(KV, _successes(keys, results))
        return results

    def get(self, key: Any, target_location: Any = None, target_sizes: Any = None) -> Any:
        value = self._backend().get(key, target_location, target_sizes)
        if value is not None and self._ttl > 0:
            self._stored(KV, [key])
        return value

    def batch_get(self, keys: Any, target_locations: Any = None, target_sizes: Any = None) -> Any:
        values = self._backend().batch_get(keys, target_locations, target_sizes)
        if self._ttl > 0 and isinstance(values, list | tuple):
            self._stored(KV, [k for k, v in zip(keys, values) if v is not None])
        return values

    def set(
        self, key: Any, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> Any:
        ok = self._backend().set(key, value, target_location, target_sizes)
        if ok:
            self._stored(KV, [key])
        return ok

    def batch_set(
        self, keys: Any, values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        ok = self._backend().batch_set(keys, values, target_locations, target_sizes)
        if ok:
            self._stored(KV, list(keys))
        return ok

    def exists(self, key: Any) -> Any:
        return self._backend().exists(key)

    def batch_exists(self, keys: Any, extra_info: Any = None) -> Any:
        inner = self._backend()
        since = self._writes_recorded
        count = inner.batch_exists(keys, extra_info)
        if self._learns_absence(inner) and _validate.is_int(count) and 0 <= count < len(keys):
            # The real backend just said this page is absent: teach the ledger
            # (unless a write landed meanwhile: it may be this very page).
            self._stored(KV, [keys[count]], since=since)
        return count

    def _learns_absence(self, inner: Any) -> bool:
        """Whether a ``batch_exists`` shortfall removes a page from the ledger: as
        configured, else not for a Mooncake store (0 while its master is down)."""
        if not _is_storage_writer(self.storage_config):
            # MLA: another rank writes this shard; the write-count guard of
            # batch_exists cannot see its writes, so a shortfall read before one
            # of them landed would erase its record.
            return False
        if self._learn_absence is not None:
            return self._learn_absence
        return not is_mooncake_backend(inner)

    def clear(self) -> Any:
        result = self._backend().clear()
        if result is not False:
            self._writer.cleared()
        return result

    def get_stats(self) -> Any:
        return self._backend().get_stats()

    def close(self) -> None:
        try:
            if hasattr(self.inner_backend, "close"):
                self.inner_backend.close()
        finally:
            self._writer.close()
            if hasattr(self._ledger, "close"):
                self._ledger.close()

    def __getattr__(self, name: str) -> Any:
        # Backend-specific attributes (not part of HiCacheStorage) reach the real one.
        inner = self.__dict__.get("inner_backend")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)


def _is_storage_writer(storage_config: Any) -> bool:
    """Whether this rank writes L3 (sglang's ``is_storage_writer``: MLA replicas
    share one writer; older configs: MLA rank 0)."""
    try:
        writer = getattr(storage_config, "is_storage_writer", None)
        if isinstance(writer, bool):
            return writer
        return not getattr(storage_config, "is_mla_model", False) or (
            int(getattr(storage_config, "tp_rank", 0)) == 0
        )
    except Exception:
        return True


def _reconciler_section_from_env() -> ReconcilerSection:
    """The ``reconciler`` section from ``HICACHE_EXISTENCE_CONFIG`` and the
    ``HICACHE_EXISTENCE_RECONCILER__*`` variables only (not the package's others)."""
    prefix = f"{ENV_PREFIX}RECONCILER__"
    env = {k: v for k, v in os.environ.items() if k.startswith(prefix) or k == ENV_CONFIG}
    return Config.from_env(env).reconciler


def _create_backend(name: str, storage_config: Any, mem_pool_host: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend(name, storage_config, mem_pool_host)


@functools.cache
def _build_class() -> type:
    """``LedgerRecordingStorage`` over sglang's ``HiCacheStorage`` if importable."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError:
        base: type = object
    else:
        base = HiCacheStorage

    # The mixin comes first so its methods override the ABC's abstract ones.
    class LedgerRecordingStorage(_LedgerRecordingMixin, base):  # type: ignore[misc]
        """A ``HiCacheStorage`` that delegates to a real backend and records its
        successful writes into the Redis ledger (see the module docstring)."""

    LedgerRecordingStorage.__qualname__ = "LedgerRecordingStorage"
    LedgerRecordingStorage.__module__ = __name__
    return LedgerRecordingStorage


def __getattr__(name: str) -> Any:
    """Build ``LedgerRecordingStorage`` on first access (sglang imported then)."""
    if name == "LedgerRecordingStorage":
        return _build_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
