"""``hicache-existence doctor`` run as an operator runs it, and its evidence held to
the servers' own ``/metrics`` (used by test_doctor_servers.py and test_cache_mode.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from harness import REPO, Server, parse_metrics


def metrics_url(srv: Server) -> str:
    return srv.url + "/metrics"


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def doc(self) -> dict[str, Any]:
        return dict(json.loads(self.out))

    def findings(self, fid: str) -> list[dict[str, Any]]:
        return [f for f in self.doc["findings"] if f["id"] == fid]


def doctor(*argv: str, timeout_s: float = 120.0) -> Run:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_PROXY": "127.0.0.1,localhost"}
    env = {k: v for k, v in env.items() if not k.startswith("HICACHE_EXISTENCE_") or "REQUIRE" in k}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "doctor", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


_KEY = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")


def server_value(text: str, series: str) -> float:
    """``series`` (``name{label="v",...}``, as the doctor names figures) read from
    the server's own /metrics text: counters summed over every other label, gauges
    the largest (the doctor's documented aggregation; one rank here)."""
    m = _KEY.match(series)
    assert m is not None, series
    name, inner = m.group(1), m.group(2) or ""
    want = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', inner))
    values = [
        v
        for fam in parse_metrics(text).values()
        for n, labels, v in fam.samples
        if n == name and all(labels.get(k) == x for k, x in want.items())
    ]
    if not values:
        return 0.0
    return sum(values) if name.endswith("_total") else max(values)


def check_evidence(finding: dict[str, Any], servers: dict[str, Server]) -> int:
    """Every evidence figure of ``finding`` equals the server's own series; returns
    how many were compared."""
    texts = {url: srv.metrics_text() for url, srv in servers.items()}
    compared = 0
    for e in finding["evidence"]:
        if not _KEY.match(e["series"]) or e["instance"] not in texts:
            continue  # a derived figure (a share) or another source
        assert e["value"] == server_value(texts[e["instance"]], e["series"]), e
        compared += 1
    return compared
