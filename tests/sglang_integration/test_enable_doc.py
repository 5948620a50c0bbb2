"""docs/enable.md's configuration reference is generated from ``Config``'s
dataclasses (types, defaults and the ``#:`` comments above each field), so a new
or renamed key cannot go undocumented.

    python dashboards/build.py          # regenerates it (with every other generated file)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "enable.md"
BEGIN, END = "<!-- config:begin -->", "<!-- config:end -->"

sys.path.insert(0, str(REPO))

from hicache_existence.config import Config  # noqa: E402
from hicache_existence.reference import config_table  # noqa: E402


def _current() -> str:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def test_config_reference_matches_the_dataclasses() -> None:
    """The table in docs/enable.md lists every key of Config with its type,
    default, variable and comment (regenerate: python dashboards/build.py)."""
    assert _current() == config_table(), (
        "docs/enable.md's configuration table is stale: "
        "python dashboards/build.py"
    )


def test_every_key_is_in_the_table() -> None:
    """Every section.key of a default Config appears in the table."""
    table = config_table()
    for section, values in Config().to_dict().items():
        if isinstance(values, dict):
            for key in values:
                assert f"`{section}.{key}`" in table
