"""The one-pass belief-only curve equals running the real StorageExistenceCache at
each cap: hits (the cache's refreshes) and evictions, for every cap, on random
streams, on chain-shaped streams and on the Mooncake trace."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay_trace import mooncake_trace

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.replay.mattson import belief_only_curves
from hicache_existence.replay.pages import PageRequest, expand
from hicache_existence.replay.trace import read_trace


def requests_of(chains: list[list[str]], pool: str = "kv") -> list[PageRequest]:
    """Page requests, one per chain."""
    return [
        PageRequest(float(i), pool, tuple(c), (len(c),) if c else ()) for i, c in enumerate(chains)
    ]


def real_cache(requests: list[PageRequest], cap: int) -> dict[str, tuple[int, int, int]]:
    """(refreshes, evictions, inserts) per pool of the real cache in belief-only mode."""
    cache = StorageExistenceCache(cap)
    for r in requests:
        cache.pool(r.pool).add(r.pages)
    stats = cache.stats()
    return {name: (s.refreshes, s.evictions, s.inserts) for name, s in stats.items()}


def check_every_cap(requests: list[PageRequest], caps: list[int]) -> None:
    """Mattson's hits/evictions/misses equal the real cache's at each cap, per pool."""
    curves = belief_only_curves(requests)
    for cap in caps:
        real = real_cache(requests, cap)
        for pool, (refreshes, evictions, inserts) in real.items():
            curve = curves[pool]
            assert curve.hits(cap) == refreshes, (pool, cap)
            assert curve.evictions(cap) == evictions, (pool, cap)
            assert curve.misses(cap) == inserts, (pool, cap)


page = st.integers(min_value=0, max_value=24).map(lambda i: f"p{i}")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(page, max_size=10), max_size=40))
def test_random_streams_match_the_real_cache_at_every_cap(chains: list[list[str]]) -> None:
    """Arbitrary streams (repeats inside a request included) match the real cache for caps 1..30."""
    check_every_cap(requests_of(chains), list(range(1, 31)))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 12), st.integers(0, 3)),
        min_size=1,
        max_size=40,
    )
)
def test_chain_streams_match_the_real_cache(spec: list[tuple[int, int, int]]) -> None:
    """Prefix-sharing chains (the shape the run optimisation relies on) match at every cap."""
    chains = []
    for root, length, branch in spec:
        shared = [f"r{root}-{i}" for i in range(length)]
        tail = [f"r{root}-b{branch}-{i}" for i in range(branch)]
        chains.append(shared + tail)
    check_every_cap(requests_of(chains), list(range(1, 60)))


def test_pools_are_separate_lrus() -> None:
    """Each pool has its own curve, equal to that pool of the real cache."""
    rng = random.Random(7)
    requests = []
    for i in range(300):
        pool = "kv" if i % 3 else "swa"
        n = rng.randint(0, 12)
        start = rng.randint(0, 40)
        requests.append(
            PageRequest(float(i), pool, tuple(f"{pool}{start + j}" for j in range(n)), (n,))
        )
    check_every_cap(requests, [1, 2, 5, 10, 20, 40, 80])
    curves = belief_only_curves(requests)
    assert set(curves) == {"kv", "swa"}


def test_curve_edges() -> None:
    """Empty stream: ratio 1.0; a cap below 1 is refused; beyond distinct, hits stop growing."""
    curve = belief_only_curves(requests_of([["a", "b"], ["a", "b"], ["c"]]))["kv"]
    assert curve.references == 5
    assert curve.cold == 3
    assert curve.distinct == 3
    assert curve.hits(2) == 2
    assert curve.hits(1) == 1  # the chain's last page survives a cap of 1
    assert curve.hits(10**9) == curve.hits(3) == 2
    assert curve.entries(2) == 2
    empty = belief_only_curves(requests_of([[]]))["kv"]
    assert empty.hit_ratio(5) == 1.0


def test_mooncake_trace_matches_the_real_cache() -> None:
    """On the Mooncake trace (958,200 page refs) Mattson equals the real cache at four caps."""
    pages = expand(read_trace(mooncake_trace()))
    check_every_cap(list(pages.requests), [4096, 65536, 200_000, 400_000])
    curve = belief_only_curves(pages)["kv"]
    assert curve.references == 958_200
    assert curve.distinct == curve.cold == 335_388
