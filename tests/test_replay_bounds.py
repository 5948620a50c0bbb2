"""Replay faults found by review: recorded instances modelled apart, traces and
sizes bounded before anything is hashed, a subnormal learn rate, the affinity
prefix of a sampled recorded trace."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_existence.replay.pages import expand
from hicache_existence.replay.trace import MAX_PAGES_PER_REQUEST, TraceError, read_trace

ROOT = Path(__file__).resolve().parents[1]


def _replay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache_existence", "replay", *args, "--quiet", "--no-plot"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_subnormal_learn_rate_is_not_a_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp":0,"input_length":100,"output_length":1,"hash_ids":[1]}\n')
    p = _replay_cli(
        str(trace), "--fleet", "2", "--learn-rate", "1e-320", "--out", str(tmp_path / "o")
    )
    assert "Traceback" not in p.stderr, p.stderr[-300:]
    assert p.returncode == 0


def test_mooncake_request_is_bounded_like_a_page_trace(tmp_path: Path) -> None:
    """An 8 KB gzip line (4M zero ids, 2^31-1 tokens) passes the reader and expands to
    33.5M pages (2x the page-trace bound, ~4 GB); it must be refused by line."""
    n = (2**31 - 1 + 511) // 512
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wt") as f:
        ids = ",".join(["0"] * n)
        f.write(
            f'{{"timestamp":0,"input_length":{2**31 - 1},"output_length":1,"hash_ids":[{ids}]}}\n'
        )
    assert path.stat().st_size < 10_000
    trace = read_trace(path)
    assert -(-trace.requests[0].input_length // 64) > MAX_PAGES_PER_REQUEST
    with pytest.raises(TraceError, match=r"bomb\.jsonl\.gz:1"):
        expand(trace, 64)


def test_recorded_fleet_scales_the_affinity_prefix(tmp_path: Path, monkeypatch) -> None:
    """Every size of a sampled recorded trace runs x rate; the router's affinity prefix
    (in recorded pages) must too (review_repro/affinity_scaling.py shows the effect)."""
    import argparse
    import json

    from hicache_existence.commands import replay as cmd

    path = tmp_path / "rec.jsonl"
    lines = [
        {
            "format": "hicache-existence-trace",
            "version": 2,
            "sample_rate": 0.02,
            "instance": "h",
            "started_unix": 1.0,
            "page_size": 64,
        },
        {
            "timestamp": 0,
            "kind": "lookup",
            "pool": "kv",
            "pages": ["00a", "00b"],
            "walked": 0,
            "request": 1,
        },
        {"timestamp": 1, "kind": "request", "request": 1},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    seen = {}
    monkeypatch.setattr(
        cmd, "_run_fleet", lambda args, *a: seen.setdefault("aff", args.affinity_pages) and 0
    )
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args([str(path), "--fleet", "2", "--quiet", "--out", str(tmp_path / "o")])
    cmd.run(args)
    assert seen["aff"] == 1  # scaled(8, 0.02), not 8


def test_huge_block_tokens_is_refused_not_hashed(tmp_path: Path) -> None:
    """--block-tokens 2^30 --page-size 1 on a one-line, 100-token trace hashed 2^30
    pages for its (partial) block: out of memory (a hashlib ValueError at 3 GB)."""
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp":0,"input_length":100,"output_length":1,"hash_ids":[1]}\n')
    with pytest.raises(ValueError, match="pages of 1 tokens"):
        expand(read_trace(trace, block_tokens=1 << 30), 1)


def test_two_recorded_instances_are_not_one_cache(tmp_path: Path) -> None:
    """TP replicas recorded with ranks "all" (same traffic, two instances): the buffer
    model must give each instance what one instance alone gives, not replay every
    request twice through one cache (review_repro/recorded_multi_instance_model.py)."""
    import json

    from hicache_existence.accounting import recorder as R
    from hicache_existence.replay.trace import read_trace as rt

    pt = expand(rt(ROOT / "tests/data/traces/mooncake_synthetic_trace.jsonl"), 64)

    def write(d: Path, instances: list[str]) -> None:
        d.mkdir()
        for inst in instances:
            lines = [
                {
                    "format": R.FORMAT_TAG,
                    "version": 2,
                    "sample_rate": 1.0,
                    "instance": inst,
                    "started_unix": 1.0,
                    "page_size": 64,
                    "pid": 1,
                    "part": 1,
                }
            ]
            for n, r in enumerate(pt.requests[:300], 1):
                lines.append(
                    {
                        "timestamp": r.timestamp_ms,
                        "kind": "lookup",
                        "pool": "kv",
                        "pages": list(r.pages),
                        "walked": 0,
                        "request": n,
                    }
                )
                lines.append({"timestamp": r.timestamp_ms, "kind": "request", "request": n})
            with gzip.open(d / f"{inst}-x-1-00001.jsonl.gz", "wt") as f:
                f.write("".join(json.dumps(x) + "\n" for x in lines))

    write(tmp_path / "one", ["h-tp0"])
    write(tmp_path / "two", ["h-tp0", "h-tp1"])
    ratios = {}
    for name in ("one", "two"):
        js = tmp_path / f"{name}.json"
        p = _replay_cli(
            str(tmp_path / name),
            "--caps",
            "8K",
            "--current-cap",
            "8K",
            "--jobs",
            "1",
            "--json",
            str(js),
        )
        assert p.returncode == 0, p.stderr
        doc = json.loads(js.read_text())
        sweeps = doc["sweeps"].values() if "sweeps" in doc else [doc["sweep"]]
        ratios[name] = [s["belief_only"]["kv"]["rows"][0]["belief_hit_ratio"] for s in sweeps]
    assert all(r == ratios["one"][0] for r in ratios["two"]), ratios
