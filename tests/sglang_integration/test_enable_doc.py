"""docs/enable.md's configuration reference is generated from ``Config``'s
dataclasses (types, defaults and the ``#:`` comments above each field), so a new
or renamed key cannot go undocumented.

    python dashboards/build.py          # regenerates it (with every other generated file)
"""

from __future__ import annotations

import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "enable.md"
BEGIN, END = "<!-- config:begin -->", "<!-- config:end -->"

sys.path.insert(0, str(REPO))

from hicache_existence.config import Config  # noqa: E402
from hicache_existence.docs_tables import config_table  # noqa: E402


def _current() -> str:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def test_config_reference_matches_the_dataclasses() -> None:
    """The table in docs/enable.md lists every key of Config with its type,
    default, variable and comment (regenerate: python dashboards/build.py)."""
    assert _current() == config_table(), (
        "docs/enable.md's configuration table is stale: python dashboards/build.py"
    )


def _doc_rows() -> dict[str, tuple[str, str]]:
    """``section.key`` -> (default cell, environment variable) as written in the doc."""
    rows: dict[str, tuple[str, str]] = {}
    for line in _current().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        key = cells[0].strip("`")
        if key.startswith("**") or not key:
            continue
        rows[key] = (cells[2].strip("`"), cells[3].strip("`"))
    return rows


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


#: Values a key accepts that differ from its default, where the generic rule
#: (flip, +1, half, another literal) would not do.
OTHER = {"reconciler.redis_url": "redis://localhost:6379/0", "logging.level": "debug"}


def _other_value(key: str, default: Any) -> Any:
    if key in OTHER:
        return OTHER[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    hint = _hint_of(key)
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in typing.get_args(hint) if a != default)
    return default + "x"


def _hint_of(key: str) -> Any:
    section, name = key.split(".")
    return typing.get_type_hints(type(getattr(Config(), section)))[name]


def test_the_documented_table_matches_what_config_does() -> None:
    """Read back from docs/enable.md (not regenerated): the keys are exactly
    Config's, each documented default is the real default, and each documented
    variable, set to another value, changes exactly that key."""
    rows = _doc_rows()
    actual = _flat(Config().to_dict())
    assert set(rows) == set(actual)
    for key, (default_cell, variable) in rows.items():
        assert json.loads(default_cell) == actual[key], (key, default_cell)
        value = _other_value(key, actual[key])
        text = json.dumps(value) if not isinstance(value, str) else value
        changed = _flat(Config.from_env({variable: text}).to_dict())
        assert changed[key] == value, (key, variable, changed[key])
        assert {k for k in actual if changed[k] != actual[k]} == {key}, (key, variable)
