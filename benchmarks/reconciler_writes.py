"""Scheduler-thread cost of a wired reconciler, this tree's beside another revision's.

The reconciler withholds verdicts whose first missing page was written while its
query was out (docs/reconciler.md, "Writes racing a query").  The check runs when
a verdict is applied; the observer calls on the write path (``touched``,
``added``, ``inflight``) must cost what they did.  This times, per simulated step,
one lookup of a chain (``covered``), one D2H launch (``track_inflight``) and one
storage ack (``add`` + ``untrack_inflight``) of a node, and ``apply`` at the default
sampling rate, through this tree's ``Reconciler`` and through the one of
``--baseline-rev`` (its ``reconciler.py`` read with ``git show`` and executed as a
private module over this tree's package), in alternating rounds of thread CPU
time, in two regimes: ground truth answering at once ("present"), and ground
truth that never answers (a query is always out: every add is noted).  Then
the scheduler-thread CPU time of applying one absence verdict, where the new
check runs.

    python benchmarks/reconciler_writes.py --baseline-rev main [--rounds 9] [--steps 20000]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any


def _pages(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


class _Blocking:
    """Ground truth that never answers until released: a query is always out."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        self.release.wait()
        return 0

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        return [False] * len(hashes)


#: Modules of this package renamed since older revisions: an old ``reconciler.py``
#: imports them by their new names.
_RENAMED = {"hicache_existence.reconcile.truth": "hicache_existence.reconcile.ground_truth"}


def _baseline(rev: str) -> Any:
    """``Reconciler`` as of ``rev``, executed as a private module."""
    import subprocess
    import types
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:hicache_existence/reconcile/reconciler.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for old, new in _RENAMED.items():  # modules renamed since ``rev``
        source = source.replace(f"from {old} import", f"from {new} import")
    module = types.ModuleType("hicache_existence_bench_baseline_reconciler")
    sys.modules[module.__name__] = module  # dataclasses and typing look it up
    exec(compile(source, f"{rev}:reconciler.py", "exec"), module.__dict__)
    return module.Reconciler


def _setup(cls: Any, truth: Any, node_pages: int, chain_pages: int) -> tuple[Any, Any, Any]:
    from hicache_existence.core.cache import StorageExistenceCache
    from hicache_existence.core.observers import Tee

    tee = Tee()
    cache = StorageExistenceCache(1 << 20, observer=tee)
    rec = cls(cache, truth, sampling_rate=0.01, timeout_s=3600.0, agree_interval_steps=4)
    tee.append(rec)
    kv = cache.pool("kv")
    chain = _pages("chain", chain_pages)
    kv.add(chain)
    nodes = [_pages(f"node{i}", node_pages) for i in range(64)]
    record = getattr(truth, "record_stored", None)
    if record is not None:  # L3 holds what is believed: verdicts are "present"
        record("kv", chain)
        for node in nodes:
            record("kv", node)
    return kv, rec, (chain, nodes)


def _time(kv: Any, rec: Any, data: Any, steps: int) -> float:
    chain, nodes = data
    n = len(nodes)
    start = time.thread_time_ns()
    for i in range(steps):
        node = nodes[i % n]
        kv.covered(chain)
        kv.track_inflight(node)
        kv.add(node)
        kv.untrack_inflight(node)
        rec.apply(i)
    return (time.thread_time_ns() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="main", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--node-pages", type=int, default=8)
    parser.add_argument("--chain-pages", type=int, default=64)
    args = parser.parse_args()

    from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth
    from hicache_existence.reconcile.reconciler import Reconciler

    Baseline = _baseline(args.baseline_rev)

    for regime in ("present", "a query always out"):
        blocking = regime != "present"
        truths = [_Blocking() if blocking else InMemoryGroundTruth() for _ in range(2)]
        ours = _setup(Reconciler, truths[0], args.node_pages, args.chain_pages)
        base = _setup(Baseline, truths[1], args.node_pages, args.chain_pages)
        _time(*ours, 2000)
        _time(*base, 2000)
        o_ns, b_ns = [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                o_ns.append(_time(*ours, args.steps))
                b_ns.append(_time(*base, args.steps))
            else:
                b_ns.append(_time(*base, args.steps))
                o_ns.append(_time(*ours, args.steps))
        mid = args.rounds // 2
        o, b = sorted(o_ns)[mid], sorted(b_ns)[mid]
        print(
            f"{regime}: {o:.0f} ns/step this tree, {b:.0f} ns/step {args.baseline_rev} "
            f"(medians of {args.rounds}): ratio {o / b:.3f}"
        )
        for t in truths:
            if isinstance(t, _Blocking):
                t.release.set()
        ours[1].close()
        base[1].close()
    _verdict_cost(Reconciler, Baseline, args.baseline_rev, args.rounds)


def _verdict_cost(new: Any, base: Any, label: str, rounds: int) -> None:
    """CPU time of applying one absence verdict: a 1024-page chain, the answer
    stopping at page 500 (524 believed pages invalidated), 256 other pages added
    since the query (and, second case, also in flight)."""
    from hicache_existence.core.cache import StorageExistenceCache
    from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth
    from hicache_existence.reconcile.worker import Query

    chain = tuple(_pages("verdict", 1024))
    other = _pages("other", 256)

    def make(cls: Any, inflight: bool) -> tuple[Any, Any, Any]:
        cache = StorageExistenceCache(1 << 20)
        rec = cls(cache, InMemoryGroundTruth(), sampling_rate=1e-9)
        if inflight:
            cache.pool("kv").track_inflight(other)
        writes = getattr(rec, "_writes", rec)  # ``WritesSince`` since the reconciler's split
        writes._recent["kv"] = dict.fromkeys(other, 1)
        q = Query(0, "kv", chain, 0.0)
        q.adds_before = 0
        return cache, rec, q

    def run(cache: Any, rec: Any, q: Any, n: int = 300) -> float:
        kv = cache.pool("kv")
        total = 0
        for _ in range(n):
            kv.add(chain[500:])
            start = time.thread_time_ns()
            rec._apply_verdict(q, 500, True)
            total += time.thread_time_ns() - start
        return total / n

    for inflight in (False, True):
        ours, theirs = make(new, inflight), make(base, inflight)
        o_ns = sorted(run(*ours) for _ in range(rounds))
        b_ns = sorted(run(*theirs) for _ in range(rounds))
        o, b = o_ns[rounds // 2], b_ns[rounds // 2]
        where = "added and in flight" if inflight else "added"
        print(
            f"absence verdict, 256 other pages {where} since the query: {o / 1000:.1f} us "
            f"this tree, {b / 1000:.1f} us {label} (medians of {rounds}): ratio {o / b:.3f}"
        )


if __name__ == "__main__":
    main()
