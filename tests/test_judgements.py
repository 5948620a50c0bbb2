"""One declaration per judgement (issue 29): the doctor's findings, the Prometheus
alerts and the docs' tables come from ``hicache_existence.doctor.judgements``.

A threshold changed in ``SETTINGS`` moves the doctor's verdict, the rendered alert
and the generated docs together; a threshold or a series name written anywhere
else in the doctor, the build or the docs tables fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


def test_one_threshold_moves_the_doctor_the_alert_and_the_docs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``churn_ratio`` 0.05 -> 0.2: the 12% churn that was a warning is info, the
    alert fires above 0.2 (20% in its text), the dashboard's line and both docs
    tables say 0.2; nothing else was edited."""
    build = load_build()
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
