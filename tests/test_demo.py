"""``hicache-existence demo``: the main job, end to end, with real processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from reconcile_redis_server import RedisServer

CIRCUIT_OPEN = "hicache_existence_reconciler_circuit_open"


def _no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr


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
    assert out.returncode == 2 and "--ranks must be >= 1" in out.stderr
    out = _demo("--trace", "/nonexistent/trace.jsonl")
    assert out.returncode == 2 and "no such file" in out.stderr


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


def test_malformed_trace_gives_replays_error_and_exit_2(tmp_path: Path) -> None:
    """A malformed --trace stops the demo before it starts with replay's exact error."""
    trace = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    trace.write_text(good + "\n" + '{"timestamp": 1, "input_length": "x"}\n', encoding="utf-8")
    demo = _demo("--ranks", "1", "--port", "0", "--trace", str(trace))
    replay = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "replay", "--quiet", str(trace)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert demo.returncode == 2 and replay.returncode == 2
    assert "bad.jsonl:2:" in demo.stderr and demo.stderr == replay.stderr
    assert "serving /metrics" not in demo.stdout
    _no_traceback(demo)


def test_taken_port_gives_a_clear_error() -> None:
    """A --port another process holds stops the demo with a clear error (exit 2)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = _demo("--ranks", "1", "--steps", "5", "--port", str(port))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in out.stderr
    assert "already in use" in out.stderr and "--port 0" in out.stderr
    _no_traceback(out)


@pytest.mark.redis
def test_unreachable_redis_stops_before_starting() -> None:
    """--redis-url with nothing listening: a clear message and exit 2, before any rank
    or port starts (the URL's password is not shown)."""
    pytest.importorskip("redis")
    url = f"redis://:s3cret@127.0.0.1:{_free_port()}/0"
    out = _demo("--ranks", "1", "--steps", "5", "--port", "0", "--redis-url", url, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Redis does not answer" in out.stderr and "s3cret" not in out.stderr
    assert "serving /metrics" not in out.stdout
    _no_traceback(out)


@pytest.mark.redis
@pytest.mark.multiprocess
def test_redis_dying_mid_run_leaves_the_demo_running(tmp_path: Path) -> None:
    """A real redis-server killed mid-run: the demo keeps stepping to the end (exit 0),
    the breaker shows in its progress line, its summary and the /metrics gauge."""
    pytest.importorskip("redis")
    server = RedisServer(tmp_path).start()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "hicache_existence", "demo", "--ranks", "1", "--port", "0"),
            *("--steps", "600", "--steps-per-s", "40", "--redis-url", server.url),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    gauge = ""
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            lines.append(line)
            if not url and (m := re.search(r"serving /metrics at (\S+)", line)):
                url = m.group(1)
            if re.match(r"step (\d+)/", line) and int(line.split()[1].split("/")[0]) >= 40:
                break
        assert url, "".join(lines)
        server.kill()  # mid-run: the ledger's writes and the verifications now fail
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            lines.append(line)
            if "breaker open" in line or "breaker half-open" in line:
                with urllib.request.urlopen(url, timeout=5) as r:
                    body = r.read().decode()
                gauge = "".join(re.findall(rf"{CIRCUIT_OPEN}\{{[^}}]*\}} 1\.0", body))
                if gauge or time.monotonic() > deadline:
                    break
        rest, stderr = proc.communicate(timeout=120)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.close()
    text = "".join(lines)
    assert proc.returncode == 0, text + stderr
    assert "Traceback" not in text + stderr, text + stderr
    assert gauge, "the circuit-open gauge never read 1 on /metrics"
    assert "demo finished: 600 steps" in text
    assert re.search(r"circuit breaker opened [1-9]\d* time", text), text


def _session_members(sid: int) -> dict[int, str]:
    """Every live process of session ``sid`` (its pid: its command line), from /proc."""
    members: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            members[int(entry.name)] = cmdline
    return members


def _torch_in(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch.distributed"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("sig", "keep_running"),
    [
        (signal.SIGTERM, True),
        (signal.SIGTERM, False),
        (signal.SIGINT, False),
        (signal.SIGKILL, True),
    ],
    ids=["sigterm-keep-running", "sigterm-one-pass", "sigint-one-pass", "sigkill-keep-running"],
)
def test_a_signal_to_the_demo_stops_every_process_it_started(
    tmp_path: Path, sig: signal.Signals, keep_running: bool
) -> None:
    """A supervisor's ``kill PID`` (SIGTERM), a Ctrl-C (SIGINT), even a SIGKILL of the
    demo's own process: no rank process it spawned (two gloo ranks with torch, one
    without) outlives it, and SIGTERM / SIGINT end it with its summary."""
    ranks = 2 if _torch_in(sys.executable) else 1
    mode = ["--keep-running"] if keep_running else ["--steps", "100000"]
    # Files, not pipes: an orphaned rank holding a pipe open would hang the reader.
    with (tmp_path / "stdout").open("w") as out, (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "hicache_existence", "demo"),
                *("--ranks", "2", "--port", "0", "--steps-per-s", "20", *mode),
            ],
            stdout=out,
            stderr=err,
            start_new_session=True,  # the demo's pid is its session id: its processes
        )
    exited = True
    try:
        deadline = time.monotonic() + 120
        workers: dict[int, str] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            members = _session_members(proc.pid)
            workers = {p: c for p, c in members.items() if "spawn_main" in c}
            if len(workers) == ranks:
                break
            time.sleep(0.2)
        assert len(workers) == ranks, (workers, proc.poll())
        while time.monotonic() < deadline and proc.poll() is None:  # the ranks are stepping
            if re.search(r"^step \d+", (tmp_path / "stdout").read_text(), re.M):
                break
            time.sleep(0.2)
        assert proc.poll() is None
        proc.send_signal(sig)  # the demo's process only, as `kill PID` does
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            exited = False
        deadline = time.monotonic() + 10
        left = _session_members(proc.pid)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _session_members(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _session_members(proc.pid):  # leave no orphan behind a failure
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    stdout, stderr = ((tmp_path / name).read_text() for name in ("stdout", "stderr"))
    assert exited, f"the demo still ran 60 s after {sig.name}: {stdout + stderr}"
    assert not left, f"still running after the demo exited: {left}"
    if sig != signal.SIGKILL:
        assert proc.returncode == (0 if keep_running else 128 + sig), stdout + stderr
        assert "demo finished" in stdout, stdout + stderr
        assert "Traceback" not in stdout + stderr, stdout + stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("env", "flags", "shown"),
    [
        ({}, [], False),
        ({"HICACHE_EXISTENCE_LOGGING__LEVEL": "info"}, [], True),
        ({"HICACHE_EXISTENCE_LOGGING__LEVEL": "info"}, ["--log-level", "error"], False),
    ],
)
def test_demo_ranks_log_at_the_configured_level(env, flags, shown) -> None:
    """logging.level from the environment reaches the spawned ranks (their start-up
    event is logged at info), and --log-level wins over it."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache_existence",
            *flags,
            "demo",
            "--no-progress",
            "--ranks",
            "1",
            "--steps",
            "10",
            "--steps-per-s",
            "0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_EXISTENCE_")} | env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("hicache_existence.startup" in out.stderr) is shown, out.stderr


@pytest.mark.parametrize(
    "argv, missing, extra",
    [
        (["demo", "--port", "0"], "prometheus_client", "demo"),
        (["reconcile-bench", "--spawn"], "redis", "redis"),
    ],
)
def test_a_missing_extra_is_a_one_line_hint(argv, missing, extra, monkeypatch, capsys) -> None:
    """A wheel installed without its extras (docs/enable.md section 1 allows it):
    the command says which extra to install, before starting anything (the
    reconcile bench's redis-server included), instead of a traceback."""
    import importlib.util

    from hicache_existence import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: spawned.append(a) or 1 / 0)
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    text = err + (code if isinstance(code, str) else "")
    assert code not in (0, None) and not spawned
    assert f"hicache-existence[{extra}]" in text and "Traceback" not in text
