"""The harness's start-up when another process holds the port it chose.

A Prometheus exposition server (another test process's exporter) that binds the
port ``free_port()`` picked answers the readiness probe itself: without a check,
the test then talks to it (``POST /generate`` -> 405) while the real server's own
bind fails minutes later.  Stand-in processes play the server here (no model, no
sglang start-up): the real servers of the other modules are the positive control.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness import PortTaken, Server, ServerSpec, foreign
from prometheus_client import CollectorRegistry, start_http_server

#: A stand-in server: answers ``/health`` with an empty 200 on ``--port``.
STAND_IN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError:  # the port is taken: wait, as SGLang loads its model before it binds
    import time
    time.sleep(60)
    raise
server.serve_forever()
"""


def stand_in(tmp_path: Path, port: int) -> Server:
    srv = Server(ServerSpec(), tmp_path, tmp_path / "l3", port)
    srv.args = [sys.executable, "-c", STAND_IN, "--port", str(port)]
    return srv


@pytest.fixture
def exporter_port() -> object:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        yield server.server_port
    finally:
        server.shutdown()
        thread.join(5)


def test_an_exporter_on_the_chosen_port_is_not_taken_for_the_server(
    tmp_path: Path, exporter_port: int
) -> None:
    srv = stand_in(tmp_path, exporter_port)
    t0 = srv.spawn()
    with pytest.raises(PortTaken, match="Prometheus exposition server"):
        srv._wait_ready(t0)
    assert srv.proc is not None and srv.proc.poll() is not None  # stopped, not leaked


def test_start_moves_to_a_fresh_port_and_reaches_its_own_server(
    tmp_path: Path, exporter_port: int
) -> None:
    srv = stand_in(tmp_path, exporter_port)
    try:
        srv.start()
        assert srv.port != exporter_port
        assert srv.url.endswith(f":{srv.port}")
        assert srv.args[srv.args.index("--port") + 1] == str(srv.port)
    finally:
        srv.stop(grace_s=2.0)


@pytest.mark.parametrize(
    ("content_type", "head", "expected"),
    [
        ("text/plain; version=0.0.4; charset=utf-8", b"# HELP python_gc", True),
        ("application/openmetrics-text; version=1.0.0", b"", True),
        (None, b"# TYPE x counter\n", True),
        (None, b"", False),  # SGLang's /health
        ("application/json", b'{"status":"ok"}', False),
        ("text/plain; charset=utf-8", b"OK", False),
    ],
)
def test_foreign_answers(content_type: str | None, head: bytes, expected: bool) -> None:
    assert foreign(content_type, head) is expected
