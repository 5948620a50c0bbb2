"""Deferred miss classification gives every miss the reason it had when it happened."""

from __future__ import annotations

import hicache_existence as he
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence_bench import workload


def test_reason_is_fixed_at_miss_time_even_if_the_page_is_evicted_later():
    """A cold miss stays cold although the page is added and evicted before settle()."""
    cache = he.StorageExistenceCache(4, miss_memory=GhostFactory(4, memory_fraction=1.0))
    kv = cache.pool("kv")
    page = workload.chain(7, 1, "late")[0]
    assert not kv.contains(page)  # cold now
    kv.add([page])
    kv.add(workload.chain(8, 4, "filler"))  # evicts page: the memory now says "evicted"
    cache.settle()
    stats = kv.stats()
    assert (stats.misses_cold, stats.misses_evicted) == (1, 0)
    assert not kv.contains(page)  # this miss happens after the eviction
    cache.settle()
    assert kv.stats().misses_evicted == 1


def test_flat_reason_is_fixed_at_miss_time():
    """The flat generation settles a pool's misses before its memory changes."""
    cache = he.FlatStorageExistenceCache(3, miss_memory=GhostFactory(3, memory_fraction=1.0))
    page = workload.chain(9, 1, "flatlate")[0]
    assert not cache.contains("swa", page)
    cache.add("swa", [page])
    cache.invalidate_beyond("swa", [page], 0)
    cache.settle()
    assert cache.stats()["swa"].misses_cold == 1
    assert cache.stats()["swa"].misses_invalidated == 0


def test_misses_wait_for_settle_and_then_sum_to_page_misses():
    """Unsettled misses are counted as misses but not yet by reason."""
    cache = he.StorageExistenceCache(10, miss_memory=GhostFactory(10, memory_fraction=1.0))
    kv = cache.pool("kv")
    for page in workload.chain(1, 5, "pending"):
        assert not kv.contains(page)
    before = kv.stats()
    assert before.page_misses == 5 and sum(before.misses_by_reason.values()) == 0
    cache.settle()
    after = kv.stats()
    assert after.misses_cold == 5 and sum(after.misses_by_reason.values()) == after.page_misses
