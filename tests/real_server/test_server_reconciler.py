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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    REPO,
    Server,
    ServerSpec,
    delta,
    family,
    free_port,
    launch,
    poll,
    sample_value,
    settle,
    trace_requests,
)

sys.path.insert(0, str(REPO / "tests"))
from reconcile_redis_server import RedisServer

pytestmark = [pytest.mark.real_server, pytest.mark.redis, pytest.mark.prometheus]

NAMESPACE = "hx-real-server"
P = "hicache_existence_"
PAGE = 16


def config(redis_url: str, trace_dir: Path) -> dict[str, Any]:
    return {
        # The recorder's series are on the dashboard too.
        "recorder": {"enabled": True, "path": str(trace_dir), "flush_interval_s": 0.25},
        # And the storage-tier events' (opt-in; the package's own publisher).
        "events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
        # Fewer beliefs than the pages Churn cycles through (668): evictions.
        "cache": {"max_entries": 256},
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
            config=config(self.redis.url, workdir / "trace"),
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


#: What the real server must visibly do under ``Churn`` (PromQL that returns a
#: sample > 0 when it does): the simulated runtime's list
#: (``test_prometheus_e2e.MOVING``) for the one pool a Llama has (kv), with the
#: miss reasons one by one (each must move, not all within the same minute).
def real_moving() -> list[tuple[str, str]]:
    import test_prometheus_e2e as e2e

    # Not here: swa (a Llama has one pool), the four reasons at once (one by one
    # below), and two host memory modes (one buffer-mode server; test_cache_mode*.py
    # run the cache-mode ones, and the Prometheus test asks for this one's mode).
    left_out = ("swa", "every classified reason", "host memory modes")
    kept = [(w, q) for w, q in e2e.MOVING if not any(x in w for x in left_out)]
    assert len(kept) == len(e2e.MOVING) - 4, "the simulated list changed: review this one"
    reasons = [
        (
            f"{reason} misses",
            f'sum(increase(hicache_existence_page_misses_total{{reason="{reason}"}}[1m])) > 0',
        )
        for reason in ("cold", "evicted", "invalidated", "cleared")
    ]
    curves = [
        (
            f"{curve}-curve estimates at all six caps for kv",
            f'count(max by (cap_multiplier) ({metric}{{pool="kv"}})) == 6',
        )
        for curve, metric in (
            ("stream", "hicache_existence_advisor_estimated_hit_ratio"),
            ("lookup", "hicache_existence_advisor_estimated_lookup_hit_ratio"),
        )
    ]
    return [*reasons, *kept, *curves]


class Churn:
    """Traffic that makes every signal of the dashboard move on the real server:
    trace requests (hits, cold misses, avoided writes) over more pages than the
    cap (evictions, evicted misses, redundant writes, pages learnt), a device
    flush every 12 requests, page files deleted under the server with their
    ledger entries, then the last requests again from L3 (stale positives,
    invalidations, invalidated misses) and, on
    request (``clear_and_replay``), SGLang's clear of the L3 (cleared pages and
    misses; it empties L3, so learning stops for a while after it)."""

    def __init__(self, stack: Stack) -> None:
        assert stack.server is not None
        self.srv = stack.server
        self.redis = stack.redis
        self.reqs = trace_requests(limit=60, max_blocks=10)
        self.i = 0
        self.cleared = False

    def step(self, requests: int = 6) -> None:
        for _ in range(requests):
            self.srv.generate(self.reqs[self.i % len(self.reqs)].input_ids, 2)
            self.i += 1
            if self.i % 12 == 0:
                self.srv.flush_cache()
            if self.i % 24 == 0:
                self.drop_pages(every=5)
                # Only a believed page can be a stale positive, and under the cap
                # only the last requests' pages are believed: ask for them again
                # from L3 (a device flush first) while they still are.
                self.srv.flush_cache()
                self.replay(3)

    def clear_and_replay(self, replay: int = 3) -> None:
        """SGLang's clear of the L3 (every belief goes too), then the last
        ``replay`` requests again after a device flush: their pages, believed at
        the clear, miss as ``cleared``."""
        self.clear_l3()
        self.cleared = True
        self.srv.flush_cache()
        self.replay(replay)

    def replay(self, last: int) -> None:
        """The ``last`` requests served, again (``i`` does not move)."""
        for k in range(last, 0, -1):
            self.srv.generate(self.reqs[(self.i - k) % len(self.reqs)].input_ids, 2)

    def drop_pages(self, every: int) -> None:
        """Delete every ``every``-th page file and its ledger entry (L3 lost them)."""
        lost = sorted(self.srv.l3_pages())[::every]
        for name in lost:
            (self.srv.l3_dir / name).unlink(missing_ok=True)
        if lost:
            self.redis.client().delete(*(ledger_key(n) for n in lost))

    def clear_l3(self) -> None:
        status, body = self.srv._request("POST", "/hicache/storage-backend/clear")
        assert status == 200, body


@pytest.fixture(scope="module")
def prom(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Prom]:
    """A real Prometheus scraping the server's /metrics every second and
    evaluating rules.yml."""
    import test_prometheus_e2e as e2e

    srv = stack.server
    assert srv is not None
    tmp_path = tmp_path_factory.mktemp("prometheus")
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
        yield prom
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture(scope="module")
def churn(stack: Stack) -> Churn:
    return Churn(stack)


def churn_until(churn: Churn, check: Callable[[], list[str]], timeout_s: float = 90.0) -> list[str]:
    """``churn.step()`` then ``check()`` until it reports nothing or time is up."""
    failed = check()
    deadline = time.monotonic() + timeout_s
    while failed and time.monotonic() < deadline:
        churn.step()
        time.sleep(1.0)
        failed = check()
    return failed


def test_prometheus_scrapes_the_server_and_every_panel_and_rule_returns_data(
    prom: _Prom, churn: Churn
) -> None:
    """A real Prometheus scraping the real server: every dashboard query, variable,
    recording rule and selector returns data, and every alert expression is valid."""
    import test_prometheus_e2e as e2e

    # every panel target, variable, rule and selector, but those that only a
    # cache-mode server answers (this one runs buffer mode: ``mode_info`` must say
    # so below; tests/real_server/test_cache_mode*.py check cache-mode servers'
    # series, test_prometheus_e2e's cache-mode runtime these selectors)
    live = [c for c in e2e.checks() if 'host_memory_mode="cache"' not in c.query]
    assert len(live) < len(e2e.checks()), "no cache-mode selector left: review the filter"
    live.append(
        e2e.Check(
            "this server's host memory mode",
            'hicache_existence_mode_info{host_memory_mode="buffer_only", cache_mode_dedup="false"}',
        )
    )
    churn.step()
    failed = churn_until(churn, lambda: e2e.failures(prom, live))  # type: ignore[arg-type]
    assert not failed, "\n".join(failed) + f"\nprometheus log:\n{prom.log_tail()}"


def test_the_real_server_moves_every_signal_the_panels_show(prom: _Prom, churn: Churn) -> None:
    """Under real traffic the server evicts, misses for every classified reason
    (cold, evicted, invalidated, cleared), heals, writes redundantly, checks its
    replica, finds stale positives, learns pages and estimates every cap multiple:
    the dashboard is tested on moving data from SGLang's /metrics, not on zeros.
    Each signal must move at some point: L3 is cleared once the others have
    (a clear stops learning for a while)."""
    moved: set[str] = set()

    def check() -> list[str]:
        out = []
        for what, promql in real_moving():
            if what in moved:
                continue
            status, result, error = prom.query(promql)
            if status != "success":
                out.append(f"{what}: {error or status}\n    {promql}")
            elif any(float(r["value"][1]) > 0 for r in result):
                moved.add(what)
            else:
                out.append(f"{what}: does not move\n    {promql}")
        if not churn.cleared and all(" does not move" in o and "cleared" in o for o in out):
            churn.clear_and_replay()
        return out

    failed = churn_until(churn, check)
    assert not failed, "\n".join(failed)


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


#: The fresh prompt of the stale-positive test: 6 blocks of 32 tokens = 12 pages.
FRESH_PAGES = 12
WATCHED = (
    "written_pages",
    "redundant_written_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "page_inserts",
    "invalidations",
    "reconciler_stale_positives",
    "reconciler_pages_invalidated",
)


def watched(srv: Server) -> dict[str, float]:
    """Our write, belief and reconciler counters and SGLang's backed-up pages,
    once they have stopped moving (every family must be on /metrics)."""

    def read() -> dict[str, float]:
        fams = srv.metrics()
        out = {c: family(fams, P + c).total("_total") for c in WATCHED}
        backuped = sample_value(fams, "sglang:backuped_tokens_total")
        out["sglang_backuped_pages"] = backuped / PAGE
        return out

    srv.wait_writes_settled()
    return settle(read)


def test_pages_deleted_under_the_server_are_stale_positives_healed_and_rewritten(
    stack: Stack,
) -> None:
    """Page files (and their ledger entries) removed under the running server are
    found by the reconciler as one stale positive whose heal drops exactly those
    beliefs; served again before the heal nothing is written (believed stored);
    after it exactly those pages are written once more (SGLang backs up exactly
    them) and nothing else: no redundant write, no other page; served once more,
    the chain L3 now holds is verified present and nothing is dropped."""
    srv = stack.server
    assert srv is not None
    # A fresh request below the 256-token prefetch threshold: upstream's own
    # prefetch healing never looks at it, only the reconciler can.
    fresh = trace_requests(limit=1, max_blocks=6, salt="stale")[0]
    before = srv.l3_pages()
    srv.generate(fresh.input_ids, 2)
    srv.wait_writes_settled()
    mine = sorted(set(srv.l3_pages()) - set(before))
    assert len(mine) == FRESH_PAGES, mine
    redis = stack.redis.client()
    keys = [ledger_key(n) for n in mine]
    assert all(redis.exists(k) for k in keys), "the ledger did not record the writes"
    # L3 drops the pages (and the ledger, mirroring L3 retention, forgets them).
    for n in mine:
        (srv.l3_dir / n).unlink()
    redis.delete(*keys)
    untouched = set(srv.l3_pages())
    r0 = watched(srv)

    srv.flush_cache()
    srv.generate(fresh.input_ids, 2)  # believed stored: not written (the stale positive)
    assert poll(
        lambda: srv.value(P + "reconciler_stale_positives_total") > r0["reconciler_stale_positives"]
    )
    r1 = watched(srv)
    healed = delta(r1, r0)
    print(f"\nstale positive found and healed: {healed}")
    assert healed["reconciler_stale_positives"] == 1, healed
    assert healed["reconciler_pages_invalidated"] == healed["invalidations"] == FRESH_PAGES, healed
    assert healed["written_pages"] == healed["sglang_backuped_pages"] == 0, healed
    assert not set(mine) & set(srv.l3_pages()), "rewritten before the heal"

    srv.flush_cache()
    srv.generate(fresh.input_ids, 2)
    r2 = watched(srv)
    rewritten = delta(r2, r1)
    print(f"rewritten: {rewritten}")
    assert set(srv.l3_pages()) - untouched == set(mine)
    assert rewritten["written_pages"] == rewritten["write_acknowledged_pages"] == FRESH_PAGES
    assert rewritten["sglang_backuped_pages"] == FRESH_PAGES, rewritten
    assert rewritten["redundant_written_pages"] == rewritten["write_failed_pages"] == 0, rewritten
    assert rewritten["page_inserts"] == FRESH_PAGES, rewritten
    assert rewritten["reconciler_pages_invalidated"] == 0, rewritten

    # Served once more, believed and held by L3: verified present, nothing dropped.
    present0 = srv.value(P + "reconciler_queries_total", result="present")
    srv.flush_cache()
    srv.generate(fresh.input_ids, 2)
    assert poll(lambda: srv.value(P + "reconciler_queries_total", result="present") > present0)
    held = delta(watched(srv), r2)
    print(f"held: {held}")
    assert held["written_pages"] == held["sglang_backuped_pages"] == 0, held
    assert held["reconciler_pages_invalidated"] == held["invalidations"] == 0, held
    assert held["reconciler_stale_positives"] == 0, held


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
    assert poll(lambda: srv.value("hicache_existence_reconciler_circuit_open") == 1)
    # How many queries fail before the breaker opens and while its probes retry
    # depends on timing (lookups per second, backoff): a lower bound.
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
