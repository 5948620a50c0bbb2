"""A real Prometheus scrapes the real runtime while it serves a simulated prefill
workload, evaluates rules.yml, and answers every dashboard query and every rule
expression with data: no misspelt metric, label or label value.

The workload is the package's own: an ``ExistenceRuntime`` with every feature on
(miss reasons, TP-divergence checks on the default single-rank group, the
reconciler against the demo's ``L3`` shard as ground truth, the capacity advisor) serving
standalone ``/metrics`` on a free port, driven in-process by ``SimulatedScheduler``
over the bundled Mooncake trace.  A small cap and a small, lossy L3 make
evictions, every classified miss reason, stale positives and divergence checks
move within seconds.

Every name the dashboard and rules use comes from the metric catalog
(``dashboards/build.py``), so every query is asserted: nothing is exempt.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from hicache_existence.config import Config
from hicache_existence.demo.run import DemoOptions, bundled_trace, demo_config
from hicache_existence.demo.scheduler import SimulatedScheduler
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.replay import pages
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.trace import read_trace
from hicache_existence.runtime import ExistenceRuntime

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ALL = os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"
#: Grafana's $__rate_interval is at least 4 scrape intervals; 1 s scrapes here.
RATE_INTERVAL = "15s"
#: Longest wait for data; the workload usually fills every query within ~10 s.
DEADLINE_S = 40.0

pytestmark = pytest.mark.prometheus


def load_script(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


build = load_script("hicache_existence_dashboards_build", ROOT / "dashboards" / "build.py")


def need_prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "prometheus is not installed (apt-get install -y prometheus)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- what to ask ----------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One PromQL query and whether it must return data."""

    what: str
    query: str
    must_have_data: bool = True


_VARIABLE = re.compile(r"\$\{?(" + "|".join(build.DASHBOARD_VARIABLES) + r")\}?")
_SELECTOR = re.compile(r"\b((?:[a-z_]+:)?hicache_existence_[a-zA-Z0-9_:]*)(\{[^}]*\})?")


def dashboard_query(expr: str) -> str:
    """A panel expression as Grafana would send it with every variable at All."""
    return _VARIABLE.sub(".*", expr.replace("$__rate_interval", RATE_INTERVAL))


_ALTERNATION = re.compile(r'(\w+)=~"(\w+(?:\|\w+)+)"')


def expand(selector: str) -> list[str]:
    """``m{result=~"a|b"}`` -> ``m{result="a"}``, ``m{result="b"}``: every
    alternative must exist (a misspelt one would hide behind the others)."""
    match = _ALTERNATION.search(selector)
    if match is None:
        return [selector]
    label, alternatives = match.groups()
    head, tail = selector[: match.start()], selector[match.end() :]
    return [s for alt in alternatives.split("|") for s in expand(f'{head}{label}="{alt}"{tail}')]


def selectors(expr: str) -> list[str]:
    """Every metric or recorded-series selector of ``expr`` (name and matchers),
    regex alternatives of label values expanded."""
    found = {name + (matchers or "") for name, matchers in _SELECTOR.findall(expr)}
    return sorted({s for f in found for s in expand(f)})


_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$", re.S)


def variable_query(query: str) -> str:
    """Grafana's ``label_values(selector, label)`` as PromQL that returns one
    series per value, and none if the label is missing or misspelt."""
    match = _LABEL_VALUES.match(query.strip())
    assert match is not None, f"not a label_values() query: {query}"
    selector, label = match.groups()
    nonempty = f'{label}!=""'
    if selector.endswith("}"):
        selector = f"{selector[:-1]}, {nonempty}}}"
    else:
        selector = f"{selector}{{{nonempty}}}"
    return f"count by ({label}) ({selector})"


def checks() -> list[Check]:
    """Every dashboard target and variable; every recording rule (its expression
    and its output); the alert expressions (valid, may be empty: the alert need not
    fire); every selector of any of them, each label-value alternative apart."""
    dashboard = json.loads(build.DASHBOARD_PATH.read_text(encoding="utf-8"))
    rules = yaml.safe_load(build.RULES_PATH.read_text(encoding="utf-8"))
    out: list[Check] = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            what = f"panel {panel['title']!r} target {t['refId']}"
            out.append(Check(what, dashboard_query(t["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            what = f"variable {variable['name']}"
            out.append(Check(what, dashboard_query(variable_query(variable["query"]))))
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                out.append(Check(f"record {rule['record']} expr", rule["expr"]))
                out.append(Check(f"record {rule['record']} evaluated", rule["record"]))
            else:
                out.append(Check(f"alert {rule['alert']}", rule["expr"], must_have_data=False))
    seen = set()
    for check in list(out):
        for s in selectors(check.query):
            if s not in seen:
                seen.add(s)
                # Only a seed-generation server (sglang 0.5.19-0.5.21) shares its cap;
                # the shared fill's promtool case (integrations/prometheus/tests.yml) has it.
                seed_only = SHARED_CAP in s
                out.append(Check(f"selector {s} (from {check.what})", s, not seed_only))
    return out


SHARED_CAP = 'capacity_scope="shared"'


# -- the stack: the runtime under a simulated scheduler, and Prometheus -------------------

#: The workload's knobs: small enough that everything moves within seconds.
CAP = 2048
L3_PAGES = 1500
L3_DROP_EVERY = 20
CLEAR_SWA_EVERY = 20
REQUESTS_PER_STEP = 4
STEPS_PER_S = 40.0
LABELS = DeploymentLabels(model_name="demo-model", engine_type="prefill", storage_backend="demo-l3")


def workload_config(trace_dir: Path) -> Config:
    """The demo's configuration (every feature on, the recorder writing into
    ``trace_dir``), served standalone on a free port, with short intervals and high
    sampling rates."""
    demo = demo_config(DemoOptions(cap=CAP, l3_pages=L3_PAGES, l3_drop_every=L3_DROP_EVERY))
    return Config.from_mapping(
        {
            "metrics": {"mode": "standalone", "host": "127.0.0.1", "port": 0},
            "miss_reasons": {"enabled": True},
            "divergence": {"enabled": True, "interval_steps": 5},
            "reconciler": {"enabled": True, "sampling_rate": 0.2, "verifications_per_s": 500.0},
            "advisor": {"enabled": True, "sampling_rate": 0.5},
            "recorder": {"enabled": True, "path": str(trace_dir), "max_bytes": 1 << 20},
            # The storage-tier events' series are on the dashboard too (opt-in).
            "events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
        },
        demo,
    )


def cycle(
    requests: Sequence[pages.PageRequest], per_step: int
) -> Iterator[list[pages.PageRequest]]:
    """Batches of ``per_step`` requests, round and round the trace."""
    index = 0
    while True:
        yield [requests[(index + i) % len(requests)] for i in range(per_step)]
        index += per_step


class Workload:
    """One scheduler process in-process: the runtime serving ``/metrics`` and a
    thread stepping ``SimulatedScheduler`` over the bundled trace.  ``host_mode``
    is what its ``mode_info`` says (the simulated write stream is the same in both
    modes: the dashboard and the alerts read the same write families in both)."""

    def __init__(
        self,
        trace_dir: Path,
        host_mode: tuple[str, str, bool] = ("buffer_only", "", False),
        labels: DeploymentLabels = LABELS,
    ) -> None:
        requests = pages.expand(read_trace(bundled_trace())).requests
        shard = L3(L3_PAGES, drop_every=L3_DROP_EVERY)
        self.runtime = ExistenceRuntime(
            workload_config(trace_dir), labels, truth=shard, host_mode=host_mode
        )
        self.scheduler = SimulatedScheduler(self.runtime, shard, clear_swa_every=CLEAR_SWA_EVERY)
        self.error: str | None = None
        self._batches = cycle(requests, REQUESTS_PER_STEP)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    @property
    def port(self) -> int:
        server = self.runtime.telemetry.server
        assert server is not None, "the runtime serves no standalone /metrics"
        return int(server.port)

    def start(self) -> None:
        self.runtime.start()
        self._thread.start()

    def _run(self) -> None:
        period = 1.0 / STEPS_PER_S
        try:
            while not self._stop.is_set():
                self.scheduler.step(next(self._batches))
                self._stop.wait(period)
        except BaseException:  # reported by every test through Stack.problems()
            self.error = traceback.format_exc()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.runtime.close()


class Stack:
    """The workload and a prometheus process that scrapes it every second and
    evaluates rules.yml every second."""

    def __init__(self, workdir: Path) -> None:
        self.binary = need_prometheus()
        self.workdir = workdir
        self.workload = Workload(workdir / "trace")
        self.workload.start()
        #: A second process labelled as a cache-mode server without dedup (the
        #: selectors of the cache-mode alert and panels must find it).
        self.cache_mode = Workload(
            workdir / "trace-cache-mode",
            ("cache", "write_through", False),
            DeploymentLabels(
                model_name="demo-model", engine_type="unified", storage_backend="demo-l3"
            ),
        )
        self.cache_mode.start()
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(build.RULES_PATH)],
            "scrape_configs": [
                {
                    "job_name": "hicache-existence-runtime",
                    "static_configs": [
                        {
                            "targets": [
                                f"127.0.0.1:{self.workload.port}",
                                f"127.0.0.1:{self.cache_mode.port}",
                            ]
                        }
                    ],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config), encoding="utf-8")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def url(self, path: str, **params: str) -> str:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return f"http://127.0.0.1:{self.port}{path}{query}"

    def get(self, path: str, **params: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url(path, **params), timeout=10) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as exc:  # 400 on bad PromQL carries a JSON error
            return dict(json.load(exc))

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def query(self, promql: str) -> tuple[str, list[dict[str, Any]], str]:
        """(status, result, error) of an instant query now."""
        body = self.get("/api/v1/query", query=promql)
        data = body.get("data") or {}
        return body.get("status", ""), list(data.get("result") or []), body.get("error", "")

    def log_tail(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-3000:]

    def check_workload(self) -> None:
        """Fail with a scheduler thread's traceback if it died."""
        for workload in (self.workload, self.cache_mode):
            if workload.error is not None:
                pytest.fail(f"the scheduler thread failed:\n{workload.error}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.workload.close()
        self.cache_mode.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_prometheus()
    s = Stack(tmp_path_factory.mktemp("prometheus"))
    try:
        s.wait_ready()
        yield s
        s.check_workload()
    finally:
        s.close()


def has_data(result: list[dict[str, Any]]) -> bool:
    """At least one finite sample (a ratio of zero rates is NaN: no traffic)."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


def failures(stack: Stack, todo: list[Check]) -> list[str]:
    out = []
    for check in todo:
        status, result, error = stack.query(check.query)
        if status != "success":
            out.append(f"{check.what}: {error or status}\n    {check.query}")
        elif check.must_have_data and not has_data(result):
            out.append(f"{check.what}: no data\n    {check.query}")
    return out


def poll(stack: Stack, attempt: Callable[[], list[str]]) -> list[str]:
    """``attempt()`` until it reports no problem or ``DEADLINE_S`` has passed."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        stack.check_workload()
        problems = attempt()
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(1.0)


def test_every_dashboard_query_and_rule_expression_returns_data(stack):
    """After a few scrapes of the live runtime, every dashboard target and
    variable, every recording rule and every selector of every alert (feature
    metrics included) returns finite data, and every alert expression is valid
    PromQL; nothing is exempt."""
    live = checks()
    assert len(live) > 100
    failed = poll(stack, lambda: failures(stack, live))
    assert not failed, "\n".join(failed) + f"\nprometheus log:\n{stack.log_tail()}"


#: What the workload must visibly do (PromQL that returns a sample > 0 when it
#: does): a panel or an alert that only ever sees zeros proves little.
MOVING = (
    (
        "misses of every classified reason",
        "count(sum by (reason) (increase(hicache_existence_page_misses_total"
        '{reason=~"cold|evicted|invalidated|cleared"}[1m])) > 0) == 4',
    ),
    ("evictions", "sum(increase(hicache_existence_evictions_total[1m])) > 0"),
    ("page hits", "sum(increase(hicache_existence_page_hits_total[1m])) > 0"),
    ("invalidations", "sum(increase(hicache_existence_invalidations_total[1m])) > 0"),
    ("cleared pages", "sum(increase(hicache_existence_cleared_pages_total[1m])) > 0"),
    ("writes avoided", "sum(increase(hicache_existence_write_avoided_pages_total[1m])) > 0"),
    ("redundant writes", "sum(increase(hicache_existence_redundant_written_pages_total[1m])) > 0"),
    (
        "redundant writes by cause",
        "sum(increase(hicache_existence_redundant_cause_pages_total[1m])) > 0",
    ),
    (
        "both host memory modes",
        "count(count by (host_memory_mode) (hicache_existence_mode_info)) == 2",
    ),
    ("divergence checks", "sum(increase(hicache_existence_divergence_checks_total[1m])) > 0"),
    ("check seconds", "sum(increase(hicache_existence_divergence_check_seconds_total[1m])) > 0"),
    ("checks active", "min(hicache_existence_divergence_active) == 1"),
    ("last checked step", "max(hicache_existence_divergence_last_check_step) > 0"),
    (
        "present and absent verifications",
        "count(sum by (result) (increase(hicache_existence_reconciler_queries_total"
        '{result=~"present|absent"}[1m])) > 0) == 2',
    ),
    (
        "stale positives",
        "sum(increase(hicache_existence_reconciler_stale_positives_total[1m])) > 0",
    ),
    (
        "reconciler invalidations",
        "sum(increase(hicache_existence_reconciler_pages_invalidated_total[1m])) > 0",
    ),
    ("pages learnt", "sum(increase(hicache_existence_reconciler_pages_learnt_total[1m])) > 0"),
    (
        "query latency observations",
        "sum(increase(hicache_existence_reconciler_query_seconds_count[1m])) > 0",
    ),
    (
        "stream-curve estimates at all six caps for kv and swa",
        "count(count by (pool) (max by (pool, cap_multiplier) "
        "(hicache_existence_advisor_estimated_hit_ratio)) == 6) == 2",
    ),
    (
        "lookup-curve estimates at all six caps for kv and swa",
        "count(count by (pool) (max by (pool, cap_multiplier) "
        "(hicache_existence_advisor_estimated_lookup_hit_ratio)) == 6) == 2",
    ),
)


def test_the_workload_moves_every_signal_the_panels_show(stack):
    """Within seconds the runtime workload evicts, misses for every classified
    reason (cold, evicted, invalidated, cleared), heals, writes redundantly,
    checks replicas, finds stale positives, and estimates every cap multiple:
    the dashboard is tested on moving data, not on zeros."""

    def attempt() -> list[str]:
        out = []
        for what, promql in MOVING:
            status, result, error = stack.query(promql)
            if status != "success":
                out.append(f"{what}: {error or status}\n    {promql}")
            elif not any(float(r["value"][1]) > 0 for r in result):
                out.append(f"{what}: does not move\n    {promql}")
        return out

    failed = poll(stack, attempt)
    assert not failed, "\n".join(failed)


def test_prometheus_loaded_and_evaluates_every_rule_without_error(stack):
    """/api/v1/rules lists every rule of rules.yml, each healthy after evaluation."""
    rules = yaml.safe_load(build.RULES_PATH.read_text(encoding="utf-8"))
    want = {r.get("record") or r["alert"] for g in rules["groups"] for r in g["rules"]}
    deadline = time.monotonic() + DEADLINE_S
    while True:
        groups = stack.get("/api/v1/rules")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        # Go's zero time ("0001-01-01T00:00:00Z") until a rule's first evaluation.
        evaluated = all(
            not r.get("lastEvaluation", "0001").startswith("0001") for r in loaded.values()
        )
        if (set(loaded) == want and evaluated) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(loaded) == want
    unhealthy = {n: r.get("lastError") for n, r in loaded.items() if r["health"] != "ok"}
    assert not unhealthy
