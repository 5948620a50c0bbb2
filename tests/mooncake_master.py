"""A real ``mooncake_master`` (with its HTTP metadata server) that a test starts
itself on free loopback ports, and SGLang's own ``MooncakeStore`` connected to
it over TCP (no SGLang server)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from reconcile_helpers import sglang_storage_config
from reconcile_redis_server import REQUIRE_ALL, free_port


def need_mooncake() -> str:
    """The ``mooncake_master`` beside this interpreter (the non-CUDA wheel) and an
    importable store client; fails under HICACHE_EXISTENCE_REQUIRE_ALL=1, else skips."""
    path = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    path = path if os.access(path, os.X_OK) else (shutil.which("mooncake_master") or "")
    problem = ""
    if not path:
        problem = "mooncake_master is not installed"
    else:
        try:
            import mooncake.store  # noqa: F401
        except Exception as exc:  # ImportError, or libibverbs missing (OSError)
            problem = f"the Mooncake store client does not import: {exc}"
    if problem:
        message = (
            f"{problem} (pip install mooncake-transfer-engine-non-cuda==0.3.13.post1; "
            "apt-get install -y libibverbs1)"
        )
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return path


class MooncakeMaster:
    """One ``mooncake_master`` process; ``restart`` keeps its ports (and loses
    its metadata: objects stored before are unknown to the new master).
    ``args`` are extra master flags (``--default_kv_lease_ttl=500``, ...)."""

    def __init__(self, workdir: Path, args: tuple[str, ...] = ()) -> None:
        self.binary = need_mooncake()
        self.workdir = workdir
        self.args = tuple(args)
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> MooncakeMaster:
        log = (self.workdir / "mooncake_master.log").open("ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--port={self.port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--metrics_port={self.metrics_port}",
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError("mooncake_master did not listen")

    def extra_config(self) -> dict[str, Any]:
        """SGLang's ``--hicache-storage-backend-extra-config`` for this master."""
        return {
            "master_server_address": f"127.0.0.1:{self.port}",
            "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
            "protocol": "tcp",
            "global_segment_size": 64 << 20,
            "local_hostname": "127.0.0.1",
        }

    def metrics(self) -> dict[str, float]:
        """The master's own counters and gauges (its ``/metrics``, unlabelled
        samples): ``master_key_count`` (objects held), ``master_batch_put_start_items_total``
        (objects a client started to put), ...; independent of any client."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()


def sglang_mooncake_store(master: MooncakeMaster, model: str = "tiny") -> Any:
    """SGLang's real ``MooncakeStore`` (TP 1, MHA) on ``master``, no host pool."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    config = sglang_storage_config(master.extra_config(), page_first=True, model=model)
    return MooncakeStore(config, None)
