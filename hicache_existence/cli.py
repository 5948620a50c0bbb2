"""The ``hicache-existence`` command line: the only module that configures the
process's logging (the library only asks for loggers, ``hicache_existence.logs``;
inside SGLang the plugin sets only the package's own logger from ``logging``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Sub-command modules under ``hicache_existence.commands``, in help order.
COMMANDS = ("demo", "bench", "replay", "doctor", "reconcile_bench", "launch", "assets")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by docs tests)."""
    from hicache_existence._version import __version__

    parser = argparse.ArgumentParser(
        prog="hicache-existence",
        description="Observe, verify and heal SGLang HiCache's storage-existence cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default=None,
        choices=("debug", "info", "warning", "error"),
        help="library log events at or above this level go to stderr (default: "
        "logging.level from HICACHE_EXISTENCE_* configuration, else warning)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=None,
        help="log events as JSON lines (default: logging.json from the configuration)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"hicache_existence.commands.{name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    from hicache_existence.config import Config, ConfigError
    from hicache_existence.logs import configure_logging

    try:
        section = Config.from_env().logging
    except ConfigError as exc:
        print(
            f"hicache-existence: invalid configuration in the environment: {exc}", file=sys.stderr
        )
        return 2
    # Resolved once, here; commands that spawn processes (the demo) pass them on.
    args.log_level = args.log_level or section.level or "warning"
    args.log_json = section.json if args.log_json is None else args.log_json
    configure_logging(args.log_level, json_output=args.log_json)
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
