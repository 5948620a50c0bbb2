"""``hicache-existence launch``: start sglang with the package enabled, without
sglang's parser knowing our flags (docs/enable.md §2).

Our two flags are taken out of the command line (wherever they are) and turned
into the environment the plugin reads in every sglang process; sglang is
``exec``-ed with every other argument unchanged, in order (one process: signals
and exit status are sglang's own, PID 1 in a container).  Launching is enabling:
the child always gets ``HICACHE_EXISTENCE_ENABLED=1``.  A configuration given here
is merged over ``HICACHE_EXISTENCE_CONFIG`` and the per-key variables into the
child's ``HICACHE_EXISTENCE_CONFIG``; the per-key variables are removed (they
would override it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hicache_existence.config import ENV_CONFIG, Config, ConfigError, is_setting_variable
from hicache_existence.integrations.sglang.flags import (
    CONFIG_FLAG,
    ENABLE_FLAG,
    ENV_ENABLED,
    read_config_text,
)

#: sglang entry points the launcher can start.
ENTRIES: dict[str, tuple[str, ...]] = {
    "launch_server": ("-m", "sglang.launch_server"),
    "serve": (
        "-c",
        "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; sys.exit(main())",
        "serve",
    ),
}


class LaunchError(ValueError):
    """The launcher's own arguments are wrong (exit status 2, like argparse)."""


@dataclass(frozen=True)
class LaunchPlan:
    """What would be executed: the argv and the environment changes."""

    argv: tuple[str, ...]
    forwarded: tuple[str, ...]
    set_env: dict[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset_env}
        env.update(self.set_env)
        return env


def split_flags(args: Sequence[str]) -> tuple[bool, str | None, list[str]]:
    """Take ``--enable-hicache-existence`` and ``--hicache-existence-config
    VALUE`` (or ``=VALUE``) out of ``args``; everything else, in order, is for
    sglang (``--`` included: separating the launcher's own options is the
    command line's job, see ``commands/launch.py``)."""
    enabled = False
    config: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == ENABLE_FLAG:
            enabled = True
        elif arg == CONFIG_FLAG:
            if i + 1 >= len(args):
                raise LaunchError(f"{CONFIG_FLAG} needs a value (JSON, a file or @file)")
            config = args[i + 1]
            i += 1
        elif arg.startswith(CONFIG_FLAG + "="):
            config = arg[len(CONFIG_FLAG) + 1 :]
        elif arg.startswith(ENABLE_FLAG + "="):
            raise LaunchError(f"{ENABLE_FLAG} takes no value")
        else:
            rest.append(arg)
        i += 1
    return enabled, config, rest


def plan(
    args: Sequence[str],
    *,
    entry: str = "launch_server",
    config: str | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
) -> LaunchPlan:
    """The launch of sglang ``entry`` with ``args`` (which may contain our flags),
    the package enabled."""
    environ = dict(os.environ if env is None else env)
    _, in_args_config, forwarded = split_flags(args)
    config = in_args_config if in_args_config is not None else config
    flag_text: str | None = None
    if config is not None:
        try:
            flag_text = read_config_text(config)
        except argparse.ArgumentTypeError as exc:
            raise LaunchError(f"{CONFIG_FLAG}: {exc}") from None
    try:
        merged = Config.load(flag_text, environ)
    except ConfigError as exc:
        raise LaunchError(f"invalid hicache-existence configuration: {exc}") from None
    merged = dataclasses.replace(merged, enabled=True)
    python = python or sys.executable
    if entry in ENTRIES:
        command: tuple[str, ...] = (python, *ENTRIES[entry])
    elif entry.startswith("module:") and len(entry) > len("module:"):
        command = (python, "-m", entry[len("module:") :])
    else:
        raise LaunchError(
            f"--sglang-entry must be one of {sorted(ENTRIES)} or module:<name>, got {entry!r}"
        )
    set_env = {ENV_ENABLED: "1"}
    unset: list[str] = []
    if flag_text is not None:
        set_env[ENV_CONFIG] = merged.to_json()
        unset = [key for key in environ if is_setting_variable(key) and key != ENV_ENABLED]
    return LaunchPlan(
        argv=(*command, *forwarded),
        forwarded=tuple(forwarded),
        set_env=set_env,
        unset_env=tuple(k for k in unset if k not in set_env),
    )


def preflight(entry: str) -> list[str]:
    """Problems that would make the launch pointless (no exec happens with them)."""
    if entry.startswith("module:"):
        return []
    if importlib.util.find_spec("sglang") is None:
        return ["sglang is not installed in this interpreter"]
    problems: list[str] = []
    if importlib.util.find_spec("sglang.srt.plugins") is None:
        problems.append(
            "this sglang has no plugin system (sglang.srt.plugins, sglang >= 0.5.12); "
            "hicache-existence cannot hook it"
        )
    from importlib.metadata import entry_points

    if not any(
        ep.value.startswith("hicache_existence.") for ep in entry_points(group="sglang.srt.plugins")
    ):
        problems.append(
            "the hicache_existence entry point (group sglang.srt.plugins) is not installed: "
            "install the package in this interpreter's environment (a wheel built from the "
            "checkout: docs/enable.md, section 1)"
        )
    return problems


def execute(launch: LaunchPlan) -> None:
    """Replace this process with sglang (never returns on success)."""
    env = launch.environment(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.argv[0], list(launch.argv), env)
