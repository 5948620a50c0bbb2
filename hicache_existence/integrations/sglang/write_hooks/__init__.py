"""The hooks that feed ``WritePath`` from SGLang's write path: the table ``HOOKS``
of every write-path hook, its registration per host memory mode (``register``) and
``install_on``.

Modules: ``binding`` (the ``Hook`` record, parameter binding, and the guard and
brackets the hooks share), ``buffer_mode``, ``backends`` (the backup thread) and
``cache_mode``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hicache_existence.integrations.sglang import targets
from hicache_existence.integrations.sglang.targets import TREE as TREE
from hicache_existence.integrations.sglang.write_hooks import backends, buffer_mode, cache_mode
from hicache_existence.integrations.sglang.write_hooks.binding import (
    BUFFER,
    CACHE,
    MODE_COUNTERS,
    Hook,
    Hooked,
    Mode,
)
from hicache_existence.integrations.sglang.write_hooks.binding import MODES as MODES
from hicache_existence.integrations.sglang.write_hooks.binding import Params as Params

logger = logging.getLogger("hicache_existence.integrations.sglang")

_MM = "sglang.srt.mem_cache"
PIPELINE = f"{_MM}.buffer_mode.pipeline.BufferModePipeline"
CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"
HYBRID_CONTROLLER = f"{_MM}.hybrid_cache.hybrid_cache_controller.HybridCacheController"
FILE_BACKEND = f"{_MM}.hicache_storage.HiCacheFile"
MOONCAKE_BACKEND = f"{_MM}.storage.mooncake_store.mooncake_store.MooncakeStore"
FLAT_COVERS_ALL = "hicache_existence.core.flat.FlatStorageExistenceCache.covers_all"

_CUR = frozenset({"current"})
_FLAT = frozenset({"flat"})
_BOTH = frozenset({"current", "flat"})
_WRITE_STORAGE = ("host_indices", "token_ids", "hash_value", "prefix_keys", "extra_pools?")

#: Every hook of the write path, in registration order.
HOOKS: tuple[Hook, ...] = (
    Hook(f"{PIPELINE}.enqueue_backup_intent", "AROUND", buffer_mode.enqueue_backup_intent,
         _FLAT, ("node_id",), required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._refresh_pending_backup_intents", "AROUND", buffer_mode.refresh_pending,
         _CUR, required=BUFFER, serves=BUFFER),
    # An admission's avoided pools: the cache's covered() tally counts them
    # (WritePath.tally_admissions), except on a tree with sidecar pools, whose
    # pipeline gets these two (install_on).
    Hook(f"{PIPELINE}._backup_pool_keys", "AFTER", buffer_mode.backup_pool_keys, _CUR,
         required=BUFFER, serves=BUFFER, per_instance=True),
    Hook(f"{PIPELINE}._write_intents", "AFTER", buffer_mode.write_intents, _CUR,
         required=BUFFER, serves=BUFFER, per_instance=True),
    Hook(f"{PIPELINE}._drop_queue_head", "AROUND", buffer_mode.drop_queue_head, _CUR,
         ("dropped",), loses="buffer mode: queued writes retired before launch (avoided)",
         serves=BUFFER),
    Hook(FLAT_COVERS_ALL, "AROUND", buffer_mode.flat_covers_all, _FLAT, ("pool", "hashes"),
         required=BUFFER, serves=BUFFER),
    Hook(f"{TREE}.insert", "AROUND", buffer_mode.tree_insert, _FLAT,
         required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._stage_backup_intent", "AFTER", buffer_mode.stage_backup_intent, _BOTH,
         ("intent", "keys_by_pool?"), required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}.finish_storage_write_ack", "AROUND", buffer_mode.storage_write_ack, _BOTH,
         ("operation_id",), required=BUFFER, serves=BUFFER),
    Hook(f"{CONTROLLER}._page_backup", "AROUND", backends.page_backup, _BOTH, ("operation",),
         required=MODES),
    # sglang 0.5.21-0.5.23 writes L3 through a HybridCacheController (also for plain
    # models): its hooks are as required as HiCacheController's, where it exists.
    Hook(f"{HYBRID_CONTROLLER}._page_backup", "AROUND", backends.page_backup, _BOTH,
         ("operation",), required=MODES, only_with=HYBRID_CONTROLLER),
    Hook(f"{FILE_BACKEND}.set", "AROUND", backends.file_set, _BOTH, ("key",),
         loses="file backend: redundant pages (the backend's own answer)"),
    Hook(f"{FILE_BACKEND}.exists", "AROUND", backends.file_exists, _BOTH, ("key",),
         loses="file backend: redundant pages (the backend's own answer)"),
    Hook(f"{MOONCAKE_BACKEND}.batch_set_v1", "AROUND", backends.mooncake_batch_set_v1, _BOTH,
         ("keys",), loses="Mooncake backend: redundant pages (the backend's own answer)"),
    Hook(f"{MOONCAKE_BACKEND}.batch_set_v2", "AROUND", backends.mooncake_batch_set_v2, _BOTH,
         loses="Mooncake backend: extra pools' redundant pages"),
    Hook(f"{MOONCAKE_BACKEND}._batch_exist", "AROUND", backends.mooncake_batch_exist, _BOTH,
         loses="Mooncake backend: redundant pages (the backend's own answer)"),
    # cache mode, and the prefetch dispositions behind the causes (both modes)
    Hook(f"{TREE}.write_backup_storage", "AROUND", cache_mode.write_backup_storage, _BOTH,
         ("node_id",), required=CACHE, serves=CACHE),
    Hook(f"{CONTROLLER}.write_storage", "AROUND", cache_mode.write_storage, _BOTH, _WRITE_STORAGE,
         required=CACHE, serves=CACHE),
    Hook(f"{HYBRID_CONTROLLER}.write_storage", "AROUND", cache_mode.write_storage, _BOTH,
         _WRITE_STORAGE, required=CACHE, serves=CACHE, only_with=HYBRID_CONTROLLER),
    Hook(f"{TREE}._invalidate_absent_from_hit_query", "AFTER", cache_mode.hit_query, _BOTH,
         ("operation",),
         loses="prefetch shortfalls (cause prefetch_shortfall) and cache mode's heal"),
    Hook(f"{TREE}._handle_prefetch_result", "AROUND", cache_mode.prefetch_result, _BOTH,
         ("operation",), loses="prefetch dispositions behind the redundant-write causes"),
)  # fmt: skip


def hook(target_suffix: str, generation: str = "current") -> Hook:
    """The hook whose target ends with ``target_suffix`` (tests, diagnostics)."""
    for h in HOOKS:
        if h.target.endswith(target_suffix) and generation in h.generations:
            return h
    raise KeyError(target_suffix)


def register(
    registry: Any,
    hook_type: Any,
    generation: str,
    resolve: Callable[[str], object],
    warn: Callable[[str], None] | None = None,
    off: set[str] | None = None,
) -> list[str]:
    """Register the write-path hooks the installed sglang has, for ``generation``;
    returns the targets registered.  A required hook missing or with another
    signature turns off its host memory mode's hooks only (``off`` receives the
    modes); every missing or changed target gets one ``warn`` naming what stops
    being counted, except a backend whose module does not import (Mooncake without
    its client) or a hook whose ``only_with`` class is absent: a debug line."""
    say = warn if warn is not None else _log_warning
    found: list[tuple[Hook, Hooked]] = []
    modes_off: set[Mode] = set()
    for h in HOOKS:
        if generation not in h.generations:
            continue
        try:
            installed = h.bound(resolve(h.target))
        except Exception as exc:
            if h.only_with and not _resolves(resolve, h.only_with):
                logger.debug("hicache-existence: no %s here; %s not hooked", h.only_with, h.target)
            elif h.required:
                modes_off |= h.required
                stops = "; ".join(MODE_COUNTERS[m] for m in sorted(h.required))
                say(f"{h.target} is missing or changed ({exc}); {stops}")
            elif targets.dependency_missing(h.target):
                logger.debug("hicache-existence: %s not importable (%s); not hooked", h.target, exc)
            else:
                say(f"{h.target} is missing or changed ({exc}); not counted: {h.loses}")
            continue
        found.append((h, installed))
    kept = [(h, fn) for h, fn in found if h.serves - modes_off and not h.per_instance]
    for h, installed in kept:
        registry.register(h.target, installed, getattr(hook_type, h.kind))
    if off is not None:
        off.update(modes_off)
    return [h.target for h, _ in kept]


def install_on(owner: Any, generation: str = "current") -> list[str]:
    """Install the ``per_instance`` hooks of ``generation`` whose class is
    ``owner``'s on ``owner`` itself, as the plugin would on the class (an AFTER hook
    sees the result, then the call's arguments); returns the methods wrapped.  A
    method whose signature no longer fits is left alone with a warning."""
    done: list[str] = []
    cls = type(owner)
    classes = {c.__name__ for c in cls.__mro__}
    for h in HOOKS:
        path, _, method = h.target.rpartition(".")
        if not h.per_instance or generation not in h.generations:
            continue
        if path.rpartition(".")[2] not in classes:
            continue
        try:
            after = h.bound(getattr(cls, method))
        except Exception as exc:
            _log_warning(f"{h.target} is missing or changed ({exc}); not hooked on {owner!r}")
            continue
        setattr(owner, method, _after(getattr(owner, method), after, owner))
        done.append(h.target)
    return done


def _after(call: Callable[..., Any], after: Hooked, owner: Any) -> Callable[..., Any]:
    def hooked(*a: Any, **kw: Any) -> Any:
        result = call(*a, **kw)
        with contextlib.suppress(Exception):  # the hooks count their own failures
            after(result, owner, *a, **kw)
        return result

    hooked.__name__ = hooked.__qualname__ = getattr(after, "__name__", "after")
    return hooked


def _resolves(resolve: Callable[[str], object], target: str) -> bool:
    try:
        resolve(target)
    except Exception:
        return False
    return True


def _log_warning(message: str) -> None:
    logger.warning("hicache-existence: %s", message)
