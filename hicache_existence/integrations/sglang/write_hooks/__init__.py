"""The hooks that feed ``WritePath`` from SGLang's write path, as one table.

Each entry of ``HOOKS`` is a ``Hook`` record: the upstream target, the hook type,
the API generations it serves, whether the write accounting is meaningless
without it, the upstream parameters it reads, and the factory that builds the
installed callable.  Parameters are read by name: at registration the target's
own signature says where each named parameter sits, so a hook never indexes
upstream's arguments by a position guessed here.  A target that lacks a named
parameter counts as missing, exactly like a target that does not resolve.

Every hook calls upstream first or last, exactly once, outside its own ``try``;
every failure of ours is counted by ``WritePath.error`` and never raised into
sglang.  The scheduler-thread hooks do no I/O; the backup-thread hooks only
record what the backend answered.

Modules: ``binding`` (the ``Hook`` record, parameter binding, and the prelude,
guard and bracket every hook shares), ``buffer_mode``, ``backends`` (the backup
thread), ``cache_mode``, and ``registry`` (the table ``HOOKS`` and ``register``).
"""

from __future__ import annotations

from hicache_existence.integrations.sglang import targets
from hicache_existence.integrations.sglang.write_hooks.binding import (
    BUFFER,
    CACHE,
    MODE_COUNTERS,
    MODES,
    Hook,
    Hooked,
    Kind,
    Mode,
    Param,
    Params,
)
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
    register,
)

__all__ = [
    "BUFFER",
    "CACHE",
    "CONTROLLER",
    "FILE_BACKEND",
    "FLAT_COVERS_ALL",
    "HOOKS",
    "HYBRID_CONTROLLER",
    "MODES",
    "MODE_COUNTERS",
    "MOONCAKE_BACKEND",
    "PIPELINE",
    "TREE",
    "Hook",
    "Hooked",
    "Kind",
    "Mode",
    "Param",
    "Params",
    "hook",
    "register",
    "targets",
]
