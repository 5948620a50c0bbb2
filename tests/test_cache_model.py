"""Stateful tests: the current generation (``StorageExistenceCache`` / ``PoolBeliefs``)
against the plain reference model in tests/reference_models.py.

After every step the machine compares LRU order, in-flight refs, ``len``, the
upstream-compatible private attributes, ``max_entries`` and every ``stats()``
field of every pool and of ``.total``.
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
    RefCache,
    check_miss_reasons,
    on_pure_python_index,
    ref_chain_heal_from_query,
    ref_heal_from_transfer,
    ref_trailing_heal_from_query,
)

import hicache_existence as he


class PoolName(str, Enum):
    """A stand-in for sglang's ``PoolName`` str enum."""

    KV = "kv"
    MAMBA = "mamba"


class HitPolicy(str, Enum):
    """A stand-in for sglang's ``PoolHitPolicy`` str enum."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


ALPHABET = ("a", "b", "c", "d", "e", "f")
# "kv" and PoolName.KV name the same pool; few pools keep each one busy.
POOL_NAMES = ("kv", "swa", PoolName.KV, PoolName.MAMBA)
FEEDS = ("list", "tuple", "generator", "iterator", "iterable")

# Miss-reason memory is an optional extension: with an exact memory the
# classified misses are predictable, and turning it on must change nothing else.
_HAS_MEMORY = "miss_memory" in inspect.signature(he.StorageExistenceCache).parameters
memories = st.booleans() if _HAS_MEMORY else st.just(False)

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


def plain(name):
    """The plain-str value of a pool name (str enums included)."""
    return str.__str__(name)


def stats_fields(pool_stats):
    """The contract's fields of one ``PoolStats`` as a dict."""
    return {name: getattr(pool_stats, name) for name in FIELDS}


class CacheMachine(RuleBasedStateMachine):
    """Drives a real cache and the reference model with the same calls."""

    def __init__(self):
        super().__init__()
        self.cache = None
        self.model = None
        self.handles = {}  # plain name -> PoolBeliefs returned by cache.pool()

    @initialize(cap=caps, by_keyword=st.booleans(), memory=memories)
    def start(self, cap, by_keyword, memory):
        extra = {"miss_memory": lambda name: ExactMissMemory()} if memory else {}
        if by_keyword:
            self.cache = he.StorageExistenceCache(max_entries=cap, **extra)
        else:
            self.cache = he.StorageExistenceCache(cap, **extra)
        self.model = RefCache(cap)
        self.memory = memory

    def _pool(self, name):
        """The real and the model pool; checks ``pool()`` returns one stable object."""
        real = self.cache.pool(name)
        key = plain(name)
        if key in self.handles:
            assert real is self.handles[key]
        else:
            self.handles[key] = real
        return real, self.model.pool(key)

    # -- pools and caps --
    @rule(name=pool_names)
    def create_pool(self, name):
        self._pool(name)

    @rule(cap=caps)
    def set_cache_max_entries(self, cap):
        self.cache.max_entries = cap
        self.model.max_entries = cap

    @rule(name=pool_names, cap=caps)
    def set_pool_max_entries(self, name, cap):
        real, model = self._pool(name)
        real.max_entries = cap
        model.max_entries = cap

    # -- writes --
    @rule(name=pool_names, batch=batches, kind=feeds)
    def add(self, name, batch, kind):
        real, model = self._pool(name)
        assert real.add(feed(kind, batch)) is None
        model.add(batch)

    @rule(name=pool_names, batch=batches, kind=feeds, keep=st.integers(0, 9))
    def invalidate_beyond(self, name, batch, kind, keep):
        real, model = self._pool(name)
        assert real.invalidate_beyond(feed(kind, batch), keep) is None
        model.invalidate_beyond(batch, keep)

    @rule(name=pool_names, batch=batches, kind=feeds)
    def track_inflight(self, name, batch, kind):
        real, model = self._pool(name)
        assert real.track_inflight(feed(kind, batch)) is None
        model.track_inflight(batch)

    @rule(name=pool_names, batch=batches, kind=feeds)
    def untrack_inflight(self, name, batch, kind):
        real, model = self._pool(name)
        assert real.untrack_inflight(feed(kind, batch)) is None
        model.untrack_inflight(batch)

    # -- reads --
    @rule(name=pool_names, page=pages)
    def contains(self, name, page):
        real, model = self._pool(name)
        assert real.contains(page) is model.contains(page)

    @rule(name=pool_names, batch=batches, kind=feeds)
    def contains_all(self, name, batch, kind):
        real, model = self._pool(name)
        assert real.contains_all(feed(kind, batch)) is model.contains_all(batch)

    @rule(name=pool_names, batch=batches, kind=feeds)
    def covered(self, name, batch, kind):
        real, model = self._pool(name)
        assert real.covered(feed(kind, batch)) is model.covered(batch)

    # -- clears --
    @rule(name=pool_names)
    def pool_clear(self, name):
        real, model = self._pool(name)
        assert real.clear() is None
        model.clear()

    @rule(name=pool_names)
    def pool_clear_inflight(self, name):
        real, model = self._pool(name)
        assert real.clear_inflight() is None
        model.clear_inflight()

    @rule()
    def cache_clear(self):
        assert self.cache.clear() is None
        self.model.clear()

    @rule()
    def cache_clear_inflight(self):
        assert self.cache.clear_inflight() is None
        self.model.clear_inflight()

    # -- heal policies --
    @rule(
        name=pool_names,
        chain=st.lists(pages, min_size=0, max_size=8),
        hit=st.integers(0, 9),
        evidence=st.booleans(),
        which=st.sampled_from(
            ("chain", "trailing", "default_all", "default_trailing", "default_enum")
        ),
        window=st.integers(0, 3),
    )
    def heal_from_query(self, name, chain, hit, evidence, which, window):
        real, model = self._pool(name)
        keys = chain[len(chain) - window :] if window else []
        if which == "chain":
            policy = he.ChainPagesPolicy()
        elif which == "trailing":
            policy = he.TrailingWindowPolicy()
        elif which == "default_all":
            policy = he.default_belief_policy("all_pages")
        elif which == "default_trailing":
            policy = he.default_belief_policy("trailing_pages")
        else:
            policy = he.default_belief_policy(HitPolicy.TRAILING_PAGES)
        trailing = which in ("trailing", "default_trailing", "default_enum")
        assert isinstance(policy, he.PoolBeliefPolicy)
        assert isinstance(policy, he.TrailingWindowPolicy if trailing else he.ChainPagesPolicy)
        result = policy.heal_from_query(real, chain, keys, hit, evidence=evidence)
        assert result is None
        if trailing:
            ref_trailing_heal_from_query(model, chain, keys, hit, evidence)
        else:
            ref_chain_heal_from_query(model, chain, keys, hit, evidence)

    @rule(
        name=pool_names,
        keys=st.lists(pages, min_size=0, max_size=8),
        delivered=st.integers(0, 9),
        trailing=st.booleans(),
    )
    def heal_from_transfer(self, name, keys, delivered, trailing):
        real, model = self._pool(name)
        policy = he.TrailingWindowPolicy() if trailing else he.ChainPagesPolicy()
        assert policy.heal_from_transfer(real, keys, delivered) is None
        ref_heal_from_transfer(model, keys, delivered)

    # -- miss reasons (optional extension) --
    @precondition(lambda self: self.memory and hasattr(self.cache, "settle"))
    @rule()
    def settle(self):
        """Pending misses are classified: the reasons are now exact."""
        assert self.cache.settle() is None
        stats = self.cache.stats()
        for key, mpool in self.model.pools.items():
            assert dict(stats[key].misses_by_reason) == mpool.miss_reasons

    # -- the check after every step --
    @precondition(lambda self: self.cache is not None)
    @invariant()
    def matches_model(self):
        cache, model = self.cache, self.model
        assert cache.max_entries == model.max_entries
        assert cache.pool_names() == model.pool_names()
        assert all(type(n) is str for n in cache.pool_names())
        stats = cache.stats()
        assert list(stats) == list(model.pools)
        for key, mpool in model.pools.items():
            real = self.handles[key]
            assert real.name == key
            assert real.max_entries == mpool.max_entries
            assert real.lru_keys() == tuple(mpool.lru)
            assert real.inflight_refs() == mpool.refs
            assert len(real) == len(mpool.lru)
            assert list(real._entries) == mpool.lru
            assert dict(real._inflight) == mpool.refs
            assert stats_fields(real.stats()) == mpool.stats()
            assert stats_fields(stats[key]) == mpool.stats()
            assert stats[key].pool == key and type(stats[key].pool) is str
            check_miss_reasons(
                stats[key].misses_by_reason, mpool.miss_reasons, self.memory, self.cache
            )
        assert stats_fields(stats.total) == model.total()


SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

CacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, **SETTINGS)
TestCacheModel = CacheMachine.TestCase
TestCacheModel.__doc__ = "The current generation matches the reference model step by step."


PurePythonCacheMachine = on_pure_python_index(CacheMachine)
PurePythonCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, **SETTINGS
)
TestCacheModelPurePython = PurePythonCacheMachine.TestCase


@pytest.mark.slow
def test_cache_model_many_examples():
    """The current generation matches the reference model over many more examples."""
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(max_examples=2000, stateful_step_count=60, **SETTINGS),
    )
