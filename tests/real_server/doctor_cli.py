"""``hicache-existence doctor`` run as an operator runs it, and its evidence held to
the servers' own ``/metrics`` (used by test_doctor_servers.py and test_cache_mode.py)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REPO, MissingSeries, Server, parse_metrics


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


def server_value(text: str, series: str, *, unborn_ok: bool = False) -> float:
    """``series`` (``name{label="v",...}``, as the doctor names figures) read from
    the server's own /metrics text: counters summed over every other label, gauges
    the largest (the doctor's documented aggregation; one rank here).

    Strict, like the harness's readers: a series with no sample raises
    ``MissingSeries``, so a misspelt or vanished name never reads 0.  ``unborn_ok``
    allows one case only, a series that exists but was never created: its family is
    declared on /metrics (its ``# TYPE``: a cause or reason of ours not seen yet), or
    it is an SGLang metric the installed SGLang defines (``sglang_defines``), which
    SGLang creates at its first event and its multiprocess exposition leaves out
    until then; it then reads 0."""
    m = _KEY.match(series)
    assert m is not None, series
    name, inner = m.group(1), m.group(2) or ""
    want = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', inner))
    fams = parse_metrics(text)
    values = [
        v
        for fam in fams.values()
        for n, labels, v in fam.samples
        if n == name and all(labels.get(k) == x for k, x in want.items())
    ]
    if not values:
        declared = name in fams or name.removesuffix("_total") in fams or sglang_defines(name)
        if unborn_ok and declared:
            return 0.0
        why = "declared, no such sample yet" if declared else "not on /metrics at all"
        raise MissingSeries(f"no sample {series} on the server's /metrics ({why})")
    return sum(values) if name.endswith("_total") else max(values)


@functools.cache
def _sglang_metric_sources() -> str:
    import sglang

    root = Path(sglang.__file__).parent / "srt"
    return "\n".join(p.read_text(errors="replace") for p in sorted(root.rglob("*collector*.py")))


def sglang_defines(name: str) -> bool:
    """Whether the installed SGLang's metrics collectors define the metric ``name``
    (``sglang:...``, as a quoted literal in their source): independent of this
    package's own list of the SGLang series it reads."""
    return name.startswith("sglang:") and f'"{name}"' in _sglang_metric_sources()


def check_evidence(finding: dict[str, Any], servers: dict[str, Server]) -> int:
    """Every evidence figure of ``finding`` equals the server's own series; returns
    how many were compared.  A figure the server has no sample for must be 0 and
    exist without a sample (``server_value``'s ``unborn_ok``): the doctor reading a
    name neither the server nor SGLang knows fails, whatever it reports."""
    texts = {url: srv.metrics_text() for url, srv in servers.items()}
    compared = 0
    for e in finding["evidence"]:
        if not _KEY.match(e["series"]) or e["instance"] not in texts:
            continue  # a derived figure (a share) or another source
        unborn = e["value"] == 0
        assert e["value"] == server_value(texts[e["instance"]], e["series"], unborn_ok=unborn), e
        compared += 1
    return compared
