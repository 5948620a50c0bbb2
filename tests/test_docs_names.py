"""What the operator docs name exists, and their measured figures say where they
come from.

Checked over ``docs/*.md``, ``README.md``, ``benchmarks/README.md`` and
``integrations/*/README.md``:

* every metric name (``hicache_existence_*``) is a catalog family or one of its
  samples, every recording rule (``level:hicache_existence_...:ops``) is in
  ``integrations/prometheus/rules.yml``;
* every configuration key (`` `section.key` ``) and ``HICACHE_EXISTENCE_*``
  variable is a ``Config`` setting (or a documented non-setting variable);
* every ``hicache-existence`` command line in code names a real sub-command and
  only its real flags, and every sglang flag of the plugin is the plugin's;
* every alert name (``HicacheExistence*``) is an alert of the shipped rules;
* every repository path in code font exists (a test named with ``::`` too);
* the figure convention: a section (text under one heading) that states measured
  figures (durations, sizes per entry, MiB, overhead percentages, speed-ups)
  carries a line starting ``Command:`` or ``Record:`` naming where they come
  from, and what it names exists (a CLI command with its flags, a ``python``
  one-liner whose imports and attributes resolve, a file in the repository, a
  test function).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import yaml

import hicache_existence as he
from hicache_existence import config
from hicache_existence.cli import build_parser
from hicache_existence.exporters import catalog
from hicache_existence.integrations.sglang import flags as sglang_flags
from hicache_existence.reconcile.counters import ERROR_KINDS, RESULTS

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "README.md",
    REPO / "benchmarks" / "README.md",
    *sorted((REPO / "integrations").glob("*/README.md")),
]
RULES = REPO / "integrations" / "prometheus" / "rules.yml"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _texts() -> list[tuple[Path, str]]:
    return [(path, path.read_text(encoding="utf-8")) for path in DOCS]


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _code(text: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span and fenced code block line."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line))
        else:
            out.extend((number, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return out


# -- metric names --------------------------------------------------------------------
def _metric_names() -> set[str]:
    names: set[str] = set()
    for spec in (*catalog.CATALOG, *catalog.FEATURE_CATALOG):
        names |= {spec.name, spec.exposed_name}
        if spec.kind == "histogram":
            names |= {f"{spec.name}_{s}" for s in ("bucket", "sum", "count")}
    return names


def _rules() -> dict[str, set[str]]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {"record": set(), "alert": set()}
    for group in data["groups"]:
        for rule in group["rules"]:
            for kind in out:
                if kind in rule:
                    out[kind].add(rule[kind])
    return out


RECORD = re.compile(r"\b[a-z_]+:hicache_existence_[a-z0-9_]+:[a-z0-9_]+\b")
METRIC = re.compile(r"(?<![\w:.])hicache_existence_[a-z0-9_]+\b(?!:)")


def test_metric_and_recording_rule_names_exist() -> None:
    """Every hicache_existence_* metric name and level:...:ops recording rule in
    the docs is exported by the catalog / defined in rules.yml."""
    metrics, records = _metric_names(), _rules()["record"]
    assert "hicache_existence_reconciler_circuit_open" in metrics  # the scan reads the catalog
    wrong = []
    for path, text in _texts():
        for m in RECORD.finditer(text):
            if m.group(0) not in records:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: rule {m.group(0)}")
        for m in METRIC.finditer(RECORD.sub("", text)):
            if m.group(0) not in metrics and importlib.util.find_spec(m.group(0)) is None:
                wrong.append(f"{_rel(path)}: metric {m.group(0)}")
    assert not wrong, "names the catalog / rules do not have:\n" + "\n".join(wrong)


#: Metrics of other programs the docs quote (name -> whose).
EXTERNAL_METRICS = {
    "master_batch_put_start_items_total": "Mooncake master",
    "master_batch_put_start_failed_items_total": "Mooncake master",
}
#: A code span shaped like a sample or a selector: ``name_total`` or
#: ``name{label="value", ...}`` (the ``hicache_existence_`` prefix may be left out).
SELECTOR = re.compile(r"`([a-z][a-z0-9_]*)(\{[^`}]*\})?`")
#: Label values the exporters can produce, per (family without prefix, label).
LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("page_misses", "reason"): catalog.MISS_REASON_LABELS,
    ("reconciler_queries", "result"): RESULTS,
    ("reconciler_errors", "kind"): ERROR_KINDS,
    ("divergence_check_failures", "reason"): ("timeout", "error"),
}


def _families() -> dict[str, tuple[str, ...]]:
    """Family name without the prefix -> its label names."""
    out: dict[str, tuple[str, ...]] = {}
    for spec in catalog.CATALOG:
        out[spec.name.removeprefix(catalog.PREFIX)] = spec.label_names
    for fspec in catalog.FEATURE_CATALOG:
        out[fspec.name.removeprefix(catalog.PREFIX)] = fspec.label_names
    return out


def check_selector(name: str, selector: str | None) -> str | None:
    """Why a metric-shaped code span (``errors{kind="timeout"}``, ``x_total``)
    names no exported family with those labels and values (None: it does).
    A short name is read as a family's name or its last words."""
    if name in EXTERNAL_METRICS:
        return None
    short = name.removeprefix(catalog.PREFIX)
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        short = short.removesuffix(suffix)
    families = _families()
    candidates = [f for f in families if f == short or f.endswith("_" + short)]
    if not candidates:
        return f"no metric family {name}"
    matchers = re.findall(r'([a-z_]+)\s*(=~|!=|!~|=)?\s*(?:"([^"]*)")?', (selector or "")[1:-1])
    problems = []
    for family in candidates:
        problems = []
        for label, op, value in matchers:
            if label not in families[family]:
                problems.append(f"{family} has no label {label}")
                continue
            allowed = LABEL_VALUES.get((family, label))
            if allowed is None or op not in ("=", "=~") or not value:
                continue
            for v in value.split("|") if op == "=~" else [value]:
                if re.fullmatch(r"[a-z_+]+", v) and v not in allowed:
                    problems.append(f"{family}{{{label}}} is never {v!r}")
        if not problems:
            return None
    return "; ".join(problems)


def test_short_metric_names_and_selectors_exist() -> None:
    """Every metric-shaped code span, with or without the hicache_existence_
    prefix (`errors{kind="timeout"}`, `page_misses_total{reason}`,
    `x_total`), names an exported family that has those labels and can take
    those values (or a listed metric of another program), so a name the
    catalog never had cannot hide behind a left-out prefix."""
    wrong = []
    for path, text in _texts():
        for m in SELECTOR.finditer(text):
            name, selector = m.group(1), m.group(2)
            if not (selector or name.endswith("_total")) or "..." in (selector or ""):
                continue  # not metric-shaped, or a format (`name{label="value",...}`)
            problem = check_selector(name, selector)
            if problem:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: {m.group(0)}: {problem}")
    assert not wrong, "metric names or labels that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("name", "selector", "ok"),
    [
        ("errors", '{kind="ledger_empty"}', True),
        ("queries", '{result="void"}', True),
        ("page_misses_total", "{reason}", True),
        ("hicache_existence_reconciler_queries_total", '{result=~"error|timeout"}', True),
        ("ledger_pages_total", '{op="stored",result="error"}', False),
        ("errors", '{kind="nonsense"}', False),
        ("queries", '{op="x"}', False),
        ("page_inserts_total", None, True),
        ("page_insertions_total", None, False),
    ],
)
def test_the_selector_check_can_fail(name: str, selector: str | None, ok: bool) -> None:
    """The short-name check refuses a family, a label or a value that does not exist."""
    assert (check_selector(name, selector) is None) is ok, check_selector(name, selector)


# -- configuration -------------------------------------------------------------------
def _config_keys() -> tuple[set[str], set[str]]:
    sections, keys = set(), {"enabled"}
    defaults = config.Config()
    for top in fields(defaults):
        value = getattr(defaults, top.name)
        if is_dataclass(value):
            sections.add(top.name)
            keys |= {f"{top.name}.{f.name}" for f in fields(value)}
    return sections, keys


def test_config_keys_and_variables_exist() -> None:
    """Every `section.key` and HICACHE_EXISTENCE_* variable the docs write is a
    Config setting (the variable is accepted by Config.from_env), a variable the
    config module lists as a non-setting, or a public constant of the package."""
    sections, keys = _config_keys()
    key_re = re.compile(
        rf"`((?:{'|'.join(sorted(sections))})\.(?!(?:py|md|json|sh|yml|yaml)`)[a-z_]+)(?![\w(])"
    )  # not a file name (`reconciler.py`)
    wrong = []
    for path, text in _texts():
        for m in key_re.finditer(text):
            if m.group(1) not in keys:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: key {m.group(1)}")
        for m in re.finditer(r"\bHICACHE_EXISTENCE_[A-Z0-9_]*[A-Z0-9]\b(__\*?)?", text):
            name = m.group(0)
            where = f"{_rel(path)}:{_line_of(text, m.start())}"
            if name.endswith(("__", "__*")):  # a prefix: HICACHE_EXISTENCE_DIVERGENCE__*
                section = name[len(config.ENV_PREFIX) :].rstrip("*").rstrip("_").lower()
                if section not in sections:
                    wrong.append(f"{where}: variable prefix {name}")
                continue
            if name == config.ENV_CONFIG or name in config.ENV_NOT_SETTINGS:
                continue
            if name.startswith(config.ENV_NOT_SETTINGS_PREFIXES) or hasattr(he, name):
                continue
            try:
                config.Config.from_env({name: _any_value(name)})
            except config.ConfigError as exc:
                if "unknown configuration key" in str(exc):
                    wrong.append(f"{where}: variable {name}")
    assert not wrong, "settings that do not exist:\n" + "\n".join(wrong)


def _default_tables(text: str) -> list[tuple[int, list[tuple[int, str, str]]]]:
    """Markdown tables whose first two columns are ``key`` and ``default``:
    (first line, [(line, key cell, default cell)])."""
    tables: list[tuple[int, list[tuple[int, str, str]]]] = []
    rows: list[tuple[int, str, str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if len(cells) >= 2 and cells[0] == "key" and cells[1] == "default":
            rows = []
            tables.append((number, rows))
        elif rows is not None and cells and not set(cells[0]) <= set("-: "):
            rows.append((number, cells[0], cells[1]))
        elif not cells:
            rows = None
    return tables


def _same_default(shown: str, value: object) -> bool:
    text = shown.strip().strip("`").strip('"')
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(text.replace(",", "").replace("_", "")) == float(value)
        except ValueError:
            return False
    return text == value


def check_default_table(rows: list[tuple[int, str, str]]) -> list[str]:
    """Problems of one ``| key | default |`` table: every key (cells may list
    several as `` `a` / `b` `` with values ``1 / 2``) is a field of one
    ``Config`` section and shows that field's default."""
    keyed = [(n, re.findall(r"`([a-z_.]+)`", k), d.split(" / ")) for n, k, d in rows]
    names = {name.rsplit(".", 1)[-1] for _, ks, _ in keyed for name in ks}
    defaults = config.Config()
    owners = [
        top.name
        for top in fields(defaults)
        if is_dataclass(getattr(defaults, top.name))
        and names <= {f.name for f in fields(getattr(defaults, top.name))}
    ]
    if not owners:
        return [f"keys {sorted(names)} are not the fields of one configuration section"]
    section = getattr(defaults, owners[0])
    problems = []
    for number, ks, shown in keyed:
        if len(ks) != len(shown):
            problems.append(f"line {number}: {len(ks)} keys, {len(shown)} defaults")
            continue
        for key, value in zip(ks, shown):
            real = getattr(section, key.rsplit(".", 1)[-1])
            if not _same_default(value, real):
                where = f"line {number}: {owners[0]}.{key}"
                problems.append(f"{where} defaults to {real!r}, not {value}")
    return problems


def test_default_tables_show_the_config_defaults() -> None:
    """Every hand-written ``| key | default |`` table (reconciler budgets, advisor
    and divergence settings) shows the defaults ``Config`` really has."""
    wrong = []
    for path, text in _texts():
        for start, rows in _default_tables(text):
            wrong.extend(f"{_rel(path)}:{start}: {p}" for p in check_default_table(rows))
    assert not wrong, "defaults that are not Config's:\n" + "\n".join(wrong)


def test_the_recorder_table_lists_every_recorder_key() -> None:
    """docs/replay.md's recorder table (checked above for its defaults) has a row for
    every ``recorder`` setting, so a new one cannot be left out of it."""
    text = (REPO / "docs" / "replay.md").read_text(encoding="utf-8")
    tables = [
        {k for _, cell, _ in rows for k in re.findall(r"`recorder\.([a-z_]+)`", cell)}
        for _, rows in _default_tables(text)
    ]
    shown = next((keys for keys in tables if keys), set())
    assert shown == {f.name for f in fields(config.RecorderSection)}


def test_the_default_table_check_can_fail() -> None:
    """A wrong default, or a key of no section, is refused."""
    good = [(1, "`timeout_ms` / `connect_timeout_ms`", "50 / 50"), (2, "`method`", "`lua`")]
    assert check_default_table(good) == []
    assert check_default_table([(1, "`queue_size`", "512")]) == [
        "line 1: reconciler.queue_size defaults to 256, not 512"
    ]
    assert check_default_table([(1, "`no_such_key`", "1")]) != []


def _any_value(variable: str) -> str:
    """A text the variable's setting accepts, whatever its type (range errors
    are not unknown keys, so any text that parses will do)."""
    key = variable[len(config.ENV_PREFIX) :].lower().replace("__", ".")
    defaults = config.Config().to_dict()
    node: object = defaults
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, bool):
        return "1"
    if node is None or isinstance(node, dict):
        return "1"
    return str(node)


# -- CLI -----------------------------------------------------------------------------
def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def check_command(line: str) -> list[str]:
    """Problems of one ``hicache-existence ...`` command line (empty: none)."""
    top, subs = _parsers()
    text = line.strip().removeprefix("$ ").split(" #", 1)[0].replace("\\", " ")
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)  # VAR=value prefixes
    if not words or words[0] != "hicache-existence":
        return []
    words = words[1:]
    allowed = _flags(top)
    command = None
    problems = []
    for word in words:
        if word in ("--", "|", "&&", ";", ">", ">>", "2>&1"):
            break  # the rest belongs to another program (launch -- python -m sglang ...)
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            if flag not in allowed:
                problems.append(f"flag {flag} of {command or 'hicache-existence'}")
        elif command is None and re.fullmatch(r"[a-z][a-z-]*", word):
            if word not in subs:
                problems.append(f"sub-command {word}")
                break
            command = word
            allowed = _flags(subs[word]) | _flags(top)
    return problems


def test_cli_commands_and_flags_exist() -> None:
    """Every `hicache-existence ...` command line in code spans and blocks names
    a real sub-command and only flags it (or the top-level parser) accepts; every
    --enable-hicache-existence / --hicache-existence-* flag is the plugin's."""
    plugin_flags = {sglang_flags.ENABLE_FLAG, sglang_flags.CONFIG_FLAG}
    wrong = []
    for path, text in _texts():
        for number, code in _code(text):
            for m in re.finditer(r"--(?:enable-)?hicache-existence[a-z-]*", code):
                if m.group(0) not in plugin_flags:
                    wrong.append(f"{_rel(path)}:{number}: plugin flag {m.group(0)}")
            for part in re.split(r"\s(?:&&|\|\||;)\s", code):
                if "hicache-existence " in part:
                    start = part.index("hicache-existence ")
                    before = part[:start].strip().removeprefix("$").strip()
                    if before and not all("=" in w for w in before.split()):
                        continue  # e.g. `pip install hicache-existence ...`
                    for problem in check_command(part[start:]):
                        wrong.append(f"{_rel(path)}:{number}: {problem}")
    assert not wrong, "CLI names that do not exist:\n" + "\n".join(wrong)


def test_the_cli_check_can_fail() -> None:
    """The command check rejects an unknown sub-command and an unknown flag."""
    assert check_command("hicache-existence replay TRACE --caps 16K") == []
    assert check_command("hicache-existence replai TRACE") == ["sub-command replai"]
    assert check_command("$ hicache-existence bench --suite digest --fast") == [
        "flag --fast of bench"
    ]


def _script_defaults(script: Path) -> dict[str, str]:
    """``--flag`` -> its argparse default as written (``add_argument`` calls of a script)."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        for flag in flags:
            if isinstance(flag, str) and flag.startswith("--"):
                out[flag] = ast.unparse(default) if default is not None else "None"
    return out


def check_usage(line: str) -> list[str]:
    """Problems of a usage line's optional arguments shown with a value,
    ``[--rounds 6]``: the flag must exist and the value be its default (a
    ``hicache-existence`` command's or a ``python script.py``'s)."""
    shown = re.findall(r"\[(--[a-z][a-z-]*)[ =]([^\]\s|]+)\]", line)
    if not shown:
        return []
    words = line.strip().removeprefix("$ ").split()
    defaults: dict[str, str] = {}
    if words[:1] == ["hicache-existence"]:
        top, subs = _parsers()
        sub = subs.get(words[1]) if len(words) > 1 else None
        for parser in (top, *([sub] if sub else [])):
            for action in parser._actions:
                for flag in action.option_strings:
                    defaults[flag] = str(action.default).replace("_", "")
    elif len(words) > 1 and words[0] == "python" and (REPO / words[1]).is_file():
        defaults = {k: v.replace("_", "") for k, v in _script_defaults(REPO / words[1]).items()}
    else:
        return []
    problems = []
    for flag, value in shown:
        if flag not in defaults:
            problems.append(f"{flag} is not a flag of {words[0]} {words[1]}")
        elif not re.fullmatch(r"[\d.]+", value):
            continue  # a placeholder (N, PATH), not a default
        elif defaults[flag] != value:
            problems.append(f"{flag} defaults to {defaults[flag]}, not {value}")
    return problems


def test_usage_lines_show_the_real_defaults() -> None:
    """A usage line that shows an optional argument with a number (`[--rounds 6]`)
    shows that argument's real default."""
    wrong = []
    for path, text in _texts():
        for number, code in _code(text):
            for problem in check_usage(code):
                wrong.append(f"{_rel(path)}:{number}: {problem}")
    assert not wrong, "usage lines that show the wrong default:\n" + "\n".join(wrong)


def test_the_usage_check_can_fail() -> None:
    """A wrong default or a missing flag in a usage line is refused."""
    assert check_usage("python benchmarks/real_server_cost.py [--rounds 6] [--json]") == []
    assert check_usage("python benchmarks/real_server_cost.py [--rounds 7]") == [
        "--rounds defaults to 6, not 7"
    ]
    assert check_usage("python benchmarks/real_server_cost.py [--laps 7]") == [
        "--laps is not a flag of python benchmarks/real_server_cost.py"
    ]


# -- alerts --------------------------------------------------------------------------
def test_alert_names_and_runbook_anchors_exist() -> None:
    """Every HicacheExistence* alert name, and every runbook anchor
    #hicacheexistence..., is an alert of integrations/prometheus/rules.yml."""
    alerts = _rules()["alert"]
    anchors = {a.lower() for a in alerts}
    wrong = []
    for path, text in _texts():
        for m in re.finditer(r"\bHicacheExistence[A-Za-z0-9]+\b", text):
            if m.group(0) not in alerts:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: alert {m.group(0)}")
        for m in re.finditer(r"#(hicacheexistence[a-z0-9]+)", text):
            if m.group(1) not in anchors:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: anchor {m.group(1)}")
    assert not wrong, "alerts that do not exist:\n" + "\n".join(wrong)


# -- repository paths ----------------------------------------------------------------
REPO_PATH = re.compile(
    r"`((?:hicache_existence|tests|docs|benchmarks|integrations|dashboards)/[^`\s]*)`"
)


def test_repository_paths_exist() -> None:
    """Every repository path written in code font (`hicache_existence/core/lru.py`,
    `tests/test_x.py::test_y`, `benchmarks/results/x.json`) exists, so a moved
    module or a renamed test cannot leave the docs pointing at nothing."""
    wrong = []
    for path, text in _texts():
        for m in REPO_PATH.finditer(text):
            ref = m.group(1).rstrip(",;:")
            if "*" in ref or "<" in ref:
                continue  # a pattern or a placeholder
            problem = check_reference(ref)
            if problem:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: {problem}")
    assert not wrong, "paths that do not exist:\n" + "\n".join(wrong)


# -- links ---------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, code marks and punctuation
    dropped (hyphens and underscores kept), spaces to hyphens."""
    text = heading.strip().lstrip("#").strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            base = slug(line)
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def test_links_and_their_anchors_exist() -> None:
    """Every relative markdown link names a file of the repository, and its
    #anchor (or an in-page one) a heading of that file."""
    wrong = []
    for path, text in _texts():
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            where = f"{_rel(path)}:{_line_of(text, m.start())}"
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                wrong.append(f"{where}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                wrong.append(f"{where}: {target}: no heading with that anchor")
    assert not wrong, "links to nothing:\n" + "\n".join(wrong)


def test_the_anchor_rule_is_githubs() -> None:
    """Headings turn into the anchors GitHub gives them."""
    assert slug("## 6. Configuration reference") == "6-configuration-reference"
    assert slug("### Two prefill servers sharing one L3 (measured)") == (
        "two-prefill-servers-sharing-one-l3-measured"
    )
    assert slug("## `divergence.enabled` and the handshake") == (
        "divergenceenabled-and-the-handshake"
    )


#: `NAME` (`path`), `NAME` in `path`: a name said to be defined in a repository file.
NAME_IN_FILE = re.compile(
    r"`([A-Za-z_][\w.]*)(?:\(\))?`(?:\s*\(| in )"
    r"`((?:hicache_existence|tests|docs|benchmarks|integrations|dashboards)/[^`\s]+)`"
)


def test_names_said_to_be_in_a_file_are_there() -> None:
    """`Settings.runbook_url` in `dashboards/build.py`, `NAME` (`path`): every part
    of the name occurs in that file, so a constant or class the docs send a
    reader to cannot be one that was removed or never existed."""
    wrong = []
    for path, text in _texts():
        for m in NAME_IN_FILE.finditer(text):
            name, ref = m.group(1), m.group(2).split("::", 1)[0]
            target = REPO / ref
            if not target.is_file():
                continue  # test_repository_paths_exist reports it
            content = target.read_text(encoding="utf-8")
            missing = [part for part in name.split(".") if part not in content]
            if missing:
                wrong.append(f"{_rel(path)}:{_line_of(text, m.start())}: {name} not in {ref}")
    assert not wrong, "names their file does not have:\n" + "\n".join(wrong)


# -- figures -------------------------------------------------------------------------
#: A measured figure: a duration, a size, bytes per entry, a rate, a signed
#: overhead percentage, or a speed-up.
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?"
    r"(?:ns|µs|us|ms|MiB|KiB|GiB|MB|GB|B per entry|B/entry|refs/s|pages/s)\b"
    r"|(?<![\w.])[+\u2212-]\d+(?:\.\d+)?\s?%"  # + or - (or a minus sign) before a percentage
    r"|(?<![\w.])\d+(?:\.\d+)?x (?:faster|slower|hot|spread)\b"
)
SOURCE = re.compile(r"^\s*(?:[-*] )?(Command|Record)s?:(.*)$")


def _sections(text: str) -> list[tuple[int, str, str]]:
    """(first line, heading, body) per heading; fenced blocks never split one."""
    out: list[tuple[int, str, str]] = []
    heading, start, body, fenced = "(top)", 1, [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            out.append((start, heading, "\n".join(body)))
            heading, start, body = line.strip(), number, []
        else:
            body.append(line)
    out.append((start, heading, "\n".join(body)))
    return out


def _is_reference(span: str) -> bool:
    """A command (``hicache-existence ...``, ``python ...``, optionally after
    ``VAR=value``) or a repository path (``a/b.json``, ``tests/x.py::test``)."""
    words = [w for w in span.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    if not words:
        return False
    return words[0] in ("hicache-existence", "python", "$") or ("/" in words[0] and len(words) == 1)


def _sources(body: str) -> list[tuple[str, list[str]]]:
    """(reference, the backticked names after it on its line) for each reference
    on a section's Command:/Record: lines (a fenced block right after a bare
    ``Command:`` line counts as its reference); several references on one line,
    or several such lines, are all checked.  A label without a reference gives
    ("", [])."""
    refs: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    for i, line in enumerate(lines):
        m = SOURCE.match(line)
        if not m:
            continue
        found: list[tuple[str, list[str]]] = []
        for span in re.findall(r"`([^`]+)`", m.group(2)):
            if _is_reference(span):
                found.append((span, []))
            elif found:
                found[-1][1].append(span)
        rest = [x for x in lines[i + 1 :] if x.strip()]
        if not found and not m.group(2).strip() and rest and rest[0].lstrip().startswith("```"):
            for follow in rest[1:]:
                if follow.lstrip().startswith("```"):
                    break
                found.append((follow.split(" #", 1)[0].strip(), []))
        refs.extend(found or [("", [])])
    return refs


def check_reference(ref: str, names: list[str] | None = None) -> str | None:
    """Why ``ref`` does not name an existing command, record or test (None: it
    does); ``names`` written after a file reference must occur in that file (a
    JSON record's keys, a module's constants)."""
    text = ref.strip().removeprefix("$ ")
    words = text.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    text = " ".join(words)
    if not text:
        return "no reference"
    if text.startswith("hicache-existence"):
        problems = check_command(text)
        return "; ".join(problems) if problems else None
    if text.startswith("python"):
        return _check_python(text)
    path, _, test = text.partition("::")
    target = REPO / path
    if not target.exists():
        return f"{path} does not exist"
    if test:
        functions = {
            n.name
            for n in ast.walk(ast.parse(target.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef)
        }
        if test.split("[", 1)[0] not in functions:
            return f"{path} has no {test}"
    if target.is_file():
        content = target.read_text(encoding="utf-8")
        for name in names or ():
            if not re.fullmatch(r"[A-Za-z_]\w*(\(\))?", name):
                continue  # prose in code font (a key path, a flag), not a name of the file
            if name.rstrip("()") not in content:
                return f"{path} has no {name}"
    return None


def _check_python(text: str) -> str | None:
    words = shlex.split(text)
    if len(words) >= 3 and words[1] == "-c":
        return _check_snippet(words[2])
    if len(words) >= 3 and words[1] == "-m":
        module = words[2]
        return None if importlib.util.find_spec(module) else f"no module {module}"
    if len(words) >= 2:
        return None if (REPO / words[1]).is_file() else f"{words[1]} does not exist"
    return "incomplete python command"


def _check_snippet(code: str) -> str | None:
    """Imports resolve and every ``alias.attribute`` read from an imported module exists."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return f"not Python: {exc}"
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or alias.name.split(".")[0]] = module
            elif isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    bound[alias.asname or alias.name] = value
        except ImportError as exc:
            return f"cannot import: {exc}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = bound.get(node.value.id)
            if owner is not None and not hasattr(owner, node.attr):
                return f"{node.value.id}.{node.attr} does not exist"
    return None


def test_figures_name_their_source() -> None:
    """Every section stating measured figures has a Command:/Record: line, and
    every reference on such a line names something that exists."""
    wrong = []
    for path, text in _texts():
        for start, heading, body in _sections(text):
            refs = _sources(body)
            where = f"{_rel(path)}:{start} {heading[:60]!r}"
            if FIGURE.search(body) and not refs:
                figures = sorted({m.group(0) for m in FIGURE.finditer(body)})[:5]
                wrong.append(f"{where}: figures {figures} without a Command:/Record: line")
            for ref, names in refs:
                problem = check_reference(ref, names)
                if problem:
                    wrong.append(f"{where}: {ref[:80]!r}: {problem}")
    assert not wrong, "figures without a checkable source:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("ref", "ok"),
    [
        ("hicache-existence bench --suite digest", True),
        ("hicache-existence bench --suite digest --nope", False),
        ("benchmarks/results/digest.json", True),
        ("benchmarks/results/none.json", False),
        ("tests/test_ghosts.py::test_memory_is_at_most_ten_percent_of_the_cache_at_full_cap", True),
        ("tests/test_ghosts.py::test_missing", False),
        ('python -c "from hicache_existence_bench import digest as d; print(d.run_digest)"', True),
        ('python -c "from hicache_existence_bench import digest as d; print(d.nothing())"', False),
        ("python -m hicache_existence_bench.digest", True),
        ("python -m hicache_existence_bench.nothing", False),
    ],
)
def test_the_reference_check_can_fail(ref: str, ok: bool) -> None:
    """A reference to a missing command, flag, file, test, function or module is refused."""
    assert (check_reference(ref) is None) is ok, check_reference(ref)


def test_names_after_a_record_must_be_in_it() -> None:
    """`Record: `x.json` (`key`)`: the key must occur in the record."""
    assert check_reference("benchmarks/results/digest.json", ["check_costs_us"]) is None
    assert check_reference("benchmarks/results/digest.json", ["no_such_key"]) is not None
