"""Whether our existence cache serves everything the installed upstream's does.

A public method a new sglang adds to its existence cache (or to the per-pool
beliefs ``pool()`` hands out) would raise ``AttributeError`` on our replacement.
So the REPLACE is registered only when, checked at start against the installed
wheel, ours serves every public name of upstream's classes and instances, each
callable accepting every parameter upstream's accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache

#: The probe instances' cap (tiny: the check builds one of each at start).
_PROBE_ENTRIES = 8


def ours_for(generation: str) -> type:
    """Our class that serves ``generation``'s API."""
    return StorageExistenceCache if generation == "current" else FlatStorageExistenceCache


def gaps(generation: str, upstream: type, ours: type | None = None) -> list[str]:
    """What upstream's existence cache has that ours lacks, as ``Class.name`` (or
    ``Class.name(param)``); empty when ours serves all of it."""
    mine = ours if ours is not None else ours_for(generation)
    theirs_obj = _probe(upstream)
    mine_obj = _probe(mine)
    if theirs_obj is None:  # upstream's cannot be built without arguments: compare classes
        return list(_missing(upstream.__name__, upstream, mine))
    if mine_obj is None:
        return [f"{mine.__name__}(max_entries=...)"]
    found = list(_missing(upstream.__name__, theirs_obj, mine_obj))
    if generation == "current" and not found:
        try:
            theirs_pool, mine_pool = theirs_obj.pool("kv"), mine_obj.pool("kv")
        except Exception as exc:  # upstream's pool() changed: that is a gap too
            return [f"{upstream.__name__}.pool('kv') ({type(exc).__name__})"]
        found.extend(_missing(type(theirs_pool).__name__, theirs_pool, mine_pool))
    return found


def _probe(cls: type) -> Any:
    try:
        return cls(max_entries=_PROBE_ENTRIES)
    except Exception:
        return None


def _missing(label: str, theirs: object, mine: object) -> Iterator[str]:
    for name in sorted(n for n in dir(theirs) if not n.startswith("_")):
        if not hasattr(mine, name):
            yield f"{label}.{name}"
            continue
        want, have = getattr(theirs, name, None), getattr(mine, name, None)
        if callable(want) and not isinstance(want, type):
            if not callable(have):
                yield f"{label}.{name} (not callable here)"
                continue
            for param in _unaccepted(want, have):
                yield f"{label}.{name}({param})"


def _unaccepted(want: Any, have: Any) -> Iterator[str]:
    """Parameters a call shaped for ``want`` may pass that ``have`` cannot take."""
    try:
        theirs = inspect.signature(want).parameters
        mine = inspect.signature(have).parameters
    except (TypeError, ValueError):
        return
    kinds = inspect.Parameter
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    mine_positional = [p for p in mine.values() if p.kind in positional]
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in mine.values())
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in mine.values())

    def by_name(name: str) -> bool:
        q = mine.get(name)
        return var_keyword or (q is not None and q.kind is not kinds.POSITIONAL_ONLY)

    for i, p in enumerate(theirs.values()):  # positional parameters come first
        if p.kind in positional:
            ok_by_position = i < len(mine_positional) or var_positional
            if not (ok_by_position and (p.kind is kinds.POSITIONAL_ONLY or by_name(p.name))):
                yield p.name
        elif p.kind is kinds.KEYWORD_ONLY and not by_name(p.name):
            yield p.name
        elif p.kind is kinds.VAR_POSITIONAL and not var_positional:
            yield f"*{p.name}"
        elif p.kind is kinds.VAR_KEYWORD and not var_keyword:
            yield f"**{p.name}"
    takes_any = any(q.kind is kinds.VAR_POSITIONAL for q in theirs.values())
    for p in mine.values():  # ours must not require what upstream's callers never pass
        required = p.default is p.empty and p.kind in (*positional, kinds.KEYWORD_ONLY)
        if required and p.name not in theirs and not (p.kind in positional and takes_any):
            yield f"{p.name} (required here only)"
