"""The sglang plugin: entry point ``hicache_existence`` of group ``sglang.srt.plugins``
(the name ``SGLANG_PLUGINS`` must list to allow it); docs/enable.md §2-3.

sglang calls ``register()`` through ``sglang.srt.plugins.load_plugins()`` in every
process it starts, before the scheduler exists.  It always registers the two
AROUND hooks (``flags``) that add the server flags (a command line without them
parses as before); once enabled it also registers the REPLACE of upstream's
``StorageExistenceCache``, the per-step AFTER hook and the write-path hooks.

A missing target, an unknown API shape, an upstream existence cache with a
public name ours does not serve (``conformance.py``), or an invalid
configuration produce one warning and no hook of that group (a write-path target
turns off only its host memory mode's counting): sglang then runs exactly as it
would without this package.  ``register()`` itself never raises.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from hicache_existence import logs
from hicache_existence.config import Config, ConfigError
from hicache_existence.core import lru as _lru
from hicache_existence.integrations.sglang import conformance as _conformance
from hicache_existence.integrations.sglang import flags as _flags
from hicache_existence.integrations.sglang import hooks as _hooks
from hicache_existence.integrations.sglang import kv_events as _kv_events
from hicache_existence.integrations.sglang import recorder_hooks as _recorder_hooks
from hicache_existence.integrations.sglang import targets as _targets
from hicache_existence.integrations.sglang import write_hooks as _write_hooks

logger = logging.getLogger("hicache_existence.integrations.sglang")

_DONE: dict[int, dict[str, Any]] = {}


def register() -> None:
    """The entry point: register the hooks this process needs (see module doc)."""
    pid = os.getpid()
    if pid in _DONE:  # idempotent, like load_plugins itself
        return
    report: dict[str, Any] = {"flags": False, "cache": False, "warnings": []}
    _DONE[pid] = report
    try:
        _register(report, os.environ)
    except Exception as exc:  # the plugin must never stop sglang
        _warn(report, f"the plugin failed to load ({exc!r}); sglang runs unmodified")


def status() -> dict[str, Any]:
    """What ``register()`` did in this process (tests, diagnostics)."""
    return dict(_DONE.get(os.getpid(), {}))


def _warn(report: dict[str, Any], message: str) -> None:
    report["warnings"].append(message)
    logger.warning("hicache-existence: %s", message)


def _register(report: dict[str, Any], env: Mapping[str, str]) -> None:
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as exc:
        _warn(
            report,
            f"sglang has no plugin hook registry ({exc!r}); use `hicache-existence launch` "
            "with an sglang that has one (docs/enable.md)",
        )
        return

    missing = _targets.first_missing(_targets.FLAG_TARGETS)
    if missing is None:
        _flags.register(HookRegistry, HookType.AROUND)
        report["flags"] = True
    else:
        _warn(
            report,
            f"this sglang cannot take {_flags.ENABLE_FLAG} (missing {missing}); enable with "
            f"HICACHE_EXISTENCE_ENABLED=1 or `hicache-existence launch` instead",
        )

    try:
        config = Config.from_env(env)
    except ConfigError as exc:
        _warn(report, f"invalid configuration in the environment ({exc}); staying inactive")
        return
    report["enabled"] = config.enabled
    if not config.enabled:
        logger.debug("hicache-existence: installed, not enabled; no cache hooks registered")
        return
    logs.configure_package_logging(config.logging.level, json_output=config.logging.json)
    role = _process_role()
    if role is not None:
        # It never builds a tree cache; resolving the targets would only import
        # unified_radix_cache (seconds of start-up) into it.
        report["skipped"] = role
        logger.debug("hicache-existence: no cache hooks in the %s process", role)
        return
    register_cache_hooks(report, HookRegistry, HookType, config)


#: sglang process entry functions that load plugins but never build a tree cache.
_NO_CACHE_ENTRIES = {"run_detokenizer_process": "detokenizer"}


def _process_role(depth: int = 30) -> str | None:
    """``detokenizer`` when called from sglang's detokenizer process entry."""
    frame: Any = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_code.co_name in _NO_CACHE_ENTRIES:
            return _NO_CACHE_ENTRIES[frame.f_code.co_name]
        frame = frame.f_back
    return None


def register_cache_hooks(
    report: dict[str, Any], registry: Any, hook_type: Any, config: Config
) -> bool:
    """The REPLACE and AFTER hooks, all or nothing."""

    def inactive(why: str) -> bool:
        _warn(report, f"{why} the plugin stays inactive and sglang runs unmodified")
        return False

    missing = _targets.first_missing(_targets.CACHE_TARGETS)
    if missing is not None:
        return inactive(
            f"the installed sglang lacks hook target {missing.target} ({missing.reason});"
        )
    upstream = _targets.resolve(_targets.CACHE_CLASS)
    generation = _targets.detect_generation(upstream)
    if generation is None or not isinstance(upstream, type):
        return inactive(
            f"{_targets.CACHE_CLASS} has an API this package does not know (neither "
            "pool(name) nor add(pool, hashes));"
        )
    forced = config.cache.generation
    if forced not in ("auto", generation):
        return inactive(
            f"cache.generation is {forced!r} but the installed sglang has the {generation} API;"
        )
    gaps = _conformance.gaps(generation, upstream)
    if gaps:
        return inactive(
            f"the installed sglang's existence cache has {', '.join(gaps)}, which this "
            f"package's {generation}-generation cache does not serve; upstream's "
            "StorageExistenceCache stays,"
        )
    replacement = _hooks.replacement_class(generation, upstream)
    registry.register(_targets.CACHE_CLASS, replacement, hook_type.REPLACE)
    registry.register(_targets.STEP_METHOD, _hooks.after_check_hicache_events, hook_type.AFTER)
    modes_off: set[str] = set()
    try:
        report["write_hooks"] = _write_hooks.register(
            registry,
            hook_type,
            generation,
            _targets.resolve,
            lambda m: _warn(report, m),
            off=modes_off,
        )
    except Exception as exc:  # the cache hooks stand without the write accounting
        modes_off.update(_write_hooks.MODES)
        _warn(report, f"write accounting hooks not registered ({exc!r}); write counters are off")
    # A mode without its write path exports no write families (absent, never 0).
    report["write_modes_off"] = sorted(modes_off)
    _hooks.set_uncounted_modes(modes_off)
    # Optional: a missing target costs one info line.  events.enabled may come from
    # a flag read later, so the publisher hook (called once) is registered, inert;
    # the recorder's hook runs at every insert, so the runtime installs it on its
    # tree at the first step, and only with a recorder (recorder_hooks.install_on).
    for key, target, hook, without in (
        ("recorder_hooks", _recorder_hooks.TARGET, None, "traces have no request boundaries"),
        ("events_hooks", _kv_events.TARGET, _kv_events.after_init_kv_events,
         "storage-tier events stay off SGLang's stream"),
        ("events_clear_hooks", _hooks.CLEAR_TARGET, _hooks.after_clear_storage_backend,
         "storage-tier events keep L3's blocks after /clear_hicache_storage_backend"),
    ):  # fmt: skip
        try:
            _targets.resolve(target)
        except Exception as exc:
            logger.info("hicache-existence: %s (%s)", without, exc)
            report[key] = []
            continue
        try:
            if hook is not None:
                registry.register(target, hook, hook_type.AFTER)
            report[key] = [target]
        except Exception as exc:
            _warn(report, f"{target} not registered ({exc!r}); {without}")
    report["cache"] = True
    report["generation"] = generation
    logger.info(
        "hicache-existence: enabled; %s-generation cache hooks registered; %s LRU index "
        "(%.0f B per entry)",
        generation,
        "compiled" if _lru.BACKEND == "c" else "pure-Python",
        _lru.BYTES_PER_ENTRY,
    )
    return True
