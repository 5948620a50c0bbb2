"""Harness of the real-sglang tests: runs ``hx_scenarios.py``, each scenario in its own process.

The scenarios start together on a small pool (two at a time: the machine has two
cores and every process pays sglang's ~8 s import) when the first test asks for
one; each test then waits for its own result.  A scenario that cannot run here
(exit status 3: sglang, torch or ``unified_radix_cache`` does not import, e.g. in
the "light" environment without torchvision) is skipped with the reason, or fails
when ``HICACHE_EXISTENCE_REQUIRE_SGLANG=1`` / ``HICACHE_EXISTENCE_REQUIRE_ALL=1``.

The plugin is found the way sglang finds it: an entry point of group
``sglang.srt.plugins`` in the installed distribution.  If the installed
distribution does not declare it (pyproject.toml without the entry point), the
scenarios get it from a throw-away ``.dist-info`` directory on ``PYTHONPATH``
instead, and ``test_entry_point_is_declared`` fails to say so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "hx_scenarios.py"
GROUP = "sglang.srt.plugins"
EP_NAME = "hicache_existence"
EP_VALUE = "hicache_existence.integrations.sglang.plugin:register"
RESULT = "HX-RESULT "
TIMEOUT_S = 420
#: The environment of the scenarios that run the reconciler on every lookup.
RECONCILING = {
    "HICACHE_EXISTENCE_ENABLED": "1",
    "HICACHE_EXISTENCE_RECONCILER__ENABLED": "1",
    "HICACHE_EXISTENCE_RECONCILER__SAMPLING_RATE": "1",
}

REQUIRED = (
    os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"
    or os.environ.get("HICACHE_EXISTENCE_REQUIRE_SGLANG") == "1"
)


def installed_generation() -> str:
    """The installed sglang wheel's cache generation, read from its version (not
    from our detection, which is under test): flat (the seed's API) up to 0.5.21,
    current from 0.5.22."""
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    parts = tuple(int(x) for x in version.split(".")[:3] if x.isdigit())
    return "flat" if parts < (0, 5, 22) else "current"


def installed_entry_point() -> Any:
    for ep in entry_points(group=GROUP):
        if ep.name == EP_NAME:
            return ep
    return None


def write_shim(root: Path) -> Path:
    info = root / "hicache_existence_plugin_shim-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hicache-existence-plugin-shim\nVersion: 0.0.0\n"
    )
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{EP_NAME} = {EP_VALUE}\n")
    return root


def base_env(extra_path: Sequence[Path]) -> dict[str, str]:
    """The test process's environment without anything that would configure
    hicache-existence, sglang's plugin selection or Prometheus from outside."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (
            k.startswith("HICACHE_EXISTENCE_") and not k.startswith("HICACHE_EXISTENCE_REQUIRE")
        )
        and k not in ("SGLANG_PLUGINS", "PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH")
    }
    paths = [str(p) for p in extra_path] + [str(REPO)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONWARNINGS"] = "ignore"
    env["HICACHE_EXISTENCE_METRICS__PORT"] = "0"  # never collide with anything
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Outcome:
    """One scenario process: its result, or why there is none."""

    def __init__(self, name: str, code: int, stdout: str, stderr: str) -> None:
        self.name = name
        self.code = code
        self.stdout = stdout
        self.stderr = stderr
        self.result: dict[str, Any] | None = None
        for line in reversed(stdout.splitlines()):
            if line.startswith(RESULT):
                self.result = json.loads(line[len(RESULT) :])
                break

    def value(self) -> dict[str, Any]:
        """The scenario's result; skip/fail when the environment cannot run it."""
        if self.code == 3 and self.result and "environment" in self.result:
            message = (
                f"scenario {self.name}: the real sglang modules do not import here "
                f"({self.result['environment']}); these tests need the full test "
                "environment (HICACHE_EXISTENCE_ENV_FLAVOR=full bash tests/envs/ensure-env.sh)"
            )
            if REQUIRED:
                pytest.fail(message)
            pytest.skip(message)
        if self.code != 0 or self.result is None or "error" in (self.result or {}):
            detail = (self.result or {}).get("error") or self.stderr[-4000:]
            pytest.fail(f"scenario {self.name} failed (exit {self.code}):\n{detail}")
        assert self.result is not None
        return self.result


class Scenarios:
    """Starts scenario processes on a small pool; ``get`` waits for one."""

    def __init__(self, shim_root: Path | None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hx-scenario")
        self._futures: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()
        self.extra_path = [shim_root] if shim_root is not None else []

    def env(self, **extra: str) -> dict[str, str]:
        env = base_env(self.extra_path)
        env.update(extra)
        return env

    def run(self, name: str, *args: str, env: dict[str, str] | None = None) -> Outcome:
        """One scenario, now, in this thread."""
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), name, *args],
            env=env if env is not None else self.env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=str(REPO),
        )
        return Outcome(name, proc.returncode, proc.stdout, proc.stderr)

    def submit(self, key: str, fn: Any) -> None:
        with self._lock:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(fn)

    def get(self, key: str) -> Any:
        with self._lock:
            future = self._futures[key]
        return future.result(timeout=TIMEOUT_S * 2)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def multirank_pair(
    s: Scenarios, diverge_at: int, rank_env: dict[int, dict[str, str]] | None = None
) -> list[Outcome]:
    """Two ranks of one TP group; ``rank_env`` adds variables to one rank's
    environment (a deployment whose ranks are configured differently)."""
    port = str(free_port())
    env = s.env(
        HICACHE_EXISTENCE_ENABLED="1",
        HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS="2",
        HICACHE_EXISTENCE_DIVERGENCE__TIMEOUT_S="60",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "multirank", str(r), "2", port, str(diverge_at)],
            env={**env, **(rank_env or {}).get(r, {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
        )
        for r in range(2)
    ]
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out.append(Outcome("multirank", proc.returncode, stdout, stderr))
    return out


RECIPES = REPO / "integrations" / "sglang"


def recipe_argv(script: str, **env: str) -> list[str]:
    """The command a recipe would run (``DRY_RUN=1``), one element per argument."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("HX_ROUTE", "HX_CONFIG")}
    run_env.update(env, DRY_RUN="1")
    proc = subprocess.run(
        ["bash", str(RECIPES / script)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.splitlines()


def sglang_args(argv: list[str]) -> list[str]:
    """The arguments after ``-m sglang.launch_server`` in a recipe's command."""
    i = argv.index("sglang.launch_server")
    return argv[i + 1 :]


#: What each test may ask for: key -> how to run it.
def scenario_plan(s: Scenarios) -> dict[str, Any]:
    argv = json.dumps(["--model-path", "dummy", "--page-size", "64", "--tp-size", "2"])
    return {
        "enabled": lambda: s.run(
            "enabled",
            env=s.env(
                HICACHE_EXISTENCE_ENABLED="1",
                HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS="3",
            ),
        ),
        "buffer_pipeline": lambda: s.run(
            "buffer_pipeline", env=s.env(HICACHE_EXISTENCE_ENABLED="1")
        ),
        "buffer_reconcile": lambda: s.run(
            "buffer_reconcile",
            env=s.env(
                **RECONCILING,
                HICACHE_EXISTENCE_RECONCILER__AGREE_INTERVAL_STEPS="1",
                HICACHE_EXISTENCE_RECONCILER__TIMEOUT_MS="5000",
            ),
        ),
        "buffer_inflight": lambda: s.run("buffer_inflight", env=s.env(**RECONCILING)),
        "buffer_writes": lambda: s.run("buffer_writes", env=s.env(HICACHE_EXISTENCE_ENABLED="1")),
        "buffer_writes_hooked": lambda: s.run(
            "buffer_writes", "0", "1", env=s.env(HICACHE_EXISTENCE_ENABLED="1")
        ),
        "buffer_writes_capped": lambda: s.run(
            "buffer_writes",
            "1",
            env=s.env(HICACHE_EXISTENCE_ENABLED="1", HICACHE_EXISTENCE_CACHE__MAX_ENTRIES="8"),
        ),
        "mamba_writes": lambda: s.run(
            "mamba_cache_writes", env=s.env(HICACHE_EXISTENCE_ENABLED="1")
        ),
        "mamba_writes_dedup": lambda: s.run(
            "mamba_cache_writes",
            env=s.env(HICACHE_EXISTENCE_ENABLED="1", HICACHE_EXISTENCE_CACHE_MODE__DEDUP="1"),
        ),
        "mamba_writes_buffer": lambda: s.run(
            "mamba_cache_writes", "buffer_only", env=s.env(HICACHE_EXISTENCE_ENABLED="1")
        ),
        "disabled": lambda: s.run("disabled", argv),
        "no_plugin": lambda: s.run("disabled", argv, env=s.env(SGLANG_PLUGINS="some_other_plugin")),
        "missing_target": lambda: s.run("missing_target", env=s.env(HICACHE_EXISTENCE_ENABLED="1")),
        "unknown_shape": lambda: s.run("unknown_shape", env=s.env(HICACHE_EXISTENCE_ENABLED="1")),
        "upstream_grew": lambda: s.run("upstream_grew", env=s.env(HICACHE_EXISTENCE_ENABLED="1")),
        "buffer_method_removed": lambda: s.run(
            "buffer_method_removed", env=s.env(HICACHE_EXISTENCE_ENABLED="1")
        ),
        "flags": lambda: s.run("flags"),
        "detokenizer": lambda: s.run("detokenizer", env=s.env(HICACHE_EXISTENCE_ENABLED="1")),
        "logging_settings": lambda: s.run(
            "logging_settings",
            env=s.env(
                HICACHE_EXISTENCE_ENABLED="1",
                HICACHE_EXISTENCE_LOGGING__LEVEL="debug",
                HICACHE_EXISTENCE_LOGGING__JSON="1",
                HICACHE_EXISTENCE_METRICS__MODE="off",
            ),
        ),
        "multirank": lambda: multirank_pair(s, diverge_at=5),
        "metrics_multiprocess": lambda: s.run(
            "metrics_multiprocess",
            env=s.env(
                HICACHE_EXISTENCE_ENABLED="1", HICACHE_EXISTENCE_METRICS__FLUSH_INTERVAL_S="0"
            ),
        ),
        "recipes": lambda: s.run(
            "recipes",
            json.dumps(sglang_args(recipe_argv("prefill.sh"))),
            json.dumps(sglang_args(recipe_argv("decode.sh"))),
        ),
        # Last: the other scenarios' tests should not wait behind these pairs.
        "multirank_mixed": lambda: multirank_pair(
            s, diverge_at=5, rank_env={1: {"HICACHE_EXISTENCE_DIVERGENCE__ENABLED": "0"}}
        ),
        # Rank 1 runs without the package (upstream's cache): rank 0 waits
        # divergence.timeout_s for it in new_group, once.
        "multirank_half": lambda: multirank_pair(
            s,
            diverge_at=0,
            rank_env={
                0: {"HICACHE_EXISTENCE_DIVERGENCE__TIMEOUT_S": "10"},
                1: {"HICACHE_EXISTENCE_ENABLED": "0"},
            },
        ),
    }
