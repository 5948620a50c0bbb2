"""One place per fact: every exported family's help text and name are written once,
in their declaration (``core/stats.py`` for the cache families, declared beside
their counters; ``exporters/catalog.py`` for the rest), and the code that
exports, feeds or documents them takes them from the catalog.

Scope: the package's core/, accounting/, exporters/, replicas/, reconcile/ and
integrations/, config.py, logs.py and the docs generation (docs_tables.py).  The
doctor and ``dashboards/build.py`` are checked by the judgement table's own test.
Docstrings are prose and may name a family; every other string literal counts
(f-string parts included)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from hicache_existence.accounting.writes import PoolWriteStats
from hicache_existence.core.stats import PoolStats
from hicache_existence.exporters.catalog import CATALOG, FEATURE_CATALOG, PREFIX

PACKAGE = Path(__file__).resolve().parents[1] / "hicache_existence"
SCOPE = (
    "core",
    "accounting",
    "exporters",
    "replicas",
    "reconcile",
    "integrations",
    "config.py",
    "logs.py",
    "docs_tables.py",
)
#: Where the names and help texts are declared.
DECLARATIONS = ("core/stats.py", "exporters/catalog.py")
SPECS = (*CATALOG, *FEATURE_CATALOG)


def _files() -> Iterator[Path]:
    for entry in SCOPE:
        path = PACKAGE / entry
        yield from sorted(path.rglob("*.py")) if path.is_dir() else (path,)


def _literals(path: Path) -> Iterator[tuple[int, str]]:
    """(line, value) of every string literal of ``path`` but its docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


def _all_literals() -> list[tuple[str, int, str]]:
    return [
        (str(path.relative_to(PACKAGE)), line, value)
        for path in _files()
        for line, value in _literals(path)
    ]


def _field_names() -> set[str]:
    """Snapshot field names (a family may be named like the field it reads)."""
    names = {spec.field for spec in SPECS}
    for snapshot in (PoolStats, PoolWriteStats):
        names.update(snapshot.__dataclass_fields__)
    return names


def test_every_help_text_is_written_once():
    """Each family's help text occurs in exactly one string literal of the scope,
    its declaration (a copy in a comment-turned-literal, a docs generator or an
    exporter fails)."""
    literals = _all_literals()
    for spec in SPECS:
        where = [(path, line) for path, line, value in literals if spec.help in value]
        assert len(where) == 1, (spec.name, where)
        assert where[0][0] in DECLARATIONS, (spec.name, where)


def test_family_names_are_written_only_in_their_declaration():
    """No literal spells a family's exposed name (``hicache_existence_...``) or
    the bare prefix outside the catalog, and a family's own name (one that is not
    also a snapshot field's) occurs once, where it is declared: exporters,
    feeders and docs take names from the catalog's specs."""
    literals = _all_literals()
    short = {spec.name.removeprefix(PREFIX) for spec in SPECS}
    fields = _field_names()
    full = [
        (path, line, value)
        for path, line, value in literals
        if any(PREFIX + name in value for name in short)
        or (value == PREFIX and path != "exporters/catalog.py")
    ]
    assert full == []
    for name in sorted(short - fields):
        where = [(path, line) for path, line, value in literals if value == name]
        assert len(where) == 1, (name, where)
        assert where[0][0] in DECLARATIONS, (name, where)


def test_the_scan_sees_the_declarations():
    """The scan is not vacuous: it finds every declared help text and every
    declared family name in the declaration files."""
    literals = {value for path, _, value in _all_literals() if path in DECLARATIONS}
    assert all(any(spec.help in value for value in literals) for spec in SPECS)
    short = {spec.name.removeprefix(PREFIX) for spec in SPECS} - _field_names()
    assert short and short <= literals
