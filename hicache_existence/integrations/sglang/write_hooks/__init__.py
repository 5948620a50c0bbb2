"""The hooks that feed ``WritePath`` from SGLang's write path, as one table.

Modules: ``binding`` (the ``Hook`` record, parameter binding, and the prelude,
guard and bracket every hook shares), ``buffer_mode``, ``backends`` (the backup
thread), ``cache_mode``, and ``registry`` (the table ``HOOKS``, ``register`` and
``install_on``).
"""

from __future__ import annotations

from hicache_existence.integrations.sglang import targets
from hicache_existence.integrations.sglang.write_hooks.binding import MODES, Params
from hicache_existence.integrations.sglang.write_hooks.registry import (
    CONTROLLER,
    FILE_BACKEND,
    FLAT_COVERS_ALL,
    HOOKS,
    HYBRID_CONTROLLER,
    MOONCAKE_BACKEND,
    PIPELINE,
    TREE,
    hook,
    install_on,
    register,
)

__all__ = [
    "CONTROLLER",
    "FILE_BACKEND",
    "FLAT_COVERS_ALL",
    "HOOKS",
    "HYBRID_CONTROLLER",
    "MODES",
    "MOONCAKE_BACKEND",
    "PIPELINE",
    "TREE",
    "Params",
    "hook",
    "install_on",
    "register",
    "targets",
]
