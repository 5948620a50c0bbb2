"""One declaration per judgement (issue 29): the doctor's findings, the Prometheus
alerts and the docs' tables come from ``hicache_existence.doctor.judgements``.

A threshold changed in ``SETTINGS`` moves the doctor's verdict, the rendered alert,
the generated docs and the alerts' promtool unit tests together; a threshold or a
series name written anywhere else in the doctor, the build or the docs tables fails
here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_prometheus_rules import run

from hicache_existence import docs_tables
from hicache_existence.doctor import judgements
from hicache_existence.doctor.diagnosis import diagnose
from hicache_existence.doctor.exposition import parse
from hicache_existence.doctor.figures import Reading

ROOT = Path(__file__).resolve().parents[1]


def load_build() -> ModuleType:
    """dashboards/build.py as a module (the same one tests/test_dashboards.py loads)."""
    name = "hicache_existence_dashboards_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "dashboards" / "build.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


#: A pool whose lookups miss an evicted page 12% of the time (5,000 lookups).
CHURN = """\
hicache_existence_queries_total{pool="kv"} 5000
hicache_existence_page_misses_total{pool="kv",reason="evicted"} 600
hicache_existence_evictions_total{pool="kv"} 900
hicache_existence_entries{pool="kv"} 1024
hicache_existence_capacity_entries{pool="kv"} 1024
hicache_existence_written_pages_total{pool="kv"} 1000
hicache_existence_redundant_written_pages_total{pool="kv"} 10
"""


def verdict() -> str:
    report = diagnose([Reading("http://10.0.0.1:30000/metrics", parse(CHURN))])
    (f,) = [f for f in report.findings if f.id == "cap_too_small"]
    return f.severity


def churn_alert(build: ModuleType) -> tuple[str, str]:
    (a,) = [a for a in build.alerts() if a.name == "HicacheExistenceEvictionChurn"]
    return a.expr, a.description


def churn_panel_threshold(build: ModuleType) -> float:
    (p,) = [p for r in build.rows() for p in r.panels if p.title == "Capacity misses per lookup"]
    return float(p.threshold)


CHURN_ALERT = "HicacheExistenceEvictionChurn"


def churn_promtool(build: ModuleType) -> tuple[str, str]:
    """The rules and the promtool tests of the churn alert (its cases only), as built."""
    suite = yaml.safe_load(build.rule_tests_text())
    suite["tests"] = [
        case
        for case in suite["tests"]
        if any(c["alertname"] == CHURN_ALERT for c in case.get("alert_rule_test", []))
    ]
    return build.rules_text(), yaml.safe_dump(suite, sort_keys=False)


def with_expr_of(rules: str, other: str) -> str:
    """``rules`` with the churn alert's expression taken from ``other`` (its texts
    kept), so that only where the series sit decides a cross run."""

    def churn(r: dict[str, Any]) -> dict[str, Any]:
        (rule,) = [x for g in r["groups"] for x in g["rules"] if x.get("alert") == CHURN_ALERT]
        return rule

    out = yaml.safe_load(rules)
    churn(out)["expr"] = churn(yaml.safe_load(other))["expr"]
    return yaml.safe_dump(out, sort_keys=False)


def promtool_passes(tmp: Path, rules: str, tests: str) -> bool:
    tmp.mkdir()
    (tmp / "rules.yml").write_text(rules, encoding="utf-8")
    (tmp / "tests.yml").write_text(tests, encoding="utf-8")
    result = run("test", "rules", str(tmp / "tests.yml"))
    assert "Unit Testing" in result.stdout, result.stdout  # it ran the file
    return result.returncode == 0


@pytest.mark.prometheus
def test_one_threshold_moves_the_doctor_the_alert_the_docs_and_the_promtool_tests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``churn_ratio`` 0.05 -> 0.2: the 12% churn that was a warning is info, the
    alert fires above 0.2 (20% in its text), the dashboard's line and both docs
    tables say 0.2, and the promtool tests place their series against 0.2 (they pass
    under the moved rules and fail under the old expression, and the old tests fail
    under the moved one); nothing else was edited."""
    build = load_build()
    old_rules, old_tests = churn_promtool(build)
    expr, description = churn_alert(build)
    assert verdict() == "warning"
    assert "ratio_rate5m > 0.05\n" in expr and "more than 5% of" in description
    assert churn_panel_threshold(build) == 0.05
    assert "`churn_ratio` = 0.05 |" in docs_tables.thresholds_table()
    assert "`churn_ratio` = 0.05 |" in docs_tables.alerts_table()

    moved = dataclasses.replace(judgements.SETTINGS, churn_ratio=0.2)
    monkeypatch.setattr(judgements, "SETTINGS", moved)
    expr, description = churn_alert(build)
    assert verdict() == "info"
    assert "ratio_rate5m > 0.2\n" in expr and "more than 20% of" in description
    assert churn_panel_threshold(build) == 0.2
    assert "`churn_ratio` = 0.2 |" in docs_tables.thresholds_table()
    assert "`churn_ratio` = 0.2 |" in docs_tables.alerts_table()
    new_rules, new_tests = churn_promtool(build)
    assert new_tests != old_tests and "more than 20% of" in new_tests
    assert promtool_passes(tmp_path / "old", old_rules, old_tests)
    assert promtool_passes(tmp_path / "moved", new_rules, new_tests)
    # Under the other threshold (each side's texts kept) the series sit wrong.
    assert not promtool_passes(tmp_path / "old-expr", with_expr_of(new_rules, old_rules), new_tests)
    assert not promtool_passes(tmp_path / "new-expr", with_expr_of(old_rules, new_rules), old_tests)


def test_every_declaration_is_complete_and_rendered() -> None:
    """Each judgement's threshold and guards are numeric settings, its alert's
    ``for`` a duration setting, each alert rendered once in the table's order
    with its severity, and every finding of docs/doctor.md declared."""
    s = judgements.SETTINGS
    for j in judgements.JUDGEMENTS:
        for name in (j.threshold, j.guard, j.rate_guard):
            if name is not None:
                s.value(name)  # raises for a missing or non-numeric setting
        assert (j.threshold is None) == (j.ratio is None), j.key
        if j.alert is not None and j.alert.for_:
            assert re.fullmatch(r"\d+[smh]", getattr(s, j.alert.for_)), j.key
    build = load_build()
    rendered = [(a.name, a.severity) for a in build.alerts()]
    assert rendered == [(a.name, j.severity) for j, a in judgements.alerting()]
    doc = (ROOT / "docs" / "doctor.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^### `([a-z0-9_]+)`$", doc, flags=re.M))
    assert documented == {j.finding for j in judgements.JUDGEMENTS if j.finding}


# -- nothing outside its declaration ---------------------------------------------------

#: The code that judges, renders or documents a judgement.  The declarations
#: themselves are ``judgements.py`` (thresholds), the catalog (the package's
#: series) and ``figures.py`` (SGLang's series); ``exposition.py`` and
#: ``scrape.py`` are the parser and the HTTP reads (sizes and timeouts, no
#: judgement).
SCANNED = (
    "hicache_existence/doctor/diagnosis.py",
    "hicache_existence/doctor/figures.py",
    "hicache_existence/doctor/model.py",
    "hicache_existence/doctor/report.py",
    "hicache_existence/doctor/rules.py",
    "hicache_existence/docs_tables.py",
    "dashboards/build.py",
    "dashboards/rule_tests.py",
)
SERIES_NAME = re.compile(r"hicache_existence_[a-z0-9]|sglang:[a-z]")
#: Where a series name may be spelt out: SGLang's series are upstream's and
#: declared once, in figures.py.
SERIES_DECLARED = {"hicache_existence/doctor/figures.py": re.compile(r"sglang:[a-z]")}
#: Integers a comparison may use without being a threshold: none, one, a pair.
PLAIN_INTS = {0, 1, 2}
#: Floats that are no threshold: a zero to start a sum from, a ratio's whole.
PLAIN_FLOATS = {0.0, 1.0}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        value = first.value if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.add(id(value))
    return out


def literals_outside_declarations(path: str, source: str) -> list[str]:
    """Numeric thresholds and series names written in ``source`` (module docstring)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    in_compare = {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in ast.walk(c)}
    quantiles = {
        id(n.args[0])
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "quantile" and n.args
    }
    allowed = SERIES_DECLARED.get(path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docs:
            continue
        v = node.value
        where = f"{path}:{node.lineno}"
        if isinstance(v, str):
            for m in SERIES_NAME.finditer(v):
                if allowed is None or not allowed.match(v, m.start()):
                    found.append(f"{where}: series name in {v!r}")
        elif isinstance(v, bool):
            continue
        elif isinstance(v, float) and v not in PLAIN_FLOATS and id(node) not in quantiles:
            found.append(f"{where}: number {v!r}")
        elif isinstance(v, int) and id(node) in in_compare and v not in PLAIN_INTS:
            found.append(f"{where}: number {v!r} in a comparison")
    return found


def test_no_threshold_or_series_name_outside_its_declaration() -> None:
    """No float (but a quantile), no integer past 2 in a comparison, and no
    ``hicache_existence_*`` or ``sglang:*`` series name outside its declaration,
    in the doctor's judging code, dashboards/build.py and the docs tables."""
    found = []
    for path in SCANNED:
        found += literals_outside_declarations(path, (ROOT / path).read_text(encoding="utf-8"))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("def f(r, w):\n    return r / w > 0.05\n", True),
        ("def f(w):\n    return w >= 64\n", True),
        ('N = "hicache_existence_queries_total"\n', True),
        ('N = "sglang:backuped_tokens_total"\n', True),
        ("def f(views):\n    return len(views) < 2\n", False),
        ('def f():\n    """hicache_existence_queries_total is read."""\n', False),
        ("X = quantile(0.99, m)\n", False),
    ],
)
def test_the_scan_catches_a_threshold_or_a_name(source: str, caught: bool) -> None:
    """The scan above flags a threshold or a series name written in place, and
    lets plain counts, docstrings and quantiles pass."""
    assert bool(literals_outside_declarations("x.py", source)) is caught


# -- nor in the prose that states when a judgement holds --------------------------------


def _value_forms(value: object) -> list[str]:
    """Patterns of a setting's value as prose writes it: a fraction as ``5%`` or
    ``0.05``, a rate as ``1 lookup/s`` or ``1 per second``, a count as ``64``, a
    duration as ``15m`` (not a range selector's ``[1h]`` of a query to run)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, str):
        ok = re.fullmatch(r"\d+[smh]", value)
        return [rf"(?<![\w.\[]){value}(?!\w)"] if ok else []
    if isinstance(value, float) and value < 1:
        return [rf"(?<![\d.]){value * 100:g}%", rf"(?<![\d.]){value:g}(?!\.?\d)"]
    if isinstance(value, float):
        return [rf"(?<![\d.]){value:g} ?(\w+)? ?(/s|per second)"]
    if isinstance(value, int):
        return [rf"(?<![\d.,]){value}(?![\d.,%])"]
    return []


def setting_values_in(text: str) -> list[str]:
    """Every setting whose value ``text`` writes, as ``name 'match'``."""
    found = []
    for f in dataclasses.fields(judgements.Settings):
        for pattern in _value_forms(getattr(judgements.SETTINGS, f.name)):
            found += [f"{f.name} {m.group(0)!r}" for m in re.finditer(pattern, text)]
    return found


def judgement_prose() -> list[tuple[str, str]]:
    """(file, paragraph) of the prose that says when a judgement holds: every
    paragraph of docs/runbooks.md from its settings table on (the alerts' sections),
    and docs/doctor.md's thresholds section and every ``**Means.**`` paragraph; the
    generated tables left out (they are where the values are)."""

    def read(path: str) -> str:
        text = (ROOT / path).read_text(encoding="utf-8")
        return re.sub(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)

    runbooks = read("docs/runbooks.md")
    out = [("runbooks.md", p) for p in runbooks[runbooks.index("\n## Settings") :].split("\n\n")]
    doctor = read("docs/doctor.md")
    section = doctor[doctor.index("\n## Thresholds") : doctor.index("\n## Findings")]
    out += [("doctor.md", p) for p in section.split("\n\n")]
    out += [("doctor.md", p) for p in doctor.split("\n\n") if p.startswith("**Means.**")]
    return out


def test_no_setting_value_in_the_judgement_prose() -> None:
    """The runbooks and the doctor's findings name a setting (`churn_ratio`), never
    its value: the generated tables hold the values, so a changed threshold cannot
    leave a stale figure in the prose.  The scope is not empty: every alert's
    **Fires when** and every finding's **Means.** is in it."""
    prose = judgement_prose()
    fires = sum("**Fires when**" in p for _, p in prose)
    means = sum(p.startswith("**Means.**") for _, p in prose)
    assert fires == len(judgements.alerting())
    assert means == len({j.finding for j in judgements.JUDGEMENTS if j.finding})
    found = [f"{path}: {hit}: {p[:80]!r}" for path, p in prose for hit in setting_values_in(p)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("exceed 5% of lookups", True),
        ("`pool:x:ratio_rate5m > 0.05`", True),
        ("for 15m while", True),
        ("more than 1 lookup/s", True),
        ("at least 4096 tokens", True),
        ("`increase(hicache_existence_clears_total[1h])`", False),
        ("exceed `churn_ratio` of lookups for `churn_for`", False),
        ("SGLang 0.5.23 on CPU, measured 3.2%", False),
    ],
)
def test_the_prose_scan_catches_a_value(text: str, caught: bool) -> None:
    """The prose scan flags a setting's value in each form prose writes it, and lets
    setting names, a query's range selector and unrelated figures pass."""
    assert bool(setting_values_in(text)) is caught
