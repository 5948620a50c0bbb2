"""Fleet replay (``replay --fleet``): N instances behind a router sharing one L3.

Differential checks against the single-instance model (itself checked against a
brute-force simulation in test_replay_model.py): a fleet of one, and a fleet
whose router sends everything to one instance, equal ``run_model`` counter for
counter.  Properties on random traces: the fleet's writes minus its redundant
writes are the pages L3 holds; instance shares add up to the fleet; ledger
learning never increases fleet writes when nothing is evicted; verification
finds and drops beliefs L3 evicted.  The real PD test's stream worked out by
hand (tests/real_server/test_pd.py compares the same stream with real servers).
Plus the CLI on the repository's trace."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from test_replay_model import CONFIGS, FIELDS, random_trace

from hicache_existence.cli import main
from hicache_existence.replay.fleet import FleetConfig, route, run_fleet
from hicache_existence.replay.model import ModelConfig, run_model
from hicache_existence.replay.pages import PageRequest, PageTrace, chunk_ends, expand
from hicache_existence.replay.trace import read_trace

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: The Mooncake trace the repository carries (tests/data/traces, with its licence).
REPO_TRACE = Path(__file__).parent / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
SUMS = ("requests", "writes_issued", "redundant_writes", "writes_avoided")


@pytest.mark.parametrize("config_index", range(len(CONFIGS)))
@pytest.mark.parametrize("seed", range(4))
def test_fleet_of_one_equals_the_single_instance_model(config_index: int, seed: int) -> None:
    """N=1 (either router, learning off) gives every counter of run_model."""
    rng = random.Random(seed * 31 + config_index)
    cfg = CONFIGS[config_index]
    trace = random_trace(rng, pools=("kv", "swa") if seed % 2 else ("kv",))
    for cap in (1, 3, 40):
        want = run_model(trace, cap, cfg)
        for router in ("round-robin", "prefix-affinity"):
            got = run_fleet(trace, cap, cfg, FleetConfig(1, router)).model  # type: ignore[arg-type]
            for name in (*FIELDS, "requests", "page_references", "cache_stats"):
                assert getattr(got, name) == getattr(want, name), (name, cap, router)
            assert got.belief_hit_ratio == want.belief_hit_ratio


def test_fleet_of_one_on_the_repository_trace() -> None:
    """The Mooncake trace (first 1,000 requests), fleet of one vs run_model."""
    trace = expand(read_trace(REPO_TRACE, "auto"), 64)
    head = PageTrace(trace.source, trace.format, trace.page_size, trace.requests[:1000])
    want = run_model(head, 64 * 1024).as_dict()
    got = run_fleet(head, 64 * 1024, fleet=FleetConfig(1)).model.as_dict()
    for key in want:
        if key != "elapsed_s":
            assert got[key] == want[key], key


def test_affinity_fleet_whose_requests_share_a_prefix_is_one_instance() -> None:
    """Prefix-affinity sends requests with the same leading pages to one
    instance: with one common first node, a fleet of 7 is a single instance
    (the other six stay idle) and equals run_model."""
    rng = random.Random(5)
    base = random_trace(rng, requests=80)
    reqs = []
    for r in base.requests:
        pages = ("root-0", "root-1", "root-2", "root-3", *r.pages)
        reqs.append(PageRequest(r.timestamp_ms, r.pool, pages, chunk_ends(len(pages), 4)))
    trace = PageTrace("shared-root", "pages", 64, tuple(reqs))
    cfg = ModelConfig(device_pages=10, l3_pages=40, ack_latency_ms=2.0)
    fleet = run_fleet(trace, 8, cfg, FleetConfig(7, "prefix-affinity", affinity_pages=4))
    want = run_model(trace, 8, cfg)
    assert sorted(i.requests for i in fleet.instances) == [0] * 6 + [80]
    for name in (*FIELDS, "requests"):
        assert getattr(fleet.model, name) == getattr(want, name), name


def test_router_policies() -> None:
    """Round-robin cycles; prefix-affinity depends only on the leading pages."""
    a = PageRequest(0.0, "kv", tuple(f"{i:064x}" for i in range(10)), (10,))
    b = PageRequest(0.0, "kv", (*a.pages[:8], "f" * 64), (9,))
    rr = FleetConfig(5, "round-robin")
    assert [route(a, i, rr) for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    pa = FleetConfig(5, "prefix-affinity", affinity_pages=8)
    assert {route(a, i, pa) for i in range(7)} == {route(b, 0, pa)}
    odd = PageRequest(0.0, "kv", ("not-hex",), (1,))
    assert 0 <= route(odd, 3, pa) < 5


_FLEETS = st.builds(
    FleetConfig,
    instances=st.integers(1, 6),
    router=st.sampled_from(["round-robin", "prefix-affinity"]),
    affinity_pages=st.integers(1, 4),
    learn_rate=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), fleet=_FLEETS, config_index=st.integers(0, len(CONFIGS) - 1))
def test_fleet_accounting_adds_up(seed: int, fleet: FleetConfig, config_index: int) -> None:
    """Instance shares sum to the fleet totals; with an unbounded L3 every
    written page is either new to L3 or redundant."""
    cfg = CONFIGS[config_index]
    trace = random_trace(random.Random(seed))
    result = run_fleet(trace, 6, cfg, fleet)
    for name in SUMS:
        assert sum(getattr(i, name) for i in result.instances) == getattr(result.model, name)
    assert result.model.redundant_writes <= result.model.writes_issued
    if not cfg.l3_pages:
        assert result.model.writes_issued - result.model.redundant_writes == result.l3_pages_held
    if fleet.learn_rate == 0:
        assert result.verifications == 0 and result.pages_learnt == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    instances=st.integers(1, 6),
    router=st.sampled_from(["round-robin", "prefix-affinity"]),
    rate=st.sampled_from([0.1, 0.5, 1.0]),
    threshold=st.sampled_from([0, 256, 100_000]),
)
def test_learning_never_increases_fleet_writes(
    seed: int, instances: int, router: str, rate: float, threshold: int
) -> None:
    """Same stream, unbounded L3, a cap nothing is evicted from, acks landing
    before the next request: beliefs are a subset of L3, so verdicts only add
    pages L3 holds, and fleet writes with learning on never exceed writes with
    it off (redundant writes neither)."""
    trace = random_trace(random.Random(seed), requests=80)
    cfg = ModelConfig(device_pages=8, prefetch_threshold_tokens=threshold)
    cap = 10_000
    off = run_fleet(trace, cap, cfg, FleetConfig(instances, router)).model  # type: ignore[arg-type]
    on = run_fleet(trace, cap, cfg, FleetConfig(instances, router, learn_rate=rate))  # type: ignore[arg-type]
    assert on.model.writes_issued <= off.writes_issued
    assert on.model.redundant_writes <= off.redundant_writes
    assert on.verifications > 0 or on.model.cache_stats["queries"] == 0
    assert sum(i.pages_invalidated for i in on.instances) == 0


def test_verdicts_past_an_in_flight_page_are_withheld() -> None:
    """The race the leading-count verdict used to lose: a chain whose gap is a
    page still being written (not yet in the ledger) gets a stale "absent"
    answer; the verdict is withheld instead of dropping the believed pages after
    the gap (which L3 holds), so nothing is written again: learning on writes
    exactly what learning off writes, and the withheld verdicts are counted."""
    a = ("a0", "a1")
    reqs = [
        PageRequest(0.0, "kv", ("p0", "p1", "p2", "p3"), (2, 4)),  # writes p0..p3
        PageRequest(20.0, "kv", ("q0",), (1,)),  # acks land
        PageRequest(21.0, "kv", (*a, "p2", "p3"), (2, 4)),  # a0, a1 written (in flight)
        PageRequest(22.0, "kv", (*a, "p2", "p3"), (4,)),  # lookup [a0 a1 p2 p3]: picked
        PageRequest(23.0, "kv", ("r0",), (1,)),  # verdict: leading 0, a0 in flight: withheld
        PageRequest(60.0, "kv", ("p2", "p3"), (2,)),  # p2, p3 still believed: not rewritten
    ]
    trace = PageTrace("gap", "pages", 64, tuple(reqs))
    cfg = ModelConfig(device_pages=0, ack_latency_ms=10.0, prefetch_threshold_tokens=100_000)
    off = run_fleet(trace, 100, cfg, FleetConfig(1))
    on = run_fleet(trace, 100, cfg, FleetConfig(1, learn_rate=1.0))
    assert on.instances[0].pages_invalidated == 0
    assert on.instances[0].verdicts_withheld >= 1
    assert on.model.redundant_writes == off.model.redundant_writes == 0
    assert on.model.writes_issued == off.model.writes_issued


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), ack=st.sampled_from([1.0, 5.0, 50.0]))
def test_learning_with_writes_in_flight_never_increases_writes(seed: int, ack: float) -> None:
    """With acks landing later than the next requests (writes in flight at
    verification), an unbounded L3, a cap nothing is evicted from and every
    admitted node written (none dropped for a parent that is neither believed
    nor pending), every looked-up page is in L3 or being written: the only
    verdicts short of a chain stop at a page in flight and are withheld, so
    learning drops no belief and never adds writes."""
    trace = random_trace(random.Random(seed), requests=80)
    cfg = ModelConfig(device_pages=0, ack_latency_ms=ack, prefetch_threshold_tokens=100_000)
    off = run_fleet(trace, 10_000, cfg, FleetConfig(1)).model
    on = run_fleet(trace, 10_000, cfg, FleetConfig(1, learn_rate=1.0))
    assume(off.dropped_writes == 0 and on.model.dropped_writes == 0)
    assert on.instances[0].pages_invalidated == 0
    assert on.model.writes_issued <= off.writes_issued
    assert on.model.redundant_writes <= off.redundant_writes


def test_learning_drops_beliefs_l3_evicted() -> None:
    """A bounded L3 evicts pages the beliefs still hold (stale skips); verifying
    every lookup against the ledger drops those beliefs, so fewer writes are
    skipped wrongly and more are issued."""
    rng = random.Random(11)
    trace = random_trace(rng, requests=200)
    cfg = ModelConfig(device_pages=0, l3_pages=15, prefetch_threshold_tokens=100_000)
    off = run_fleet(trace, 1000, cfg, FleetConfig(2))
    on = run_fleet(trace, 1000, cfg, FleetConfig(2, learn_rate=1.0))
    assert off.model.stale_skips > 0
    assert sum(i.pages_invalidated for i in on.instances) > 0
    assert on.model.stale_skips < off.model.stale_skips
    assert on.model.writes_issued > off.model.writes_issued


def test_concurrent_writes_of_one_prefix_are_redundant_whatever_learning() -> None:
    """Two instances computing the same prefix within the ack latency both write
    it (neither write has landed, so neither L3 nor the ledger knows it): the
    second write is redundant with learning on or off, since the ledger only
    learns landed writes."""
    x = tuple(f"x{i}" for i in range(4))
    y = tuple(f"y{i}" for i in range(4))
    reqs = [
        PageRequest(0.0, "kv", (*x, *y), (4, 8)),  # A writes x, y (ack at 10 ms)
        PageRequest(1.0, "kv", (*x, *y), (4, 8)),  # B: not in L3 yet: B writes them too
        PageRequest(20.0, "kv", ("z0",), (1,)),  # A (lets the acks land)
        PageRequest(21.0, "kv", (*x, *y, "w"), (4, 8, 9)),  # B again
    ]
    trace = PageTrace("learn", "pages", 64, tuple(reqs))
    cfg = ModelConfig(device_pages=0, ack_latency_ms=10.0, prefetch_threshold_tokens=100_000)
    off = run_fleet(trace, 100, cfg, FleetConfig(2))
    on = run_fleet(trace, 100, cfg, FleetConfig(2, learn_rate=1.0))
    assert on.verifications > 0
    assert on.model.writes_issued <= off.model.writes_issued
    assert on.model.redundant_writes == off.model.redundant_writes == 8


def test_cli_fleet_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """replay --fleet prints one row per (router, learn rate, N) and writes fleet.json."""
    small = tmp_path / "head.jsonl"
    small.write_text("".join(REPO_TRACE.read_text().splitlines(keepends=True)[:300]))
    out = tmp_path / "out"
    code = main(
        [
            "replay",
            str(small),
            "--fleet",
            "1,4",
            "--learn-rate",
            "0,0.05",
            "--out",
            str(out),
            "--quiet",
            "--instance-cap",
            "16K",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "fleet replay: 300 requests" in printed
    rows = [line for line in printed.splitlines() if line.strip().startswith(("round", "prefix"))]
    assert len(rows) == 8
    doc = json.loads((out / "fleet.json").read_text())
    assert doc["schema"] == "hicache-existence-replay-fleet/1"
    assert len(doc["runs"]) == 8
    one = [r for r in doc["runs"] if r["config"]["instances"] == 1]
    assert len({r["fleet"]["writes_issued"] for r in one if r["config"]["learn_rate"] == 0}) == 1
    assert all(len(r["instances"]) == r["config"]["instances"] for r in doc["runs"])
    # Bad fleets are refused at the edge (exit 2, the flag named).
    for flags, word in [
        (["--fleet", "0"], "instance counts must be"),
        (["--fleet", "2", "--router", "random"], "argument --router"),
        (["--fleet", "2", "--learn-rate", "1.5"], "rates must be within [0, 1]"),
        (["--fleet", "2", "--affinity-pages", "0"], "argument --affinity-pages"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["replay", str(small), *flags, "--quiet"])
        assert info.value.code == 2
        assert word in capsys.readouterr().err


def _alternating_conversations(conversations: int, first: int, turn: int, turns: int) -> PageTrace:
    """Conversations sent one after another, each turn the previous prompt plus
    ``turn`` pages; nodes as in the radix tree of the instance round robin over two
    gives each turn (its own earlier turns end nodes; the first turn is one node)."""
    reqs = []
    for c in range(conversations):
        lengths = [first + t * turn for t in range(turns)]
        chain = tuple(f"c{c}-p{i}" for i in range(lengths[-1]))
        for t, n in enumerate(lengths):
            ends = {first, n, *(lengths[u] for u in range(t % 2, t, 2))}
            reqs.append(PageRequest(float(len(reqs)), "kv", chain[:n], tuple(sorted(ends))))
    return PageTrace("alternating", "pages", 16, tuple(reqs))


@pytest.mark.parametrize("learn_rate", [0.0, 1.0])
def test_alternating_turns_on_two_instances_by_hand(learn_rate: float) -> None:
    """tests/real_server/test_pd.py's stream (6 conversations, 20 pages then 4 a
    turn, 5 turns, round robin over 2): per conversation the first turn writes 20,
    the second prefetches those 20 (320 tokens >= 256) and writes its 4, and each
    later turn writes the other instance's last 4 again plus its own 4: 48
    written, 12 redundant, 20 + 20 + 24 + 28 avoided, 36 in L3; learning, verified
    after the acks, learns nothing.  Without the prefetch (a threshold above the
    second turn) the second turn writes all 24 itself: 20 more written and
    redundant, 20 fewer avoided, as a real second turn whose prefetch ran before
    the first turn's write landed."""
    trace = _alternating_conversations(6, 20, 4, 5)
    cfg = ModelConfig(device_pages=4096, prefetch_threshold_tokens=256)
    got = run_fleet(trace, 65536, cfg, FleetConfig(2, "round-robin", learn_rate=learn_rate))
    m = got.model
    assert (m.writes_issued, m.redundant_writes, m.writes_avoided) == (6 * 48, 6 * 12, 6 * 92)
    assert (m.l3_hit_pages, got.l3_pages_held, got.pages_learnt) == (6 * 20, 6 * 36, 0)
    assert (got.verifications > 0) == (learn_rate > 0)
    late = ModelConfig(device_pages=4096, prefetch_threshold_tokens=24 * 16 + 1)
    m2 = run_fleet(trace, 65536, late, FleetConfig(2, "round-robin", learn_rate=learn_rate)).model
    assert m2.l3_hit_pages == 0
    assert m2.writes_issued - m.writes_issued == m2.redundant_writes - m.redundant_writes == 6 * 20
    assert m.writes_avoided - m2.writes_avoided == 6 * 20


def test_fleet_verdicts_are_the_reconcilers() -> None:
    """Fleet learning applies the reconciler's verdict code: a trailing-window
    pool (``swa``) learns nothing while ``kv`` on the same stream does, and a
    verdict whose leading pages are all believed adds nothing (the cache's own
    ``adds`` equal learning off's, no LRU refresh)."""
    rng = random.Random(5)
    kv = random_trace(rng, requests=200)
    swa = PageTrace("swa", "pages", 64, tuple(replace(r, pool="swa") for r in kv.requests))
    cfg = ModelConfig(device_pages=0, prefetch_threshold_tokens=100_000)
    fleet = FleetConfig(2, learn_rate=1.0)
    assert run_fleet(kv, 3, cfg, fleet).pages_learnt > 0
    on = run_fleet(swa, 3, cfg, fleet)
    assert on.verifications > 0 and on.pages_learnt == 0
    # At a cap nothing is evicted from, every verified head is believed already.
    off, on = run_fleet(kv, 10_000, cfg, FleetConfig(2)), run_fleet(kv, 10_000, cfg, fleet)
    assert on.verifications > 0 and on.pages_learnt == 0
    assert on.model.cache_stats["adds"] == off.model.cache_stats["adds"]
