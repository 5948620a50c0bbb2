"""Where the recorder's insert bracket spends its time, in process, the caches cold.

In the server the bracket of each insert (``Recorder.bracket``: the compiled ``Bracket``)
costs about 1-2.5 us, the largest part of the recorder's share (issue 31).  This times,
after an 8 MB copy that leaves the caches cold as a real upstream call does, one call
of a Python ``insert(params)`` made five ways, each as extra ns over calling it from
Python directly (median and mean over ``--calls``):

- ``C into Python``: through ``functools.partial``, a C callable that only calls it:
  what any C wrapper pays for the interpreter entry, before doing anything;
- ``bracket (C)``: the recorder's compiled bracket (numbering, the request, its end);
- ``Python wrapper``: a Python function of insert's signature that only calls it;
- ``Python bracket``: that wrapper doing the bracket's work through the tap's
  attributes and ``ended`` (what ``Recorder.begin_request`` / ``end_request`` do).

    python benchmarks/bracket_parts.py [--calls 3000] [--evict-mb 8] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hicache_existence.accounting import recorder


def _insert(params: Any) -> int:
    """A stand-in for the tree's insert: a few microseconds of Python."""
    return sum(range(300))


def _python_wrapper(insert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def wrapped(params: Any) -> Any:
        return insert(params)

    return wrapped


def _python_bracket(tap: Any, insert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def bracketed(params: Any) -> Any:
        tap.numbered += 1
        tap.request = number = tap.numbered
        try:
            return insert(params)
        finally:
            tap.request = 0
            tap.ended(number)

    return bracketed


def measure(calls: int, evict_mb: int) -> dict[str, Any]:
    tap = recorder.Tap("0", 1 << 20, time.monotonic)
    ways: dict[str, Callable[[Any], Any]] = {
        "direct": _insert,
        "C into Python": functools.partial(_insert),
        "bracket (C)" if recorder.Tap is not recorder.PyTap else "bracket (PyTap)": tap.bracket(
            _insert
        ),
        "Python wrapper": _python_wrapper(_insert),
        "Python bracket": _python_bracket(tap, _insert),
    }
    src = bytearray(evict_mb << 20)
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {name: [] for name in ways}
    for i in range(calls):
        for name, call in ways.items():  # interleaved: each way sees the same machine
            bytes(src)
            t0 = clock()
            call(None)
            times[name].append(clock() - t0)
        if i % 1000 == 999:
            tap.take(1 << 20)
    base_median = statistics.median(times["direct"])
    base_mean = statistics.mean(times["direct"])
    return {
        "calls": calls,
        "evict_mb": evict_mb,
        "direct_ns": {"median": round(base_median), "mean": round(base_mean)},
        "extra_ns": {
            name: {
                "median": round(statistics.median(t) - base_median),
                "mean": round(statistics.mean(t) - base_mean),
            }
            for name, t in times.items()
            if name != "direct"
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--evict-mb", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.evict_mb < 0:
        parser.error("--calls must be >= 1 and --evict-mb >= 0")
    out = measure(args.calls, args.evict_mb)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"direct call: {out['direct_ns']['median']} ns (median), caches cold")
    for name, r in out["extra_ns"].items():
        print(f"{name:>16}: +{r['median']} ns median, +{r['mean']} ns mean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
