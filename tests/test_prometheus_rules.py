"""The Prometheus rules under the real promtool: syntax, the example config, the
unit tests, and proof that every alert's firing and non-firing cases can fail."""

from __future__ import annotations

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
