"""What the operator docs name exists, and their measured figures say where they
come from.

Checked over ``docs/*.md``, ``README.md`` and ``integrations/*/README.md``:

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

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "README.md",
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
    key_re = re.compile(rf"`((?:{'|'.join(sorted(sections))})\.[a-z_]+)(?![\w(])")
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
