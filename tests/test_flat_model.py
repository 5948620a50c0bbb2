"""Stateful tests: the seed generation (``FlatStorageExistenceCache``) against the
plain reference model in tests/reference_models.py.

After every step the machine compares the global LRU order over (pool, hash),
``len``, ``max_entries`` and every ``stats()`` field of every pool and of ``.total``.
"""

from __future__ import annotations

import inspect
from enum import Enum

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from reference_models import (
    FIELDS,
    ExactMissMemory,
    RefFlat,
    check_miss_reasons,
    on_pure_python_index,
)

import hicache_existence as he


class PoolName(str, Enum):
    """A stand-in for sglang's ``PoolName`` str enum."""

    KV = "kv"
    MAMBA = "mamba"


ALPHABET = ("a", "b", "c", "d", "e", "f")
POOL_NAMES = ("kv", "swa", PoolName.KV, PoolName.MAMBA)
FEEDS = ("list", "tuple", "generator", "iterator", "iterable")
_FLAT_PARAMS = inspect.signature(he.FlatStorageExistenceCache).parameters
PRIMARIES = (None, "swa", "other") if "primary_pool" in _FLAT_PARAMS else (None,)
# Miss-reason memory is an optional extension: with an exact memory the
# classified misses are predictable, and turning it on must change nothing else.
memories = st.booleans() if "miss_memory" in _FLAT_PARAMS else st.just(False)
COVERS = ("default", "frozenset", "set", "list", "tuple", "dict", "container")

caps = st.integers(min_value=1, max_value=6)
pages = st.sampled_from(ALPHABET)
batches = st.lists(pages, min_size=0, max_size=8)
pool_names = st.sampled_from(POOL_NAMES)
feeds = st.sampled_from(FEEDS)


class _Iterable:
    """A re-iterable that is neither a list, tuple nor Sequence."""

    def __init__(self, items):
        self._items = list(items)

    def __iter__(self):
        return iter(self._items)


class _OnlyContains:
    """A Container with ``__contains__`` only: not iterable, not sized, always truthy."""

    def __init__(self, items):
        self._items = frozenset(items)

    def __contains__(self, item):
        return item in self._items


def feed(kind, items):
    """The same pages as a list, tuple, generator, one-shot iterator or iterable."""
    items = list(items)
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "generator":
        return (h for h in items)
    if kind == "iterator":
        return iter(items)
    return _Iterable(items)


def cover(kind, items):
    """``extra_cover`` as one of several Container types."""
    if kind == "frozenset":
        return frozenset(items)
    if kind == "set":
        return set(items)
    if kind == "list":
        return list(items)
    if kind == "tuple":
        return tuple(items)
    if kind == "dict":
        return dict.fromkeys(items)
    return _OnlyContains(items)


def plain(name):
    """The plain-str value of a pool name (str enums included)."""
    return str.__str__(name)


def stats_fields(pool_stats):
    """The contract's fields of one ``PoolStats`` as a dict."""
    return {name: getattr(pool_stats, name) for name in FIELDS}


class FlatMachine(RuleBasedStateMachine):
    """Drives a real flat cache and the reference model with the same calls."""

    def __init__(self):
        super().__init__()
        self.cache = None
        self.model = None

    @initialize(
        cap=caps, by_keyword=st.booleans(), primary=st.sampled_from(PRIMARIES), memory=memories
    )
    def start(self, cap, by_keyword, primary, memory):
        # The implementation keys one "primary" pool differently (a speed-up);
        # the semantics must not depend on which pool that is.
        extra = {} if primary is None else {"primary_pool": primary}
        if memory:
            extra["miss_memory"] = lambda name: ExactMissMemory()
        self.memory = memory
        if by_keyword:
            self.cache = he.FlatStorageExistenceCache(max_entries=cap, **extra)
        else:
            self.cache = he.FlatStorageExistenceCache(cap, **extra)
        self.model = RefFlat(cap)

    @rule(cap=caps)
    def set_max_entries(self, cap):
        self.cache.max_entries = cap
        self.model.max_entries = cap

    @rule(pool=pool_names, batch=batches, kind=feeds)
    def add(self, pool, batch, kind):
        assert self.cache.add(pool, feed(kind, batch)) is None
        self.model.add(plain(pool), batch)

    @rule(pool=pool_names, batch=batches, kind=feeds, keep=st.integers(0, 9))
    def invalidate_beyond(self, pool, batch, kind, keep):
        assert self.cache.invalidate_beyond(pool, feed(kind, batch), keep) is None
        self.model.invalidate_beyond(plain(pool), batch, keep)

    @rule(pool=pool_names, page=pages)
    def contains(self, pool, page):
        assert self.cache.contains(pool, page) is self.model.contains(plain(pool), page)

    @rule(pool=pool_names, batch=batches, kind=feeds)
    def contains_all(self, pool, batch, kind):
        got = self.cache.contains_all(pool, feed(kind, batch))
        assert got is self.model.contains_all(plain(pool), batch)

    @rule(
        pool=pool_names,
        batch=batches,
        kind=feeds,
        cover_kind=st.sampled_from(COVERS),
        cover_pages=st.lists(pages, max_size=4),
        by_keyword=st.booleans(),
    )
    def covers_all(self, pool, batch, kind, cover_kind, cover_pages, by_keyword):
        hashes = feed(kind, batch)
        if cover_kind == "default":
            got = self.cache.covers_all(pool, hashes)
            want = self.model.covers_all(plain(pool), batch)
        else:
            extra = cover(cover_kind, cover_pages)
            if by_keyword:
                got = self.cache.covers_all(pool, hashes, extra_cover=extra)
            else:
                got = self.cache.covers_all(pool, hashes, extra)
            want = self.model.covers_all(plain(pool), batch, frozenset(cover_pages))
        assert got is want

    @rule()
    def clear(self):
        assert self.cache.clear() is None
        self.model.clear()

    @precondition(lambda self: self.memory and hasattr(self.cache, "settle"))
    @rule()
    def settle(self):
        """Pending misses are classified: the reasons are now exact."""
        assert self.cache.settle() is None
        stats = self.cache.stats()
        for pool, want in self.model.miss_reasons.items():
            assert dict(stats[pool].misses_by_reason) == want, pool

    @precondition(lambda self: self.cache is not None)
    @invariant()
    def matches_model(self):
        cache, model = self.cache, self.model
        assert cache.max_entries == model.max_entries
        assert len(cache) == len(model)
        assert cache.lru_keys() == tuple(model.lru)
        stats = cache.stats()
        assert set(stats) == set(model.pool_names())
        assert all(type(name) is str for name in stats)
        for pool, want in model.stats().items():
            assert stats_fields(stats[pool]) == want, pool
            assert stats[pool].pool == pool and type(stats[pool].pool) is str
            check_miss_reasons(
                stats[pool].misses_by_reason, model.miss_reasons[pool], self.memory, cache
            )
        assert stats_fields(stats.total) == model.total()


SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

FlatMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, **SETTINGS)
TestFlatModel = FlatMachine.TestCase
TestFlatModel.__doc__ = "The seed generation matches the reference model step by step."


PurePythonFlatMachine = on_pure_python_index(FlatMachine)
PurePythonFlatMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, **SETTINGS
)
TestFlatModelPurePython = PurePythonFlatMachine.TestCase


@pytest.mark.slow
def test_flat_model_many_examples():
    """The seed generation matches the reference model over many more examples."""
    run_state_machine_as_test(
        FlatMachine,
        settings=settings(max_examples=2000, stateful_step_count=60, **SETTINGS),
    )
