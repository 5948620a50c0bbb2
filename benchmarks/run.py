"""Run every benchmark suite and keep the JSON records in benchmarks/results/.

A thin wrapper over ``hicache-existence bench``: the suites live in the package
(``hicache_existence_bench``) so the installed CLI can run them too.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from hicache_existence.cli import main

RESULTS = Path(__file__).resolve().parent / "results"


def run(name: str, argv: list[str]) -> int:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(argv)
    record = json.loads(buffer.getvalue())
    record["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{name}: exit {rc}, written to {RESULTS / (name + '.json')}")
    return rc


if __name__ == "__main__":
    extra = sys.argv[1:]
    rc = run("foundation", ["bench", "--json", *extra])
    # The observability issue's criterion: the same ratios with export wired in.
    rc |= run("foundation-wired", ["bench", "--json", "--wired", *extra])
    sys.exit(rc)
