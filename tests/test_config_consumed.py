"""No configuration field is decorative: each one is read by runtime code.

An AST scan over the package (``config.py`` itself and the demo excluded; the
benchmarks live outside it) finds, per section, the expressions holding it: an
attribute ``<anything>.<section>`` (``config.reconciler``), a variable or
``self`` attribute assigned from one, or a parameter annotated with the section's
class.  A field counts as consumed when one of those is read as
``<holder>.<field>``.  ``Config.enabled`` is read as ``<config>.enabled`` where
the holder is a ``Config``.  The behavioural tests of each feature check what the
values do; this check catches a field nobody reads at all.
"""

from __future__ import annotations

import ast
from dataclasses import fields, is_dataclass
from pathlib import Path

from hicache_existence import config

PACKAGE = Path(config.__file__).resolve().parent
#: Not runtime code: the configuration itself, benchmarks, the demo's scripts.
EXCLUDED = {PACKAGE / "config.py"}
EXCLUDED_DIRS = {PACKAGE / "demo"}


def _sections() -> dict[str, tuple[str, set[str]]]:
    """section attribute name -> (its dataclass name, its field names)."""
    out = {}
    defaults = config.Config()
    for top in fields(defaults):
        value = getattr(defaults, top.name)
        if is_dataclass(value):
            out[top.name] = (type(value).__name__, {f.name for f in fields(value)})
    return out


def _runtime_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in EXCLUDED and not any(d in path.parents for d in EXCLUDED_DIRS)
    ]


def _annotation_text(node: ast.expr | None) -> str:
    return ast.unparse(node) if node is not None else ""


def reads(source: str) -> dict[str, set[str]]:
    """section -> fields read in ``source`` through an expression holding that section."""
    sections = _sections()
    by_class = {cls: name for name, (cls, _) in sections.items()}
    tree = ast.parse(source)
    # Pass 1: what holds a section (names and self attributes).
    holders: dict[str, str] = {}  # "name" or "self.attr" -> section
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                text = _annotation_text(arg.annotation)
                for cls, name in by_class.items():
                    if cls in text:
                        holders[arg.arg] = name
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            section = None
            if isinstance(value, ast.Attribute) and value.attr in sections:
                section = value.attr
            elif isinstance(value, ast.Name) and value.id in holders:
                section = holders[value.id]
            if isinstance(node, ast.AnnAssign):
                text = _annotation_text(node.annotation)
                section = section or next((n for c, n in by_class.items() if c in text), None)
            if section is None:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    holders[target.id] = section
                elif isinstance(target, ast.Attribute):
                    holders[ast.unparse(target)] = section
    # Pass 2: reads of <holder>.<field>.
    out: dict[str, set[str]] = {name: set() for name in sections}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        value = node.value
        section = None
        if isinstance(value, ast.Attribute) and value.attr in sections:
            section = value.attr
        elif ast.unparse(value) in holders:
            section = holders[ast.unparse(value)]
        if section is not None and node.attr in sections[section][1]:
            out[section].add(node.attr)
    return out


def test_every_configuration_field_is_read_by_runtime_code() -> None:
    """Each field of each Config section is read somewhere in the package's
    runtime code (not only in config.py, a benchmark or the demo), and
    Config.enabled is read too."""
    sections = _sections()
    seen: dict[str, set[str]] = {name: set() for name in sections}
    enabled_read = False
    for path in _runtime_modules():
        source = path.read_text(encoding="utf-8")
        for section, names in reads(source).items():
            seen[section] |= names
        enabled_read = enabled_read or any(
            isinstance(n, ast.Attribute)
            and n.attr == "enabled"
            and isinstance(n.value, ast.Name)
            and n.value.id in ("config", "cfg")
            for n in ast.walk(ast.parse(source))
        )
    unread = sorted(
        f"{section}.{name}"
        for section, (_, names) in sections.items()
        for name in names - seen[section]
    )
    assert not unread, f"configuration fields no runtime code reads: {unread}"
    assert enabled_read, "Config.enabled is read by no runtime code"


def test_the_scan_finds_reads_and_misses_decoys() -> None:
    """The scan credits reads through a section attribute, a variable, a self
    attribute and an annotated parameter, and nothing else (so it can fail)."""
    source = """
def a(config):
    return config.reconciler.timeout_ms

def b(section: ReconcilerSection):
    return section.retries

class C:
    def __init__(self, config):
        self._div = config.divergence
    def f(self):
        return self._div.policy

def d(other):
    return other.connect_timeout_ms, other.namespace  # not known to be a section
"""
    got = reads(source)
    assert got["reconciler"] == {"timeout_ms", "retries"}
    assert got["divergence"] == {"policy"}
