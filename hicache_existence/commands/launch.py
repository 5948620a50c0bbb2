"""``hicache-existence launch -- <sglang args>``: start sglang with hicache-existence
enabled through the environment (for an sglang whose parser cannot take the
server flags, or wrappers that build sglang's command line).  Launching is
enabling: ``--enable-hicache-existence`` is accepted but not needed.

Our two flags may stand before ``--`` or among sglang's arguments; every other
argument reaches sglang unchanged and in order.  The launcher ``exec``s sglang,
so signals and the exit status are sglang's.  See docs/enable.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

NAME = "launch"
HELP = "start sglang (launch_server or serve) with hicache-existence enabled"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hicache_existence.integrations.sglang.flags import CONFIG_FLAG, ENABLE_FLAG

    parser.add_argument(
        ENABLE_FLAG,
        dest="enable",
        action="store_true",
        help="accepted for symmetry with the server flag; the launcher always enables the "
        "package in every sglang process (HICACHE_EXISTENCE_ENABLED=1)",
    )
    parser.add_argument(
        CONFIG_FLAG,
        dest="config",
        metavar="JSON|PATH",
        help="configuration (JSON text, a JSON file or @file); wins over HICACHE_EXISTENCE_* "
        "variables",
    )
    parser.add_argument(
        "--sglang-entry",
        default="launch_server",
        metavar="ENTRY",
        help="launch_server (python -m sglang.launch_server, the default), serve "
        "(sglang serve), or module:<name> (python -m <name>)",
    )
    parser.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="print the command and the environment changes as JSON instead of running",
    )
    parser.add_argument(
        "sglang_args",
        nargs=argparse.REMAINDER,
        metavar="-- SGLANG_ARGS",
        help="arguments for sglang, forwarded unchanged",
    )


def run(args: argparse.Namespace) -> int:
    from hicache_existence.integrations.sglang.launcher import LaunchError, execute, plan, preflight

    forwarded = list(args.sglang_args)
    if forwarded[:1] == ["--"]:  # the separator (argparse keeps it with REMAINDER)
        forwarded = forwarded[1:]
    try:
        launch = plan(forwarded, entry=args.sglang_entry, config=args.config)
    except LaunchError as exc:
        print(f"hicache-existence launch: error: {exc}", file=sys.stderr)
        return 2
    if args.print_only:
        from hicache_existence.config import ENV_CONFIG, Config

        shown = dataclasses.asdict(launch)
        set_env = shown["set_env"]
        if ENV_CONFIG in set_env:  # the configuration may hold a Redis password
            redacted = Config.from_json(set_env[ENV_CONFIG]).redacted()
            set_env[ENV_CONFIG] = json.dumps(redacted, sort_keys=True)
        print(json.dumps(shown, indent=2))
        return 0
    problems = preflight(args.sglang_entry)
    if problems:
        for problem in problems:
            print(f"hicache-existence launch: error: {problem}", file=sys.stderr)
        return 2
    try:
        execute(launch)
    except OSError as exc:
        print(f"hicache-existence launch: cannot start {launch.argv[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover (exec does not return)
