"""Accounting snapshots: immutability, derived ratios, deltas, totals, and the cost
of taking a snapshot (O(pools), independent of the number of entries).
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from reference_models import COUNTERS, GAUGES  # the contract's field lists, once

import hicache_existence as he


def busy_cache():
    """A current-generation cache with two pools and known counters."""
    cache = he.StorageExistenceCache(4)
    kv = cache.pool("kv")
    kv.add(["a", "b", "c"])
    kv.contains_all(["a", "b", "x"])  # 2 hits + 1 miss
    kv.track_inflight(["y"])
    kv.covered(["c", "y"])  # 1 hit + 1 rescue
    cache.pool("swa").add(["p"])
    return cache


# ---------------------------------------------------------------------------
# Immutability
# ---------------------------------------------------------------------------


def test_pool_stats_is_frozen():
    """A PoolStats snapshot rejects attribute assignment and new attributes."""
    s = busy_cache().stats()["kv"]
    with pytest.raises(AttributeError):
        s.queries = 99
    with pytest.raises(AttributeError):
        s.entries = 99
    with pytest.raises((AttributeError, TypeError)):
        s.something_new = 1
    assert s.queries == 2


def test_cache_stats_is_frozen():
    """A CacheStats snapshot rejects item and attribute assignment, also through .pools."""
    stats = busy_cache().stats()
    kv = stats["kv"]
    with pytest.raises(TypeError):
        stats["kv"] = kv  # type: ignore[index]
    with pytest.raises(TypeError):
        del stats["kv"]  # type: ignore[attr-defined]
    with pytest.raises((AttributeError, TypeError)):
        stats.pools = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        stats.pools["other"] = kv  # type: ignore[index]
    assert list(stats) == ["kv", "swa"]


def test_snapshot_does_not_follow_the_cache():
    """A snapshot keeps its values while the cache moves on (also after new pools)."""
    cache = busy_cache()
    before = cache.stats()
    frozen = {name: dataclasses.astuple(s) for name, s in before.items()}
    total = dataclasses.astuple(before.total)
    cache.pool("kv").add(["q", "r", "s", "t"])
    cache.pool("kv").contains("q")
    cache.pool("mamba").add(["m"])
    cache.clear()
    assert {name: dataclasses.astuple(s) for name, s in before.items()} == frozen
    assert dataclasses.astuple(before.total) == total
    assert "mamba" not in before and "mamba" in cache.stats()


def test_taking_stats_changes_nothing():
    """stats() neither counts as a query nor touches the LRU order."""
    cache = busy_cache()
    kv = cache.pool("kv")
    order = kv.lru_keys()
    first = cache.stats()
    kv.stats()
    second = cache.stats()
    assert dict(first) == dict(second)
    assert kv.lru_keys() == order


def test_known_values():
    """The snapshot holds the counts the contract defines for a small known history."""
    kv = busy_cache().stats()["kv"]
    assert kv.pool == "kv"
    assert (kv.queries, kv.query_hits, kv.query_misses) == (2, 1, 1)
    assert (kv.pages_checked, kv.page_hits, kv.rescues, kv.page_misses) == (5, 3, 1, 1)
    assert (kv.adds, kv.inserts, kv.refreshes, kv.evictions) == (1, 3, 0, 0)
    assert (kv.entries, kv.capacity, kv.inflight) == (3, 4, 1)
    assert kv.inflight_tracked == 1


def test_new_pool_starts_at_zero():
    """A pool that was only created reports zero counters and its gauges."""
    cache = he.StorageExistenceCache(7)
    cache.pool("kv")
    s = cache.stats()["kv"]
    assert all(getattr(s, name) == 0 for name in COUNTERS)
    assert (s.entries, s.capacity, s.inflight) == (0, 7, 0)


def test_default_capacity_is_upstream():
    """Without max_entries a pool's capacity gauge is upstream's 512K default."""
    cache = he.StorageExistenceCache()
    assert cache.max_entries == he.HICACHE_EXISTENCE_CACHE_MAX_ENTRIES == 512 * 1024
    assert cache.pool("kv").stats().capacity == 512 * 1024
    flat = he.FlatStorageExistenceCache()
    flat.add("kv", [])
    assert flat.stats()["kv"].capacity == 512 * 1024


# ---------------------------------------------------------------------------
# Derived ratios
# ---------------------------------------------------------------------------


def test_ratios_are_one_with_no_requests():
    """With nothing asked, hit and coverage ratios are 1.0, the miss ratio 0.0 (like Caffeine)."""
    cache = he.StorageExistenceCache(4)
    cache.pool("kv").add(["a"])
    s = cache.stats()["kv"]
    assert s.queries == 0 and s.pages_checked == 0
    assert s.query_hit_ratio == 1.0
    assert s.page_hit_ratio == 1.0
    assert s.coverage_ratio == 1.0
    assert s.miss_ratio == 0.0
    empty_total = he.StorageExistenceCache(4).stats().total
    assert empty_total.query_hit_ratio == 1.0 and empty_total.page_hit_ratio == 1.0


def test_ratios_from_counts():
    """Ratios are the documented quotients of the counters."""
    s = busy_cache().stats()["kv"]
    assert s.query_hit_ratio == pytest.approx(1 / 2)
    assert s.miss_ratio == pytest.approx(1 / 2)
    assert s.page_hit_ratio == pytest.approx(3 / 5)
    assert s.coverage_ratio == pytest.approx(4 / 5)
    assert s.fill_ratio == pytest.approx(3 / 4)


def test_as_dict_is_json_ready():
    """as_dict() of a pool and of the cache is plain JSON data including the ratios."""
    stats = busy_cache().stats()
    data = json.loads(json.dumps(stats.as_dict()))
    assert data["pools"]["kv"]["queries"] == 2
    assert data["pools"]["kv"]["query_hit_ratio"] == pytest.approx(0.5)
    assert data["total"]["entries"] == 4


# ---------------------------------------------------------------------------
# Deltas and totals
# ---------------------------------------------------------------------------


def test_subtraction_gives_counter_deltas_and_newer_gauges():
    """newer - older: counters subtract, gauges keep the newer snapshot's value."""
    cache = busy_cache()
    kv = cache.pool("kv")
    older = cache.stats()
    kv.add(["d", "e"])  # 2 inserts, 1 eviction (cap 4)
    kv.contains_all(["d", "e", "zz"])  # 2 hits, 1 miss
    kv.untrack_inflight(["y"])
    newer = cache.stats()
    delta = newer - older
    d = delta["kv"]
    assert (d.adds, d.inserts, d.evictions) == (1, 2, 1)
    assert (d.queries, d.query_hits, d.query_misses) == (1, 0, 1)
    assert (d.pages_checked, d.page_hits, d.page_misses) == (3, 2, 1)
    assert d.inflight_released == 1
    for name in COUNTERS:
        assert getattr(d, name) == getattr(newer["kv"], name) - getattr(older["kv"], name)
    for name in GAUGES:
        assert getattr(d, name) == getattr(newer["kv"], name)
    assert (d.entries, d.capacity, d.inflight) == (4, 4, 0)
    # Ratios of a delta describe the interval.
    assert d.page_hit_ratio == pytest.approx(2 / 3)
    assert d.query_hit_ratio == 0.0
    # Unchanged pool: zero counters, current gauges.
    s = delta["swa"]
    assert all(getattr(s, name) == 0 for name in COUNTERS)
    assert s.entries == 1


def test_pool_stats_subtraction():
    """PoolStats - PoolStats follows the same rule as CacheStats."""
    cache = busy_cache()
    older = cache.pool("kv").stats()
    cache.pool("kv").contains("a")
    d = cache.pool("kv").stats() - older
    assert (d.queries, d.query_hits, d.page_hits) == (1, 1, 1)
    assert d.entries == 3


def test_subtraction_counts_a_new_pool_from_zero():
    """A pool absent from the older snapshot appears in the delta with its full counts."""
    cache = busy_cache()
    older = cache.stats()
    cache.pool("mamba").add(["m", "n"])
    delta = cache.stats() - older
    assert delta["mamba"].inserts == 2 and delta["mamba"].entries == 2


def test_delta_of_equal_snapshots_is_zero():
    """s - s has zero counters and s's gauges."""
    stats = busy_cache().stats()
    delta = stats - stats
    for name, s in delta.items():
        assert all(getattr(s, c) == 0 for c in COUNTERS), name
        assert (s.entries, s.capacity, s.inflight) == (
            stats[name].entries,
            stats[name].capacity,
            stats[name].inflight,
        )


def test_total_sums_pools_current_generation():
    """.total sums every counter and gauge over pools; per-pool caps sum too."""
    cache = busy_cache()
    cache.pool("swa").max_entries = 9
    cache.pool("swa").add([])
    stats = cache.stats()
    total = stats.total
    for name in COUNTERS + GAUGES:
        assert getattr(total, name) == sum(getattr(s, name) for s in stats.values()), name
    assert total.capacity == 4 + 9
    assert total.entries == len(cache.pool("kv")) + len(cache.pool("swa"))


def test_total_flat_generation_has_the_shared_capacity():
    """.total of the flat cache sums counters and entries but reports the one shared cap."""
    flat = he.FlatStorageExistenceCache(5)
    flat.add("kv", ["a", "b", "c"])
    flat.add("swa", ["a", "b", "c"])  # evicts kv's a
    flat.contains("mamba", "a")
    stats = flat.stats()
    total = stats.total
    for name in (*COUNTERS, "entries", "inflight"):
        assert getattr(total, name) == sum(getattr(s, name) for s in stats.values()), name
    assert total.capacity == 5
    assert all(s.capacity == 5 for s in stats.values())
    assert total.entries == len(flat) == 5
    assert stats["kv"].evictions == 1 and stats["swa"].evictions == 0


def test_total_of_a_delta():
    """.total of a delta is the delta of the totals (counters)."""
    cache = busy_cache()
    older = cache.stats()
    cache.pool("swa").contains_all(["p", "p"])
    cache.pool("kv").contains("zz")
    newer = cache.stats()
    dt = (newer - older).total
    for name in COUNTERS:
        assert getattr(dt, name) == getattr(newer.total, name) - getattr(older.total, name)


# ---------------------------------------------------------------------------
# Cost: O(pools), independent of entries
# ---------------------------------------------------------------------------


def _best_of(fn, rounds=7, calls=50):
    """The fastest per-call time over several rounds (robust to scheduler noise)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _compare(small_fn, big_fn):
    # Interleave so a slow patch of the machine hits both sides.
    small = min(_best_of(small_fn, rounds=2) for _ in range(4))
    big = min(_best_of(big_fn, rounds=2) for _ in range(4))
    return small, big


# An O(entries) stats() walking 200k entries costs milliseconds; O(pools) costs
# microseconds.  The bound leaves a 10x margin plus 100 us of absolute slack.
BIG = 200_000


def test_stats_cost_is_independent_of_entries_current():
    """stats() of a 200k-entry current cache is about as cheap as of a 10-entry one."""
    pools = ("kv", "swa", "mamba")
    small, big = he.StorageExistenceCache(BIG), he.StorageExistenceCache(BIG)
    for name in pools:
        small.pool(name).add([f"{name}{i}" for i in range(3)])
        big.pool(name).add([f"{name}{i}" for i in range(BIG // len(pools))])
    big.pool("kv").track_inflight([f"kv{i}" for i in range(10_000)])
    assert sum(s.entries for s in big.stats().values()) >= 199_000
    t_small, t_big = _compare(small.stats, big.stats)
    assert t_big < 10 * t_small + 100e-6, (t_small, t_big)
    t_small, t_big = _compare(lambda: small.stats().total, lambda: big.stats().total)
    assert t_big < 10 * t_small + 100e-6, (t_small, t_big)


def test_stats_cost_is_independent_of_entries_flat():
    """stats() of a 200k-entry flat cache is about as cheap as of a 10-entry one."""
    pools = ("kv", "swa", "mamba")
    small, big = he.FlatStorageExistenceCache(BIG), he.FlatStorageExistenceCache(BIG)
    for name in pools:
        small.add(name, [f"{name}{i}" for i in range(3)])
        big.add(name, [f"{name}{i}" for i in range(BIG // len(pools))])
    assert len(big) >= 199_000
    t_small, t_big = _compare(small.stats, big.stats)
    assert t_big < 10 * t_small + 100e-6, (t_small, t_big)
    t_small, t_big = _compare(lambda: small.stats().total, lambda: big.stats().total)
    assert t_big < 10 * t_small + 100e-6, (t_small, t_big)
