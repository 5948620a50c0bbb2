"""The Grafana dashboard and the Prometheus rules: committed files equal the build,
dashboard-linter conventions, alert conventions, runbooks, and every metric name
known to the catalog (or explicitly pending)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from hicache_existence.accounting.advisor import ADVICE_TOLERANCE, MULTIPLIERS, multiplier_label
from hicache_existence.exporters import catalog
from hicache_existence.reconcile.counters import (
    ANSWERED_RESULTS,
    DISCARDED_RESULTS,
    FAILED_RESULTS,
    RESULTS,
)

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def load_build() -> ModuleType:
    """dashboards/build.py as a module (it is a script, not a package)."""
    name = "hicache_existence_dashboards_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "dashboards" / "build.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


build = load_build()


def committed_dashboard() -> dict[str, Any]:
    return json.loads(build.DASHBOARD_PATH.read_text(encoding="utf-8"))


def committed_rules() -> dict[str, Any]:
    return yaml.safe_load(build.RULES_PATH.read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def alert_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def recording_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "record" in r]


# -- lint: dashboard-linter conventions plus ours ------------------------------------

#: Grafana unit ids the dashboard may use (a typo renders as a raw number).
KNOWN_UNITS = {"percentunit", "ops", "binBps", "bytes", "short", "s"}
VARIABLES = ("job", "instance", "model_name", "pool", "tp_rank")
_RANGE = re.compile(r"\[([^\]]*)\]")
_SELECTOR = re.compile(r"\b(hicache_existence_[a-zA-Z0-9_]*)(\{[^}]*\})?")


def lint_dashboard(d: dict[str, Any]) -> list[str]:
    """Problems with the dashboard, one line each (empty when clean)."""
    problems: list[str] = []
    if d.get("schemaVersion") != 41:
        problems.append(f"schemaVersion is {d.get('schemaVersion')}, want 41")
    variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("no datasource variable of type datasource querying prometheus")
    for name in VARIABLES:
        v = variables.get(name)
        if v is None:
            problems.append(f"no {name} variable")
            continue
        if v.get("type") != "query" or v.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"variable {name} must be a query on ${{datasource}}")
        if not (v.get("multi") and v.get("includeAll") and v.get("allValue") == ".*"):
            problems.append(f"variable {name} must be multi-valued with All = .*")
    ids = [p.get("id") for p in d.get("panels", [])]
    if len(ids) != len(set(ids)):
        problems.append("duplicate panel ids")
    cells: set[tuple[int, int]] = set()
    for p in d.get("panels", []):
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            problems.append(f"panel {p.get('title')!r} is wider than the grid")
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        if cells & mine:
            problems.append(f"panel {p.get('title')!r} overlaps another panel")
        cells |= mine
    for p in panels(d):
        title = p.get("title") or "<untitled>"
        if not p.get("title"):
            problems.append("a panel has no title")
        if not p.get("description"):
            problems.append(f"panel {title!r} has no description")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if unit not in KNOWN_UNITS:
            problems.append(f"panel {title!r} has no known unit (got {unit!r})")
        if p.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"panel {title!r} does not use the datasource variable")
        if not p.get("targets"):
            problems.append(f"panel {title!r} has no targets")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            if t.get("datasource", {}).get("uid") != "${datasource}":
                problems.append(f"a target of {title!r} does not use the datasource variable")
            for window in _RANGE.findall(expr):
                if window != "$__rate_interval":
                    problems.append(f"panel {title!r} uses [{window}], not [$__rate_interval]")
            for name, matchers in _SELECTOR.findall(expr):
                for required in ('job=~"$job"', 'instance=~"$instance"'):
                    if required not in matchers:
                        problems.append(f"panel {title!r}: {name} lacks {required}")
    return problems


_ALERT_NAME = re.compile(r"^HicacheExistence[A-Z][A-Za-z0-9]*$")
_RECORD_NAME = re.compile(r"^[a-z_]+:hicache_existence_[a-z0-9_]+:[a-z0-9_]+$")


def lint_rules(rules: dict[str, Any]) -> list[str]:
    """Problems with the rules (monitoring-mixins conventions), one line each."""
    problems: list[str] = []
    recorded = {r["record"] for r in recording_rules(rules)}
    for r in recording_rules(rules):
        if not _RECORD_NAME.match(r["record"]):
            problems.append(f"recording rule {r['record']!r} is not level:metric:operations")
    for r in alert_rules(rules):
        name = r["alert"]
        if not _ALERT_NAME.match(name):
            problems.append(f"alert {name!r} is not CamelCase with the HicacheExistence prefix")
        labels = r.get("labels", {})
        if labels.get("severity") not in ("critical", "warning", "info"):
            problems.append(f"alert {name}: severity must be critical, warning or info")
        for key, value in labels.items():
            if "$value" in str(value) or "{{" in str(value):
                problems.append(f"alert {name}: label {key} is templated (series churn)")
        notes = r.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            if not notes.get(key):
                problems.append(f"alert {name} has no {key}")
        url = notes.get("runbook_url", "")
        if url != f"{build.SETTINGS.runbook_url}#{name.lower()}":
            problems.append(f"alert {name}: runbook_url must point at its anchor in runbooks.md")
        if "for" not in r:
            problems.append(f"alert {name} has no for")
    for r in [*recording_rules(rules), *alert_rules(rules)]:
        for used in build.names_in(r["expr"]):
            if ":" in used and used not in recorded:
                problems.append(f"{used} is used but not recorded")
    return problems


def test_committed_files_equal_the_build_output():
    """dashboards/hicache-existence-dashboard.json and rules.yml are exactly what build.py
    writes (run `python dashboards/build.py` after editing it)."""
    for path, text in build.outputs().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale"


def test_check_mode_reports_and_write_mode_fixes_a_stale_file(tmp_path, monkeypatch):
    """`build.py --check` exits 1 on any differing generated file (the dashboard,
    a doc table) and the plain run rewrites each of them."""
    names = (
        "DASHBOARD_PATH",
        "RULES_PATH",
        "PROMETHEUSRULE_PATH",
        "METRICS_DOC_PATH",
        "CONFIG_DOC_PATH",
    )
    for name in names:
        original = getattr(build, name)
        copy_ = tmp_path / original.name
        copy_.write_text(original.read_text(encoding="utf-8"), encoding="utf-8")
        monkeypatch.setattr(build, name, copy_)
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.main(["--check"]) == 0
    build.DASHBOARD_PATH.write_text("{}", encoding="utf-8")
    doc = build.METRICS_DOC_PATH
    doc.write_text(
        doc.read_text(encoding="utf-8").replace("| `hicache_existence_queries_total`", "| `stale`"),
        encoding="utf-8",
    )
    assert build.main(["--check"]) == 1
    assert build.DASHBOARD_PATH.read_text(encoding="utf-8") == "{}"
    assert build.main([]) == 0
    assert build.main(["--check"]) == 0
    assert json.loads(build.DASHBOARD_PATH.read_text(encoding="utf-8"))["schemaVersion"] == 41
    assert "| `hicache_existence_queries_total`" in doc.read_text(encoding="utf-8")


def test_panel_ids_are_unique_and_survive_adding_and_moving_panels(monkeypatch):
    """Ids derive from each panel's key: all distinct; a new panel inserted at the
    top of the first row, and a panel moved to another row, leave every other
    id unchanged (Grafana links such as viewPanel= keep working)."""
    before = {p["title"]: p["id"] for p in build.dashboard()["panels"]}
    ids = [p["id"] for p in build.dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    original = build.rows

    def edited() -> tuple[build.Row, ...]:
        rows = list(original())
        new = build.Panel("A new panel", "d", "short", (build._t("vector(1)", "x"),))
        moved = rows[0].panels[-1]
        rows[0] = build.Row(rows[0].title, (new, *rows[0].panels[:-1]))
        rows[1] = build.Row(rows[1].title, (*rows[1].panels, moved))
        return tuple(rows)

    monkeypatch.setattr(build, "rows", edited)
    after = {p["title"]: p["id"] for p in build.dashboard()["panels"]}
    assert set(after) == set(before) | {"A new panel"}
    assert {t: after[t] for t in before} == before


def test_every_row_fills_its_lines():
    """No stray panels: within every row, each line of panels spans the full
    24-column width (a lone half-width panel is a layout mistake)."""
    problems = []
    row = None
    lines: dict[int, int] = {}
    for p in [*build.dashboard()["panels"], {"type": "row", "title": None, "gridPos": {}}]:
        if p["type"] == "row":
            problems += [
                f"row {row!r}: a line at y={y} spans {w}" for y, w in lines.items() if w != 24
            ]
            row, lines = p["title"], {}
            continue
        g = p["gridPos"]
        lines[g["y"]] = lines.get(g["y"], 0) + g["w"]
    assert problems == []


def test_dashboard_passes_the_lint():
    """Datasource, job/instance/model_name/pool/tp_rank variables; every panel has a
    title, description, unit and the datasource variable; every range is
    $__rate_interval; every selector filters job and instance; no overlap."""
    assert lint_dashboard(committed_dashboard()) == []


def test_dashboard_lint_catches_each_violation():
    """Each kind of violation planted in a copy of the dashboard is reported."""
    d = copy.deepcopy(committed_dashboard())
    d["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "instance"]
    first, second, third = panels(d)[:3]
    del first["description"]
    second["fieldConfig"]["defaults"]["unit"] = "persentunit"
    third["targets"][0]["expr"] = 'sum(rate(hicache_existence_queries_total{job=~"$job"}[5m]))'
    problems = "\n".join(lint_dashboard(d))
    assert "no instance variable" in problems
    assert f"{first['title']!r} has no description" in problems
    assert "'persentunit'" in problems
    assert "uses [5m], not [$__rate_interval]" in problems
    assert 'lacks instance=~"$instance"' in problems


def test_dashboard_has_every_row_with_panels():
    """Rows overview, churn, TP health, reconciler, fleet, capacity advice and the
    generated one-panel-per-family row, in that order, each with panels."""
    d = committed_dashboard()
    titles = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert titles == [
        "Overview",
        "Churn",
        "TP health",
        "Reconciler",
        "Fleet",
        "Capacity advice",
        "Every exported family",
    ]
    counts = dict.fromkeys(titles, 0)
    row = None
    for p in d["panels"]:
        if p["type"] == "row":
            row = p["title"]
        else:
            counts[row] += 1
    assert all(n >= 3 for n in counts.values()), counts


def test_fleet_row_sums_over_instances_and_shares_redundant_writes():
    """The fleet row sums the write counters over instances (no per-instance
    grouping) and divides each instance's redundant writes by the fleet's."""
    fleet = {p["title"]: p for p in panels(committed_dashboard()) if "leet" in p["title"]}
    writes = fleet["Fleet L3 writes (pages/s)"]["targets"]
    assert [t["legendFormat"] for t in writes] == ["written", "redundant", "avoided"]
    assert all(t["expr"].startswith("sum (rate(hicache_existence_") for t in writes)
    (share,) = fleet["Share of the fleet's redundant writes by instance"]["targets"]
    per, total = share["expr"].split("/ ignoring (instance) group_left")
    assert per.startswith("sum by (instance) (rate(hicache_existence_redundant_written_pages")
    assert total.strip().startswith("sum (rate(hicache_existence_redundant_written_pages")


def test_overview_hit_ratio_is_computed_from_counters():
    """The hit ratio panel divides rates of the hit and checked counters (no
    ratio gauge exists)."""
    (panel,) = [p for p in panels(committed_dashboard()) if p["title"] == "Page hit ratio"]
    expr = panel["targets"][0]["expr"]
    assert "rate(hicache_existence_page_hits_total{" in expr
    assert "rate(hicache_existence_pages_checked_total{" in expr
    assert "\n/\n" in expr


def test_rules_pass_the_lint():
    """Alert names, severities, annotations, runbook URLs, no templated labels,
    level:metric:operations records, and every record used is defined."""
    assert lint_rules(committed_rules()) == []


def test_rules_lint_catches_each_violation():
    """Each kind of violation planted in a copy of the rules is reported."""
    rules = copy.deepcopy(committed_rules())
    a, b, c = alert_rules(rules)[:3]
    a["alert"] = "evictionChurn"
    b["labels"] = {"severity": "page", "detail": "{{ $value }}"}
    del c["annotations"]["runbook_url"]
    recording_rules(rules)[0]["record"] = "hicache_existence_queries_rate5m"
    problems = "\n".join(lint_rules(rules))
    assert "'evictionChurn' is not CamelCase" in problems
    assert f"alert {b['alert']}: severity" in problems
    assert f"alert {b['alert']}: label detail is templated" in problems
    assert f"alert {c['alert']} has no runbook_url" in problems
    assert "is not level:metric:operations" in problems
    assert "pool:hicache_existence_queries:rate5m is used but not recorded" in problems


def test_the_alerts_the_issue_asks_for_exist():
    """Churn, hit-ratio collapse, TP divergence (critical), TP checks stopped,
    reconciler down, circuit open, stale positives, at cap with redundant writes
    rising, fleet-wide redundant writes below the cap, cache mode rewriting pages
    without cache_mode.dedup (issue 21)."""
    severity = {r["alert"]: r["labels"]["severity"] for r in alert_rules(committed_rules())}
    assert severity == {
        "HicacheExistenceEvictionChurn": "warning",
        "HicacheExistenceHitRatioCollapse": "warning",
        "HicacheExistenceTPDivergence": "critical",
        "HicacheExistenceTPChecksStopped": "warning",
        "HicacheExistenceReconcilerDown": "warning",
        "HicacheExistenceReconcilerCircuitOpen": "warning",
        "HicacheExistenceStalePositivesHigh": "warning",
        "HicacheExistenceAtCapRedundantWritesRising": "warning",
        "HicacheExistenceFleetRedundantWrites": "warning",
        "HicacheExistenceCacheModeRedundantWrites": "info",
    }


def test_alert_severities_are_the_doctors_table():
    """Every rendered alert is a declaration of the judgements' table (the one the
    doctor's findings read), with its severity, in the table's order."""
    from hicache_existence.doctor import judgements

    rendered = [(r["alert"], r["labels"]["severity"]) for r in alert_rules(committed_rules())]
    declared = [(a.name, j.severity) for j, a in judgements.alerting()]
    assert rendered == declared


def test_runbook_url_points_at_the_runbooks_of_this_repository_by_default():
    """The default base of every runbook_url is docs/runbooks.md of this repository
    (a path from its root that exists), not a placeholder host."""
    base = build.SETTINGS.runbook_url
    assert (ROOT / base).resolve() == RUNBOOKS.resolve()
    for r in alert_rules(committed_rules()):
        assert r["annotations"]["runbook_url"].startswith(f"{base}#"), r["alert"]


# -- runbooks --------------------------------------------------------------------------


def runbook_sections() -> dict[str, str]:
    """``## heading`` -> its text, keyed by GitHub's anchor of the heading."""
    text = RUNBOOKS.read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        anchor = re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")
        out[anchor] = body
    return out


def test_every_alert_has_a_runbook_section_with_meaning_confirmation_and_action():
    """Each runbook_url anchor is a section of docs/runbooks.md that says what the
    alert means, how to confirm it and what to do, and states its thresholds (by
    the names of their settings: the generated settings table gives the values)."""
    sections = runbook_sections()
    thresholds = {
        "HicacheExistenceEvictionChurn": ["churn_ratio", "churn_for"],
        "HicacheExistenceHitRatioCollapse": ["collapse_offset", "collapse_for"],
        "HicacheExistenceTPDivergence": ["divergence_window"],
        "HicacheExistenceTPChecksStopped": ["checks_stopped_for"],
        "HicacheExistenceReconcilerDown": ["reconciler_down_for"],
        "HicacheExistenceReconcilerCircuitOpen": ["circuit_open_for"],
        "HicacheExistenceStalePositivesHigh": ["stale_ratio", "stale_for"],
        "HicacheExistenceAtCapRedundantWritesRising": [
            "redundant_ratio",
            "at_cap_fill",
            "redundant_for",
        ],
        "HicacheExistenceFleetRedundantWrites": [
            "fleet_redundant_ratio",
            "at_cap_fill",
            "fleet_redundant_for",
        ],
        "HicacheExistenceCacheModeRedundantWrites": [
            "cache_mode_redundant_ratio",
            "cache_mode_redundant_for",
        ],
    }
    for rule in alert_rules(committed_rules()):
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor in sections, f"docs/runbooks.md has no section #{anchor}"
        body = sections[anchor]
        for part in ("**Meaning.**", "**Confirm.**", "**Act.**"):
            assert part in body, f"#{anchor} lacks {part}"
        for name in thresholds[rule["alert"]]:
            assert hasattr(build.SETTINGS, name), name
            assert f"`{name}`" in body, f"#{anchor} does not state its threshold `{name}`"


def test_every_alert_runbook_section_belongs_to_an_alert():
    """No runbook section for an alert that no longer exists."""
    names = {r["alert"].lower() for r in alert_rules(committed_rules())}
    documented = {a for a in runbook_sections() if a.startswith("hicacheexistence")}
    assert documented == names


#: Italic words of the runbooks that name Grafana UI elements, not panels.
_UI_WORDS = {"All", "i"}
_ITALIC = re.compile(r"(?<![*\w])\*([^*]+?)\*(?![*\w])")


def test_runbooks_explain_every_dashboard_row():
    """docs/runbooks.md has a "Reading the dashboard" section with a subsection
    per dashboard row, in dashboard order."""
    sections = runbook_sections()
    assert "reading-the-dashboard" in sections
    rows = [p["title"] for p in committed_dashboard()["panels"] if p["type"] == "row"]
    headings = re.findall(r"^### (.+)$", sections["reading-the-dashboard"], flags=re.M)
    assert headings == rows


def test_runbooks_refer_only_to_panels_that_exist():
    """Every italic *name* in docs/runbooks.md is a panel, a row or the dashboard
    (a renamed panel leaves no stale instruction behind)."""
    d = committed_dashboard()
    titles = {p["title"] for p in d["panels"]} | {d["title"]} | _UI_WORDS
    text = RUNBOOKS.read_text(encoding="utf-8")
    named = {" ".join(m.split()) for m in _ITALIC.findall(text)}
    assert named, "the runbooks name no panel"
    assert named <= titles, sorted(named - titles)


# -- metric names: the catalog or the explicit pending list ------------------------------

_MATCHERS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_SCRAPE_LABELS = {"job", "instance"}
#: Every exported family: cache metrics and feature metrics (both have ``kind``
#: and ``label_names``).
KNOWN: dict[str, catalog.MetricSpec] = {
    **catalog.BY_NAME,
    **catalog.FEATURE_BY_NAME,
}


def metric_problems(exprs: list[str], known: dict[str, catalog.MetricSpec]) -> list[str]:
    """Names or labels used in ``exprs`` that ``known`` (the catalog) does not
    account for, one line each."""
    problems: list[str] = []
    for expr in exprs:
        for used in sorted(build.names_in(expr)):
            if ":" in used:
                continue  # a recording rule (lint_rules checks it is defined)
            family = build.metric_of(used)
            if family is None:
                problems.append(f"{used} is not a sample of any metric in build.METRICS")
                continue
            spec = known.get(family.name)
            if spec is None:
                problems.append(f"{family.name} is not in the catalog")
                continue
            if spec.kind != family.kind:
                problems.append(f"{family.name} is a {spec.kind} in the catalog")
            missing = set(family.labels) - set(spec.label_names)
            if missing:
                problems.append(f"{family.name} has no label(s) {sorted(missing)}")
        for name, matchers in _SELECTOR.findall(expr):
            family = build.metric_of(name)
            if family is None:
                continue
            allowed = {*catalog.DEPLOYMENT_LABELS, *_SCRAPE_LABELS, *family.labels}
            if name.endswith("_bucket"):
                allowed.add("le")
            for label in _MATCHERS.findall(matchers):
                if label not in allowed:
                    problems.append(f"{name} has no label {label!r}")
    return problems


def used_expressions() -> list[str]:
    d = committed_dashboard()
    exprs = [t["expr"] for p in panels(d) for t in p["targets"]]
    exprs += [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    rules = committed_rules()
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


def test_every_metric_used_is_in_the_catalog():
    """Every metric the dashboard and the rules query is exported by the catalog
    (cache or feature metrics; right kind, labels it has)."""
    assert metric_problems(used_expressions(), KNOWN) == []


def test_build_takes_every_name_kind_and_label_from_the_catalog():
    """build.METRICS is the catalog's families with the catalog's kinds and labels,
    and looking up a name the catalog does not export fails the build."""
    assert {m.name for m in build.METRICS} == set(KNOWN)
    for m in build.METRICS:
        spec = KNOWN[m.name]
        assert m.kind == spec.kind
        assert (*catalog.DEPLOYMENT_LABELS, *m.labels) == spec.label_names
    with pytest.raises(KeyError, match=r"not in hicache_existence\.exporters\.catalog"):
        build.family("querys")


def test_metric_check_rejects_unknown_names_and_labels():
    """A misspelt name, an unknown label and a family the catalog lacks are each
    reported."""
    exprs = [
        'rate(hicache_existence_querys_total{job=~"$job"}[5m])',
        'rate(hicache_existence_queries_total{poool="kv"}[5m])',
        'rate(hicache_existence_divergence_checks_total{job=~"$job"}[5m])',
    ]
    without = {k: v for k, v in KNOWN.items() if k != build.DIV_CHECKS.name}
    problems = "\n".join(metric_problems(exprs, without))
    assert "hicache_existence_querys_total is not a sample" in problems
    assert "hicache_existence_queries_total has no label 'poool'" in problems
    assert f"{build.DIV_CHECKS.name} is not in the catalog" in problems


def test_metric_check_rejects_a_wrong_kind_or_a_label_the_catalog_lacks():
    """A family declared with another kind, or with a label the catalog does not
    export, is reported (e.g. a histogram where the catalog has a counter)."""
    fake = dict(KNOWN)
    fake[build.DIV_SECONDS.name] = catalog.FEATURE_BY_NAME[build.REC_SECONDS.name]
    fake[build.ADVISOR.name] = catalog.FEATURE_BY_NAME[build.REC_CIRCUIT.name]
    problems = "\n".join(metric_problems(used_expressions(), fake))
    assert f"{build.DIV_SECONDS.name} is a histogram in the catalog" in problems
    assert f"{build.ADVISOR.name} has no label(s) ['cap_multiplier', 'pool']" in problems


def test_every_exported_family_is_on_the_dashboard():
    """Every family of the catalog is queried by some panel or rule (the generated
    "Every exported family" row guarantees a new metric its panel)."""
    used = {build.metric_of(n) for e in used_expressions() for n in build.names_in(e)}
    assert set(build.METRICS) <= used


def test_every_feature_metric_is_on_the_dashboard():
    """Each TP-divergence, reconciler and advisor family of the catalog has a panel
    (they exist to be watched; a new one needs a panel or a deliberate exclusion)."""
    d = committed_dashboard()
    on_dashboard = {
        family.name
        for p in panels(d)
        for t in p["targets"]
        for n in build.names_in(t["expr"])
        if (family := build.metric_of(n)) is not None
    }
    assert set(catalog.FEATURE_BY_NAME) - on_dashboard == set()


def test_label_values_the_expressions_rely_on_match_the_package():
    """Reconciler results split exactly into answered, failed and discarded;
    cap multipliers are the advisor's, ascending; the churn reason is a miss
    reason."""
    groups = (ANSWERED_RESULTS, FAILED_RESULTS, DISCARDED_RESULTS)
    assert sorted(v for g in groups for v in g) == sorted(RESULTS)
    assert groups[:2] == (build.ANSWERED_RESULTS, build.FAILED_RESULTS)
    multipliers = tuple(multiplier_label(m) for m in sorted(MULTIPLIERS))
    assert multipliers == build.CAP_MULTIPLIERS
    assert {build.CAP_NOW, build.CAP_DOUBLE} <= set(build.CAP_MULTIPLIERS)
    assert build.REASON_EVICTED in catalog.MISS_REASON_LABELS


def test_recommended_cap_tries_every_multiple_smallest_first():
    """The recommended-cap query has one term per cap multiple, ascending, so
    ``or`` keeps the smallest qualifying multiple."""
    expr = build.recommended(build.advisor_at)
    found = re.findall(r'cap_multiplier="([0-9.]+)"', expr)
    assert found == [m for m in build.CAP_MULTIPLIERS for _ in range(2)]
    assert expr.count("\nor\n") == len(build.CAP_MULTIPLIERS) - 1
    assert f"- {ADVICE_TOLERANCE})" in expr


def test_selector_rejects_a_label_the_metric_lacks():
    """build.selector() refuses a matcher on a label the family does not carry."""
    with pytest.raises(ValueError, match="has no label 'reason'"):
        build.selector(build.QUERIES, reason="evicted")


def test_runbooks_name_only_metrics_that_exist():
    """Every metric or recorded series docs/runbooks.md names is exported by the
    catalog or recorded by rules.yml (a runbook query must work)."""
    known = {spec.exposed_name for spec in catalog.CATALOG}
    for fspec in catalog.FEATURE_CATALOG:
        if fspec.kind == "histogram":
            known |= {fspec.name + suffix for suffix in ("_bucket", "_count", "_sum")}
        else:
            known.add(fspec.exposed_name)
    known |= {r["record"] for r in recording_rules(committed_rules())}
    named = build.names_in(RUNBOOKS.read_text(encoding="utf-8"))
    assert named, "the runbooks name no metric"
    assert named <= known, sorted(named - known)


def test_the_fill_panel_sums_every_pool_into_a_shared_caps_fill() -> None:
    """The pool variable narrows the pools shown, never the entries summed into a
    shared cap's fill (kv 600 + swa 400 of 1000 is full with only kv selected)."""
    import json

    dashboard = json.loads(build.DASHBOARD_PATH.read_text(encoding="utf-8"))
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Fill"]
    (target,) = panel["targets"]
    per_pool, shared = target["expr"].split("\nor\n")
    assert "$pool" in per_pool
    assert "$pool" not in shared.split("group_left ()", 1)[1]
