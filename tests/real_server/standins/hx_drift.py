"""Test-only upstream drift inside the server processes: ``HX_DRIFT=<case>``.

Each case changes one thing of the installed sglang the way a newer release
could, right after sglang imports the module (the post-import hook of
``hx_cpu_standins``), so the plugin's ``register()`` in the scheduler process
meets the changed API. Upstream's own code keeps working exactly as before: a
renamed method is still reached by upstream's callers (as if they had been
renamed with it), a renamed parameter is still passed positionally, an added
method answers. So the server serves the same outputs; only the package's view
of the API changes. Used by ``tests/real_server/test_drift.py``.

``write_intents_renamed``
    ``BufferModePipeline._write_intents`` (a buffer-mode admission hook target)
    becomes ``_select_write_intents``: the class has no ``_write_intents`` any
    more; its instances resolve the old name to the new one (a class
    ``__getattr__``), standing in for upstream's callers renamed with it.
``write_backup_storage_renamed``
    ``UnifiedRadixCache.write_backup_storage`` (cache mode's node write) becomes
    ``backup_node_to_storage``, the same way.
``write_storage_param_renamed``
    ``HybridCacheController.write_storage(host_indices, token_ids, hash_value,
    ...)``, the controller every tree of sglang 0.5.21-0.5.23 writes L3 through,
    has ``hash_value`` renamed ``hash_values`` (its callers pass it by position).
``beliefs_method_added``
    The per-pool beliefs class (``PoolExistenceBeliefs``) gains a public method
    ``hx_future_sweep(budget=0)`` and the scheduler calls it on its tree's
    existence cache (``pool("kv")``) once per event-loop iteration (after
    ``ingest_requests``, the first call of both loops' iterations). A cache class
    without that method would raise there and kill the scheduler.

Every applied change writes one ``HX-PROBE {"kind": "drift", ...}`` line (in each
process that imports the module); the added method's first call writes one
``{"kind": "drift_call", ...}`` with what it answered and the cache's class; and
every record of the package's loggers at WARNING or above writes one
``{"kind": "hx_warning", ...}`` with its level and message (the server log's own
format carries no level), so a test counts the package's warnings exactly.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import hx_cpu_standins
from hx_probes import emit

#: What ``hx_future_sweep`` answers (the probe shows the call reached upstream's).
SWEEP_ANSWER = "upstream's sweep"


def _owner(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that defines ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise AttributeError(f"{cls.__qualname__} has no {name}")


def rename_method(cls: type, old: str, new: str) -> None:
    """``cls.old`` becomes ``cls.new``; instances still resolve ``old`` (upstream's
    callers, renamed with it), the class does not (what a hook registry patches)."""
    owner = _owner(cls, old)
    fn = vars(owner)[old]
    setattr(owner, new, fn)
    delattr(owner, old)
    fallback = getattr(owner, "__getattr__", None)

    def __getattr__(self: Any, name: str) -> Any:
        if name == old:
            return getattr(self, new)
        if fallback is not None:
            return fallback(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    owner.__getattr__ = __getattr__  # type: ignore[attr-defined]
    emit("drift", change="renamed", target=f"{owner.__module__}.{owner.__qualname__}.{old}")


def rename_param(cls: type, method: str, old: str, new: str) -> None:
    """``cls.method``'s parameter ``old`` becomes ``new`` (its signature says so;
    positional calls and calls by the new name reach the original)."""
    owner = _owner(cls, method)
    original = vars(owner)[method]
    signature = inspect.signature(original)
    if old not in signature.parameters:
        raise LookupError(f"{owner.__qualname__}.{method} has no parameter {old!r}")
    params = [p.replace(name=new) if p.name == old else p for p in signature.parameters.values()]

    def renamed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if new in kwargs:
            kwargs[old] = kwargs.pop(new)
        return original(self, *args, **kwargs)

    # No __wrapped__: the changed signature is the method's own, as in a new release.
    renamed.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    renamed.__name__ = method
    renamed.__qualname__ = getattr(original, "__qualname__", method)
    renamed.__module__ = owner.__module__
    setattr(owner, method, renamed)
    emit(
        "drift",
        change="param_renamed",
        target=f"{owner.__module__}.{owner.__qualname__}.{method}",
        old=old,
        new=new,
    )


def _add_sweep(mod: ModuleType) -> None:
    def hx_future_sweep(self: Any, budget: int = 0) -> str:
        return SWEEP_ANSWER

    mod.PoolExistenceBeliefs.hx_future_sweep = hx_future_sweep
    emit("drift", change="added", target=f"{mod.__name__}.PoolExistenceBeliefs.hx_future_sweep")


def _call_sweep(mod: ModuleType) -> None:
    cls = mod.Scheduler
    ingest = cls.ingest_requests
    calls = [0]

    def ingest_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = ingest(self, *args, **kwargs)
        cache = getattr(getattr(self, "tree_cache", None), "storage_existence_cache", None)
        if cache is not None:
            answer = cache.pool("kv").hx_future_sweep(1)
            calls[0] += 1
            if calls[0] == 1:
                kind = type(cache)
                emit(
                    "drift_call",
                    answer=answer,
                    cache_class=f"{kind.__module__}.{kind.__qualname__}",
                )
        return out

    cls.ingest_requests = ingest_requests


_MM = "sglang.srt.mem_cache"
CASES: dict[str, list[tuple[str, Callable[[ModuleType], None]]]] = {
    "write_intents_renamed": [
        (
            f"{_MM}.buffer_mode.pipeline",
            lambda m: rename_method(
                m.BufferModePipeline, "_write_intents", "_select_write_intents"
            ),
        )
    ],
    "write_backup_storage_renamed": [
        (
            f"{_MM}.unified_radix_cache",
            lambda m: rename_method(
                m.UnifiedRadixCache, "write_backup_storage", "backup_node_to_storage"
            ),
        )
    ],
    "write_storage_param_renamed": [
        (
            f"{_MM}.hybrid_cache.hybrid_cache_controller",
            lambda m: rename_param(
                m.HybridCacheController, "write_storage", "hash_value", "hash_values"
            ),
        )
    ],
    "beliefs_method_added": [
        (f"{_MM}.buffer_mode.storage_existence_cache", _add_sweep),
        ("sglang.srt.managers.scheduler", _call_sweep),
    ],
}


class _Warnings(logging.Handler):
    """The package's warnings, as probe lines (the package only ever replaces its
    own handler class, so this one stays)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        emit("hx_warning", logger=record.name, level=record.levelname, message=record.getMessage())


def install() -> None:
    case = os.environ.get("HX_DRIFT", "")
    if case not in CASES:
        raise KeyError(f"HX_DRIFT={case!r}: not one of {sorted(CASES)}")
    logging.getLogger("hicache_existence").addHandler(_Warnings())
    for module, patch in CASES[case]:
        hx_cpu_standins.on_import(module, patch)
