"""Per-call cost of the per-step hook, beside an empty hook.

SGLang calls ``after_check_hicache_events`` after every scheduler event-loop
iteration, idle ones included (thousands per second), so its fixed cost is the
package's floor inside a server.  This times it in-process with the default
configuration (divergence checks on a single rank, miss reasons, advisor;
metrics off), against an empty function called the same way, in alternating
rounds of thread CPU time.  ``--mode cache`` steps a cache-mode server's runtime
(its write path's pending operations tested every step); ``--in-flight`` keeps one
write pending and unacknowledged (its reap then tests upstream's ``ongoing_backup``
every step).  Only the package's public hook and ``ProcessEntry`` are used, so the
same script times an older checkout (``PYTHONPATH=<old tree>``) side by side.

    python benchmarks/step_hook.py [--rounds 7] [--calls 100000] [--mode cache [--in-flight]]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, ClassVar


def _time(fn: Any, tree: Any, calls: int) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        fn(None, tree)
    return (time.thread_time_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--mode", choices=["buffer", "cache"], default="buffer")
    parser.add_argument("--in-flight", action="store_true", help="cache mode: one write pending")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.in_flight and args.mode != "cache":
        parser.error("--in-flight needs --mode cache")

    from hicache_existence.config import Config
    from hicache_existence.exporters.catalog import DeploymentLabels
    from hicache_existence.integrations.sglang import hooks
    from hicache_existence.integrations.sglang.facts import SchedulerFacts
    from hicache_existence.integrations.sglang.process import PROCESS
    from hicache_existence.runtime import ExistenceRuntime

    env = {"HICACHE_EXISTENCE_ENABLED": "1", "HICACHE_EXISTENCE_METRICS__MODE": "off"}
    runtime = ExistenceRuntime(Config.load(None, env), DeploymentLabels(), generation="current")

    class Tree:
        storage_existence_cache = runtime.cache
        ongoing_backup: ClassVar[dict[int, object]] = {}

    facts = (
        SchedulerFacts(host_memory_mode="cache", storage_backend="file")
        if args.mode == "cache"
        else SchedulerFacts()
    )
    entry = hooks.ProcessEntry(runtime, facts, None, None, None)
    hooks._ENTRIES[PROCESS.pid] = entry
    if args.in_flight:  # launched, not yet drained by upstream's storage ack
        assert entry.write_path.cache_mode is not None
        entry.write_path.cache_mode._pending[1] = object()
        Tree.ongoing_backup[1] = object()

    def empty(result: Any, *a: Any, **k: Any) -> None:
        return None

    tree = Tree()
    _time(hooks.after_check_hicache_events, tree, 2000)  # the first call binds the tree
    ours, base = [], []
    for _ in range(args.rounds):
        ours.append(_time(hooks.after_check_hicache_events, tree, args.calls))
        base.append(_time(empty, tree, args.calls))
    mid = args.rounds // 2
    o, b = sorted(ours)[mid], sorted(base)[mid]
    if args.json:
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "in_flight": args.in_flight,
                    "rounds": args.rounds,
                    "calls": args.calls,
                    "hook_ns_per_call_median": round(o, 1),
                    "empty_hook_ns_per_call_median": round(b, 1),
                    "own_ns_per_call": round(o - b, 1),
                }
            )
        )
        return
    print(
        f"{args.mode} mode{', a write in flight' if args.in_flight else ''}: "
        f"step hook {o:.0f} ns/call, empty hook {b:.0f} ns/call (medians of {args.rounds}): "
        f"{o - b:.0f} ns of our own per event-loop iteration"
    )


if __name__ == "__main__":
    main()
