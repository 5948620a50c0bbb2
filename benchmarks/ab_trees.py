"""Two checkouts of the package, A/B in one process: did a change slow the hot paths?

``hicache-existence bench`` reports our classes against the seed and upstream. A
refactor of our own code ("the foundation ratios must not fall") asks something else:
is the tree after the change slower than the tree before it? Two bench runs cannot
answer that on a shared machine: their ratios move by more than the change between
runs. Here both trees are imported side by side into one process (each under its own
``sys.modules`` snapshot), their caches built alike and each operation timed round by
round, the two trees interleaved and the order flipped every round.

Even then a cache's speed depends on where its memory landed, so every run also
measures an **A/A control**: the "before" tree against an identical copy of itself.
A change is visible only where the A/B ratios leave the spread of the A/A ones.

    python benchmarks/ab_trees.py BEFORE_TREE AFTER_TREE [--processes 6] [--rounds 40]

``BEFORE_TREE``/``AFTER_TREE``: directories holding a ``hicache_existence`` package
(``git worktree add /tmp/before <commit>``; the compiled index must be built in both,
or copied when ``_lru.c`` did not change). Each process is a fresh interpreter; the
trees' build order alternates between processes. Printed per operation: the geometric
mean over processes of the median after/before time ratio, and its range, for A/B and
for A/A.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_existence_bench import workload

#: Chains cached, pages per chain (``bench``'s 1024), hot chains, lookups per round.
SIZES = {"full": (256, 1024, 8, 32), "quick": (16, 64, 4, 8)}


def _load(root: str) -> Any:
    """The package of ``root``, imported afresh (the other tree's modules set aside)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "hicache_existence"]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        pkg = importlib.import_module("hicache_existence")
    finally:
        sys.path.remove(root)
    if not Path(str(pkg.__file__)).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"imported {pkg.__file__}, not the tree {root}")
    return pkg


def _operations(
    pkg: Any, kv: list[list[str]], swa: list[list[str]], sizes: tuple[int, int, int, int]
) -> dict[str, Any]:
    """One tree's caches, filled alike, and its timed operations (one round each)."""
    chains, pages, hot, queries = sizes
    rng = random.Random(1)
    hot_kv, hot_swa = rng.sample(kv, hot), rng.sample(swa, hot)
    cap = chains * pages
    flat = pkg.FlatStorageExistenceCache(cap)
    for a, b in zip(kv[: len(swa)], swa):
        flat.add("kv", a)
        flat.add("swa", b)
    pools = []
    for _ in range(3):
        pool = pkg.StorageExistenceCache(cap).pool("kv")
        for c in kv:
            pool.add(c)
        pools.append(pool)
    cur, inflight, adder = pools
    inflight.track_inflight(workload.chain(0, 64, "inflight"))
    fresh = workload.chains(8, pages, "fresh")
    turn = [0]

    def lookups(fn: Callable[..., bool], *head: str, on: list[list[str]]) -> Callable[[], None]:
        def run() -> None:
            for i in range(queries):
                if not fn(*head, on[i % hot]):
                    raise AssertionError("a hot chain missed")

        return run

    def add_two() -> None:
        i = turn[0]
        turn[0] += 2
        adder.add(fresh[i % len(fresh)])
        adder.add(fresh[(i + 1) % len(fresh)])

    return {
        "flat.second_pool.contains_all[hot]": lookups(flat.contains_all, "swa", on=hot_swa),
        "flat.second_pool.covers_all[hot]": lookups(flat.covers_all, "swa", on=hot_swa),
        "current.contains_all[hot]": lookups(cur.contains_all, on=hot_kv),
        "current.covered[hot]": lookups(cur.covered, on=hot_kv),
        "current.covered_inflight[hot]": lookups(inflight.covered, on=hot_kv),
        "current.add_steady": add_two,
    }


def one_process(
    before: str, after: str, after_first: bool, rounds: int, reps: int, size: str
) -> None:
    """Child: build both trees' caches, time them interleaved, print JSON ratios."""
    sizes = SIZES[size]
    chains, pages = sizes[:2]
    kv = workload.chains(chains, pages, "kv")
    swa = workload.chains(chains // 2, pages, "swa")
    order = [("before", before), ("after", after)]
    if after_first:
        order.reverse()
    ops = {name: _operations(_load(root), kv, swa, sizes) for name, root in order}
    out: dict[str, float] = {}
    for op in ops["after"]:
        ratios = []
        for r in range(rounds + 1):
            times: dict[str, float] = {}
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                best = math.inf
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ops[name][op]()
                    best = min(best, time.perf_counter() - t0)
                times[name] = best
            if r:  # round 0 warms up
                ratios.append(times["after"] / times["before"])
        out[op] = statistics.median(ratios)
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--reps", type=int, default=4, help="timings per round and tree (the fastest)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, not figures)")
    ap.add_argument("--json", action="store_true", help="print the ratios as JSON")
    ap.add_argument("--child", choices=("before-first", "after-first"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    if args.child:
        first = args.child == "after-first"
        one_process(args.before, args.after, first, args.rounds, args.reps, size)
        return 0
    for tree in (args.before, args.after):
        if not (Path(tree) / "hicache_existence" / "__init__.py").is_file():
            ap.error(f"{tree}: no hicache_existence package there")
    with tempfile.TemporaryDirectory(prefix="hx-ab-") as tmp:
        control = str(Path(tmp) / "before-copy")
        shutil.copytree(
            Path(args.before) / "hicache_existence",
            Path(control) / "hicache_existence",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        results: dict[str, dict[str, list[float]]] = {"A/B": {}, "A/A": {}}
        for i in range(args.processes):
            child = "after-first" if i % 2 else "before-first"
            for label, other in (("A/B", args.after), ("A/A", control)):
                cmd = [sys.executable, __file__, args.before, other, "--child", child]
                cmd += ["--rounds", str(args.rounds), "--reps", str(args.reps)]
                cmd += ["--quick"] if args.quick else []
                line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                for op, ratio in json.loads(line.splitlines()[-1]).items():
                    results[label].setdefault(op, []).append(ratio)
                print(f"process {i + 1}/{args.processes} {label} done", file=sys.stderr, flush=True)

    def gmean(xs: list[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    if args.json:
        print(
            json.dumps(
                {
                    label: {
                        op: {"gmean": round(gmean(xs), 4), "min": min(xs), "max": max(xs)}
                        for op, xs in ops.items()
                    }
                    for label, ops in results.items()
                },
                indent=2,
            )
        )
        return 0
    print("after/before time (below 1: after faster); geometric mean over processes [range]")
    print(f"{'operation':38s} {'A/B (the change)':>26s} {'A/A (identical code)':>26s}")
    for op, ab in results["A/B"].items():
        aa = results["A/A"][op]

        def cell(xs: list[float]) -> str:
            return f"{gmean(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"

        print(f"{op:38s} {cell(ab):>26s} {cell(aa):>26s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
