"""One fact, one place: the counter set is declared once (``PoolStats``'s
fields), and the things that must follow it — the live counters, the cache's
increments and the reference models' — cover it exactly, so a counter missing
from any of them fails here instead of going unchecked.  The catalog's cache
families are built from the same declaration (help text, family name, unit), and
the rest follows from the catalog (exporters, docs tables, dashboard row, the
multiprocess test's expectations) and is checked where it is built."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import reference_models

from hicache_existence.core import stats
from hicache_existence.core.stats import PoolCounters, PoolStats
from hicache_existence.exporters.catalog import CATALOG

#: The catalog field that stands for ``page_misses`` split by classified reason.
_BY_REASON = "misses_by_reason"

CORE = Path(__file__).resolve().parents[1] / "hicache_existence" / "core"
#: Where the caches count: the lookups both generations share, and each
#: generation's mutations.
COUNTING, GENERATIONS = "counting.py", ("cache.py", "flat.py")


def _increments() -> dict[str, set[str]]:
    """Declared counter -> the core modules that increment it (``x.<counter> += n``)."""
    out: dict[str, set[str]] = {}
    for name in (COUNTING, *GENERATIONS):
        for node in ast.walk(ast.parse((CORE / name).read_text(encoding="utf-8"))):
            target = node.target if isinstance(node, ast.AugAssign) else None
            if isinstance(target, ast.Attribute) and target.attr in stats.COUNTER_FIELDS:
                out.setdefault(target.attr, set()).add(name)
    return out


def _exported_cache_fields() -> set[str]:
    out: set[str] = set()
    for spec in CATALOG:
        if spec.source != "cache":
            continue
        if spec.field == _BY_REASON:
            out.add("page_misses")
            out.update(f"misses_{r}" for r in stats.MISS_REASONS)
        else:
            out.add(spec.field)
    return out


def test_counter_and_gauge_fields_come_from_the_snapshot_declaration():
    """COUNTER_FIELDS / GAUGE_FIELDS are exactly PoolStats's fields of each kind, in order."""
    kinds = {f.name: f.metadata.get("kind") for f in dataclasses.fields(PoolStats)}
    assert tuple(n for n, k in kinds.items() if k == "counter") == stats.COUNTER_FIELDS
    assert tuple(n for n, k in kinds.items() if k == "gauge") == stats.GAUGE_FIELDS
    unmarked = [n for n, k in kinds.items() if k is None and n != "pool"]
    assert not unmarked, f"PoolStats fields without counter()/gauge()/miss_reason(): {unmarked}"


def test_live_counters_have_one_slot_per_declared_counter_and_snapshot_by_keyword():
    """PoolCounters holds exactly the declared counters, and snapshot() carries each
    one into the field of the same name (a distinct value per counter proves no
    positional shift)."""
    c = PoolCounters()
    assert set(type(c).__slots__) == {*stats.COUNTER_FIELDS, "miss_reasons"}
    for i, name in enumerate(stats.COUNTER_FIELDS):
        assert getattr(c, name) == 0
        setattr(c, name, 100 + i)
    c.miss_reasons[:] = [7, 8, 9, 10]
    snap = c.snapshot("kv", entries=1, capacity=2, inflight=3)
    for i, name in enumerate(stats.COUNTER_FIELDS):
        assert getattr(snap, name) == 100 + i, name
    assert (snap.entries, snap.capacity, snap.inflight) == (1, 2, 3)
    assert dict(snap.misses_by_reason) == dict(zip(stats.MISS_REASONS, [7, 8, 9, 10]))


def test_every_declared_counter_is_incremented_by_the_cache():
    """Each declared counter is incremented in the core's counting code (a counter
    declared and exported but never counted would export a flat 0)."""
    counted = _increments()
    assert [n for n in stats.COUNTER_FIELDS if n not in counted] == []


def test_lookups_are_counted_in_one_place_for_both_generations():
    """The counters of the counting walk (core/counting.py, which both generations'
    pools are) are incremented nowhere else: a copy of the walk in cache.py or
    flat.py fails here."""
    counted = _increments()
    walk = {n for n, where in counted.items() if COUNTING in where}
    assert walk >= {"queries", "page_hits", "rescues", "page_misses"}
    assert {n: sorted(counted[n]) for n in walk if counted[n] != {COUNTING}} == {}


def _model_increments() -> set[str]:
    """The counter names tests/reference_models.py increments (``c["name"] += n``)."""
    source = Path(reference_models.__file__).read_text(encoding="utf-8")
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
            for sub in ast.walk(node.target.slice):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    out.add(sub.value)
    return out


def test_reference_models_count_exactly_the_declared_counters():
    """tests/reference_models.py takes the counter names from the declaration but
    counts them itself: it must increment every declared counter (one the models
    forgot would stay 0 there and fail the model tests only if their workload
    happened to move it) and no name that is not declared, and keep the reasons."""
    counted = _model_increments() - set(stats.MISS_REASONS)
    assert sorted(set(stats.COUNTER_FIELDS) - counted) == []
    assert sorted(counted - set(stats.COUNTER_FIELDS)) == []
    assert tuple(reference_models.MISS_REASONS) == stats.MISS_REASONS


def test_catalog_exports_exactly_the_declared_fields():
    """Every declared counter, gauge and miss reason is exported by the catalog,
    and the catalog reads no cache field that is not declared."""
    declared = {f.name for f in dataclasses.fields(PoolStats) if f.name != "pool"}
    assert _exported_cache_fields() == declared


def test_write_counters_are_declared_once_and_all_exported():
    """WRITE_FIELDS is PoolWriteStats's counter fields; the live record has one slot
    each; snapshot, delta and as_dict carry each by name; every write counter is
    exported in pages (and in bytes where it has a byte size)."""
    from hicache_existence.accounting.writes import WRITE_FIELDS, PoolWriteStats, WriteAccounting

    kinds = {f.name: f.metadata.get("kind") for f in dataclasses.fields(PoolWriteStats)}
    assert tuple(n for n, k in kinds.items() if k == "counter") == WRITE_FIELDS
    acct = WriteAccounting(page_size_bytes=10)
    rec = acct._pool("kv")
    for i, name in enumerate(WRITE_FIELDS):
        setattr(rec, name, 100 + i)
    snap = acct.stats()["kv"]
    delta = snap - PoolWriteStats("kv")
    out = snap.as_dict()
    for i, name in enumerate(WRITE_FIELDS):
        assert getattr(snap, name) == getattr(delta, name) == out[name] == 100 + i, name
    exported = {spec.field for spec in CATALOG if spec.source == "writes"}
    assert "causes" in exported  # redundant pages by cause: a labelled family, not a counter
    exported.discard("causes")
    for name in WRITE_FIELDS:
        assert name in exported, f"write counter {name} is not exported"
        if hasattr(snap, f"{name}_bytes"):
            assert f"{name}_bytes" in exported, f"{name}_bytes is not exported"
    assert exported <= {*WRITE_FIELDS, *(f"{n}_bytes" for n in WRITE_FIELDS)}
