"""``hicache-existence demo``: the main job, end to end, with real processes."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache_existence", "demo", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.torch
@pytest.mark.multiprocess
def test_two_rank_demo_runs_end_to_end():
    """Two gloo ranks replay the bundled trace: replicas never diverge, the
    reconciler verifies, and the summary gives capacity advice."""
    pytest.importorskip("torch.distributed")
    out = _demo("--steps", "80", "--steps-per-s", "0", "--port", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "2 TP rank(s)" in text
    checks = re.search(r"TP replicas: (\d+) checks, (\d+) divergences, (\d+) failed", text)
    assert checks and int(checks.group(1)) >= 3 and checks.group(2) == "0"
    assert checks.group(3) == "0"
    verifications = re.search(r"reconciler: (\d+) verifications", text)
    assert verifications and int(verifications.group(1)) > 0
    assert "capacity advice" in text and re.search(r"kv: 0\.25x=[0-9.]+ ", text)


def test_one_rank_demo_needs_no_torch_group():
    """With one rank the demo runs without torch.distributed and still checks."""
    out = _demo("--ranks", "1", "--steps", "40", "--steps-per-s", "0", "--port", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 TP rank(s)" in out.stdout
    assert re.search(r"TP replicas: \d+ checks, 0 divergences", out.stdout)


def test_demo_rejects_bad_options_without_starting():
    """Bad options give a clear error and exit 2 before anything starts."""
    out = _demo("--ranks", "0")
    assert out.returncode == 2 and "--ranks must be >= 1" in out.stdout
    out = _demo("--trace", "/nonexistent/trace.jsonl")
    assert out.returncode == 2 and "no such file" in out.stdout


@pytest.mark.multiprocess
def test_keep_running_serves_metrics_until_interrupted():
    """--keep-running serves the aggregated /metrics while the ranks loop, and a
    Ctrl-C stops every rank at an agreed step and prints the summary."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hicache_existence",
            "demo",
            "--no-progress",
            "--ranks",
            "1",
            "--keep-running",
            "--port",
            str(port),
            "--steps-per-s",
            "100",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        body = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                if re.search(r"hicache_existence_divergence_checks_total\{[^}]*\} [1-9]", body):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert "hicache_existence_page_hits_total" in body
        assert re.search(r"hicache_existence_divergence_checks_total\{[^}]*\} [1-9]", body)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "demo finished" in stdout
