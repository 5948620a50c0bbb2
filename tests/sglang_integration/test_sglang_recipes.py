"""The PD recipes in integrations/sglang: the scripts' sglang arguments go through
sglang's own parser and HiCache validator, the scrape configuration passes
promtool, the PrometheusRule carries integrations/prometheus/rules.yml unchanged,
and the Kubernetes monitors select the pods they are meant to scrape.  Also where
the metrics appear with --enable-metrics: on sglang's own /metrics route."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hx_harness import RECIPES, REPO, Scenarios, recipe_argv, sglang_args

from hicache_existence.config import Config
from hicache_existence.integrations.sglang.launcher import plan

K8S = RECIPES.parent / "kubernetes"
REQUIRE_ALL = os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def test_scripts_are_valid_bash() -> None:
    """Every recipe script parses (bash -n)."""
    for script in ("common.sh", "prefill.sh", "decode.sh", "router.sh"):
        subprocess.run(["bash", "-n", str(RECIPES / script)], check=True, timeout=30)


def test_prefill_routes_run_the_same_sglang_arguments() -> None:
    """Flag, launcher and environment routes start sglang with the same arguments;
    only how hicache-existence is switched on differs."""
    flag = recipe_argv("prefill.sh")
    args = sglang_args(flag)
    i = args.index("--enable-hicache-existence")
    base, ours = args[:i], args[i:]
    assert ours[0] == "--enable-hicache-existence" and ours[1] == "--hicache-existence-config"
    assert Path(ours[2]) == RECIPES / "hicache-existence-config.json"
    for expected in ("buffer_only", "prefill", "--enable-metrics", "--enable-hierarchical-cache"):
        assert expected in base

    launcher = recipe_argv("prefill.sh", HX_ROUTE="launcher")
    assert launcher[:2] == ["hicache-existence", "launch"]
    launched = plan(launcher[2:], env={}, python="python3")
    forwarded = [a for a in launched.forwarded if a != "--"]
    assert forwarded == base
    assert launched.set_env["HICACHE_EXISTENCE_ENABLED"] == "1"

    env = recipe_argv("prefill.sh", HX_ROUTE="env")
    assert env[:3] == ["env", "HICACHE_EXISTENCE_ENABLED=1", f"HICACHE_EXISTENCE_CONFIG=@{ours[2]}"]
    assert sglang_args(env) == base


def test_decode_and_router_have_no_hicache_existence() -> None:
    """Decode servers get neither our flags nor buffer mode; the router lists
    every prefill and decode URL."""
    decode = recipe_argv("decode.sh")
    assert not any("hicache" in a for a in decode)
    router = recipe_argv(
        "router.sh", PREFILL_URLS="http://p0:1 http://p1:1", DECODE_URLS="http://d:2"
    )
    assert router.count("--prefill") == 2 and router.count("--decode") == 1
    assert "--pd-disaggregation" in router


def test_example_configurations_load_and_agree() -> None:
    """The recipes' JSON and the Kubernetes ConfigMap load as the same Config."""
    from_file = Config.from_json(str(RECIPES / "hicache-existence-config.json"))
    (configmap,) = _docs(K8S / "hicache-existence-config.yaml")
    assert Config.from_json(configmap["data"]["config.json"]) == from_file


@pytest.mark.prometheus
def test_scrape_config_passes_promtool() -> None:
    """promtool accepts integrations/sglang/prometheus.yml and the rules it loads."""
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool is not installed (apt-get install prometheus)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    proc = subprocess.run(
        [promtool, "check", "config", str(RECIPES / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rules found" in proc.stdout + proc.stderr


def test_prometheusrule_is_rules_yml() -> None:
    """The committed PrometheusRule is what the renderer makes now, and its groups
    equal integrations/prometheus/rules.yml's."""
    proc = subprocess.run(
        [sys.executable, str(K8S / "render_prometheusrule.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    (rule,) = _docs(K8S / "prometheusrule.yaml")
    source = yaml.safe_load((REPO / "integrations" / "prometheus" / "rules.yml").read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == source["groups"]


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] != "In" or labels.get(expr["key"]) not in expr["values"]:
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_monitors_select_the_prefill_and_decode_pods() -> None:
    """The PodMonitor selects the prefill and decode pods (not the router) on a
    port they declare; the ServiceMonitor selects their Services."""
    objects = _docs(K8S / "pd-deployment.yaml")
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("StatefulSet", "Deployment")}
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    (pod_monitor,) = _docs(K8S / "podmonitor.yaml")
    (service_monitor,) = _docs(K8S / "servicemonitor.yaml")
    for name, obj in sets.items():
        template = obj["spec"]["template"]
        labels = template["metadata"]["labels"]
        picked = _selected(pod_monitor["spec"]["selector"], labels)
        assert picked == (name != "sglang-router"), name
        if picked:
            ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
            assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    for name, svc in services.items():
        picked = _selected(service_monitor["spec"]["selector"], svc["metadata"]["labels"])
        assert picked == (name != "sglang-router"), name
    prefill = sets["sglang-prefill"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in prefill["env"]}
    assert env["HICACHE_EXISTENCE_ENABLED"] == "1"
    decode = sets["sglang-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in decode and not any("hicache" in a for a in decode["args"])
    kustomization = _docs(K8S / "kustomization.yaml")[0]
    assert all((K8S / r).is_file() for r in kustomization["resources"])


@pytest.mark.sglang
def test_recipe_arguments_pass_sglangs_parser_and_validator(scenarios: Scenarios) -> None:
    """prefill.sh's arguments parse with sglang (our flags included, the JSON file
    read) and pass upstream's buffer-mode validator; decode.sh's parse without
    our flags; buffer mode on decode is rejected by upstream itself."""
    r = scenarios.get("recipes").value()
    prefill, decode = r["prefill"], r["decode"]
    assert prefill["flags"]["enabled"] is True
    expected = json.loads((RECIPES / "hicache-existence-config.json").read_text())
    assert json.loads(prefill["flags"]["config"]) == expected
    assert (prefill["host_memory_mode"], prefill["disaggregation_mode"]) == (
        "buffer_only",
        "prefill",
    )
    assert prefill["validator"] == "ok"
    assert decode["flags"] is None and decode["disaggregation_mode"] == "decode"
    assert decode["validator"] == "ok"
    assert "not supported on decode" in r["decode_buffer_only"]


@pytest.mark.sglang
def test_metrics_on_sglangs_own_metrics_route(scenarios: Scenarios) -> None:
    """With --enable-metrics (multiprocess mode set up by sglang's
    set_prometheus_multiproc_dir), a spawned scheduler's series appear on the
    /metrics route sglang's add_prometheus_middleware serves."""
    r = scenarios.get("metrics_multiprocess").value()
    assert r["child"] == {"mode": "multiprocess"} and r["exitcode"] == 0
    # The scenario's lookup and adds are on pool kv (the seed generation's tree may
    # create other pools' series at construction, at zero).
    kv_queries = [s for s in r["queries"] if 'pool="kv"' in s]
    assert len(kv_queries) == 1, r["queries"]
    assert 'engine_type="prefill"' in kv_queries[0] and kv_queries[0].endswith(" 1.0"), r
    kv_entries = [s for s in r["entries"] if 'pool="kv"' in s]
    assert len(kv_entries) == 1 and kv_entries[0].endswith(" 4.0"), r["entries"]
    others = [s for s in r["queries"] if 'pool="kv"' not in s]
    assert all(s.endswith(" 0.0") for s in others), others
