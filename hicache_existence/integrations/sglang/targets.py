"""What the integration hooks in sglang, and how it recognises the installed API.

Targets are resolved (imported) before anything is registered, so a missing one
leaves sglang as it was instead of failing inside ``HookRegistry.apply_hooks``.
The cache generation is read from the *shape* of upstream's class, never from a
version string: a release can backport or rename.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from collections.abc import Iterable
from typing import Literal

Generation = Literal["current", "flat"]

#: Upstream's existence cache class (REPLACEd by ours).
CACHE_CLASS = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"
#: Upstream's radix tree, which most targets are methods of.
TREE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
#: The per-step lockstep point (our hook runs AFTER it).
STEP_METHOD = f"{TREE}.check_hicache_events"
#: sglang's argparse machinery (AROUND hooks add and carry the server flags).
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"

CACHE_TARGETS: tuple[str, ...] = (CACHE_CLASS, STEP_METHOD)
FLAG_TARGETS: tuple[str, ...] = (ADD_CLI_ARGS, FROM_CLI_ARGS)


class TargetMissing(LookupError):
    """A hook target does not exist in the installed sglang (``reason`` says why)."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"{target}: {reason}")
        self.target = target
        self.reason = reason


def resolve(target: str) -> object:
    """Import and return ``target`` (``package.module.Class.attr``), or raise
    ``TargetMissing`` naming what is absent."""
    try:
        return pkgutil.resolve_name(target)
    except Exception as exc:  # ImportError, AttributeError, or a module failing to import
        raise TargetMissing(target, f"{type(exc).__name__}: {exc}") from None


def dependency_missing(target: str) -> bool:
    """Whether ``target``'s module is installed but does not import for want of
    another module (a backend whose client library is absent, e.g. Mooncake's):
    an optional part of this deployment, not a change of upstream's API."""
    parts = target.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # a parent package that does not import
            continue
        if spec is None:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return exc.name != name  # the module's own file is there; a dependency is not
        except Exception:
            return False
        return False
    return False


def first_missing(targets: Iterable[str]) -> TargetMissing | None:
    """The first target that does not resolve, or ``None`` when all do."""
    for target in targets:
        try:
            resolve(target)
        except TargetMissing as missing:
            return missing
    return None


def detect_generation(cls: object) -> Generation | None:
    """The API generation of an upstream existence cache class, by its shape:
    ``current`` (per-pool objects from ``pool(name)``), ``flat`` (the seed's
    ``add(pool, hashes)`` ... on the cache itself) or ``None`` (unknown)."""
    if not isinstance(cls, type):
        return None
    if callable(getattr(cls, "pool", None)) and callable(getattr(cls, "clear_inflight", None)):
        return "current"
    flat_methods = ("add", "contains", "contains_all", "covers_all", "invalidate_beyond")
    if not all(callable(getattr(cls, name, None)) for name in flat_methods):
        return None
    try:
        params = inspect.signature(cls.add).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return "flat" if sum(p.kind in kinds for p in params) >= 3 else None  # self, pool, hashes


def original_of(obj: object) -> object:
    """``obj`` with HookRegistry's wrappers peeled off (``__wrapped__`` chain)."""
    seen = 0
    while hasattr(obj, "__wrapped__") and seen < 32:
        obj = obj.__wrapped__
        seen += 1
    return obj
