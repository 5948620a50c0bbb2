"""Every feature on in a real server, with a real Redis ledger and a real Prometheus.

One server for the module: the ledger-recording storage backend wrapping the file
backend (``--hicache-storage-backend dynamic``), the reconciler against a real
``redis-server``, miss reasons, divergence checks and the capacity advisor. A real
Prometheus scrapes its ``/metrics`` (SGLang's, multiprocess mode). The tests run in
file order: Prometheus first (all signals fresh), then stale positives healed, then
Redis killed and restarted under the server.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Server, ServerSpec, launch, poll, trace_requests

sys.path.insert(0, str(REPO / "tests"))
from reconcile_redis_server import RedisServer

pytestmark = [pytest.mark.real_server, pytest.mark.redis, pytest.mark.prometheus]

NAMESPACE = "hx-real-server"


def config(redis_url: str) -> dict[str, Any]:
    return {
        "cache": {"max_entries": 4096},
        "miss_reasons": {"enabled": True},
        "divergence": {"enabled": True, "interval_steps": 50},
        "advisor": {"enabled": True, "sampling_rate": 1.0},
        "reconciler": {
            "enabled": True,
            "redis_url": redis_url,
            "namespace": NAMESPACE,
            "sampling_rate": 1.0,
            "verifications_per_s": 1000.0,
            # A loaded 2-core CI machine: generous, so only a dead Redis times out.
            "timeout_ms": 500.0,
            "connect_timeout_ms": 200.0,
            "breaker_failures": 3,
            "breaker_backoff_s": 0.5,
            "breaker_backoff_max_s": 1.0,
        },
    }


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.redis = RedisServer(workdir / "redis", persistent=True)
        (workdir / "redis").mkdir()
        self.redis.start()
        l3 = workdir / "l3"
        self.spec = ServerSpec(
            existence=True,
            config=config(self.redis.url),
            l3_dir=l3,
            storage_backend="dynamic",
            storage_extra_config={
                "backend_name": "hicache-existence-ledger",
                "module_path": "hicache_existence.reconcile.storage_adapters",
                "class_name": "LedgerRecordingStorage",
                "inner_backend": "file",
                "file_storage_path": str(l3),
                "ledger_redis_url": self.redis.url,
                "ledger_namespace": NAMESPACE,
            },
        )
        self.workdir = workdir
        self.server: Server | None = None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("reconciler")
    st = Stack(workdir)
    try:
        with launch(st.spec, workdir / "server") as srv:
            st.server = srv
            for r in trace_requests(limit=16, max_blocks=12):
                srv.generate(r.input_ids, 2)
            srv.flush_cache()
            for r in trace_requests(limit=16, max_blocks=12):
                srv.generate(r.input_ids, 2)
            srv.wait_writes_settled()
            yield st
    finally:
        st.redis.close()


# -- Prometheus -------------------------------------------------------------------------


def test_prometheus_scrapes_the_server_and_every_panel_and_rule_returns_data(
    stack: Stack, tmp_path: Path
) -> None:
    """A real Prometheus scraping the real server: every dashboard query, variable,
    recording rule and selector returns data, and every alert expression is valid."""
    import test_prometheus_e2e as e2e

    srv = stack.server
    assert srv is not None
    binary = e2e.need_prometheus()
    port = e2e.free_port()
    prom_config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(e2e.build.RULES_PATH)],
        "scrape_configs": [
            {"job_name": "sglang", "static_configs": [{"targets": [f"127.0.0.1:{srv.port}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(prom_config))
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = _Prom(port, proc, log)
    try:
        prom.wait_ready()
        live = e2e.checks()  # every panel target, variable, rule and selector
        reqs = trace_requests(limit=60, max_blocks=10)
        i = 0

        def attempt() -> list[str]:
            nonlocal i
            for _ in range(6):  # keep traffic flowing so rates are non-zero
                srv.generate(reqs[i % len(reqs)].input_ids, 2)
                i += 1
                if i % 12 == 0:
                    srv.flush_cache()
            return e2e.failures(prom, live)  # type: ignore[arg-type]

        failed = attempt()
        deadline = time.monotonic() + 60
        while failed and time.monotonic() < deadline:
            time.sleep(1.0)
            failed = attempt()
        assert not failed, "\n".join(failed) + f"\nprometheus log:\n{prom.log_tail()}"
    finally:
        proc.terminate()
        proc.wait(15)


class _Prom:
    """Just what ``test_prometheus_e2e.failures`` asks of its stack."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.port, self.proc, self.log = port, proc, log

    def wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_tail()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(self.log_tail())

    def query(self, promql: str) -> tuple[str, list[dict[str, Any]], str]:
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        data = body.get("data") or {}
        return body.get("status", ""), list(data.get("result") or []), body.get("error", "")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


# -- stale positives --------------------------------------------------------------------


def ledger_key(name: str) -> str:
    """``<hash>_<shard>.bin`` (the file backend's name) -> the ledger's key."""
    stem = name.removesuffix(".bin")
    page_hash, shard = stem.split("_", 1)
    return f"{NAMESPACE}:{shard}:kv:{page_hash}"


def test_pages_deleted_under_the_server_are_stale_positives_healed_and_rewritten(
    stack: Stack,
) -> None:
    """Page files (and their ledger entries) removed under the running server are
    found by the reconciler as stale positives and healed; the next request
    rewrites exactly those pages and nothing else."""
    srv = stack.server
    assert srv is not None
    # A fresh request below the 256-token prefetch threshold: upstream's own
    # prefetch healing never looks at it, only the reconciler can.
    fresh = trace_requests(limit=1, max_blocks=6, salt="stale")[0]
    before = srv.l3_pages()
    srv.generate(fresh.input_ids, 2)
    srv.wait_writes_settled()
    mine = sorted(set(srv.l3_pages()) - set(before))
    assert len(mine) >= 6, mine
    redis = stack.redis.client()
    keys = [ledger_key(n) for n in mine]
    assert all(redis.exists(k) for k in keys), "the ledger did not record the writes"
    # L3 drops the pages (and the ledger, mirroring L3 retention, forgets them).
    for n in mine:
        (srv.l3_dir / n).unlink()
    redis.delete(*keys)
    untouched = {n: (srv.l3_dir / n).stat().st_mtime_ns for n in srv.l3_pages()}
    stale0 = srv.value("hicache_existence_reconciler_stale_positives_total")
    healed0 = srv.value("hicache_existence_reconciler_pages_invalidated_total")

    srv.flush_cache()
    srv.generate(fresh.input_ids, 2)  # believed stored: not written (the stale positive)
    assert poll(lambda: srv.value("hicache_existence_reconciler_stale_positives_total") > stale0)
    assert srv.value("hicache_existence_reconciler_pages_invalidated_total") >= healed0 + len(mine)
    srv.wait_writes_settled()
    assert not set(mine) & set(srv.l3_pages()), "rewritten before the heal"

    srv.flush_cache()
    srv.generate(fresh.input_ids, 2)
    srv.wait_writes_settled()
    now = srv.l3_pages()
    assert set(now) - set(untouched) == set(mine)
    assert all((srv.l3_dir / n).stat().st_mtime_ns == t for n, t in untouched.items())


# -- Redis down -------------------------------------------------------------------------


def test_redis_killed_keeps_serving_invalidates_nothing_breaker_opens_and_recovers(
    stack: Stack,
) -> None:
    """With Redis killed the server keeps answering, no belief is removed on an
    error, the circuit breaker opens; after Redis restarts it closes again and
    verifications succeed."""
    srv = stack.server
    assert srv is not None
    reqs = trace_requests(limit=30, max_blocks=10, salt="redis-down")
    invalidated0 = srv.value("hicache_existence_reconciler_pages_invalidated_total")
    stack.redis.kill()
    served = []
    for i, r in enumerate(reqs[:15]):
        served.append(srv.generate(r.input_ids, 2))
        if i % 5 == 4:
            srv.flush_cache()
    assert len(served) == 15
    assert poll(lambda: srv.value("hicache_existence_reconciler_circuit_open") >= 1)
    assert srv.value("hicache_existence_reconciler_errors_total", kind="connection") > 0
    assert srv.value("hicache_existence_reconciler_pages_invalidated_total") == invalidated0

    stack.redis.start()
    ok0 = srv.value("hicache_existence_reconciler_queries_total", result="present") + srv.value(
        "hicache_existence_reconciler_queries_total", result="absent"
    )

    def recovered() -> bool:
        for r in reqs[15:18]:
            srv.generate(r.input_ids, 2)
        ok = srv.value("hicache_existence_reconciler_queries_total", result="present") + srv.value(
            "hicache_existence_reconciler_queries_total", result="absent"
        )
        return srv.value("hicache_existence_reconciler_circuit_open") == 0 and ok > ok0

    assert poll(recovered, timeout_s=45)
    assert math.isfinite(srv.value("hicache_existence_reconciler_circuit_open"))
