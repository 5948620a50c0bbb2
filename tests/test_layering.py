"""Imports point one way: core <- accounting <- exporters/features <- integration.

Walks every module of the package with ``ast`` and fails on an import that goes
up a layer, on a module nobody placed in a layer, on a heavy third-party
import outside the module allowed to make it, and on an import cycle between
the package's modules (at import time, or through lazy imports).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hicache_existence"

#: Layer of each module (dotted, relative to the package); a prefix ending in
#: "." covers a whole sub-package.
LAYERS: dict[str, int] = {
    "_version": 0,
    # core: the beliefs and their built-in counters (nothing above, no third party)
    "core._validate": 0,
    "core.stats": 0,
    "core.observers": 0,
    "core.protocol": 0,  # the one interface both generations offer
    "core.lru": 0,
    "core._lru": 0,  # the compiled index (hicache_existence/core/_lru.c)
    "core.sampler": 0,
    "core.counting": 1,  # the counting walk both generations' pools share
    "core.cache": 1,
    "core.flat": 1,
    "core.policies": 1,
    "core.": 1,
    "config": 1,
    "logs": 1,  # event names and the library logger (configured by applications)
    # accounting built on the core's extension points
    "accounting.": 2,
    # replicas, ground truth, exporters, replay: read the core and accounting
    "replicas.": 3,
    "reconcile.": 3,
    "exporters.": 3,
    "replay.": 3,
    "doctor.": 3,  # the doctor's parser, diagnosis and HTTP reads (reads the catalog)
    "events.": 3,  # storage-tier KV events: read the write path's acks and the verdicts
    # wiring: one process's runtime and the integrations that build it
    "runtime": 4,
    "integrations.": 4,
    "demo.": 4,
    # the command line
    "commands.": 5,
    "cli": 5,
    "__main__": 5,
    "docs_tables": 5,  # docs tables, read by dashboards/build.py
    "__init__": 6,
}

#: Heavy third-party top-level packages and the modules that may import them.
ALLOWED_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "redis": ("reconcile.",),
    "fakeredis": (),
    "sglang": ("integrations.", "reconcile.storage_adapters"),
    "torch": ("replicas.divergence", "reconcile.agreement", "integrations.", "demo."),
    "prometheus_client": ("exporters.", "integrations.", "demo."),
    "opentelemetry": ("exporters.",),
    "structlog": ("logs", "cli"),
    # The benchmark suites live beside the package (benchmarks/), outside the
    # runtime import path: only the `bench` command reaches them.
    "hicache_existence_bench": ("commands.bench",),
    "matplotlib": ("replay.",),
    "zmq": ("events.zmq_sink",),
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
            name = ".".join(parts) + "."  # a sub-package's __init__
        else:
            name = ".".join(parts)
        out.append((name, path))
    return out


def _layer(name: str) -> int | None:
    if name in LAYERS:
        return LAYERS[name]
    for key, layer in LAYERS.items():
        if key.endswith(".") and (name == key or name.startswith(key)):
            return layer
    return None


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: the module body and
    the blocks inside it (``if``, ``try``, ``with``, class bodies), not function
    bodies (lazy imports) nor ``if TYPE_CHECKING:`` blocks (never run)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _import_time_nodes(stmt.orelse)
            continue
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _import_time_nodes(inner)
        for handler in getattr(stmt, "handlers", ()):
            yield from _import_time_nodes(handler.body)


def _imports(path: Path, *, import_time_only: bool = False) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    nodes = _import_time_nodes(tree.body) if import_time_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hicache_existence" or node.module.startswith("hicache_existence."):
                # ``from hicache_existence.core import lru`` imports the module
                # ``core.lru``; ``from hicache_existence import Name`` the root.
                base = PACKAGE.joinpath(*node.module.split(".")[1:])
                for alias in node.names:
                    sub = base / alias.name
                    if sub.with_suffix(".py").is_file() or sub.is_dir():
                        found.append((f"{node.module}.{alias.name}", node.lineno))
                    elif node.module == "hicache_existence":
                        found.append(("hicache_existence.__init__", node.lineno))
                    else:
                        found.append((node.module, node.lineno))
            else:
                found.append((node.module, node.lineno))
    return found


def _internal_target(dotted: str) -> str | None:
    if dotted in ("hicache_existence", "hicache_existence.__init__"):
        return "__init__"
    if not dotted.startswith("hicache_existence."):
        return None
    rest = dotted[len("hicache_existence.") :]
    if _layer(rest) is not None:
        return rest
    if _layer(rest + ".") is not None:
        return rest + "."
    return rest


MODULES = _modules()


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_module_is_placed_in_a_layer(name: str, path: Path) -> None:
    """Every module of the package is assigned a layer."""
    assert _layer(name) is not None, f"{name} ({path}) has no layer in tests/test_layering.py"


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_never_point_up(name: str, path: Path) -> None:
    """A module imports only from its own layer or below."""
    mine = _layer(name)
    if mine is None:
        pytest.fail(f"{name} has no layer")
    for dotted, lineno in _imports(path):
        target = _internal_target(dotted)
        if target is None:
            continue
        theirs = _layer(target)
        assert theirs is not None, f"{name}:{lineno} imports unplaced module {dotted}"
        assert theirs <= mine, (
            f"{name} (layer {mine}) imports {dotted} (layer {theirs}) at line {lineno}"
        )


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_heavy_dependencies_stay_in_their_modules(name: str, path: Path) -> None:
    """redis, sglang, torch, prometheus_client, OpenTelemetry, structlog and
    matplotlib are imported only by the modules whose job is to use them."""
    for dotted, lineno in _imports(path):
        top = dotted.split(".")[0]
        allowed = ALLOWED_THIRD_PARTY.get(top)
        if allowed is None:
            continue
        ok = any(name == a or (a.endswith(".") and name.startswith(a)) for a in allowed)
        assert ok, f"{name}:{lineno} imports {top}, allowed only in {allowed}"


def _import_graph(*, import_time_only: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES:
        targets = {
            _internal_target(d) for d, _ in _imports(path, import_time_only=import_time_only)
        }
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each
    sorted: every import cycle lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_cycles_and_only_cycles() -> None:
    """The cycle finder reports a two-module and a three-module cycle and
    nothing of an acyclic chain beside them."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "x": {"y"}, "y": {"z"}, "z": {"x"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["x", "y", "z"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("import_time_only", [True, False], ids=["import-time", "lazy-too"])
def test_no_import_cycle_between_the_package_modules(import_time_only: bool) -> None:
    """No two modules of the package import each other, directly or through
    others: at import time (a cycle makes import order decide what exists), nor
    through lazy imports inside functions (one that dodges a cycle hides a tangle,
    as ``redis_truth`` importing ``redis_cluster``, which imports it, did)."""
    assert _cycles(_import_graph(import_time_only=import_time_only)) == []
