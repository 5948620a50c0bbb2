"""The Prometheus rules under the real promtool: syntax, the example config, the
unit tests, and proof that every alert's firing and non-firing cases can fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "integrations" / "prometheus"
RULES, TESTS, CONFIG = PROM / "rules.yml", PROM / "tests.yml", PROM / "prometheus.yml"
REQUIRE_ALL = os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"

pytestmark = pytest.mark.prometheus


def promtool() -> str:
    """The promtool path; fails under HICACHE_EXISTENCE_REQUIRE_ALL=1, else skips."""
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed (apt-get install -y prometheus)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """promtool with stderr folded into stdout in write order (it reports a file's
    name on one stream and its failures on the other)."""
    return subprocess.run(
        [promtool(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=False,
    )


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def alert_names() -> list[str]:
    return [r["alert"] for g in load(RULES)["groups"] for r in g["rules"] if "alert" in r]


def cases(alert: str, firing: bool) -> list[dict[str, Any]]:
    """Test cases of tests.yml that expect ``alert`` to fire at some eval time
    (``firing``) or that check it and expect it never to fire."""
    out = []
    for case in load(TESTS)["tests"]:
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == alert]
        fires = any(c.get("exp_alerts") for c in checks)
        if checks and fires == firing:
            out.append(case)
    return out


def test_promtool_check_rules_accepts_the_rules():
    """`promtool check rules` (Prometheus 2.42) parses every rule and finds no lint."""
    result = run("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout), result.stdout


def test_promtool_check_config_accepts_the_example_config():
    """The example prometheus.yml is valid and loads rules.yml."""
    result = run("check", "config", str(CONFIG))
    assert result.returncode == 0, result.stdout


def test_promtool_unit_tests_pass():
    """`promtool test rules tests.yml`: every firing and non-firing case holds."""
    result = run("test", "rules", str(TESTS))
    assert result.returncode == 0, result.stdout
    assert "SUCCESS" in result.stdout


def test_every_alert_has_firing_and_non_firing_cases_that_can_fail(tmp_path):
    """For every alert, its firing cases fail when the alert can never fire and its
    non-firing cases fail when it always fires (so neither kind is vacuous)."""
    rules = load(RULES)
    files: dict[Path, str] = {}
    for alert in alert_names():
        for firing, expr in ((True, "vector(1) < 0"), (False, "vector(1)")):
            selected = cases(alert, firing)
            kind = "firing" if firing else "non-firing"
            assert selected, f"tests.yml has no {kind} case for {alert}"
            workdir = tmp_path / f"{alert}-{kind}"
            workdir.mkdir()
            mutated = yaml.safe_load(yaml.safe_dump(rules))
            for group in mutated["groups"]:
                for rule in group["rules"]:
                    if rule.get("alert") == alert:
                        rule["expr"] = expr
            (workdir / "rules.yml").write_text(yaml.safe_dump(mutated), encoding="utf-8")
            suite = {**load(TESTS), "tests": selected}
            test_file = workdir / "tests.yml"
            test_file.write_text(yaml.safe_dump(suite, sort_keys=False), encoding="utf-8")
            files[test_file] = f"{kind} cases of {alert}"
    result = run("test", "rules", *map(str, files))
    outcome = dict(re.findall(r"Unit Testing:\s+(\S+)\n\s+(SUCCESS|FAILED)", result.stdout))
    survivors = [what for path, what in files.items() if outcome.get(str(path)) != "FAILED"]
    assert not survivors, f"these still pass with the alert mutated: {survivors}\n{result.stdout}"


# -- the dashboard's recommended-cap query, evaluated by promtool ---------------------

DASHBOARD = ROOT / "dashboards" / "hicache-existence-dashboard.json"
_VARIABLE = re.compile(r"\$\{?(job|instance|model_name|pool|tp_rank)\}?")


def dashboard_expr(title: str, ref_id: str) -> str:
    """A panel target's PromQL with every dashboard variable at All."""
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    (panel,) = [p for p in panels if p["title"] == title]
    (target,) = [t for t in panel["targets"] if t["refId"] == ref_id]
    return _VARIABLE.sub(".*", target["expr"])


#: A reference-stream curve still rising at 8x: the recommendation must ignore it
#: (in buffer mode the cap is sized by the lookup curve).
_STREAM = [0.1, 0.2, 0.3, 0.5, 0.7, 0.9]


def _advisor_series(rank: str, pool: str, ratios: list[float]) -> list[dict[str, str]]:
    """A pool's cap and its two advisor curves: ``ratios`` on the lookup curve."""
    labels = (
        f'job="sglang",instance="10.0.0.1:946{rank}",model_name="llama",engine_type="prefill",'
        f'storage_backend="mooncake",tp_rank="{rank}",dp_rank="0",pp_rank="0",pool="{pool}"'
    )
    out = [{"series": f"hicache_existence_capacity_entries{{{labels}}}", "values": "1000x5"}]
    multipliers = ("0.25", "0.5", "1", "2", "4", "8")
    for name, curve in (("lookup_hit_ratio", ratios), ("hit_ratio", _STREAM)):
        for multiplier, ratio in zip(multipliers, curve if ratios else []):
            out.append(
                {
                    "series": f"hicache_existence_advisor_estimated_{name}"
                    f'{{{labels},cap_multiplier="{multiplier}"}}',
                    "values": f"{ratio}x5",
                }
            )
    return out


def test_recommended_cap_is_the_smallest_multiple_within_tolerance_of_the_best(tmp_path):
    """The dashboard's recommended cap (and its estimate), under promtool: a lookup
    curve that flattens at 4x recommends 4x, a flat one 0.25x, one still rising at
    8x recommends 8x, whatever the reference-stream curve says; equal replicas on
    two ranks count once; a pool without estimates gets no recommendation."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": "test:recommended_cap",
                        "expr": dashboard_expr("Recommended cap (entries)", "B"),
                    },
                    {
                        "record": "test:recommended_hit_ratio",
                        "expr": dashboard_expr(
                            "Estimated lookup hit ratio at the recommended cap", "B"
                        ),
                    },
                ],
            }
        ]
    }
    flattens = [0.1, 0.2, 0.4, 0.6, 0.7, 0.705]  # within 0.01 of the best from 4x
    series = [
        *_advisor_series("0", "kv", flattens),
        *_advisor_series("1", "kv", flattens),
        *_advisor_series("0", "swa", [0.3] * 6),
        *_advisor_series("0", "draft", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        *_advisor_series("0", "other", [])[:1],  # a cap, no estimates
    ]
    suite = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": "test:recommended_cap",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": 'test:recommended_cap{pool="kv"}', "value": 4000},
                            {"labels": 'test:recommended_cap{pool="swa"}', "value": 250},
                            {"labels": 'test:recommended_cap{pool="draft"}', "value": 8000},
                        ],
                    },
                    {
                        "expr": "test:recommended_hit_ratio",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": 'test:recommended_hit_ratio{pool="kv"}', "value": 0.7},
                            {"labels": 'test:recommended_hit_ratio{pool="swa"}', "value": 0.3},
                            {"labels": 'test:recommended_hit_ratio{pool="draft"}', "value": 0.6},
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(suite, sort_keys=False), encoding="utf-8")
    result = run("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout
