"""Scheduler-thread cost of the storage-tier KV events per acknowledged page.

The write path calls ``kv_events.feed`` at every storage acknowledgement of a
buffer-mode write (``events.enabled`` only).  This times that call, on the calling
thread's CPU clock, for this tree's emitter and for another revision's
(``--baseline-rev``: its ``events/emitter.py`` and ``integrations/sglang/kv_events.py``
read with ``git show`` and executed as private modules), beside the cache's own
``add`` of the same pages: the per-page work the write path already does at the ack.
Writes are real SGLang ``BufferBackupSnapshot`` intents of new pages (each emitter
fresh, so every page is published), then the same acknowledgements again (every
page already published).  The publisher threads run and send to a sink that
discards; their CPU time is not the scheduler's and is not counted.  Rounds
alternate the variants, the order flipped every round; medians are reported.

    python benchmarks/kv_events_cost.py [--baseline-rev 5ed7548] [--rounds 7]
        [--acks 2000] [--pages 32] [--page-size 16]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
import types
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class _Discard:
    def send(self, ts: float, events: Sequence[Any]) -> None:
        return None

    def close(self) -> None:
        return None


def _module(rev: str, path: str, name: str) -> Any:
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look it up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def _intents(acks: int, pages: int, page_size: int) -> list[tuple[Any, list[str]]]:
    """``acks`` buffer-mode writes of ``pages`` pages each, in chains of 8 writes."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
        BufferBackupSnapshot,
    )

    out: list[tuple[Any, list[str]]] = []
    last: str | None = None
    for a in range(acks):
        hashes = [hashlib.sha256(f"{a}:{i}".encode()).hexdigest() for i in range(pages)]
        root = a % 8 == 0
        start = a * pages * page_size
        snapshot = BufferBackupSnapshot(
            node_id=a,
            parent_node_id=a - 1,
            parent_is_root=root,
            parent_last_hash=None if root else last,
            hash_values=hashes,
            key=RadixKey(array("q", range(start, start + pages * page_size))),
            prefix_keys=None,
        )
        out.append((types.SimpleNamespace(snapshot=snapshot), hashes))
        last = hashes[-1]
    return out


def _time_feed(
    emitter_cls: Any, feed: Callable[..., None], writes: list[tuple[Any, list[str]]]
) -> tuple[float, float]:
    """ns per acknowledged page on this thread: new pages, then the same again."""
    events = emitter_cls(lambda: _Discard(), medium="DISK", queue_size=1 << 20, max_blocks=1 << 22)
    assert events.start()
    pages = sum(len(keys) for _, keys in writes)
    out = []
    for again in (False, True):
        start = time.thread_time_ns()
        for intent, keys in writes:
            feed(events, intent, keys, len(keys))
        out.append((time.thread_time_ns() - start) / pages)
        if again:
            events.close(timeout_s=60.0)
        else:
            _settle(events)
    snap = events.snapshot()
    assert snap.dropped["queue_full"] == 0 and snap.published["stored"] == pages, snap
    return out[0], out[1]


def _settle(events: Any) -> None:
    """Let the publisher finish the first pass before the second is timed."""
    deadline = time.monotonic() + 60
    while not events._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)


def _time_add(writes: list[tuple[Any, list[str]]]) -> float:
    from hicache_existence.core.cache import StorageExistenceCache

    pages = sum(len(keys) for _, keys in writes)
    kv = StorageExistenceCache(1 << 22).pool("kv")
    start = time.thread_time_ns()
    for _, keys in writes:
        kv.add(keys)
    return (time.thread_time_ns() - start) / pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="5ed7548", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--acks", type=int, default=2000)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()

    from hicache_existence.events.emitter import KvEvents
    from hicache_existence.integrations.sglang import kv_events

    rev = args.baseline_rev
    old_em = _module(rev, "hicache_existence/events/emitter.py", "hx_bench_old_emitter")
    old_kv = _module(
        rev, "hicache_existence/integrations/sglang/kv_events.py", "hx_bench_old_kv_events"
    )
    writes = _intents(args.acks, args.pages, args.page_size)
    variants: dict[str, Callable[[], Any]] = {
        "this tree": lambda: _time_feed(KvEvents, kv_events.feed, writes),
        rev: lambda: _time_feed(old_em.KvEvents, old_kv.feed, writes),
        "cache add": lambda: _time_add(writes),
    }
    results: dict[str, list[Any]] = {name: [] for name in variants}
    for r in range(args.rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            results[name].append(variants[name]())

    def med(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    add = med(results["cache add"])
    print(
        f"{args.acks} acks of {args.pages} pages ({args.page_size} tokens), "
        f"{args.rounds} rounds, medians, scheduler-thread CPU per acknowledged page:"
    )
    print(f"  cache add: {add:.0f} ns/page")
    for name in ("this tree", rev):
        new = med([n for n, _ in results[name]])
        again = med([a for _, a in results[name]])
        print(
            f"  events {name}: new pages {new:.0f} ns/page ({new / add:.2f}x add), "
            f"already published {again:.0f} ns/page ({again / add:.2f}x add)"
        )


if __name__ == "__main__":
    main()
