"""Bad input at a real server: a bad configuration stops the launch early and
clearly; a taken metrics port costs only the metrics endpoint."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from harness import ServerSpec, launch, run_to_exit, trace_requests

pytestmark = pytest.mark.real_server


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"cache": {"max_entriez": 4096}}', "max_entriez"),
        ('{"cache_mode": {"dedup": "yes"}}', "cache_mode.dedup must be a boolean"),
    ],
)
def test_invalid_config_stops_the_launch_with_exit_2_naming_the_key(
    tmp_path: Path, text: str, named: str
) -> None:
    """A misspelt key, or a value of the wrong type, in --hicache-existence-config:
    launch_server exits 2 and names the key, before any scheduler process loads the
    model."""
    spec = ServerSpec(config_text=text)
    rc, log = run_to_exit(spec, tmp_path, timeout_s=240)
    assert rc == 2, log[-3000:]
    assert named in log
    # Nothing of the model: no weights loaded, no tree built, no scheduler started.
    assert "Load weight" not in log
    assert "HX-PROBE" not in log
    assert "Uvicorn running" not in log


def test_metrics_port_taken_costs_only_the_metrics_endpoint(tmp_path: Path) -> None:
    """Our standalone exporter's port held by another socket: the server still
    starts, serves greedy requests with our cache in the tree, and says why there
    are no metrics.  The same buffer-mode server sets cache_mode.dedup, which acts
    only in cache mode: one warning naming the key, and the server runs."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        spec = ServerSpec(
            metrics=False,
            config={
                "metrics": {"mode": "standalone", "host": "127.0.0.1", "port": port},
                "cache_mode": {"dedup": True},
            },
        )
        with launch(spec, tmp_path) as srv:
            req = trace_requests(limit=1, max_blocks=4)[0]
            first = srv.generate(req.input_ids, 4)
            assert srv.generate(req.input_ids, 4) == first
            classes = {p["cache_class"] for p in srv.probes("tree")}
            assert classes and all(c.startswith("hicache_existence.") for c in classes)
            log = srv.log.read_text(errors="replace")
            assert "metrics endpoint not started" in log and "Address already in use" in log
            assert "Traceback" not in log
            ignored = "cache_mode.dedup is set but ignored on host memory mode 'buffer_only'"
            assert log.count(ignored) == 1, log[-3000:]
