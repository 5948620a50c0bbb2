"""Where the installed sglang already does part of this package's job (docs/enable.md §8).

Three upstream pull requests overlap the package: cache-mode L3 writes
deduplicated through sglang's existence cache (#39845), a cap read from
``SGLANG_HICACHE_EXISTENCE_CACHE_MAX_ENTRIES`` (#39747), and ``BlockStored``
events with medium ``EXTERNAL`` at the storage ack (#29923).  If one lands, the
package must not deduplicate a second time, count a lookup twice, fight sglang
over the cap, or go quiet without saying why.

Each is recognised from the installed code, never a version string (a release
can backport or rename): the names a function's bytecode reads (``co_names``,
nested code included).  sglang 0.5.21 and 0.5.23 show none
(``tests/test_upstream_overlap.py`` checks the installed wheel).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache_existence.core._validate import is_int
from hicache_existence.integrations.sglang.targets import TREE

#: sglang's variable for the existence cache's capacity (#39747).
CAP_ENV = "SGLANG_HICACHE_EXISTENCE_CACHE_MAX_ENTRIES"

#: The cache-mode write path: the node write and the controllers' launches.
DEDUP_PATH: tuple[str, ...] = (
    f"{TREE}.write_backup_storage",
    "sglang.srt.managers.cache_controller.HiCacheController.write_storage",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.write_storage",
)
#: The attribute upstream's tree keeps its existence cache under.
_BELIEFS_ATTRIBUTE = "storage_existence_cache"
#: Modules whose functions would emit storage-tier events at the storage ack.
EVENT_MODULES: tuple[str, ...] = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
)
_EXTERNAL = "EXTERNAL"


@dataclass(frozen=True)
class Overlap:
    """What the installed sglang does itself (module docstring)."""

    #: The cache-mode write path consults the existence cache (the target that does).
    dedups_cache_mode: str | None = None
    #: A function that emits storage-tier (``EXTERNAL``) KV events.
    external_events: str | None = None

    def describe(self) -> str:
        """The start-up line's clause ("" when nothing overlaps)."""
        parts = []
        if self.dedups_cache_mode:
            parts.append("sglang deduplicates cache-mode L3 writes itself: counting only")
        if self.external_events:
            parts.append("sglang emits EXTERNAL storage events itself")
        return "; ".join(parts)


def code_names(fn: object) -> frozenset[str]:
    """Every name the bytecode of ``fn`` (and its nested functions, lambdas and
    comprehensions) reads as a global or an attribute; empty for a non-function."""
    fn = getattr(fn, "__func__", fn)
    for _ in range(32):  # every wrapper (HookRegistry's, functools.wraps decorators)
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = getattr(inner, "__func__", inner)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return frozenset()
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(names)


def dedup_target(resolve: Callable[[str], object]) -> str | None:
    """The cache-mode write target that reads the existence cache, looked one call
    deep into the tree's own methods; ``None`` when none does (sglang <= 0.5.23)."""
    for target in DEDUP_PATH:
        try:
            fn = resolve(target)
        except Exception:  # absent: write_hooks warns about it
            continue
        names = code_names(fn)
        if _BELIEFS_ATTRIBUTE in names:
            return target
        owner_name = target.rsplit(".", 1)[0]
        try:
            owner = resolve(owner_name)
        except Exception:
            continue
        if not isinstance(owner, type):
            continue
        for name in names:  # what ``self.<name>(...)`` may call
            callee = inspect.getattr_static(owner, name, None)  # a property stays one
            if isinstance(callee, (types.FunctionType, staticmethod, classmethod)) and (
                _BELIEFS_ATTRIBUTE in code_names(callee)
            ):
                return f"{target} (through {getattr(callee, '__name__', callee)})"
    return None


def external_events_target(import_module: Callable[[str], Any]) -> str | None:
    """The first function of ``EVENT_MODULES`` that reads ``EXTERNAL`` (a
    ``StorageMedium.EXTERNAL`` event), or ``None``."""
    for module_name in EVENT_MODULES:
        try:
            module = import_module(module_name)
        except Exception:
            continue
        for owner_name, fn in _functions(module):
            if _EXTERNAL in code_names(fn):
                return f"{module_name}.{owner_name}"
    return None


def _functions(module: Any) -> Iterable[tuple[str, object]]:
    """(qualified name, function) of the module's own functions and class methods."""
    name = getattr(module, "__name__", "")
    for attr_name, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != name:
            continue
        if isinstance(value, types.FunctionType):
            yield attr_name, value
        elif isinstance(value, type):
            for method_name, method in list(vars(value).items()):
                fn = getattr(method, "__func__", method)
                if isinstance(fn, types.FunctionType):
                    yield f"{attr_name}.{method_name}", fn
                elif isinstance(method, property) and method.fget is not None:
                    yield f"{attr_name}.{method_name}", method.fget


def detect(
    resolve: Callable[[str], object],
    import_module: Callable[[str], Any] = importlib.import_module,
) -> Overlap:
    """What the installed sglang does itself; never raises."""
    dedup: str | None = None
    events: str | None = None
    with contextlib.suppress(Exception):
        dedup = dedup_target(resolve)
    with contextlib.suppress(Exception):
        events = external_events_target(import_module)
    return Overlap(dedup, events)


@dataclass(frozen=True)
class Cap:
    """The existence cache's capacity and where it came from."""

    entries: int
    #: ``cache.max_entries``, ``SGLANG_HICACHE_EXISTENCE_CACHE_MAX_ENTRIES``,
    #: ``sglang's constructor`` or ``the default``.
    source: str
    #: A warning to log once (settings that disagree, an unusable variable).
    warning: str | None = None


def resolve_cap(
    configured: int,
    configured_given: bool,
    env: Mapping[str, str],
    passed: Any,
) -> Cap:
    """The one rule for the cap: the operator's ``cache.max_entries`` (even at its
    default), then sglang's variable, then sglang's argument, then the default."""
    raw = (env.get(CAP_ENV) or "").strip()
    env_cap: int | None = None
    warning: str | None = None
    if raw:
        with contextlib.suppress(ValueError):
            env_cap = int(raw)
        if env_cap is None or env_cap < 1:
            warning = f"{CAP_ENV}={raw!r} is not a positive integer; ignored"
            env_cap = None
    if configured_given:
        if env_cap is not None and env_cap != configured:
            warning = (
                f"cache.max_entries={configured} and {CAP_ENV}={env_cap} disagree; "
                f"cache.max_entries wins (the cap is {configured})"
            )
        return Cap(configured, "cache.max_entries", warning)
    if env_cap is not None:
        return Cap(env_cap, CAP_ENV, warning)
    if is_int(passed) and passed >= 1:
        return Cap(passed, "sglang's constructor", warning)
    return Cap(configured, "the default", warning)
