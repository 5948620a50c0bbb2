"""The server flags ``--enable-hicache-existence`` and ``--hicache-existence-config``.

sglang parses strictly with ``ServerArgs.add_cli_args(parser)``, then keeps only
real fields in ``ServerArgs.from_cli_args``.  Two AROUND hooks make the flags
real: one adds them (unless a flag of that name exists: argparse would fail every
launch), the other carries the parsed values as a non-field attribute of the
``ServerArgs`` record, which survives its pickling into every scheduler process.
Those load plugins before they receive the record, so the switch also travels as
``HICACHE_EXISTENCE_ENABLED=1`` in the environment they inherit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_existence.config import ENV_PREFIX, Config, ConfigError

logger = logging.getLogger("hicache_existence.integrations.sglang")

ENABLE_FLAG = "--enable-hicache-existence"
CONFIG_FLAG = "--hicache-existence-config"
ENABLE_DEST = "enable_hicache_existence"
CONFIG_DEST = "hicache_existence_config"
#: The attribute of ``ServerArgs`` that carries the parsed values (not a field).
ATTR = "_hicache_existence"
#: The environment switch (the ``enabled`` key of ``Config``).
ENV_ENABLED = ENV_PREFIX + "ENABLED"


@dataclass(frozen=True)
class FlagValues:
    """What the two flags said: the switch, and the configuration's JSON text
    (read once at parse time, so children never depend on a file path)."""

    enabled: bool = False
    config: str | None = None


def read_config_text(value: str) -> str:
    """``--hicache-existence-config``: JSON text, a file path or ``@path`` ->
    compact JSON text, validated together with the ``HICACHE_EXISTENCE_*``
    variables (argparse reports a ``ValueError`` as a usage error)."""
    if not isinstance(value, str) or not value.strip():
        raise argparse.ArgumentTypeError("expected JSON text, a file path or @path")
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text[1:] if text.startswith("@") else text)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"neither JSON nor a readable file: {path} ({exc.strerror or exc})"
            ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("the configuration must be a JSON object")
    compact = json.dumps(data, sort_keys=True, separators=(",", ":"))
    try:
        Config.load(compact, dict(os.environ))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc}") from None
    return compact


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Add the flags that ``parser`` does not already have; returns those added."""
    existing = getattr(parser, "_option_string_actions", {})
    added = [flag for flag in (ENABLE_FLAG, CONFIG_FLAG) if flag not in existing]
    clash = [flag for flag in (ENABLE_FLAG, CONFIG_FLAG) if flag in existing]
    if clash:
        logger.warning(
            "hicache-existence: sglang already defines %s; the plugin does not add its own "
            "and reads the value sglang parses",
            ", ".join(clash),
        )
    group = parser.add_argument_group(
        "hicache-existence", "Storage-existence cache observability (docs/enable.md)."
    )
    if ENABLE_FLAG in added:
        group.add_argument(
            ENABLE_FLAG,
            dest=ENABLE_DEST,
            action="store_true",
            default=False,
            help="Observe, verify and heal HiCache's storage-existence cache (buffer mode, "
            "prefill servers). Same as HICACHE_EXISTENCE_ENABLED=1.",
        )
    if CONFIG_FLAG in added:
        group.add_argument(
            CONFIG_FLAG,
            dest=CONFIG_DEST,
            type=read_config_text,
            default=None,
            metavar="JSON|PATH",
            help="hicache-existence configuration: JSON text, a JSON file or @file; "
            "overrides HICACHE_EXISTENCE_CONFIG and HICACHE_EXISTENCE_* variables.",
        )
    return added


def values_of_namespace(namespace: object) -> FlagValues:
    """The flags' values in a parsed namespace (absent flags: defaults)."""
    config = getattr(namespace, CONFIG_DEST, None)
    return FlagValues(
        enabled=bool(getattr(namespace, ENABLE_DEST, False)),
        config=config if isinstance(config, str) and config else None,
    )


def stored_values(server_args: object) -> FlagValues | None:
    """The values ``attach`` stored on a ``ServerArgs`` record (plain data: pickles
    anywhere), if any."""
    stored = getattr(server_args, ATTR, None)
    if not isinstance(stored, Mapping):
        return None
    enabled, config = stored.get("enabled"), stored.get("config")
    if not isinstance(enabled, bool) or not (config is None or isinstance(config, str)):
        return None
    return FlagValues(enabled=enabled, config=config)


def around_add_cli_args(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ServerArgs.add_cli_args(parser)``: sglang's flags, then ours."""
    result = original(*args, **kwargs)
    parser = kwargs.get("parser", args[0] if args else None)
    if isinstance(parser, argparse.ArgumentParser):
        try:
            add_arguments(parser)
        except Exception as exc:  # never break sglang's parser
            logger.warning("hicache-existence: could not add the server flags: %r", exc)
    return result


def around_from_cli_args(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ServerArgs.from_cli_args(args)``: attach our values to the record
    and pass the switch to the scheduler processes through the environment."""
    server_args = original(*args, **kwargs)
    namespace = kwargs.get("args")
    if namespace is None:
        namespace = next((a for a in args if isinstance(a, argparse.Namespace)), None)
    if namespace is None:
        return server_args
    values = values_of_namespace(namespace)
    enabled = values.enabled
    if enabled or values.config is not None:
        attach(server_args, values)
        # The flag's configuration wins over the environment (docs/enable.md): its
        # "enabled": true switches the schedulers' plugin on too.
        try:
            enabled = Config.load(values.config, dict(os.environ)).enabled or enabled
        except ConfigError as exc:
            if enabled:  # explicitly enabled: a usage error, not a start without it
                raise SystemExit(
                    f"{ENABLE_FLAG}: invalid hicache-existence configuration: {exc}"
                ) from None
        except Exception:  # validated at parse time already; never break the launch
            if enabled:
                raise
    if enabled:
        os.environ[ENV_ENABLED] = "1"
    return server_args


def attach(server_args: object, values: FlagValues) -> None:
    """Store ``values`` on the record (bookkeeping attribute, not a field; through
    its ``__dict__``, which a frozen record's ``__setattr__`` does not guard)."""
    try:
        vars(server_args)[ATTR] = dataclasses.asdict(values)
    except Exception as exc:
        logger.warning(
            "hicache-existence: cannot attach the flags to %s (%r); the scheduler processes "
            "will read only HICACHE_EXISTENCE_* variables",
            type(server_args).__name__,
            exc,
        )


def register(registry: Any, around: Any) -> None:
    """Register both AROUND hooks on sglang's ``HookRegistry``."""
    from hicache_existence.integrations.sglang.targets import ADD_CLI_ARGS, FROM_CLI_ARGS

    registry.register(ADD_CLI_ARGS, around_add_cli_args, around)
    registry.register(FROM_CLI_ARGS, around_from_cli_args, around)
