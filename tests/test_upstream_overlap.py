"""An sglang that already does part of the package's job (``upstream_overlap``):
each upstream shape simulated in process, the rule the package follows for it.

The shapes are those of three upstream pull requests: cache-mode L3 writes
deduplicated through the existence cache (#39845), the cap read from
``SGLANG_HICACHE_EXISTENCE_CACHE_MAX_ENTRIES`` (#39747) and ``EXTERNAL`` storage
events at the storage ack (#29923).  That the installed wheels show none of them
is checked against the real sglang in tests/sglang_integration/test_sglang_units.py.
"""

from __future__ import annotations

import enum
import logging
import types
from typing import Any

import pytest
from test_cache_mode_writes import PAGE, Indices, Tree, around_node, around_write, cycle, pages

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.exporters.features import FeatureSources, sample_features
from hicache_existence.integrations.sglang import hooks
from hicache_existence.integrations.sglang import upstream_overlap as uo
from hicache_existence.integrations.sglang import write_path as wp
from hicache_existence.integrations.sglang.facts import SchedulerFacts

DEFAULT = Config().cache.max_entries


# -- the cap: one rule --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "env", "passed", "entries", "source", "warns"),
    [
        (False, {}, None, DEFAULT, "the default", None),
        (False, {}, 4096, 4096, "sglang's constructor", None),
        (False, {uo.CAP_ENV: "2048"}, 4096, 2048, uo.CAP_ENV, None),
        (False, {uo.CAP_ENV: " 2048 "}, None, 2048, uo.CAP_ENV, None),
        (True, {uo.CAP_ENV: "2048"}, 4096, 100, "cache.max_entries", "disagree"),
        (True, {uo.CAP_ENV: "100"}, None, 100, "cache.max_entries", None),
        (True, {}, 4096, 100, "cache.max_entries", None),
        (False, {uo.CAP_ENV: "lots"}, None, DEFAULT, "the default", "not a positive integer"),
        (False, {uo.CAP_ENV: "0"}, 4096, 4096, "sglang's constructor", "not a positive integer"),
        (False, {uo.CAP_ENV: "-5"}, None, DEFAULT, "the default", "not a positive integer"),
        (False, {uo.CAP_ENV: ""}, None, DEFAULT, "the default", None),
        (False, {}, True, DEFAULT, "the default", None),  # a bool is not a cap
        (False, {}, 0, DEFAULT, "the default", None),
    ],
)
def test_the_cap_comes_from_one_place(given, env, passed, entries, source, warns) -> None:
    configured = 100 if given else DEFAULT
    cap = uo.resolve_cap(configured, given, env, passed)
    assert (cap.entries, cap.source) == (entries, source)
    if warns is None:
        assert cap.warning is None
    else:
        assert cap.warning is not None and warns in cap.warning
        assert uo.CAP_ENV in cap.warning


def test_given_keys_tell_the_operator_s_choice_from_the_default(tmp_path) -> None:
    """``cache.max_entries`` counts as given from any source, also at its default
    value; a default left alone does not."""
    assert "cache.max_entries" not in Config.given_keys(None, {})
    env = {"HICACHE_EXISTENCE_CACHE__MAX_ENTRIES": str(DEFAULT)}
    assert "cache.max_entries" in Config.given_keys(None, env)
    blob = {"HICACHE_EXISTENCE_CONFIG": '{"cache": {"max_entries": 7}}'}
    assert "cache.max_entries" in Config.given_keys(None, blob)
    path = tmp_path / "c.json"
    path.write_text('{"cache": {"max-entries": 9}, "enabled": true}')
    keys = Config.given_keys(str(path), {"HICACHE_EXISTENCE_LOGGING__LEVEL": "debug"})
    assert {"cache.max_entries", "enabled", "logging.level"} <= keys
    assert "cache_mode.dedup" not in keys


# -- upstream dedup: recognised from the code ------------------------------------------------
class _Beliefs:
    def __init__(self, cache: Any) -> None:
        self.storage_existence_cache = cache


class TreeDedupsInline:
    def write_backup_storage(self, node_id: int) -> None:
        beliefs = self.storage_existence_cache.pool("kv")  # type: ignore[attr-defined]
        del beliefs, node_id


class TreeDedupsThroughHelper:
    def write_backup_storage(self, node_id: int) -> None:
        self._unwritten(node_id)

    def _unwritten(self, node_id: int) -> list[int]:
        return [p for p in [node_id] if not self.storage_existence_cache.pool("kv").contains(p)]  # type: ignore[attr-defined]


class TreeAsToday:
    """0.5.23's shape: the node write never reads the existence cache."""

    def write_backup_storage(self, node_id: int) -> None:
        self.cache_controller.write_storage(node_id)  # type: ignore[attr-defined]

    def unrelated(self) -> None:  # reads it, but is not called by the node write
        self.storage_existence_cache.clear()  # type: ignore[attr-defined]


def _resolver(tree: type) -> Any:
    owner = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"

    def resolve(target: str) -> object:
        if target == owner:
            return tree
        if target == f"{owner}.write_backup_storage":
            return tree.write_backup_storage
        raise LookupError(target)

    return resolve


@pytest.mark.parametrize(
    ("tree", "found"),
    [
        (TreeDedupsInline, "write_backup_storage"),
        (TreeDedupsThroughHelper, "through _unwritten"),
        (TreeAsToday, None),
    ],
)
def test_upstream_dedup_is_recognised_from_the_write_path_s_code(tree, found) -> None:
    got = uo.dedup_target(_resolver(tree))
    if found is None:
        assert got is None
    else:
        assert got is not None and found in got


def test_code_names_reach_into_nested_code_and_wrappers() -> None:
    def outer() -> Any:
        return [x.storage_existence_cache for x in ()]

    def wrapper() -> None: ...

    wrapper.__wrapped__ = outer  # type: ignore[attr-defined]
    assert "storage_existence_cache" in uo.code_names(outer)
    assert "storage_existence_cache" in uo.code_names(wrapper)
    assert uo.code_names(42) == frozenset()


class StorageMedium(str, enum.Enum):
    GPU = "GPU"
    EXTERNAL = "EXTERNAL"


def _module(name: str, emits: bool) -> types.ModuleType:
    module = types.ModuleType(name)

    class Controller:
        if emits:

            def drain(self, events: list[Any]) -> None:
                events.append(StorageMedium.EXTERNAL)
        else:

            def drain(self, events: list[Any]) -> None:
                events.append(StorageMedium.GPU)

    Controller.__module__ = name
    module.Controller = Controller  # type: ignore[attr-defined]
    module.StorageMedium = StorageMedium  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("emits", [True, False])
def test_external_storage_events_are_recognised(emits: bool) -> None:
    modules = {n: _module(n, emits and n == uo.EVENT_MODULES[2]) for n in uo.EVENT_MODULES}
    got = uo.external_events_target(modules.__getitem__)
    assert got == (f"{uo.EVENT_MODULES[2]}.Controller.drain" if emits else None)
    overlap = uo.detect(_resolver(TreeAsToday), modules.__getitem__)
    assert (overlap.external_events is not None) is emits
    assert ("EXTERNAL storage events" in overlap.describe()) is emits


def test_detect_never_raises() -> None:
    def broken(_: str) -> Any:
        raise RuntimeError("import failed")

    assert uo.detect(broken, broken) == uo.Overlap()
    assert uo.Overlap().describe() == ""


# -- upstream dedup: the package only counts ------------------------------------------------
class TreeThatDedups(Tree):
    """#39845's shape: the node write leaves out the pages the existence cache
    believes stored (one counted ``contains`` per page), then hands the rest to
    ``write_storage``."""

    def write_backup_storage(self, node_id: int, prefix_keys: Any = None) -> None:
        def upstream(tree: TreeThatDedups, node: int) -> None:
            beliefs = tree.storage_existence_cache.pool("kv")
            keys = [k for k in tree.nodes[node] if not beliefs.contains(k)]
            host = Indices(range(1000 + 10 * node * PAGE, 1000 + (10 * node + len(keys)) * PAGE))
            cc = tree.cache_controller
            op = around_write(cc.write_storage.__func__, cc, host, [7] * len(keys) * PAGE, keys)
            tree.ongoing_backup[op] = node

        around_node(upstream, self, node_id)


@pytest.fixture
def upstream_dedup():
    def make(upstream_dedup: bool, dedup: bool) -> tuple[TreeThatDedups, wp.WritePath]:
        cache = StorageExistenceCache(64)
        feed = wp.WritePath(
            WriteAccounting(),
            cache,
            cache_mode=True,
            dedup=dedup,
            upstream_dedup=upstream_dedup,
        )
        wp.attach(feed)
        return TreeThatDedups(cache, set()), feed

    yield make
    wp.detach()


def test_an_sglang_that_dedups_is_counted_not_deduplicated_twice(upstream_dedup) -> None:
    """With sglang deduplicating: what it hands over is what is written; the
    lookups are sglang's alone (one per page, counted once by our cache); the
    package's own dedup stays off even when asked for, so it avoids nothing."""
    tree, feed = upstream_dedup(upstream_dedup=True, dedup=True)
    assert feed.cache_mode is not None and not feed.cache_mode.dedup
    a, b = pages("a", 4), pages("b", 2)
    tree.nodes = {1: a, 2: [*a, *b]}
    cycle(tree, feed, 1)
    cycle(tree, feed, 2)
    assert [c["pages"] for c in tree.cache_controller.calls] == [a, b]
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.acknowledged, kv.avoided, kv.redundant) == (6, 6, 0, 0)
    stats = tree.storage_existence_cache.pool("kv").stats()
    assert stats.queries == len(a) + len(a) + len(b)  # sglang's contains() calls only
    assert tree.cache_controller.l3 == {*a, *b}


def test_without_the_rule_lookups_would_be_counted_twice(upstream_dedup) -> None:
    """The same sglang with the package unaware of it: a second lookup per node
    write (the counted ``covered``), which is what the rule removes."""
    tree, feed = upstream_dedup(upstream_dedup=False, dedup=False)
    a = pages("a", 4)
    tree.nodes = {1: a}
    cycle(tree, feed, 1)
    assert tree.storage_existence_cache.pool("kv").stats().queries == len(a) + 1


# -- the hooks' side: effective dedup, the label, the warning --------------------------------
CACHE_FACTS = SchedulerFacts(host_memory_mode="cache", storage_backend="file")
DEDUPS = uo.Overlap(dedups_cache_mode="UnifiedRadixCache.write_backup_storage")


def test_dedup_yields_to_sglang_s_own_and_the_label_says_so(caplog) -> None:
    on = Config.from_mapping({"cache_mode": {"dedup": True}})
    assert hooks.dedup_effective(on, CACHE_FACTS) is True
    assert hooks.dedup_effective(on, CACHE_FACTS, DEDUPS) is False
    assert hooks.dedup_label(on, CACHE_FACTS, DEDUPS) == "upstream"
    assert hooks.dedup_label(Config(), CACHE_FACTS, DEDUPS) == "upstream"
    buffer = SchedulerFacts(host_memory_mode="buffer_only", storage_backend="file")
    assert hooks.dedup_label(Config(), buffer, DEDUPS) is False
    with caplog.at_level(logging.WARNING, logger="hicache_existence"):
        hooks._warn_dedup_misplaced(on, CACHE_FACTS, DEDUPS)
        hooks._warn_dedup_misplaced(Config(), CACHE_FACTS, DEDUPS)  # not asked: silent
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "deduplicates cache-mode L3 writes itself" in warned[0]
    assert "write_backup_storage" in warned[0]


@pytest.mark.parametrize(
    ("dedup", "label"), [(True, "true"), (False, "false"), ("upstream", "upstream")]
)
def test_mode_info_exports_who_deduplicates(dedup, label) -> None:
    sources = FeatureSources(mode=lambda: ("cache", "write_through", dedup))
    scalars, _ = sample_features(sources, str, ())
    assert scalars["hicache_existence_mode_info"] == {
        ("cache", "write_through", label, "pool"): 1.0
    }


def test_the_doctor_reads_upstream_dedup_as_dedup_on() -> None:
    """A server whose sglang deduplicates is never told to turn cache_mode.dedup on."""
    from hicache_existence.doctor import figures

    labels = (
        ("cache_mode_dedup", "upstream"),
        ("host_memory_mode", "cache"),
        ("write_policy", "write_through"),
    )
    mode_info = types.SimpleNamespace(value=1.0)  # a figure, as far as mode() reads one
    view = figures.View("x", {(figures.series("mode_info"), labels): mode_info}, None)  # type: ignore[dict-item]
    assert view.mode() == ("cache", "write_through", True)


def test_the_resolved_cap_sizes_the_runtime_before_it_is_built() -> None:
    """``build_entry`` takes the resolved cap into the configuration, so the cache
    and its miss-reason memory are sized from it (not patched afterwards)."""
    entry = hooks.build_entry("current", 1234, SchedulerFacts(), Config(), DEDUPS)
    try:
        assert entry.runtime.config.cache.max_entries == 1234
        assert entry.runtime.cache.max_entries == 1234
        assert entry.overlap is DEDUPS
    finally:
        entry.close()
