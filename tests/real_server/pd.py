"""A PD deployment on CPU for tests, started by the repository's own recipes.

The prefill servers, the decode server and the router are the scripts of
``integrations/sglang/`` (``prefill.sh``, ``decode.sh``, ``router.sh``), run with
``bash`` and configured only through the environment variables they document, so a
recipe that stops working breaks these tests. The machine-specific part (CPU engine,
tiny random-weight model, token-id requests) goes in through ``SGLANG_EXTRA_ARGS``;
the CPU stand-ins reach every server process as in ``harness.py``.

KV moves from prefill to decode over the Mooncake transfer engine on TCP
(``MOONCAKE_PROTOCOL=tcp``: peer-to-peer handshake, no master needed); the router is
SGLang's Model Gateway (``smg``)::

    with PDStack(workdir, prefills=[PrefillSpec(...), ...]) as pd:
        pd.router.generate(ids, max_new_tokens=2)     # through the router
        pd.prefills[0].metrics()                     # a prefill server's /metrics
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    REPO,
    PortTaken,
    Server,
    ServerDied,
    ServerSpec,
    free_port,
    server_env,
    sleep_on_idle_allowed,
    write_model,
)

RECIPES = REPO / "integrations" / "sglang"
SERVED_MODEL = "tiny-llama"
PAGE_SIZE = 16


def cpu_args(max_total_tokens: int = 65536) -> list[str]:
    """What every sglang server of the stack needs on this machine (design notes §8)."""
    return [
        "--device",
        "cpu",
        "--disable-cuda-graph",
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--random-seed",
        "1234",
        "--served-model-name",
        SERVED_MODEL,
        "--max-total-tokens",
        str(max_total_tokens),
        "--log-level",
        "info",
        # The PD stack's servers share two cores: idle ones sleep instead of spinning.
        *(["--sleep-on-idle"] if sleep_on_idle_allowed() else []),
    ]


@dataclass
class PrefillSpec:
    """One prefill server: its hicache-existence configuration and L3."""

    config: Mapping[str, Any] = field(default_factory=dict)
    l3_backend: str = "file"
    l3_extra_config: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


class RecipeProcess(Server):
    """A server started by one of the recipe scripts (``bash <script>``); the rest
    (readiness, HTTP, metrics, stop) is ``harness.Server``'s."""

    def __init__(
        self,
        script: str,
        workdir: Path,
        port: int,
        recipe_env: Mapping[str, str],
        l3_dir: Path,
        health: str = "/health",
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(ServerSpec(), workdir, l3_dir, port)
        self.script = script
        self.health = health
        self.what = script
        self.args = ["bash", str(RECIPES / script)]
        self.env = {**server_env(ServerSpec(), l3_dir), **recipe_env}
        # The file backend reads its directory from this variable before its extra
        # config; the recipes say where L3 is through L3_EXTRA_CONFIG instead.
        self.env.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)

    def start_async(self) -> None:
        """Spawn the script without waiting for readiness (``wait_started``)."""
        self._t0 = self.spawn()

    def wait_started(self) -> None:
        self._wait_ready(self._t0)


HOST_MEMORY = ("Not enough host memory available", "No host memory is left for HiCache")


def short_of_memory(proc: RecipeProcess) -> bool:
    tail = proc.tail(400)
    return any(m in tail for m in HOST_MEMORY)


def start_retrying(proc: RecipeProcess, attempts: int = 3, pause_s: float = 10.0) -> None:
    """Start ``proc``; again (after a pause) when sglang refused for host memory, and
    again at once when a port it binds was taken.

    SGLang keeps a reserve of host memory free before it allocates a HiCache pool
    (``pool_host/base.py``, measured against the whole machine's available memory;
    10 GB upstream, less with the ``host_reserve`` stand-in), so on a shared machine
    a start can fail for other processes' memory.  A taken port is most often one
    SGLang picked for itself (torch.distributed's store: ``EADDRINUSE`` on a port
    that is not the recipe's), which it picks again at the next launch; the recipe's
    own port stays, because the router is given it."""
    for attempt in range(attempts):
        proc.start_async()
        try:
            proc.wait_started()
            return
        except PortTaken:  # _wait_ready stopped it
            if attempt == attempts - 1:
                raise
        except (ServerDied, TimeoutError):
            if attempt == attempts - 1 or not short_of_memory(proc):
                raise
            proc.stop()
            time.sleep(pause_s)


def start_all(procs: Sequence[RecipeProcess]) -> None:
    """Spawn every process, then wait for each: their start-ups overlap.  One that
    failed for host memory or a taken port starts again (``start_retrying``)."""
    for p in procs:
        p.start_async()
    for p in procs:
        try:
            p.wait_started()
        except PortTaken:
            start_retrying(p)
        except ServerDied:
            if not short_of_memory(p):
                raise
            p.stop()
            start_retrying(p)


def stop_all(procs: Sequence[Server], grace_s: float) -> None:
    """Stop every process at once: SIGINT to each process group, one shared grace
    period, then SIGKILL of what is left (``Server.stop`` one after another would
    wait a grace period per server: sglang rarely exits on SIGINT in time)."""
    running = [p.proc for p in procs if p.proc is not None and p.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.proc.pid, signal.SIGKILL)
    for p in procs:
        if p.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(10)


@dataclass
class RouterSpec:
    """One router over some of the stack's prefill servers (all decode servers)."""

    prefills: Sequence[int]
    policy: str = "cache_aware"


class PDStack:
    """Prefill servers, one decode server and one or more routers, each from its
    recipe. Every server starts at once (their start-ups overlap), then the routers."""

    def __init__(
        self,
        workdir: Path,
        prefills: Sequence[PrefillSpec],
        routers: Sequence[RouterSpec] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.model = write_model(workdir / "model")  # one path: L3 keys carry it
        self.specs = list(prefills)
        self.router_specs = list(routers or [RouterSpec(range(len(self.specs)))])
        self.extra_env = dict(env or {})
        self.prefills: list[RecipeProcess] = []
        self.decode: RecipeProcess | None = None
        self.routers: list[RecipeProcess] = []
        self._bootstrap: list[int] = []

    @property
    def router(self) -> RecipeProcess:
        return self.routers[0]

    def common_env(self) -> dict[str, str]:
        return {
            "PYTHON": sys.executable,
            "MODEL": str(self.model),
            "HOST": "127.0.0.1",
            "TP": "1",
            "PAGE_SIZE": str(PAGE_SIZE),
            "TRANSFER_BACKEND": "mooncake",
            "MOONCAKE_PROTOCOL": "tcp",
            "SGLANG_EXTRA_ARGS": " ".join(cpu_args()),
            **self.extra_env,
        }

    def start(self) -> PDStack:
        try:
            for i, spec in enumerate(self.specs):
                self.prefills.append(self._prefill(i, spec))
            port = free_port()
            self.decode = RecipeProcess(
                "decode.sh",
                self.workdir / "decode",
                port,
                {**self.common_env(), "DECODE_PORT": str(port)},
                self.workdir / "decode" / "l3",
            )
            start_all([*self.prefills, self.decode])
            self._start_routers()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_routers(self) -> None:
        for i, rspec in enumerate(self.router_specs):
            self.routers.append(self._router(i, rspec))
        start_all(self.routers)
        for router in self.routers:
            self.wait_routable(router)

    def _prefill(self, i: int, spec: PrefillSpec) -> RecipeProcess:
        port, bootstrap = free_port(), free_port()
        self._bootstrap.append(bootstrap)
        wd = self.workdir / f"prefill{i}"
        wd.mkdir(parents=True, exist_ok=True)
        config_path = wd / "hicache-existence.json"
        config_path.write_text(json.dumps(spec.config))
        extra = dict(spec.l3_extra_config)
        l3 = Path(extra.get("file_storage_path", wd / "l3"))
        l3.mkdir(parents=True, exist_ok=True)
        if spec.l3_backend == "file":
            extra.setdefault("file_storage_path", str(l3))
        env = {
            **self.common_env(),
            "PREFILL_PORT": str(port),
            "BOOTSTRAP_PORT": str(bootstrap),
            "L3_BACKEND": spec.l3_backend,
            "L3_EXTRA_CONFIG": json.dumps(extra),
            "HX_CONFIG": str(config_path),
            # buffer mode's host pool layout for the CPU copy stand-ins (harness.py)
            "PREFILL_EXTRA_ARGS": "--hicache-io-backend direct "
            "--hicache-mem-layout page_first_direct",
            **spec.env,
        }
        return RecipeProcess("prefill.sh", wd, port, env, l3)

    def _router(self, index: int, spec: RouterSpec) -> RecipeProcess:
        assert self.decode is not None
        port = free_port()
        prefill_urls = " ".join(
            f"{self.prefills[i].url},{self._bootstrap[i]}" for i in spec.prefills
        )
        env = {
            **self.common_env(),
            "ROUTER_PORT": str(port),
            "PREFILL_URLS": prefill_urls,
            "DECODE_URLS": self.decode.url,
            "PREFILL_POLICY": spec.policy,
            # the router's own /metrics listens on 0.0.0.0:29000 by default: one per host
            "ROUTER_EXTRA_ARGS": f"--log-level info --prometheus-host 127.0.0.1 "
            f"--prometheus-port {free_port()}",
        }
        wd = self.workdir / f"router{index}"
        return RecipeProcess("router.sh", wd, port, env, wd / "l3")

    def wait_routable(self, router: RecipeProcess, timeout_s: float = 120.0) -> None:
        """Until the router answers a request end to end (it health-checks its
        workers before routing to them)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for p in self.processes():
                p.check_alive()
            try:
                router.generate([5, 6, 7, 8], max_new_tokens=1)
                return
            except (RuntimeError, OSError) as exc:
                last = str(exc)
            time.sleep(1.0)
        raise TimeoutError(f"router not routing in {timeout_s}s: {last}\n{router.tail()}")

    def processes(self) -> list[RecipeProcess]:
        out = list(self.prefills)
        if self.decode is not None:
            out.append(self.decode)
        return out + self.routers

    def stop(self, grace_s: float = 5.0) -> None:
        stop_all(self.processes(), grace_s)

    def __enter__(self) -> PDStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
