"""Snapshots read from another thread never iterate a dict the scheduler thread
may grow.

A scrape thread's ``stats()`` walked ``list(pools.items())``.  Building that list
allocates a tuple per pool, and on Python 3.11 an allocation can run the garbage
collector on the spot; a collection can run Python code (finalizers, ``gc``
callbacks), the interpreter can switch threads there, and a scheduler thread
that creates a pool at that moment makes the scrape raise "dictionary changed
size during iteration" (seen once in CI, in ``test_scrape_stress``).

These tests make that interleaving certain instead of rare: a ``gc`` callback
creates a pool at every collection that starts inside the snapshot, and the
collection threshold is 1 so any container allocation collects.  Python 3.12
and later run the collector only between bytecodes, so there the race cannot
happen and these tests pass either way; on 3.10 and 3.11 (CI's main pass) they
fail when a snapshot iterates the live dict.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator
from typing import TypeVar

import hicache_existence as he
from hicache_existence.accounting.advisor import CapacityAdvisor
from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.accounting.writes import WriteAccounting

PAGE = "ab" * 32
POOLS = [f"p{i}" for i in range(40)]
T = TypeVar("T")


def collect_inside(snapshot: Callable[[], T], grow: Callable[[], object]) -> T:
    """``snapshot()``, with ``grow()`` run by every collection that starts while it
    runs (and a check that one did)."""
    fired = 0

    def grow_now(phase: str, info: dict[str, int]) -> None:
        nonlocal fired
        if phase == "start":
            fired += 1
            grow()

    gc.collect()
    # Small tuples come from a free list that never collects; hold enough of them
    # that the snapshot's tuples are fresh allocations, as under load.
    hold = [(i, -i) for i in range(10_000)]
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(grow_now)
    try:
        result = snapshot()
    finally:
        gc.callbacks.remove(grow_now)
        gc.set_threshold(*old)
    del hold
    assert fired, "no collection ran inside the snapshot"
    return result


def _names() -> Iterator[str]:
    return (f"late{i}" for i in itertools.count(1))


def test_current_generation_stats() -> None:
    cache = he.StorageExistenceCache(1000)
    for name in POOLS:
        cache.pool(name).add([PAGE])
    late = _names()
    stats = collect_inside(cache.stats, lambda: cache.pool(next(late)).add([PAGE]))
    assert set(POOLS) <= set(stats)


def test_flat_generation_stats() -> None:
    cache = he.FlatStorageExistenceCache(1000)
    for name in POOLS:
        cache.add(name, [PAGE])
    late = _names()
    stats = collect_inside(cache.stats, lambda: cache.add(next(late), [PAGE]))
    assert set(POOLS) <= set(stats)


def test_ghost_memory_by_pool() -> None:
    ghosts = GhostFactory(64)
    for name in POOLS:
        ghosts(name)
    late = _names()
    sizes = collect_inside(ghosts.nbytes_by_pool, lambda: ghosts(next(late)))
    assert set(POOLS) <= set(sizes)


def test_write_stats() -> None:
    writes = WriteAccounting(page_size_bytes=64)
    for name in POOLS:
        writes.written(name, 1)
    late = _names()
    stats = collect_inside(writes.stats, lambda: writes.written(next(late), 1))
    assert set(POOLS) <= set(stats)


def test_advisor_snapshot() -> None:
    advisor = CapacityAdvisor()
    for name in POOLS:
        advisor.sampler(name)
    late = _names()
    snap = collect_inside(lambda: advisor.snapshot(100), lambda: advisor.sampler(next(late)))
    assert set(POOLS) <= set(snap.pools)
