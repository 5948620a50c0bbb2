"""The metric catalog: naming conventions, docs/metrics.md equal to it, labels
safe and bounded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_existence import docs_tables
from hicache_existence.accounting.writes import PoolWriteStats
from hicache_existence.core.stats import PoolStats
from hicache_existence.exporters import catalog
from hicache_existence.exporters.catalog import CATALOG, DeploymentLabels

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BEGIN, END = "<!-- catalog:begin -->", "<!-- catalog:end -->"


def test_docs_reference_table_equals_the_catalog():
    """docs/metrics.md holds exactly docs_tables.metrics_table() between its markers
    (regenerate with: python dashboards/build.py)."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == docs_tables.metrics_table()


def test_every_exposed_name_is_documented_once():
    """Each exposed metric name appears in the doc's table exactly once."""
    text = DOC.read_text(encoding="utf-8")
    for spec in CATALOG:
        assert text.count(f"| `{spec.exposed_name}` |") == 1, spec.exposed_name


def test_names_follow_prometheus_conventions():
    """One prefix, snake case, no colons, unique names, counters not already _total,
    the unit is a name suffix, bytes metrics say so."""
    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))
    for spec in CATALOG:
        assert re.fullmatch(r"hicache_existence_[a-z][a-z0-9_]*", spec.name), spec.name
        assert not spec.name.endswith("_total")
        if spec.unit:
            assert spec.name.endswith("_" + spec.unit)
        assert ("bytes" in spec.name) == (spec.otel_unit == "By")
        assert spec.help.endswith(".") and len(spec.help) > 20
        assert spec.label_names[: len(catalog.DEPLOYMENT_LABELS)] == catalog.DEPLOYMENT_LABELS


def _says_field(family: str, field: str) -> bool:
    """Whether the words of ``field`` occur in order, side by side, in the family
    name, each word as it is or singular (``adds`` in ``add_calls``)."""
    words, want = family.removeprefix(catalog.PREFIX).split("_"), field.split("_")
    for i in range(len(words) - len(want) + 1):
        if all(w in (f, f.removesuffix("s")) for w, f in zip(words[i:], want)):
            return True
    return False


def test_cache_family_names_say_the_field_they_read():
    """A cache family's name contains the words of the PoolStats field it exports
    (rescues -> page_rescues, adds -> add_calls), so two families that swapped
    their fields fail here although every field is still exported once."""
    assert _says_field("hicache_existence_add_calls", "adds")
    assert not _says_field("hicache_existence_page_inserts", "refreshes")
    for spec in CATALOG:
        if spec.source == "cache" and spec.field != "misses_by_reason":
            assert _says_field(spec.name, spec.field), (spec.name, spec.field)


def test_sources_name_real_snapshot_fields():
    """Every cache/writes metric reads a field that PoolStats/PoolWriteStats has."""
    pool, writes = PoolStats("kv"), PoolWriteStats("kv")
    for spec in CATALOG:
        if spec.source == "cache":
            assert hasattr(pool, spec.field), spec.field
        elif spec.source == "writes":
            assert hasattr(writes, spec.field), spec.field


def test_issue_minimum_metric_set_is_present():
    """The metrics the observability issue requires all exist."""
    required = {
        "page_hits",
        "page_misses",
        "query_hits",
        "query_misses",
        "evictions",
        "page_rescues",
        "page_inserts",
        "page_refreshes",
        "invalidations",
        "clears",
        "entries",
        "capacity_entries",
        "memory_bytes",
        "written_pages",
        "written_bytes",
        "write_avoided_pages",
        "write_avoided_bytes",
        "redundant_written_pages",
        "redundant_written_bytes",
    }
    assert {spec.name.removeprefix(catalog.PREFIX) for spec in CATALOG} >= required


def test_deployment_labels_are_validated_and_redacted():
    """Ranks are non-negative ints; strings are short and printable; a URL's
    password never reaches a label."""
    labels = DeploymentLabels(model_name="m", tp_rank=3, storage_backend="redis://u:pw@h:1/0")
    assert labels.as_dict()["tp_rank"] == "3"
    assert "pw" not in labels.as_dict()["storage_backend"]
    with pytest.raises(TypeError, match="tp_rank"):
        DeploymentLabels(tp_rank="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dp_rank"):
        DeploymentLabels(dp_rank=-1)
    with pytest.raises(ValueError, match="model_name"):
        DeploymentLabels(model_name="x\ny")
    with pytest.raises(ValueError, match="engine_type"):
        DeploymentLabels(engine_type="e" * 200)
