"""A real redis-server that a test starts itself (free port, temp dir), and can
kill, restart, stop (SIGSTOP) and continue; plus a server that answers garbage."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REQUIRE_ALL = os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"


def need_binary(name: str) -> str:
    """The path of ``name``; fails under HICACHE_EXISTENCE_REQUIRE_ALL=1, else skips."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install -y redis-server)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return path


#: Ports ``free_port`` handed out in this test process (and the real-server
#: harness's consecutive blocks).
HANDED_OUT: set[int] = set()


def free_port(attempts: int = 100) -> int:
    """A port nothing listens on now that this process has not handed out before:
    the kernel may give two binds in a row the same ephemeral port, and a router
    once got one port for both its listeners (``--port`` and ``--prometheus-port``)."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in HANDED_OUT:
            HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no port not handed out before in {attempts} attempts")


class RedisServer:
    """One redis-server process on 127.0.0.1; ``restart`` keeps the port."""

    def __init__(self, workdir: Path, *, persistent: bool = False, extra: tuple[str, ...] = ()):
        self.binary = need_binary("redis-server")
        self.workdir = workdir
        self.port = free_port()
        self.persistent = persistent
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--enable-debug-command",
            "local",
            "--daemonize",
            "no",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args + list(self.extra)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited: {err[-500:]}")
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.exceptions.RedisError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not become ready")

    def client(self, **kw: Any) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=5, **kw)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop_process(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def continue_process(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def debug_sleep(self, seconds: float) -> threading.Thread:
        """``DEBUG SLEEP`` from another connection (the server blocks for everyone)."""

        def run() -> None:
            self.client().execute_command("DEBUG", "SLEEP", str(seconds))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        time.sleep(0.02)
        return t

    def close(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


_GARBAGE_SCRIPT = r"""
import socket, sys, threading
reply = bytes.fromhex(sys.argv[1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(64)
print(srv.getsockname()[1], flush=True)

def handle(conn):
    with conn:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            try:
                conn.sendall(reply)
            except OSError:
                return

while True:
    conn, _ = srv.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
"""


class GarbageServer:
    """A TCP server on 127.0.0.1, in its own process (so its threads never compete
    with the test's for the GIL), that answers every request with ``reply``."""

    def __init__(self, reply: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _GARBAGE_SCRIPT, reply.hex()],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
