"""Bad input, both generations: the right exception type, a message that names the
argument, and a cache left EXACTLY as before (LRU order, in-flight refs, every
stats field) -- checked on a non-trivial state.
"""

from __future__ import annotations

import inspect
from enum import Enum

import pytest

import hicache_existence as he


class PoolName(str, Enum):
    """A stand-in for sglang's ``PoolName`` str enum."""

    KV = "kv"


BAD_PAGES = [5, b"b", None, object(), 1.5]
# Prefixes before the bad page: nothing, believed pages (touched by a walk), the
# first miss (a walk would have stopped there), a miss in the middle.
PREFIXES = [[], ["b"], ["b", "c"], ["zz"], ["b", "zz", "c"]]
BAD_BATCHES = ["b", "", "abc", b"ab", bytearray(b"ab"), 5, None, object(), 1.5]
BAD_KEEP_TYPE = ["1", 1.5, None, True, False, [1]]
BAD_KEEP_VALUE = [-1, -5]
BAD_CAP_TYPE = [1.5, "3", True, False, None]
BAD_CAP_VALUE = [0, -1]
BAD_POOL_TYPE = [5, None, b"kv", object(), ("kv",), ["kv"]]


def as_list(items):
    """A list of the items."""
    return list(items)


def as_generator(items):
    """A generator of the items."""
    return (x for x in list(items))


def as_iterator(items):
    """A one-shot iterator over the items."""
    return iter(list(items))


FEEDS = [as_list, tuple, as_generator, as_iterator]


# ---------------------------------------------------------------------------
# State builders and exact snapshots
# ---------------------------------------------------------------------------


def current_cache():
    """A current-generation cache with several pools, evictions, touches,
    in-flight refs, invalidations and non-zero counters."""
    cache = he.StorageExistenceCache(4)
    kv = cache.pool("kv")
    kv.add(["a", "b", "c", "d", "e"])  # "a" evicted
    kv.contains_all(["c", "b", "zz"])  # touches c, b; misses
    kv.track_inflight(["x", "x", "y", "b"])
    kv.untrack_inflight(["y", "nope"])
    kv.covered(["d", "x", "q"])
    kv.invalidate_beyond(["b", "e"], 1)
    kv.add(["f", "c"])
    swa = cache.pool(PoolName.KV.value + "_swa")
    swa.max_entries = 2
    swa.add(["p", "q", "r"])
    swa.contains("q")
    cache.pool("mamba")
    cache.max_entries = 3
    return cache


def current_snapshot(cache):
    """Everything observable about a current-generation cache."""
    pools = {}
    for name in cache.pool_names():
        p = cache.pool(name)
        pools[name] = (
            p.lru_keys(),
            p.inflight_refs(),
            len(p),
            p.max_entries,
            p.stats(),
            list(p._entries),
            dict(p._inflight),
        )
    stats = cache.stats()
    return (cache.max_entries, cache.pool_names(), pools, dict(stats), stats.total)


def flat_cache():
    """A flat cache with several pools, a global eviction, touches and counters."""
    cache = he.FlatStorageExistenceCache(5)
    cache.add("kv", ["a", "b", "c"])
    cache.add("swa", ["a", "p", "q"])  # ("kv", "a") evicted
    cache.contains_all("kv", ["c", "b", "zz"])
    cache.covers_all("swa", ["p", "x", "nope"], extra_cover=frozenset({"x"}))
    cache.invalidate_beyond("kv", ["b", "c"], 1)
    cache.contains("mamba", "a")
    cache.max_entries = 4
    return cache


def flat_snapshot(cache):
    """Everything observable about a flat cache."""
    stats = cache.stats()
    return (cache.max_entries, len(cache), cache.lru_keys(), dict(stats), stats.total)


def check_rejects(make, snapshot, call, exc, arg):
    """``call(cache)`` raises ``exc`` naming ``arg`` and changes nothing."""
    cache = make()
    before = snapshot(cache)
    with pytest.raises(exc) as info:
        call(cache)
    names = (arg,) if isinstance(arg, str) else arg
    message = str(info.value)
    assert any(n in message for n in names), f"message {message!r} names none of {names}"
    assert snapshot(cache) == before


def check_current(call, exc, arg):
    """``check_rejects`` on a fresh current-generation state."""
    check_rejects(current_cache, current_snapshot, call, exc, arg)


def check_flat(call, exc, arg):
    """``check_rejects`` on a fresh flat state."""
    check_rejects(flat_cache, flat_snapshot, call, exc, arg)


def test_snapshots_see_changes():
    """The snapshot helpers are sharp: a touch alone changes them."""
    cache = current_cache()
    before = current_snapshot(cache)
    cache.pool("kv").contains("f")
    assert current_snapshot(cache) != before
    flat = flat_cache()
    before = flat_snapshot(flat)
    flat.contains("kv", "b")
    assert flat_snapshot(flat) != before


# ---------------------------------------------------------------------------
# Current generation
# ---------------------------------------------------------------------------

CURRENT_BATCH_METHODS = [
    "add",
    "contains_all",
    "covered",
    "track_inflight",
    "untrack_inflight",
    "invalidate_beyond",
]
# "kv" has in-flight refs, "kv_swa" none (``covered`` may take another path).
CURRENT_POOLS = ["kv", "kv_swa"]


def _current_call(pool, method, hashes):
    def call(cache):
        beliefs = cache.pool(pool)
        if method == "invalidate_beyond":
            return beliefs.invalidate_beyond(hashes, 1)
        return getattr(beliefs, method)(hashes)

    return call


@pytest.mark.parametrize("bad", BAD_PAGES, ids=repr)
@pytest.mark.parametrize("method", CURRENT_BATCH_METHODS)
def test_current_non_str_page_anywhere(method, bad):
    """A non-str page anywhere in a batch, even after the first miss -> TypeError, no change."""
    for pool in CURRENT_POOLS:
        for prefix in PREFIXES:
            for batch in ([*prefix, bad], [*prefix, bad, "c"], [bad, *prefix]):
                for make in FEEDS:
                    check_current(_current_call(pool, method, make(batch)), TypeError, "hashes")


@pytest.mark.parametrize("bad", BAD_BATCHES, ids=repr)
@pytest.mark.parametrize("method", CURRENT_BATCH_METHODS)
def test_current_bad_hashes_argument(method, bad):
    """A bare str/bytes or a non-iterable as hashes -> TypeError naming hashes, no change."""
    for pool in CURRENT_POOLS:
        check_current(_current_call(pool, method, bad), TypeError, "hashes")


class Boom(Exception):
    """Raised part-way through a caller's iterable."""


def exploding(items):
    """Yields ``items``, then raises ``Boom``."""
    yield from items
    raise Boom("boom after the pages")


@pytest.mark.parametrize("method", CURRENT_BATCH_METHODS)
def test_current_failing_iterable(method):
    """An iterable that raises part-way propagates its error and changes nothing."""
    for pool in CURRENT_POOLS:
        check_current(_current_call(pool, method, exploding(["b", "c"])), Boom, "boom")


@pytest.mark.parametrize("bad", BAD_PAGES, ids=repr)
def test_current_contains_non_str(bad):
    """contains() of a non-str page hash -> TypeError naming page_hash, no change."""
    for pool in CURRENT_POOLS:
        check_current(lambda c, p=pool: c.pool(p).contains(bad), TypeError, "page_hash")


@pytest.mark.parametrize("bad", BAD_KEEP_TYPE, ids=repr)
def test_current_keep_pages_type(bad):
    """invalidate_beyond with a non-int or bool keep_pages -> TypeError, no change."""
    for make in FEEDS:
        check_current(
            lambda c, m=make: c.pool("kv").invalidate_beyond(m(["b", "c", "f"]), bad),
            TypeError,
            "keep_pages",
        )


@pytest.mark.parametrize("bad", BAD_KEEP_VALUE)
def test_current_keep_pages_negative(bad):
    """invalidate_beyond with a negative keep_pages -> ValueError, no change."""
    for make in FEEDS:
        check_current(
            lambda c, m=make: c.pool("kv").invalidate_beyond(m(["b", "c", "f"]), bad),
            ValueError,
            "keep_pages",
        )


@pytest.mark.parametrize(
    "bad,exc",
    [(v, TypeError) for v in BAD_CAP_TYPE] + [(v, ValueError) for v in BAD_CAP_VALUE],
    ids=repr,
)
def test_current_max_entries(bad, exc):
    """A bad max_entries in the constructor or either setter -> the right error, no change."""
    with pytest.raises(exc) as info:
        he.StorageExistenceCache(bad)
    assert "max_entries" in str(info.value)
    with pytest.raises(exc) as info:
        he.StorageExistenceCache(max_entries=bad)
    assert "max_entries" in str(info.value)

    def set_cache(cache):
        cache.max_entries = bad

    def set_pool(cache):
        cache.pool("kv").max_entries = bad

    check_current(set_cache, exc, "max_entries")
    check_current(set_pool, exc, "max_entries")


@pytest.mark.parametrize(
    "bad,exc", [("", ValueError)] + [(v, TypeError) for v in BAD_POOL_TYPE], ids=repr
)
def test_current_pool_name(bad, exc):
    """pool() with an empty or non-str name -> the right error naming name, no pool created."""
    check_current(lambda c: c.pool(bad), exc, "name")


HEAL_QUERY_CASES = [
    (["b", "c", 5], 1, TypeError, ("chain", "hashes")),
    ("bc", 1, TypeError, ("chain", "hashes")),
    (["b", "c"], -1, ValueError, ("hit_pages", "keep_pages")),
    (["b", "c"], 1.0, TypeError, ("hit_pages", "keep_pages")),
    (["b", "c"], True, TypeError, ("hit_pages", "keep_pages")),
]
HEAL_TRANSFER_CASES = [
    (["b", None], 1, TypeError, "keys"),
    (["b", "c"], True, TypeError, ("delivered_pages", "keep_pages")),
    (["b", "c"], -2, ValueError, ("delivered_pages", "keep_pages")),
]
POLICIES = [he.ChainPagesPolicy, he.TrailingWindowPolicy]


@pytest.mark.parametrize("evidence", [False, True])
@pytest.mark.parametrize("chain,hit,exc,arg", HEAL_QUERY_CASES, ids=repr)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda c: c.__name__)
def test_current_heal_from_query_rejects(policy, chain, hit, exc, arg, evidence):
    """heal_from_query with a bad chain or hit count raises like the pool methods, no change."""
    check_current(
        lambda c: policy().heal_from_query(c.pool("kv"), chain, [], hit, evidence=evidence),
        exc,
        arg,
    )


class _Reiterable:
    """An iterable of pages that is not a Sequence (no slicing)."""

    def __init__(self, items):
        self._items = list(items)

    def __iter__(self):
        return iter(self._items)


@pytest.mark.parametrize("make", [as_generator, as_iterator, _Reiterable], ids=lambda f: f.__name__)
@pytest.mark.parametrize("evidence", [False, True])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda c: c.__name__)
def test_current_heal_from_query_non_sequence_chain(policy, evidence, make):
    """A non-Sequence chain either heals like a list would, or raises and changes nothing."""
    chain = ["b", "c", "f", "zz"]
    want = current_cache()
    policy().heal_from_query(want.pool("kv"), list(chain), [], 1, evidence=evidence)
    cache = current_cache()
    before = current_snapshot(cache)
    try:
        policy().heal_from_query(cache.pool("kv"), make(chain), [], 1, evidence=evidence)
    except TypeError as err:
        assert current_snapshot(cache) == before, f"changed before raising {err!r}"
        assert "chain" in str(err), str(err)
    else:
        assert current_snapshot(cache) == current_snapshot(want)


@pytest.mark.parametrize("keys,delivered,exc,arg", HEAL_TRANSFER_CASES, ids=repr)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda c: c.__name__)
def test_current_heal_from_transfer_rejects(policy, keys, delivered, exc, arg):
    """heal_from_transfer with bad keys or a bad delivered count raises, no change."""
    # The policy passes ``keys`` on as invalidate_beyond's ``hashes``.
    names = (arg, "hashes") if isinstance(arg, str) else arg
    check_current(lambda c: policy().heal_from_transfer(c.pool("kv"), keys, delivered), exc, names)


# ---------------------------------------------------------------------------
# Seed generation
# ---------------------------------------------------------------------------

FLAT_BATCH_METHODS = ["add", "contains_all", "covers_all", "invalidate_beyond"]
# "kv" is known, "brandnew" is not: a rejected call must not make it known.
FLAT_POOLS = ["kv", "brandnew"]


def _flat_call(pool, method, hashes):
    def call(cache):
        if method == "invalidate_beyond":
            return cache.invalidate_beyond(pool, hashes, 1)
        if method == "covers_all":
            return cache.covers_all(pool, hashes, extra_cover={"zz"})
        return getattr(cache, method)(pool, hashes)

    return call


@pytest.mark.parametrize("bad", BAD_PAGES, ids=repr)
@pytest.mark.parametrize("method", FLAT_BATCH_METHODS)
def test_flat_non_str_page_anywhere(method, bad):
    """A non-str page anywhere in a batch, even after the first miss -> TypeError, no change."""
    for pool in FLAT_POOLS:
        for prefix in PREFIXES:
            for batch in ([*prefix, bad], [*prefix, bad, "c"], [bad, *prefix]):
                for make in FEEDS:
                    check_flat(_flat_call(pool, method, make(batch)), TypeError, "hashes")


@pytest.mark.parametrize("bad", BAD_BATCHES, ids=repr)
@pytest.mark.parametrize("method", FLAT_BATCH_METHODS)
def test_flat_bad_hashes_argument(method, bad):
    """A bare str/bytes or a non-iterable as hashes -> TypeError naming hashes, no change."""
    for pool in FLAT_POOLS:
        check_flat(_flat_call(pool, method, bad), TypeError, "hashes")


@pytest.mark.parametrize("method", FLAT_BATCH_METHODS)
def test_flat_failing_iterable(method):
    """An iterable that raises part-way propagates its error and changes nothing."""
    for pool in FLAT_POOLS:
        check_flat(_flat_call(pool, method, exploding(["b", "c"])), Boom, "boom")


@pytest.mark.parametrize("bad", BAD_PAGES, ids=repr)
def test_flat_contains_non_str(bad):
    """contains() of a non-str page hash -> TypeError naming page_hash, no change."""
    for pool in FLAT_POOLS:
        check_flat(lambda c, p=pool: c.contains(p, bad), TypeError, "page_hash")


@pytest.mark.parametrize("bad", BAD_KEEP_TYPE, ids=repr)
def test_flat_keep_pages_type(bad):
    """invalidate_beyond with a non-int or bool keep_pages -> TypeError, no change."""
    for pool in FLAT_POOLS:
        for make in FEEDS:
            check_flat(
                lambda c, p=pool, m=make: c.invalidate_beyond(p, m(["a", "b", "c"]), bad),
                TypeError,
                "keep_pages",
            )


@pytest.mark.parametrize("bad", BAD_KEEP_VALUE)
def test_flat_keep_pages_negative(bad):
    """invalidate_beyond with a negative keep_pages -> ValueError, no change."""
    for pool in FLAT_POOLS:
        for make in FEEDS:
            check_flat(
                lambda c, p=pool, m=make: c.invalidate_beyond(p, m(["a", "b", "c"]), bad),
                ValueError,
                "keep_pages",
            )


FLAT_POOL_CALLS = {
    "add": lambda c, p: c.add(p, ["a"]),
    "contains": lambda c, p: c.contains(p, "a"),
    "contains_all": lambda c, p: c.contains_all(p, ["a"]),
    "covers_all": lambda c, p: c.covers_all(p, ["a"], extra_cover={"a"}),
    "invalidate_beyond": lambda c, p: c.invalidate_beyond(p, ["a", "b"], 0),
}


@pytest.mark.parametrize(
    "bad,exc", [("", ValueError)] + [(v, TypeError) for v in BAD_POOL_TYPE], ids=repr
)
@pytest.mark.parametrize("method", sorted(FLAT_POOL_CALLS))
def test_flat_pool_name(method, bad, exc):
    """Every flat method with an empty or non-str pool -> the right error, no change."""
    check_flat(lambda c: FLAT_POOL_CALLS[method](c, bad), exc, "pool")


@pytest.mark.parametrize("bad", [5, None, object(), 1.5])
def test_flat_extra_cover_not_a_container(bad):
    """covers_all with an extra_cover that does not support `in` -> TypeError, no change."""
    for pool in FLAT_POOLS:
        check_flat(
            lambda c, p=pool: c.covers_all(p, ["b", "zz"], extra_cover=bad),
            TypeError,
            "extra_cover",
        )


@pytest.mark.parametrize(
    "bad,exc",
    [(v, TypeError) for v in BAD_CAP_TYPE] + [(v, ValueError) for v in BAD_CAP_VALUE],
    ids=repr,
)
def test_flat_max_entries(bad, exc):
    """A bad max_entries in the constructor or the setter -> the right error, no change."""
    with pytest.raises(exc) as info:
        he.FlatStorageExistenceCache(bad)
    assert "max_entries" in str(info.value)
    with pytest.raises(exc) as info:
        he.FlatStorageExistenceCache(max_entries=bad)
    assert "max_entries" in str(info.value)

    def set_cap(cache):
        cache.max_entries = bad

    check_flat(set_cap, exc, "max_entries")


# ---------------------------------------------------------------------------
# The names the messages use are the upstream parameter names (drop-in callers
# may pass them as keywords).
# ---------------------------------------------------------------------------

UPSTREAM_SIGNATURES = {
    (he.StorageExistenceCache, "__init__"): ["self", "max_entries"],
    (he.StorageExistenceCache, "pool"): ["self", "name"],
    (he.PoolBeliefs, "add"): ["self", "hashes"],
    (he.PoolBeliefs, "contains"): ["self", "page_hash"],
    (he.PoolBeliefs, "contains_all"): ["self", "hashes"],
    (he.PoolBeliefs, "covered"): ["self", "hashes"],
    (he.PoolBeliefs, "track_inflight"): ["self", "hashes"],
    (he.PoolBeliefs, "untrack_inflight"): ["self", "hashes"],
    (he.PoolBeliefs, "invalidate_beyond"): ["self", "hashes", "keep_pages"],
    (he.ChainPagesPolicy, "heal_from_query"): [
        "self",
        "beliefs",
        "chain",
        "keys",
        "hit_pages",
        "evidence",
    ],
    (he.TrailingWindowPolicy, "heal_from_query"): [
        "self",
        "beliefs",
        "chain",
        "keys",
        "hit_pages",
        "evidence",
    ],
    (he.PoolBeliefPolicy, "heal_from_transfer"): [
        "self",
        "beliefs",
        "keys",
        "delivered_pages",
    ],
}


def _flat_signatures():
    cls = he.FlatStorageExistenceCache
    return {
        (cls, "__init__"): ["self", "max_entries"],
        (cls, "add"): ["self", "pool", "hashes"],
        (cls, "contains"): ["self", "pool", "page_hash"],
        (cls, "contains_all"): ["self", "pool", "hashes"],
        (cls, "covers_all"): ["self", "pool", "hashes", "extra_cover"],
        (cls, "invalidate_beyond"): ["self", "pool", "hashes", "keep_pages"],
    }


def test_signatures_keep_upstream_parameter_names():
    """Public methods keep upstream's parameter names (the names error messages use)."""
    for (cls, method), names in {**UPSTREAM_SIGNATURES, **_flat_signatures()}.items():
        params = list(inspect.signature(getattr(cls, method)).parameters)
        assert params[: len(names)] == names, (cls.__name__, method, params)
