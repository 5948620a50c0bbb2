"""The capacity advisor: exact at sampling rate 1, within 0.02 of the exact curve at
the default rate on the Mooncake trace and on a synthetic long-context workload,
fed by the cache's index exactly as by hand, bounded, and never raising."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay_trace import mooncake_trace

from hicache_existence.accounting.advisor import (
    MULTIPLIERS,
    SHARED_POOL,
    CapacityAdvisor,
    multiplier_label,
)
from hicache_existence.config import AdvisorSection, Config
from hicache_existence.core import lru
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.sampler import PySampler
from hicache_existence.exporters.catalog import FEATURE_BY_NAME
from hicache_existence.replay.mattson import belief_only_curves
from hicache_existence.replay.model import ModelConfig, run_model
from hicache_existence.replay.pages import PageRequest, PageTrace, expand
from hicache_existence.replay.synthetic import long_context_requests
from hicache_existence.replay.trace import read_trace
from hicache_existence_bench.advisor import SYNTHETIC

HEX = [f"{random.Random(i).getrandbits(256):064x}" for i in range(64)]


BACKENDS = ["c", "python"] if lru.BACKEND == "c" else ["python"]


@contextmanager
def index_backend(name: str) -> Iterator[None]:
    """Caches built inside use the compiled (``c``) or the pure-Python index, and
    so the matching sampler."""
    saved = lru.LruIndex
    lru.LruIndex = lru.PyLruIndex if name == "python" else (lru.c_index() or saved)
    try:
        yield
    finally:
        lru.LruIndex = saved


def exact_advisor(backend: str = lru.BACKEND) -> CapacityAdvisor:
    """Sampling rate 1 and room for every page: no estimation error at all."""
    factory = PySampler if backend == "python" else None
    return CapacityAdvisor(1.0, max_sampled_pages=1 << 16, sampler_factory=factory)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), max_size=9), max_size=40))
def test_rate_one_equals_the_exact_curve(backend: str, chains: list[list[int]]) -> None:
    """At rate 1 the advisor's curve is the Mattson curve at every cap, on both samplers."""
    requests = [PageRequest(0.0, "kv", tuple(HEX[i] for i in c), ()) for c in chains]
    advisor = exact_advisor(backend)
    for request in requests:
        advisor.added("kv", request.pages)
    if not requests or not any(r.pages for r in requests):
        return
    curve = belief_only_curves(requests)["kv"]
    for cap in range(1, 35):
        assert advisor.estimate("kv", cap) == pytest.approx(curve.hit_ratio(cap), abs=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 12),
    st.lists(
        st.tuples(
            st.sampled_from(["add", "all", "one", "clear"]),
            st.lists(st.integers(0, 20), max_size=6),
        ),
        max_size=60,
    ),
)
def test_rate_one_reproduces_the_cache_counters(
    backend: str, cap: int, ops: list[tuple[str, list[int]]]
) -> None:
    """At rate 1 and the 1x cap, fed by the cache's index: (page_hits + refreshes) /
    (walked + added) of the real cache, and its page hit ratio for lookups."""
    advisor = exact_advisor(backend)
    with index_backend(backend):
        cache = StorageExistenceCache(cap, advisor=advisor)
        pool = cache.pool("kv")
        _drive(cache, [(op, "kv", pages) for op, pages in ops], flat=False)
    s = pool.stats()
    referenced = s.page_hits + s.rescues + s.inserts + s.refreshes
    if s.pages_checked:
        # Lookups alone, the page each one missed at included: the cache's page hit ratio.
        lookups = advisor.estimate("kv", cap, lookups=True)
        assert lookups == pytest.approx(s.page_hits / s.pages_checked)
    if not referenced:
        assert advisor.estimate("kv", cap) is None
        return
    assert advisor.estimate("kv", cap) == pytest.approx((s.page_hits + s.refreshes) / referenced)


def test_buffer_mode_stream_matches_the_cache_at_1x() -> None:
    """On the write-path model's own call stream (heals invalidate, lookups touch, acks add),
    rate 1 at the 1x cap is within 0.001 of the cache's ratio (invalidation is approximated)."""
    pages = expand(read_trace(mooncake_trace()))
    trace = PageTrace(pages.source, pages.format, pages.page_size, pages.requests[:1500])
    deployments = [
        (65536, ModelConfig(l3_pages=20000, ack_latency_ms=30)),
        (32768, ModelConfig()),
    ]
    invalidations = []
    for cap, config in deployments:
        advisor = CapacityAdvisor(1.0, max_sampled_pages=1 << 20)
        cache = StorageExistenceCache(cap, advisor=advisor)
        run_model(trace, cap, config, cache=cache)
        s = cache.stats()["kv"]
        real = (s.page_hits + s.refreshes) / (s.page_hits + s.rescues + s.inserts + s.refreshes)
        assert advisor.estimate("kv", cap) == pytest.approx(real, abs=1e-3)
        lookups = advisor.estimate("kv", cap, lookups=True)
        assert lookups == pytest.approx(s.page_hits / s.pages_checked, abs=1e-3)
        invalidations.append(s.invalidations)
    assert invalidations[0] > 0  # the bounded L3 made healing remove beliefs


def test_lookup_curve_sees_that_healing_makes_a_small_cap_cheap() -> None:
    """Buffer mode, Mooncake, 1M-token device, 16K cap (420 redundant writes in all): the
    lookup curve stays flat above 1x while the reference-stream curve climbs.  Rate 0.2,
    the documented rate for a 16K cap (cap x rate >= 2,600 sampled slots; at the default
    0.02 the 1x cap has 328 and the flat stretch reads 0.00-0.017 with the hash salt)."""
    pages = expand(read_trace(mooncake_trace()))
    advisor = CapacityAdvisor(0.2)
    cache = StorageExistenceCache(16384, advisor=advisor)
    result = run_model(pages, 16384, ModelConfig(), cache=cache)
    snap = advisor.snapshot(advisor.capacities_of(cache))
    assert result.redundant_writes < 0.01 * result.writes_issued
    assert abs(snap.lookup_hit_ratio("kv", 8.0) - snap.lookup_hit_ratio("kv", 1.0)) < 0.01
    assert snap.hit_ratio("kv", 8.0) - snap.hit_ratio("kv", 1.0) > 0.2
    assert snap.pools["kv"].lookup_references > 0


def salted_errors(workload: str, salt: int) -> dict[int, float | None]:
    """|estimate - exact| per cap for the default advisor on a bench workload, in a
    subprocess with ``PYTHONHASHSEED=salt``: which pages are sampled depends on the
    process's str-hash salt, so a fixed salt makes the check reproducible."""
    env = {**os.environ, "PYTHONHASHSEED": str(salt)}
    done = subprocess.run(
        [sys.executable, "-m", "hicache_existence_bench.advisor", workload, "0.02"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return {int(cap): err for cap, err in json.loads(done.stdout)["errors"].items()}


@pytest.mark.parametrize("salt", [0, 1])
def test_accuracy_on_the_mooncake_trace(salt: int) -> None:
    """Default rate: within 0.02 of the exact curve at 0.25x..8x of 512K and at 8K..1M."""
    errors = salted_errors("mooncake", salt)
    assert set(errors) >= {1 << k for k in range(13, 21)}
    assert max(e for e in errors.values() if e is not None) <= 0.02, errors


@pytest.mark.slow  # 13.2M page references: 50-230 s a salt on 2 cores (the 3.11 legs run it)
@pytest.mark.parametrize("salt", [0, 1])
def test_accuracy_on_a_synthetic_long_context_workload(salt: int) -> None:
    """Default rate: within 0.02 at 0.25x..8x of 512K on 13.2M page references of
    16K-128K-token documents and multi-turn sessions (cap x rate >= 2,600 sampled
    slots, the documented operating range; the curve still rises through it)."""
    curve = belief_only_curves(long_context_requests(SYNTHETIC))["kv"]
    assert curve.hit_ratio(4 << 20) - curve.hit_ratio(128 << 10) > 0.05  # not a flat stretch
    errors = salted_errors("synthetic", salt)
    claimed = {cap: e for cap, e in errors.items() if cap * 0.02 >= 2600}
    assert sorted(claimed) == [int(512 * 1024 * m) for m in MULTIPLIERS]
    assert max(e for e in claimed.values() if e is not None) <= 0.02, errors


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "all", "covered", "one", "launch", "ack", "invalidate", "clear"]),
        st.sampled_from(["kv", "swa"]),
        st.lists(st.integers(0, 24), max_size=7),
    ),
    max_size=70,
)


def _drive(cache: object, ops: list[tuple[str, str, list[int]]], flat: bool) -> None:
    """Run an operation program on either cache generation."""
    inflight: dict[str, set[str]] = {"kv": set(), "swa": set()}
    for op, name, pages in ops:
        hashes = [HEX[i] for i in pages]
        if flat:
            f: FlatStorageExistenceCache = cache  # type: ignore[assignment]
            if op == "add":
                f.add(name, hashes)
            elif op == "all":
                f.contains_all(name, hashes)
            elif op == "covered":
                f.covers_all(name, hashes, inflight[name])
            elif op == "one" and hashes:
                f.contains(name, hashes[0])
            elif op == "launch":
                inflight[name].update(hashes)
            elif op == "ack":
                f.add(name, sorted(inflight[name]))
                inflight[name].clear()
            elif op == "invalidate":
                f.invalidate_beyond(name, hashes, len(hashes) // 2)
            elif op == "clear":
                f.clear()
            continue
        pool = cache.pool(name)  # type: ignore[attr-defined]
        if op == "add":
            pool.add(hashes)
        elif op == "all":
            pool.contains_all(hashes)
        elif op == "covered":
            pool.covered(hashes)
        elif op == "one" and hashes:
            pool.contains(hashes[0])
        elif op == "launch":
            pool.track_inflight(hashes)
        elif op == "ack":
            pool.add(hashes)
            pool.untrack_inflight(hashes)
        elif op == "invalidate":
            pool.invalidate_beyond(hashes, len(hashes) // 2)
        elif op == "clear":
            pool.clear()


def _same_snapshots(a: CapacityAdvisor, b: CapacityAdvisor, caps: dict[str, int] | int) -> None:
    sa, sb = a.snapshot(caps), b.snapshot(caps)
    # The cache makes a pool's sampler with the pool, the hand-fed advisor at the
    # pool's first recorded operation: a sampler only one side has saw nothing.
    for one, two in ((sa, sb), (sb, sa)):
        for name in one.pools.keys() - two.pools.keys():
            assert one.pools[name].references == one.pools[name].lookup_references == 0
    for name in sa.pools.keys() & sb.pools.keys():
        advice, other = sa.pools[name], sb.pools[name]
        assert advice.references == other.references
        assert advice.sampled_references == other.sampled_references
        assert advice.lookup_references == other.lookup_references
        assert advice.sampled_pages == other.sampled_pages
        for m in MULTIPLIERS:
            assert advice.estimates[m] == pytest.approx(other.estimates[m], abs=1e-12)
            assert advice.lookup_estimates[m] == pytest.approx(other.lookup_estimates[m], abs=1e-12)


@pytest.mark.parametrize("flat", [False, True], ids=["current", "flat"])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10), st.sampled_from([1.0, 0.5]), OPS)
def test_index_feeding_equals_feeding_by_hand(
    flat: bool, backend: str, cap: int, rate: float, ops: list[tuple[str, str, list[int]]]
) -> None:
    """The samplers the index feeds from inside its calls (plus the walks the cache
    reports) see exactly the observer stream: every operation, both generations, both
    index implementations, misses, rescues, invalidations and clears included."""
    factory = PySampler if backend == "python" else None
    attached = CapacityAdvisor(rate, max_sampled_pages=16, shared=flat, sampler_factory=factory)
    by_hand = CapacityAdvisor(rate, max_sampled_pages=16, shared=flat, sampler_factory=factory)
    with index_backend(backend):
        if flat:
            cache: object = FlatStorageExistenceCache(cap, advisor=attached, observer=by_hand)
        else:
            cache = StorageExistenceCache(cap, advisor=attached, observer=by_hand)
        _drive(cache, ops, flat)  # pools (and their indexes) are made on first use
    _same_snapshots(attached, by_hand, cap if flat else {"kv": cap, "swa": cap})
    assert attached.errors == by_hand.errors == 0


def test_hand_feeding_never_raises_and_counts_errors() -> None:
    """Malformed hand-fed operations are counted and skipped; the good ones still count."""
    advisor = exact_advisor()
    advisor.added("kv", None)  # type: ignore[arg-type]
    advisor.added("kv", [HEX[1], 7])  # type: ignore[list-item]
    advisor.touched("kv", [HEX[1]], -1)
    advisor.added("kv", [HEX[1]])
    advisor.added("kv", [HEX[1]])
    advisor.touched("kv", iter([HEX[1]]), 1)  # type: ignore[arg-type]
    assert advisor.errors == 3
    assert advisor.estimate("kv", 4) == pytest.approx(2 / 3)
    assert advisor.snapshot({"kv": 4}).errors == 3


def test_sampling_is_consistent_and_at_the_rate() -> None:
    """Two advisors in one process fed the same stream agree exactly (a page is
    sampled at every reference); the share sampled is the rate, for SHA-256 hex keys
    and for any other str keys alike (the str hash is uniform)."""
    rng = random.Random(11)
    hexes = [f"{rng.getrandbits(256):064x}" for _ in range(40000)]
    names = [f"page-{i}" for i in range(40000)]
    for keys in (hexes, names):
        a, b = CapacityAdvisor(0.05), CapacityAdvisor(0.05)
        for i in range(0, len(keys), 100):
            for advisor in (a, b):
                advisor.added("kv", keys[i : i + 100])
        sa, sb = a.snapshot({"kv": 10000}), b.snapshot({"kv": 10000})
        assert sa.pools == sb.pools
        sampled = sa.pools["kv"].sampled_pages
        assert abs(sampled - 2000) < 4 * (40000 * 0.05 * 0.95) ** 0.5, sampled


def test_snapshot_gauges_and_ranges() -> None:
    """Estimates per multiplier with string labels; None where the cap lies beyond the
    tracked distances or no cap is known; caps read from a cache."""
    advisor = CapacityAdvisor(0.5, max_sampled_pages=10)
    cache = StorageExistenceCache(16, advisor=advisor)
    # Pages are sampled by their str hash, which differs per process: of 8 pages none is
    # sampled in 1 process of 256 (PYTHONHASHSEED=16: no data, every estimate None; it
    # failed a CI leg once); of 32, in 1 of 2**32.
    for _ in range(3):
        cache.pool("kv").add(HEX[:32])
    cache.pool("swa").add(HEX[:2])
    caps = advisor.capacities_of(cache)
    assert caps == {"kv": 16, "swa": 16}
    snap = advisor.snapshot(caps)
    kv = snap.pools["kv"]
    assert set(kv.estimates) == set(MULTIPLIERS)
    assert kv.estimates[0.25] is not None
    assert kv.estimates[8.0] is None  # 128 * 0.5 sampled slots > max_sampled_pages
    labels = {s[0]["cap_multiplier"] for s in snap.gauge_samples() if s[0]["pool"] == "kv"}
    assert "0.25" in labels and "8" not in labels
    assert not snap.gauge_samples(lookups=True)  # adds only: no lookups to estimate
    assert multiplier_label(1.0) == "1" and multiplier_label(0.5) == "0.5"
    gauge = FEATURE_BY_NAME["hicache_existence_advisor_estimated_hit_ratio"]
    assert (gauge.source, gauge.labels) == ("advisor", ("pool", "cap_multiplier"))
    assert advisor.snapshot().pools["kv"].estimates == {}
    assert advisor.estimate("nope", 4) is None


def test_shared_mode_models_the_flat_cache() -> None:
    """shared=True: one LRU over all pools, reported as "all"; exact at rate 1 on the flat cache."""
    advisor = CapacityAdvisor(1.0, shared=True, max_sampled_pages=1000)
    flat = FlatStorageExistenceCache(6, advisor=advisor)
    rng = random.Random(3)
    for _ in range(200):
        pool = rng.choice(["kv", "swa"])
        pages = [HEX[rng.randrange(12)] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            flat.add(pool, pages)
        else:
            flat.contains_all(pool, pages)
    total = flat.stats().total
    referenced = total.page_hits + total.rescues + total.inserts + total.refreshes
    assert advisor.capacities_of(flat) == 6
    snap = advisor.snapshot(advisor.capacities_of(flat))
    assert list(snap.pools) == [SHARED_POOL]
    assert snap.hit_ratio(SHARED_POOL, 1.0) == pytest.approx(
        (total.page_hits + total.refreshes) / referenced
    )


def test_half_life_follows_the_recent_stream() -> None:
    """With a half-life, an old all-miss phase fades and the estimate follows the new phase."""
    keys = [f"{i:064x}" for i in range(3000)]
    plain = CapacityAdvisor(1.0)
    recent = CapacityAdvisor(1.0, half_life_references=50)
    for advisor in (plain, recent):
        for key in keys:  # phase 1: every reference a cold miss
            advisor.added("kv", [key])
        for _ in range(1000):  # phase 2: one hot page
            advisor.added("kv", [keys[0]])
    assert plain.estimate("kv", 100) == pytest.approx(999 / 4000)
    assert recent.estimate("kv", 100) > 0.99


@pytest.mark.parametrize("backend", BACKENDS)
def test_snapshot_from_another_thread_while_recording(backend: str) -> None:
    """Snapshots from an exporter thread interleave with the cache's recording."""
    advisor = CapacityAdvisor(0.5)
    with index_backend(backend):
        pool = StorageExistenceCache(64, advisor=advisor).pool("kv")
    stop = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                advisor.snapshot({"kv": 64})
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            pool.add(HEX[i % 50 : i % 50 + 10])
    finally:
        stop.set()
        reader.join()
    assert not failures
    assert advisor.errors == 0
    assert advisor.snapshot({"kv": 64}).pools["kv"].references == sum(
        len(HEX[i % 50 : i % 50 + 10]) for i in range(3000)
    )


def test_from_config_and_bad_arguments() -> None:
    """Config builds the advisor (or None when off); bad arguments name themselves."""
    assert CapacityAdvisor.from_config(AdvisorSection(enabled=False)) is None
    assert CapacityAdvisor.from_config(AdvisorSection(sampling_rate=0.0)) is None
    section = Config.from_mapping(
        {"advisor": {"sampling_rate": 0.1, "max_sampled_pages": 7, "half_life_references": 9}}
    ).advisor
    advisor = CapacityAdvisor.from_config(section)
    assert advisor is not None
    assert advisor.sampling_rate == 0.1
    assert repr(advisor.sampler("kv")).endswith("max_keys=7>")
    # The buffer and its drain are gone (the index feeds the sampler): their old
    # settings are refused by name rather than silently ignored.
    for removed in ("buffer_ops", "drain_budget_ms"):
        with pytest.raises(ValueError, match=removed):
            Config.from_mapping({"advisor": {removed: 1}})
    for kwargs, exc, word in [
        ({"sampling_rate": 0.0}, ValueError, "sampling_rate"),
        ({"sampling_rate": 1.5}, ValueError, "sampling_rate"),
        ({"sampling_rate": True}, TypeError, "sampling_rate"),
        ({"max_sampled_pages": 0}, ValueError, "max_sampled_pages"),
        ({"max_sampled_pages": 1.5}, TypeError, "max_sampled_pages"),
        ({"max_sampled_pages": 1 << 29}, ValueError, "max_sampled_pages"),
        ({"half_life_references": -1}, ValueError, "half_life_references"),
    ]:
        with pytest.raises(exc, match=word):
            CapacityAdvisor(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cap"):
        CapacityAdvisor().estimate("kv", 0)


def test_advisor_module_stays_in_the_accounting_layer() -> None:
    """advisor.py imports nothing from replay, exporters, sglang or the CLI."""
    package = Path(__file__).resolve().parents[1] / "hicache_existence"
    source = (package / "accounting" / "advisor.py").read_text()
    for forbidden in ("hicache_existence.replay", "hicache_existence.exporters", "sglang", "cli"):
        assert f"import {forbidden}" not in source and f"from {forbidden}" not in source
