"""Build copies of the cache classes with the accounting removed.

The "accounting costs at most 5%" target needs a baseline that is our code minus
its counters, not a separately written class that could drift.  This module
parses ``counting.py`` (the counted lookups both generations share), ``cache.py``
and ``flat.py``, deletes every statement that only records accounting (augmented
assignments to counter attributes, the miss-counting call) and executes the
results as private modules, the stripped caches built on the stripped
``CountingPool``.  What remains is exactly the data path the shipped classes run.
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from typing import Any

from hicache_existence.core import cache as _cache_module
from hicache_existence.core import counting as _counting_module
from hicache_existence.core import flat as _flat_module

#: In import order: each imports the ones before it.
_MODULES = (_counting_module, _cache_module, _flat_module)

_COUNTER_ROOTS = {"c", "counters", "_counters"}


def _is_accounting(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.AugAssign):
        target: ast.expr = stmt.target
        if isinstance(target, ast.Attribute) and target.attr == "size":
            return True  # the flat cache's per-pool entry count
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            inner = target.value
            if isinstance(inner, ast.Attribute) and inner.attr in _COUNTER_ROOTS:
                return True
            if isinstance(inner, ast.Name) and inner.id in _COUNTER_ROOTS:
                return True
            target = inner
        return False
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        return isinstance(func, ast.Attribute) and func.attr == "_count_miss"
    return False


class _Strip(ast.NodeTransformer):
    def __init__(self, renamed: dict[str, str]) -> None:
        #: Modules whose stripped copies the stripped code imports instead.
        self.renamed = renamed

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.module in self.renamed:
            node.module = self.renamed[node.module]
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [s for s in body if not _is_accounting(s)]
                setattr(node, field, kept or [ast.Pass()])
        return node


def _strip_module(module: types.ModuleType, name: str, renamed: dict[str, str]) -> types.ModuleType:
    tree = _Strip(renamed).visit(ast.parse(inspect.getsource(module)))
    ast.fix_missing_locations(tree)
    out = types.ModuleType(name)
    out.__dict__["__name__"] = name
    sys.modules[name] = out  # the stripped modules after it import it by name
    exec(compile(tree, f"<{name}>", "exec"), out.__dict__)
    return out


def stripped_classes() -> dict[str, Any]:
    """``StorageExistenceCache`` and ``FlatStorageExistenceCache`` without accounting."""
    renamed: dict[str, str] = {}
    stripped = {}
    for module in _MODULES:
        private = f"hicache_existence._noacct_{module.__name__.rsplit('.', 1)[1]}"
        stripped[module.__name__] = _strip_module(module, private, renamed)
        renamed[module.__name__] = private
    cache_mod = stripped[_cache_module.__name__]
    flat_mod = stripped[_flat_module.__name__]
    return {
        "StorageExistenceCache": cache_mod.StorageExistenceCache,
        "FlatStorageExistenceCache": flat_mod.FlatStorageExistenceCache,
    }


def removed_statement_count() -> int:
    """How many statements the stripping removes (a guard that it removes any)."""
    count = 0
    for module in _MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            for field in ("body", "orelse", "finalbody"):
                body = getattr(node, field, None)
                if isinstance(body, list):
                    count += sum(1 for s in body if isinstance(s, ast.stmt) and _is_accounting(s))
    return count
