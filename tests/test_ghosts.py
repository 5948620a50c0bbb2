"""Miss-reason memory: classification, batch/per-key agreement, memory bound,
measured false-classification rates, the sampled debug event, bad input."""

from __future__ import annotations

import logging
import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_existence as he
from hicache_existence import logs
from hicache_existence.accounting import ghosts
from hicache_existence.accounting.ghosts import (
    FingerprintGhosts,
    GhostFactory,
)
from hicache_existence.config import Config
from hicache_existence.core.stats import CLEARED, COLD, EVICTED, INVALIDATED
from hicache_existence_bench import observability, workload

BIG = 1 << 20


def test_remembered_pages_report_their_reason():
    """Pages remembered with a reason are reported with it; unseen pages are cold."""
    g = FingerprintGhosts(BIG)
    keys = workload.chain(1, 300, "ghost")
    g.remember(keys[:100], EVICTED)
    g.remember(keys[100:200], INVALIDATED)
    g.remember(keys[200:], CLEARED)
    assert [g.reason(k) for k in keys] == [EVICTED] * 100 + [INVALIDATED] * 100 + [CLEARED] * 100
    assert all(g.reason(k) == COLD for k in workload.chain(2, 300, "never"))


def test_latest_departure_wins():
    """A page that left twice is reported with its most recent reason."""
    g = FingerprintGhosts(BIG)
    keys = workload.chain(1, 10, "twice")
    g.remember(keys, EVICTED)
    g.remember(keys[:5], CLEARED)
    assert [g.reason(k) for k in keys] == [CLEARED] * 5 + [EVICTED] * 5


@pytest.mark.parametrize("slots", [1, 100, 300, 7730, 70_000, 4_000_000])
def test_batch_path_equals_per_key_path(slots):
    """The bulk (bytes.fromhex) path writes exactly the slots the per-key path writes,
    at every table layout."""
    keys = workload.chain(5, 2000, "layout")
    fast, slow = FingerprintGhosts(slots), FingerprintGhosts(slots)
    fast.remember(keys, INVALIDATED)
    slow._remember_slow(keys, INVALIDATED)
    assert fast._table == slow._table
    assert fast.occupancy() > 0


@pytest.mark.skipif(ghosts._native is None, reason="compiled ghosts module not built")
@pytest.mark.parametrize("slots", [1, 100, 300, 7730, 70_000, 4_000_000])
def test_compiled_path_equals_the_python_batch_path(slots, monkeypatch):
    """The compiled scatter/gather (hicache_existence/accounting/_ghosts.c) writes and reads
    exactly what the pure-Python batch path does, at every table layout."""
    keys = workload.chain(5, 2000, "layout") + [k.upper() for k in workload.chain(6, 100, "up")]
    native, python = FingerprintGhosts(slots), FingerprintGhosts(slots)
    native.remember(keys, EVICTED)
    native.remember(keys[::7], CLEARED)
    monkeypatch.setattr(ghosts, "_native", None)
    python.remember(keys, EVICTED)
    python.remember(keys[::7], CLEARED)
    assert native._table == python._table
    probes = keys[::3] + workload.chain(7, 500, "cold")
    want = python.classify(probes)
    monkeypatch.undo()
    assert native.classify(probes) == want
    assert slots < 70_000 or set(want) >= {COLD, EVICTED, CLEARED}
    # A batch with one odd key writes nothing in C and takes the per-key path.
    odd = FingerprintGhosts(slots)
    native = ghosts._native
    assert native.remember(odd._table, [*keys[:5], "x"], EVICTED) is False
    assert odd.occupancy() == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.text(min_size=0, max_size=70), min_size=1, max_size=30),
    st.sampled_from([EVICTED, INVALIDATED, CLEARED]),
)
def test_any_text_keys_agree_between_paths(keys, reason):
    """Arbitrary str keys (newlines, non-ASCII, 64-char non-hex) take a path that
    agrees with reason(): the last key of a batch is always found."""
    fast, slow = FingerprintGhosts(4096), FingerprintGhosts(4096)
    fast.remember(keys, reason)
    slow._remember_slow(keys, reason)
    assert fast._table == slow._table
    assert fast.reason(keys[-1]) == reason


def test_a_newline_inside_a_key_never_shifts_the_batch_lanes(monkeypatch):
    """Keys whose lengths add up right but hide a separator must not take the
    batch path, with or without the compiled module (review finding: the Python
    batch path wrote slots that reason() never reads)."""
    keys = ["0123abcd" + "x" * 22, "y" * 33 + "\n" + "deadbeef" + "z" * 56]
    for native in (ghosts._native, None):
        monkeypatch.setattr(ghosts, "_native", native)
        g = FingerprintGhosts(4096)
        g.remember(keys, EVICTED)
        assert [g.reason(k) for k in keys] == [EVICTED, EVICTED]
        assert g.classify(keys) == [EVICTED, EVICTED]


def test_hex_keys_with_upper_case_and_mixed_batches():
    """Upper-case hex, and a batch mixing hex and other keys, stay consistent."""
    hexes = workload.chain(9, 50, "mix")
    keys = [k.upper() for k in hexes[:25]] + hexes[25:] + ["short", "x" * 64]
    g = FingerprintGhosts(BIG)
    g.remember(keys, EVICTED)
    assert all(g.reason(k) == EVICTED for k in keys)


def _traced_growth(build):
    """Bytes ``build()`` leaves allocated (tracemalloc), and its result."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = build()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, result


def test_memory_is_at_most_ten_percent_of_the_cache_at_full_cap():
    """At the default 512K cap the miss memory's allocation, measured with
    tracemalloc, is 5-10% of a full pool's measured allocation (not of the
    constant the budget is computed from), and nbytes reports it."""
    cap = 512 * 1024
    keys = [f"{i:064x}" for i in range(cap)]  # hash strings exist beforehand
    cache = he.StorageExistenceCache(cap)
    pool = cache.pool("kv")
    cache_bytes, _ = _traced_growth(lambda: pool.add(keys))
    assert pool.stats().entries == cap
    factory = GhostFactory(cap)
    ghost_bytes, memory = _traced_growth(lambda: factory("kv"))
    ratio = ghost_bytes / cache_bytes
    print(f"miss memory {ghost_bytes} B = {ratio:.2%} of the full pool ({cache_bytes} B)")
    assert 0.05 <= ratio <= 0.10, (ghost_bytes, cache_bytes, ratio)
    assert memory.nbytes <= ghost_bytes <= memory.nbytes * 1.01, (memory.nbytes, ghost_bytes)
    assert factory.nbytes_by_pool() == {"kv": memory.nbytes}


def test_cold_pages_are_rarely_reported_left_with_a_full_table():
    """With every slot written, fewer than 2% of never-seen pages are misreported."""
    g = FingerprintGhosts(65536)
    for i in range(40):
        g.remember(workload.chain(i, 16384, "fill"), EVICTED)
    assert g.occupancy() > 0.99
    probes = workload.chain(999, 20000, "probe")
    wrong = sum(g.reason(k) != COLD for k in probes) / len(probes)
    assert wrong < 0.02, wrong


def test_old_traces_fade_out_gradually():
    """A trace survives n later departures with probability about exp(-n/slots)."""
    g = FingerprintGhosts(65536)
    first = workload.chain(1, 5000, "old")
    g.remember(first, EVICTED)
    g.remember(workload.chain(2, 65536, "newer"), EVICTED)  # n = slots
    kept = sum(g.reason(k) == EVICTED for k in first) / len(first)
    assert 0.30 < kept < 0.45, kept  # exp(-1) = 0.37


def test_cache_classifies_every_reason_current_generation():
    """StorageExistenceCache with a GhostFactory counts cold/evicted/invalidated/cleared."""
    cache = he.StorageExistenceCache(100, miss_memory=GhostFactory(100, memory_fraction=1.0))
    kv = cache.pool("kv")
    a, b, c = (workload.chain(i, 60, "cur") for i in range(3))
    kv.add(a)
    kv.add(b)  # evicts a[:20]
    kv.invalidate_beyond(b, 50)  # drops b[50:]
    assert not kv.contains_all(a)  # evicted
    assert not kv.contains_all(b)  # b[:50] hits, b[50] invalidated
    assert not kv.contains(c[0])  # cold
    survivors = list(kv.lru_keys())
    cache.clear()
    assert not kv.contains(survivors[0])  # cleared
    assert cache.stats()["kv"].misses_cleared == 0  # classified at the next settle
    cache.settle()
    stats = cache.stats()["kv"]
    assert dict(stats.misses_by_reason) == {"cold": 1, "evicted": 1, "invalidated": 1, "cleared": 1}
    assert sum(stats.misses_by_reason.values()) == stats.page_misses


def test_cache_classifies_every_reason_flat_generation():
    """FlatStorageExistenceCache attributes reasons per pool, primary and others."""
    factory = GhostFactory(100, memory_fraction=1.0)
    cache = he.FlatStorageExistenceCache(100, miss_memory=factory)
    a, b = workload.chain(1, 60, "flat"), workload.chain(2, 60, "flat")
    cache.add("swa", a)
    cache.add("kv", b)  # evicts swa a[:20]
    assert not cache.contains_all("swa", a)
    cache.invalidate_beyond("kv", b, 59)
    assert not cache.contains("kv", b[59])
    cache.settle()
    stats = cache.stats()
    assert stats["swa"].misses_evicted == 1
    assert stats["kv"].misses_invalidated == 1
    assert set(factory.memories()) == {"swa", "kv"}


def test_measured_false_classification_rates():
    """On a Zipf prefill workload with heals and a clear, compared miss by miss with
    an exact reference: evicted misses of the last cap's worth of evictions are
    found >= 85% of the time and cold misses are misreported < 2% of the time."""
    runs = observability.default_accuracy_runs(quick=True)
    result = runs[0]
    assert result.misses > 500
    recent = result.evicted_by_age
    found = recent.get(("<=1x cap", True), 0)
    lost = recent.get(("<=1x cap", False), 0)
    assert found / (found + lost) >= 0.85
    assert result.rate("cold", "evicted") < 0.02
    assert {a for a, _ in result.pairs} >= {"cold", "evicted", "invalidated", "cleared"}


def test_accuracy_runs_refuse_a_missing_trace(tmp_path):
    """A trace path that does not exist raises (it used to drop the Mooncake rows
    silently, so a wrong path printed a shorter table that looked complete)."""
    with pytest.raises(FileNotFoundError, match="Mooncake trace not found"):
        observability.default_accuracy_runs(tmp_path / "traces" / "missing.jsonl", quick=True)


def test_sampled_debug_event_is_rate_limited(caplog):
    """Every sample_every-th miss may emit one debug event (pool, reason, hash
    prefix), at most debug_events_per_s per second."""
    now = [0.0]
    g = FingerprintGhosts(
        BIG, pool="swa", debug_events_per_s=1.0, sample_every=2, clock=lambda: now[0]
    )
    keys = workload.chain(3, 10, "trace")
    g.remember(keys, EVICTED)
    with caplog.at_level(logging.DEBUG, logger="hicache_existence.accounting.ghosts"):
        for k in keys[:6]:  # 3 sampled misses in the same second: 1 event
            g.reason(k)
        now[0] = 5.0
        g.reason(keys[6])
        g.reason(keys[7])  # sampled, a new second: 1 more event
    events = [r for r in caplog.records if getattr(r, "hicache_event", None) == logs.MISS_TRACED]
    assert len(events) == 2
    fields = events[0].hicache_fields
    assert fields == {"pool": "swa", "reason": "evicted", "page_hash_prefix": keys[1][:12]}


def test_no_debug_event_when_debug_is_off(caplog):
    """With the logger above DEBUG, no event and no rate-limiter work happen."""
    g = FingerprintGhosts(BIG, sample_every=1)
    with caplog.at_level(logging.INFO, logger="hicache_existence.accounting.ghosts"):
        for k in workload.chain(4, 20, "quiet"):
            g.reason(k)
    assert not caplog.records


def test_factory_from_config_and_bad_input():
    """GhostFactory reads its sizes from Config; bad arguments name themselves."""
    config = Config.from_mapping(
        {"cache": {"max_entries": 1000}, "miss_reasons": {"memory_fraction": 0.05}}
    )
    factory = GhostFactory.from_config(config)
    assert factory.max_entries == 1000 and factory.memory_fraction == 0.05
    with pytest.raises(ValueError, match="memory_fraction"):
        GhostFactory(10, memory_fraction=0)
    with pytest.raises(TypeError, match="memory_fraction"):
        GhostFactory(10, memory_fraction="0.1")
    with pytest.raises(ValueError, match="max_entries"):
        GhostFactory(0)
    with pytest.raises(TypeError, match="slots"):
        FingerprintGhosts(1.5)
    with pytest.raises(ValueError, match="debug_events_per_s"):
        FingerprintGhosts(10, debug_events_per_s=-1)
    with pytest.raises(ValueError, match="pool"):
        FingerprintGhosts(10, pool="")


def test_remember_rejects_cold_and_unknown_reasons_without_change():
    """remember() accepts only EVICTED/INVALIDATED/CLEARED and then changes nothing."""
    g = FingerprintGhosts(4096)
    for bad in (COLD, 4, -1, "evicted"):
        with pytest.raises(ValueError, match="reason"):
            g.remember(["a"], bad)
    assert g.occupancy() == 0
    g.remember([], EVICTED)
    assert g.occupancy() == 0


def _random_keys(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [f"{r.getrandbits(256):064x}" for _ in range(n)]


@pytest.mark.parametrize("cap", [10981, 100_000])
def test_departures_spread_evenly_over_the_slots(cap: int) -> None:
    """As many departures as slots fill 1 - 1/e of them, as uniform hashing does:
    every slot gets an even share (a top byte scaled to an odd number of values gave
    some slots twice the traffic, so traces faded faster than documented)."""
    g = GhostFactory(cap, debug_events_per_s=0)("kv")
    keys = _random_keys(g.slots, 1)
    for i in range(0, len(keys), 65536):
        g.remember(keys[i : i + 65536], EVICTED)
    expected = 1 - math.exp(-1)
    sd = math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / g.slots)
    assert abs(g.occupancy() - expected) < 6 * sd + 1e-3, (g.slots, g.occupancy())


def test_traces_survive_slots_departures_with_probability_1_over_e() -> None:
    """docs/metrics.md's exp(-n / slots), at n = slots, on a table of the docs' size."""
    g = GhostFactory(10981, debug_events_per_s=0)("kv")
    hits = total = 0
    for rep in range(40):
        g.clear()
        targets = _random_keys(g.slots // 64, 100 + rep)
        g.remember(targets, EVICTED)
        g.remember(_random_keys(g.slots, 1000 + rep), INVALIDATED)
        hits += sum(r == EVICTED for r in g.classify(targets))
        total += len(targets)
    assert hits / total == pytest.approx(math.exp(-1), rel=0.025)


def test_any_table_size_is_used_whole() -> None:
    """The table is the budget, not rounded down to a multiple of 2**16."""
    for cap in (32_768, 49_152, 65_536, 524_288):
        factory = GhostFactory(cap, debug_events_per_s=0)
        assert factory("kv").slots == factory.slots
        assert factory.slots > 0.95 * 0.10 * ghosts.CACHE_BYTES_PER_ENTRY * cap
