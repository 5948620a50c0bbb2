"""Fast tests of ground truth, the Redis ledger (fakeredis), the breaker, agreement,
the reconciler and the storage adapters.  Real redis-server: test_reconcile_redis.py."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reconcile_helpers import FaultyTruth, TrustToggle, chain, step_until_idle
from reconcile_helpers import wired as _wired

from hicache_existence.config import Config, ConfigError, ReconcilerSection
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.observers import BeliefObserver, Tee
from hicache_existence.reconcile.agreement import (
    InProcessGroup,
    SingleRank,
)
from hicache_existence.reconcile.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
)
from hicache_existence.reconcile.counters import Histogram
from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruth,
    GroundTruthError,
    InMemoryGroundTruth,
    LedgerBehind,
    LedgerEmpty,
    ServerError,
    TruthUnavailable,
    UnsupportedPool,
)
from hicache_existence.reconcile.ledger_writer import LedgerWriter
from hicache_existence.reconcile.reconciler import Reconciler
from hicache_existence.reconcile.vector import UNDONE, Vector
from hicache_existence.reconcile.verdicts import default_learns

fakeredis = pytest.importorskip("fakeredis")

from hicache_existence.reconcile import storage_adapters  # noqa: E402
from hicache_existence.reconcile.redis_truth import (  # noqa: E402
    LedgerSettings,
    RedisLedger,
    build_client,
    shard_from_storage_config,
    shard_id,
    validate_redis_url,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wired(truth: Any, **kwargs: Any) -> tuple[StorageExistenceCache, Reconciler]:
    """``reconcile_helpers.wired`` with a patient query timeout unless a test sets one:
    these tests check what an answer does, and on a loaded CI machine the worker
    thread may not run within the production default (50 ms), which turns the
    answer into a timeout (a 3.13 leg failed so, once)."""
    kwargs.setdefault("timeout_s", 5.0)
    return _wired(truth, **kwargs)


def fake_ledger(method: str = "lua", ttl_s: float = 0.0, **kw: Any) -> RedisLedger:
    settings = LedgerSettings(
        "redis://localhost:6379/0", namespace="t", shard="s0", ttl_s=ttl_s, method=method, **kw
    )
    return RedisLedger(settings, client=fakeredis.FakeRedis())


# -- ground truth ---------------------------------------------------------------


def test_in_memory_truth_leading_and_present() -> None:
    """InMemoryGroundTruth answers batch_exists semantics (leading run) and per-page presence."""
    t = InMemoryGroundTruth()
    c = chain("a", 5)
    t.record_stored("kv", [c[0], c[1], c[3]])
    assert isinstance(t, GroundTruth)
    assert t.leading_present("kv", c) == 2
    assert t.present("kv", c) == [True, True, False, True, False]
    assert t.leading_present("swa", c) == 0
    t.record_removed("kv", [c[0]])
    assert t.leading_present("kv", c) == 0
    assert t.leading_present("kv", []) == 0


@pytest.mark.parametrize(
    "pool,hashes,exc,word",
    [
        ("", ["a"], ValueError, "pool"),
        (3, ["a"], TypeError, "pool"),
        ("kv", "abc", TypeError, "hashes"),
        ("kv", ["a", 5], TypeError, "hashes[1]"),
    ],
)
def test_truth_rejects_bad_input_naming_argument(
    pool: Any, hashes: Any, exc: type, word: str
) -> None:
    """Bad pool names or page hashes raise a TypeError/ValueError naming the argument."""
    t = InMemoryGroundTruth()
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        t.leading_present(pool, hashes)
    with pytest.raises(exc):
        fake_ledger().leading_present(pool, hashes)


# -- the Redis ledger over fakeredis ----------------------------------------------


@pytest.mark.parametrize("method", ["lua", "pipeline"])
def test_ledger_records_and_answers(method: str) -> None:
    """record_stored/record_removed and leading_present/present agree with a reference set."""
    led = fake_ledger(method)
    c = chain("x", 40)
    with pytest.raises(LedgerEmpty):
        led.leading_present("kv", c)  # never written: no epoch, no evidence
    assert led.record_stored("kv", c[:30]) == 30
    assert led.leading_present("kv", c) == 30
    assert led.leading_present("kv", c[:10]) == 10
    assert led.record_removed("kv", [c[5], "never-stored"]) == 1
    assert led.leading_present("kv", c) == 5
    assert led.present("kv", c[4:7]) == [True, False, True]
    assert led.leading_present("swa", c) == 0
    assert led.absence_is_evidence()


def test_ledger_key_schema() -> None:
    """Keys are <namespace>:<shard>:<pool>:<hash> and the epoch <namespace>:epoch."""
    led = fake_ledger()
    led.record_stored("kv", ["h1"])
    keys = sorted(k.decode() for k in led._client.keys("*"))
    assert keys == ["t:epoch", "t:s0:kv:h1"]
    assert led.clear_shard() == 1
    assert sorted(k.decode() for k in led._client.keys("*")) == ["t:epoch"]


def test_ledger_ttl_mirrors_retention() -> None:
    """With ttl_s the page keys expire (epoch does not)."""
    led = fake_ledger(ttl_s=30.0)
    led.record_stored("kv", ["p"])
    ttl_ms = led._client.pttl("t:s0:kv:p")
    assert 0 < ttl_ms <= 30_000
    assert led._client.pttl("t:epoch") == -1


def test_ledger_reset_makes_absence_unproven() -> None:
    """An epoch that changes under a reader (Redis restarted empty) stops absence
    being evidence for trust_after_reset_s; presence still answers."""
    clock = FakeClock()
    settings = LedgerSettings("redis://h:1/0", namespace="t", shard="s", trust_after_reset_s=60)
    client = fakeredis.FakeRedis()
    led = RedisLedger(settings, client=client, clock=clock)
    c = chain("r", 4)
    led.record_stored("kv", c)
    assert led.leading_present("kv", c) == 4 and led.absence_is_evidence()
    client.flushall()  # restarted empty
    with pytest.raises(LedgerEmpty):
        led.leading_present("kv", c)
    led.record_stored("kv", c[:1])  # a writer comes back: new epoch
    assert led.leading_present("kv", c) == 1
    assert not led.absence_is_evidence() and led.resets == 1
    clock.now += 61
    assert led.absence_is_evidence()


def test_ledger_reset_without_ttl_distrusts_forever() -> None:
    """Without a TTL nothing ever proves the old pages gone: absence stays unproven."""
    clock = FakeClock()
    client = fakeredis.FakeRedis()
    led = RedisLedger(LedgerSettings("redis://h:1/0"), client=client, clock=clock)
    led.record_stored("kv", ["a"])
    led.leading_present("kv", ["a"])
    client.delete("hicache:epoch")
    led.record_stored("kv", ["a"])
    led.leading_present("kv", ["a"])
    clock.now += 10**9
    assert not led.absence_is_evidence()


@pytest.mark.parametrize(
    "reply", [b"garbage", [b"e", "x"], [b"e", 99], [b"e", -1], [42, 1], [b"e", 1, 2], None]
)
def test_ledger_garbage_script_reply(reply: Any) -> None:
    """A reply that is not {epoch, count in range} raises GarbageAnswer, never a number."""
    led = fake_ledger()
    led.record_stored("kv", ["a", "b"])
    led._script = lambda keys, args: reply  # type: ignore[method-assign,assignment]
    with pytest.raises(GarbageAnswer):
        led.leading_present("kv", ["a", "b"])


def test_ledger_rejects_hash_with_newline() -> None:
    """A page hash containing the script's separator is refused before any I/O."""
    with pytest.raises(ValueError, match="newline"):
        fake_ledger().leading_present("kv", ["a\nb"])


def test_ledger_maps_connection_errors() -> None:
    """A client that cannot connect raises TruthUnavailable (kind connection)."""
    import redis

    client = fakeredis.FakeRedis()
    led = RedisLedger(LedgerSettings("redis://h:1/0"), client=client)

    def boom(*_a: Any, **_k: Any) -> Any:
        raise redis.exceptions.ConnectionError("refused")

    led._script = boom  # type: ignore[method-assign,assignment]
    with pytest.raises(TruthUnavailable) as info:
        led.leading_present("kv", ["a"])
    assert info.value.kind == "connection"


@pytest.mark.parametrize(
    "url,ok",
    [
        ("redis://localhost:6379/0", True),
        ("rediss://user:s3cret@cache.example:6380/2", True),
        ("unix:///tmp/redis.sock?db=1", True),
        ("http://user:s3cret@h:1", False),
        ("redis://user:s3cret@h:notaport/0", False),
        ("", False),
    ],
)
def test_redis_url_validation_never_leaks_password(url: str, ok: bool) -> None:
    """validate_redis_url accepts redis/rediss/unix and its errors mask the password."""
    if ok:
        assert validate_redis_url(url) == url
        return
    with pytest.raises(ConfigError) as info:
        validate_redis_url(url)
    assert "s3cret" not in str(info.value)
    assert "redis_url" in str(info.value)


def test_client_configured_from_url_tls_password_db_timeouts() -> None:
    """rediss:// builds a TLS connection with the URL's password and db, our timeouts
    and a bounded retry with exponential backoff."""
    import redis

    settings = LedgerSettings(
        "rediss://app:pw@cache.example:6390/3?ssl_cert_reqs=none",
        socket_timeout_s=0.02,
        connect_timeout_s=0.03,
        retries=2,
    )
    client = build_client(settings)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    assert pool.connection_class is redis.SSLConnection
    assert (kw["host"], kw["port"], kw["db"], kw["password"]) == ("cache.example", 6390, 3, "pw")
    assert kw["socket_timeout"] == 0.02 and kw["socket_connect_timeout"] == 0.03
    assert kw["retry"].get_retries() == 2
    assert "pw" not in repr(RedisLedger(settings, client=fakeredis.FakeRedis()))


def test_shard_ids_follow_storage_key_spaces() -> None:
    """TP-sharded KV gets a shard per rank, MLA one per model, PP/CP suffixes."""
    assert shard_id("org/m", 1, 4) == "org-m_1_4"
    assert shard_id("org/m", 1, 4, is_mla=True) == "org-m"
    assert shard_id("m", 0, 2, pp_rank=1, pp_size=2) == "m_0_2_2_1"

    class Cfg:
        model_name = "m"
        tp_rank, tp_size, pp_rank, pp_size = 3, 8, 0, 1
        is_mla_model = False
        attn_cp_rank, attn_cp_size = 1, 2

    assert shard_from_storage_config(Cfg()) == "m_3_8_cp1_2"


def test_reconciler_config_section_validation() -> None:
    """Bad reconciler settings raise ConfigError naming the key, without the password."""
    with pytest.raises(ConfigError, match="breaker_backoff_max_s"):
        Config.from_mapping({"reconciler": {"breaker_backoff_s": 5.0, "breaker_backoff_max_s": 1}})
    with pytest.raises(ConfigError, match="redis_url") as info:
        Config.from_mapping({"reconciler": {"redis_url": "http://u:topsecret@h"}})
    assert "topsecret" not in str(info.value)
    with pytest.raises(ConfigError, match="retries"):
        Config.from_mapping({"reconciler": {"retries": -1}})
    with pytest.raises(ConfigError, match="method"):
        Config.from_mapping({"reconciler": {"method": "mget"}})
    cfg = Config.from_env({"HICACHE_EXISTENCE_RECONCILER__REDIS_URL": "redis://:pw@h:1/0"})
    assert cfg.reconciler.redis_url == "redis://:pw@h:1/0"
    assert "pw" not in str(cfg.redacted())


# -- circuit breaker -----------------------------------------------------------------


def test_breaker_opens_probes_and_backs_off() -> None:
    """Opens after N consecutive failures, admits one probe per backoff, doubles the
    backoff up to the cap on a failed probe, closes on success."""
    clock = FakeClock()
    b = CircuitBreaker(failures=3, backoff_s=1.0, backoff_max_s=3.0, clock=clock)
    assert b.permits() == -1 and b.state == CLOSED
    for _ in range(2):
        b.failure(False)
    assert b.state == CLOSED
    b.success()
    for _ in range(3):
        b.failure(False)
    assert b.state == OPEN and b.permits() == 0 and b.rejects(False)
    clock.now += 1.0
    assert b.state == HALF_OPEN and b.permits() == 1
    assert b.admitted() is True  # the probe
    assert b.permits() == 0 and not b.rejects(True) and b.rejects(False)
    b.failure(True)  # backoff 2 s
    clock.now += 1.5
    assert b.permits() == 0
    clock.now += 0.5
    assert b.permits() == 1
    b.admitted()
    b.failure(True)  # backoff capped at 3 s
    clock.now += 2.9
    assert b.permits() == 0
    clock.now += 0.1
    b.admitted()
    b.success()
    assert b.state == CLOSED and b.permits() == -1 and b.opened == 3  # 1 + 2 re-opens


def test_breaker_settings_rejected_at_the_config_edge() -> None:
    """Breaker settings are validated and named where they enter: the config."""
    with pytest.raises(ConfigError, match="breaker_failures"):
        Config.from_mapping({"reconciler": {"breaker_failures": 0}})
    with pytest.raises(ConfigError, match="breaker_backoff_max_s"):
        Config.from_mapping({"reconciler": {"breaker_backoff_s": 2, "breaker_backoff_max_s": 1}})


# -- agreement -----------------------------------------------------------------------


def test_in_process_group_min_reduces() -> None:
    """Every member gets the element-wise MIN of all members' vectors."""
    group = InProcessGroup(3)
    results: dict[int, list[int]] = {}

    def run(rank: int) -> None:
        results[rank] = group.member(rank).min_reduce([rank, 10 - rank, -rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {r: [0, 8, -2] for r in range(3)}
    assert SingleRank().min_reduce([3, 4]) == [3, 4]


def test_agreement_vector_slots() -> None:
    """The vector every rank MIN-reduces has 3 + 2 * slots words, named slots in
    a fixed order (docs/reconciler.md's budget table), padding that never wins a
    MIN against an answer, and an idle vector that admits nothing and refills
    no rank's bucket; a vector of another length is refused."""
    v = Vector.local([(5, 1), (-1, 0)], admit=3, elapsed_ms=70, slots=4)
    words = v.words()
    assert words == [2, 3, 70, 5, -1, UNDONE, UNDONE, 1, 0, 0, 0]
    assert Vector.from_words(words, 4) == v
    agreed = Vector.from_words([min(a, b) for a, b in zip(words, Vector.idle(4).words())], 4)
    assert (agreed.done, agreed.admit, agreed.elapsed_ms) == (0, 0, 0)
    assert agreed.leading == [5, -1, UNDONE, UNDONE]
    with pytest.raises(ValueError, match="11"):
        Vector.from_words(words[:-1], 4)


# -- the reconciler ---------------------------------------------------------------------


def test_reconciler_is_a_belief_observer_and_inert_without_truth() -> None:
    """With no ground truth it starts no thread and changes nothing."""
    cache, rec = wired(None)
    assert isinstance(rec, BeliefObserver)
    kv = cache.pool("kv")
    kv.add(chain("a", 8))
    kv.contains_all(chain("a", 8))
    for i in range(10):
        rec.apply(i)
    assert rec._worker is None and len(kv) == 8 and rec.snapshot().agreements == 0


def test_stale_positive_is_invalidated() -> None:
    """A believed chain that L3 lost beyond page k loses its beliefs beyond k."""
    truth = InMemoryGroundTruth()
    cache, rec = wired(truth)
    c = chain("s", 12)
    kv = cache.pool("kv")
    kv.add(c)
    truth.record_stored("kv", c[:7])
    assert kv.contains_all(c)
    step_until_idle(rec)
    assert kv.lru_keys()[-7:] == tuple(c[:7]) and len(kv) == 7
    snap = rec.snapshot()
    assert snap.stale_positives == {"kv": 1} and snap.pages_invalidated == {"kv": 5}
    assert snap.queries == {("kv", "absent"): 1}
    rec.close()


def test_presence_is_learnt_for_all_pages_pools_only() -> None:
    """Pages L3 holds that beliefs lack are added for kv, never for trailing pools."""
    truth = InMemoryGroundTruth()
    cache, rec = wired(truth)
    c = chain("l", 10)
    for pool in ("kv", "swa"):
        truth.record_stored(pool, c)
        cache.pool(pool).add(c[:3])
        assert not cache.pool(pool).contains_all(c)  # touched c[:3], stopped at c[3]
    step_until_idle(rec)
    assert len(cache.pool("kv")) == 10 and len(cache.pool("swa")) == 3
    assert rec.snapshot().pages_learnt == {"kv": 7}
    assert default_learns("kv") and not default_learns("mamba")
    assert not default_learns("deepseek_v4_c4_state")
    rec.close()


@pytest.mark.parametrize(
    "mode,kind",
    [
        ("raise", "connection"),
        ("garbage", "garbage"),
        ("too_big", "garbage"),
        ("internal", "internal"),
    ],
)
def test_errors_are_not_evidence_of_absence(mode: str, kind: str) -> None:
    """A failing or garbage-answering truth never causes an invalidation; errors are
    counted by kind."""
    truth = FaultyTruth(InMemoryGroundTruth(), mode)
    cache, rec = wired(truth)
    c = chain("e", 6)
    kv = cache.pool("kv")
    kv.add(c)
    kv.contains_all(c)
    step_until_idle(rec)
    assert len(kv) == 6
    snap = rec.snapshot()
    assert snap.errors == {kind: 1} and snap.queries == {("kv", "error"): 1}
    assert not snap.pages_invalidated
    rec.close()


def test_untrusted_absence_does_not_invalidate_but_presence_is_learnt() -> None:
    """While the truth cannot prove absence, short answers only teach presence."""
    mem = InMemoryGroundTruth()
    truth = TrustToggle(mem)
    truth.trusted = False
    cache, rec = wired(truth)
    a, b = chain("u1", 6), chain("u2", 6)
    kv = cache.pool("kv")
    kv.add(a)
    mem.record_stored("kv", a[:2])
    mem.record_stored("kv", b[:4])
    kv.add(b[:1])
    kv.contains_all(a)
    kv.contains_all(b)
    step_until_idle(rec)
    assert set(a) <= set(kv.lru_keys()) and set(b[:4]) <= set(kv.lru_keys())
    snap = rec.snapshot()
    assert snap.queries == {("kv", "untrusted"): 2} and snap.pages_learnt == {"kv": 3}
    rec.close()


def test_slow_truth_times_out_without_blocking_or_invalidating() -> None:
    """An answer later than timeout_s is dropped (counted as timeout + late answer);
    apply() never waits for it."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "block")
    cache, rec = wired(truth, timeout_s=0.02)
    c = chain("t", 5)
    kv = cache.pool("kv")
    kv.add(c)
    kv.contains_all(c)
    t0 = time.perf_counter()
    # Submit the query and let the worker take it: a query that times out before the
    # worker reaches it is never asked (so there is no late answer to count), which a
    # loaded machine can make happen within timeout_s.
    rec.apply(0)
    while truth.calls == 0 and time.perf_counter() - t0 < 5:
        time.sleep(0.001)
    assert truth.calls == 1, rec.snapshot()
    step_until_idle(rec)
    assert time.perf_counter() - t0 < 5
    truth.release.set()
    deadline = time.monotonic() + 5
    while rec.snapshot().late_answers == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    snap = rec.snapshot()
    assert snap.queries == {("kv", "timeout"): 1} and snap.late_answers == 1
    assert len(kv) == 5
    rec.close()


def test_page_added_while_query_out_is_not_invalidated() -> None:
    """A write acked after the query left is newer than the answer: withheld."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "block")
    cache, rec = wired(truth, timeout_s=5.0)
    c = chain("w", 4)
    kv = cache.pool("kv")
    kv.add(c[:2])
    mem.record_stored("kv", c[:2])
    kv.contains_all(c)  # stops at c[2]
    rec.apply(0)  # admitted; the worker blocks inside the truth
    kv.add(c[2:])  # storage ack of the rest while the query is out
    kv.contains_all(c)
    truth.release.set()
    step_until_idle(rec)
    assert len(kv) == 4
    assert rec.snapshot().invalidations_withheld == {"kv": 1}
    rec.close()


def test_clear_voids_outstanding_queries() -> None:
    """Answers to queries that were out when their pool was cleared are discarded."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "block")
    cache, rec = wired(truth, timeout_s=5.0)
    c = chain("v", 4)
    mem.record_stored("kv", c)
    kv = cache.pool("kv")
    kv.add(c[:1])
    kv.contains_all(c)
    rec.apply(0)
    deadline = time.monotonic() + 5
    while truth.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.001)  # the worker is now blocked inside the query
    cache.clear()  # L3 flushed: a presence answer from before must not be learnt
    truth.release.set()
    step_until_idle(rec)
    assert len(kv) == 0
    deadline = time.monotonic() + 5
    while rec.snapshot().late_answers == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    snap = rec.snapshot()
    assert snap.queries == {("kv", "void"): 1} and not snap.pages_learnt
    assert snap.late_answers == 1  # the blocked answer came back and was discarded
    rec.close()


def test_sampling_is_deterministic_and_near_the_rate() -> None:
    """Two replicas fed the same lookups pick the same chains; the picked fraction is
    close to sampling_rate."""
    picks = []
    for _ in range(2):
        cache, rec = wired(InMemoryGroundTruth(), sampling_rate=0.1, max_candidates=10_000)
        kv = cache.pool("kv")
        chains = [chain(i, 3) for i in range(300)]
        for c in chains:
            kv.add(c)
        for _round in range(10):
            for c in chains:
                kv.contains_all(c)
        picks.append([c for _, c in rec._candidates])
    assert picks[0] == picks[1]
    # 300 chains looked up 10 times at 10%, a chain counted once while queued:
    # 300 * (1 - 0.9**10) ~ 195 distinct picks.
    assert 150 <= len(picks[0]) <= 240


def test_budget_limits_admissions_by_agreed_clock() -> None:
    """verifications_per_s bounds admissions per second of the (agreed) clock."""
    clock = FakeClock()
    cache, rec = wired(InMemoryGroundTruth(), verifications_per_s=5.0, clock=clock, timeout_s=1e6)
    kv = cache.pool("kv")
    chains = [chain(("b", i), 2) for i in range(200)]
    for c in chains:
        kv.add(c)
    admitted = []
    for second in range(4):
        for i in range(10):  # 10 steps per second, 5 lookups each
            for c in chains[(second * 50 + i * 5) : (second * 50 + i * 5 + 5)]:
                kv.contains_all(c)
            rec.apply(i)
            clock.now += 0.1
        admitted.append(rec.snapshot().candidates_admitted)
    assert admitted[0] == 9  # the initial burst (1 s of budget) + 0.9 s of refill
    per_second = [b - a for a, b in itertools.pairwise(admitted)]
    assert all(4 <= n <= 6 for n in per_second), per_second
    rec.close()


def test_breaker_opens_then_recovers_through_reconciler() -> None:
    """Consecutive errors open the circuit (no admissions, no I/O); after the backoff a
    probe succeeds and verification resumes."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "raise")
    breaker = CircuitBreaker(failures=2, backoff_s=0.05, backoff_max_s=0.1)
    cache, rec = wired(truth, breaker=breaker)
    kv = cache.pool("kv")
    chains = [chain(("c", i), 3) for i in range(40)]
    for c in chains:
        kv.add(c)
        mem.record_stored("kv", c)
    for c in chains[:10]:
        kv.contains_all(c)
        rec.apply(0)
        time.sleep(0.002)
    step_until_idle(rec)
    assert rec.snapshot().circuit_opened >= 1
    calls_when_open = truth.calls
    assert truth.calls <= 4  # two failures, then at most a probe or two
    truth.mode = "ok"
    time.sleep(0.12)
    for c in chains[10:]:
        kv.contains_all(c)
        rec.apply(1)
        time.sleep(0.002)
    step_until_idle(rec)
    snap = rec.snapshot()
    assert snap.circuit_state == CLOSED and truth.calls > calls_when_open
    assert snap.queries.get(("kv", "present"), 0) >= 1
    rec.close()


def test_flat_cache_is_reconciled_too() -> None:
    """The seed generation (one LRU over (pool, hash)) is healed through its own API."""
    truth = InMemoryGroundTruth()
    tee = Tee()
    cache = FlatStorageExistenceCache(1000, observer=tee)
    rec = Reconciler(cache, truth, sampling_rate=1.0, agree_interval_steps=1)
    tee.observers = (rec,)
    c = chain("f", 6)
    cache.add("kv", c)
    truth.record_stored("kv", c[:2])
    cache.contains_all("kv", c)
    step_until_idle(rec)
    assert len(cache) == 2 and rec.snapshot().stale_positives == {"kv": 1}
    rec.close()


def test_in_process_ranks_agree_and_stay_identical() -> None:
    """Two ranks whose truths disagree (rank 1 lost a page) apply the same MIN
    verdicts; without agreement the same run diverges (the check can fail)."""

    def run(agreed: bool) -> list[tuple[str, ...]]:
        group = InProcessGroup(2)
        out: list[tuple[str, ...]] = [(), ()]
        chains = [chain(("m", i), 8) for i in range(30)]

        def rank(r: int) -> None:
            truth = FaultyTruth(InMemoryGroundTruth(), "slow", delay_s=0.001 * (1 + r))
            for c in chains:
                truth.inner.record_stored("kv", c)
            truth.inner.record_removed("kv", [chains[r * 7][3 + r]])
            agreement = group.member(r) if agreed else SingleRank()
            cache, rec = wired(truth, agreement=agreement, timeout_s=1.0)
            kv = cache.pool("kv")
            for i, c in enumerate(chains):
                kv.add(c)
                kv.contains_all(c)
                rec.apply(i)
            for i in range(400):
                rec.apply(i)
                idle = rec.idle()
                both_idle = group.member(r).min_reduce([int(idle)])[0] if agreed else idle
                if both_idle:
                    break
                time.sleep(0.002)
            out[r] = kv.lru_keys()
            rec.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    a = run(True)
    assert a[0] == a[1] and len(a[0]) == 30 * 8 - 5 - 4
    b = run(False)
    assert b[0] != b[1]


def test_unsupported_pool_does_not_open_the_circuit() -> None:
    """A pool the truth cannot answer (e.g. sidecars over batch_exists) is an error
    for that pool only: kv verification goes on, the circuit stays closed."""
    backend = FakeBackend()
    truth = storage_adapters.BackendGroundTruth(backend)
    breaker = CircuitBreaker(failures=2, backoff_s=10, backoff_max_s=10)
    cache, rec = wired(truth, breaker=breaker)
    swa, kv = cache.pool("swa"), cache.pool("kv")
    chains = [chain(("u", i), 4) for i in range(6)]
    for c in chains:
        swa.add(c)
        swa.contains_all(c)
    kv.add(chains[0])
    backend.data.update(dict.fromkeys(chains[0][:2], 1))
    kv.contains_all(chains[0])
    step_until_idle(rec)
    snap = rec.snapshot()
    assert snap.errors == {"unsupported": 6} and snap.circuit_state == CLOSED
    assert snap.stale_positives == {"kv": 1} and len(kv) == 2 and len(swa) == 24
    rec.close()


def test_reconciler_settings_rejected_at_the_config_edge() -> None:
    """The reconciler's settings are validated and named where they enter: the
    config. A zero timeout is refused: it is also the Redis socket timeout, where 0
    means none (a hung Redis would hold the worker and the ledger writer for good);
    ``from_section`` keeps a tiny one above 0."""
    for key, bad, words in (
        ("sampling_rate", 1.5, "within"),
        ("queue_size", 2.5, "integer"),
        ("queue_size", 0, ">= 1"),
        ("timeout_ms", -1, "> 0"),
        ("timeout_ms", 0, "> 0"),
        ("connect_timeout_ms", 0, "> 0"),
        ("namespace", "a:b", "without whitespace or ':'"),
        ("namespace", "", "non-empty"),
    ):
        with pytest.raises(ConfigError, match=f"reconciler.{key} must be.*{words}"):
            Config.from_mapping({"reconciler": {key: bad}})
    cache, _ = wired(None)
    section = Config.from_mapping(
        {"reconciler": {"timeout_ms": 1e-9, "redis_url": "redis://h:1/0"}}
    ).reconciler
    assert Reconciler.from_section(section, cache, None)._timeout > 0
    assert LedgerSettings.from_section(section).socket_timeout_s > 0
    for arg in ("namespace", "shard"):  # the storage wrapper's extra config comes here
        with pytest.raises(ValueError, match=f"{arg} must be .*':'"):
            LedgerSettings("redis://h:1/0", **{arg: "a:b"})


def test_from_section_disabled_is_inert() -> None:
    """A disabled section yields an inert reconciler even when a truth is given."""
    cache, _ = wired(None)
    rec = Reconciler.from_section(ReconcilerSection(enabled=False), cache, InMemoryGroundTruth())
    assert not rec.active
    rec2 = Reconciler.from_section(ReconcilerSection(enabled=True), cache, InMemoryGroundTruth())
    assert rec2.active


def test_histogram_buckets() -> None:
    """Observations land in the first bucket whose bound is >= the value."""
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    s = h.snapshot()
    assert s.cumulative == (2, 3, 4) and s.count == 4 and abs(s.sum - 2.65) < 1e-9


# -- ledger writer and storage adapters -------------------------------------------------


class BlockingLedger(InMemoryGroundTruth):
    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.cleared_shards = 0

    def record_stored(self, pool: str, hashes: Any) -> int:
        self.gate.wait(10)
        return super().record_stored(pool, hashes)

    def clear_shard(self) -> int:
        self.cleared_shards += 1
        self.clear()
        return 0


def test_ledger_writer_is_async_bounded_and_counts() -> None:
    """Records never block the caller; overflow is dropped and counted; flush drains."""
    ledger = BlockingLedger()
    w = LedgerWriter(ledger, max_pending=2, batch_pages=4)
    t0 = time.perf_counter()
    for i in range(10):
        w.stored("kv", [f"p{i}"])
    assert time.perf_counter() - t0 < 0.5
    ledger.gate.set()
    assert w.flush(5)
    counts = w.counts()["pages"]
    assert counts["stored/dropped"] >= 1
    assert counts["stored/ok"] + counts["stored/dropped"] == 10
    assert len(ledger) == counts["stored/ok"]
    w.removed("kv", ["p0"])
    w.cleared()
    w.close()
    assert ledger.cleared_shards == 1


def test_ledger_barrier_answers_only_after_records_offered_before_it() -> None:
    """wait_written is True at once with nothing queued, False while a record
    offered before it is held, True once that record is in the ledger; the truth
    over the writer raises ledger_behind instead of answering past its wait, and
    answers with the record once written."""
    ledger = BlockingLedger()
    w = LedgerWriter(ledger)
    truth = w.truth(0.05)
    assert w.wait_written(0.0)
    w.stored("kv", ["p0", "p1"])
    assert not w.wait_written(0.05)
    with pytest.raises(LedgerBehind) as err:
        truth.leading_present("kv", ["p0", "p1"])
    assert err.value.kind == "ledger_behind"
    assert ledger.leading_present("kv", ["p0", "p1"]) == 0  # the record is still held
    ledger.gate.set()
    assert w.wait_written(5)
    assert ledger.leading_present("kv", ["p0", "p1"]) == 2
    assert truth.leading_present("kv", ["p0", "p1"]) == 2
    assert truth.present("kv", ["p1", "x"]) == [True, False]
    assert truth.ledger is ledger and truth.absence_is_evidence()
    w.close()


class FakeBackend:
    """A stand-in HiCache backend: a dict, with per-key failure injection."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.fail: set[str] = set()
        self.calls: list[str] = []
        self.custom_attribute = "x"

    def _ok(self, key: str) -> bool:
        return key not in self.fail

    def register_mem_pool_host(self, host: Any) -> None:
        self.calls.append("register_mem_pool_host")

    def register_mem_host_pool_v2(self, host: Any, name: Any) -> None:
        self.calls.append("register_mem_host_pool_v2")

    def on_host_pools_registered(self) -> None:
        self.calls.append("on_host_pools_registered")

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        out = [self._ok(k) for k in keys]
        for k, ok in zip(keys, out):
            if ok:
                self.data[k] = 1
        return out

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        return [k in self.data for k in keys]

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return {t.name: [self._ok(k) for k in t.keys] for t in transfers}

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return {t.name: [True for _ in t.keys] for t in transfers}

    def batch_exists_v2(self, keys: Any, pool_transfers: Any = None, extra_info: Any = None) -> Any:
        return "v2"

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.data.get(key)

    def batch_get(self, keys: Any, target_locations: Any = None, target_sizes: Any = None) -> Any:
        return [self.data.get(k) for k in keys]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if not self._ok(key):
            return False
        self.data[key] = value
        return True

    def batch_set(
        self, keys: Any, values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if any(not self._ok(k) for k in keys):
            return False
        self.data.update(zip(keys, values or [1] * len(keys)))
        return True

    def exists(self, key: str) -> bool:
        return key in self.data

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, k in enumerate(keys):
            if k not in self.data:
                return i
        return len(keys)

    def clear(self) -> bool:
        self.data.clear()
        return True

    def get_stats(self) -> str:
        return "stats"

    def close(self) -> None:
        self.calls.append("close")


class Transfer:
    def __init__(self, name: str, keys: list[str]) -> None:
        self.name = name
        self.keys = keys


class StorageConfig:
    extra_config: ClassVar[dict[str, Any]] = {}
    model_name = "m"
    tp_rank, tp_size = 0, 1


def test_backend_ground_truth_uses_batch_exists() -> None:
    """Ground truth over a backend answers kv through batch_exists; other pools need
    a key mapping; raising or garbage backends map to errors."""
    backend = FakeBackend()
    backend.data.update(a=1, b=1)
    truth = storage_adapters.BackendGroundTruth(backend)
    assert truth.leading_present("kv", ["a", "b", "c", "a"]) == 2
    assert truth.present("kv", ["a", "c"]) == [True, False]
    with pytest.raises(UnsupportedPool):
        truth.leading_present("swa", ["a"])
    mapped = storage_adapters.BackendGroundTruth(backend, key_for=lambda p, h: h)
    assert mapped.leading_present("swa", ["a"]) == 1
    backend.batch_exists = lambda keys, extra_info=None: 9  # type: ignore[method-assign]
    with pytest.raises(GarbageAnswer):
        truth.leading_present("kv", ["a"])

    def boom(keys: Any, extra_info: Any = None) -> int:
        raise OSError("disk gone")

    backend.batch_exists = boom  # type: ignore[method-assign]
    with pytest.raises(ServerError):
        truth.leading_present("kv", ["a"])
    with pytest.raises(TypeError, match="batch_exists"):
        storage_adapters.BackendGroundTruth(object())


def test_wrapper_delegates_and_records_successful_writes() -> None:
    """The wrapper delegates every HiCacheStorage call and records only successful
    writes (v1, v2, set, batch_set) into the ledger; exists shortfalls remove."""
    cls = storage_adapters.LedgerRecordingStorage
    backend = FakeBackend()
    ledger = InMemoryGroundTruth()
    ledger.clear_shard = ledger.clear  # type: ignore[attr-defined]
    w = cls(StorageConfig(), {}, inner=backend, ledger=ledger)
    backend.fail.add("bad")
    w.register_mem_pool_host("host")
    w.register_mem_host_pool_v2("host", "swa")
    w.on_host_pools_registered()
    assert w.batch_set_v1(["k1", "bad", "k2"], None) == [True, False, True]
    assert w.batch_set_v2([Transfer("swa", ["s1", "bad"]), Transfer("kv", ["k3"])]) == {
        "swa": [True, False],
        "kv": [True],
    }
    assert w.set("k4", 1) is True and w.set("bad", 1) is False
    assert w.batch_set(["k5", "k6"], [1, 1]) is True
    assert w.batch_set(["k7", "bad"], [1, 1]) is False
    assert w.flush_ledger(5)
    stored = ["k1", "k2", "k3", "k4", "k5", "k6"]
    assert all(ledger.present("kv", stored)) and ledger.present("kv", ["k7", "bad"]) == [
        False,
        False,
    ]
    assert ledger.present("swa", ["s1", "bad"]) == [True, False]
    # reads and other calls are delegated untouched
    assert w.batch_get_v1(["k1", "zz"], None) == [True, False]
    assert w.get("k4") == 1 and w.batch_get(["k4", "zz"]) == [1, None]
    assert w.exists("k1") and w.batch_exists_v2(["k1"]) == "v2" and w.get_stats() == "stats"
    assert w.custom_attribute == "x" and w.inner_backend is backend
    # the real backend says k2 is absent (L3 evicted it): the ledger forgets it
    del backend.data["k2"]
    assert w.batch_exists(["k1", "k2", "k3"]) == 1
    w.flush_ledger(5)
    assert ledger.present("kv", ["k1", "k2"]) == [True, False]
    assert w.clear() is True
    w.flush_ledger(5)
    assert len(ledger) == 0
    assert w.ledger_ground_truth().ledger is ledger  # behind the writer's barrier
    w.close()
    assert backend.calls == [
        "register_mem_pool_host",
        "register_mem_host_pool_v2",
        "on_host_pools_registered",
        "close",
    ]


def test_an_absence_learnt_while_a_write_landed_is_not_recorded() -> None:
    """A prefetch hit query reads page X absent; before its call returns, the backup
    thread stores X and records it. Recording the absence after that would leave
    the ledger without a page L3 holds: trusted absence for every reconciler on it."""
    page = "ab" * 32

    class Racing(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.answered, self.go_on = threading.Event(), threading.Event()

        def batch_exists(self, keys: Any, extra_info: Any = None) -> int:
            n = super().batch_exists(keys, extra_info)
            self.answered.set()  # the store answered; the call returns a moment later
            self.go_on.wait(5)
            return n

    backend = Racing()
    ledger = InMemoryGroundTruth()
    ledger.clear_shard = ledger.clear  # type: ignore[attr-defined]
    w = storage_adapters.LedgerRecordingStorage(StorageConfig(), {}, inner=backend, ledger=ledger)
    hit_query = threading.Thread(target=lambda: w.batch_exists([page]))
    hit_query.start()
    assert backend.answered.wait(5)
    assert w.batch_set_v1([page], None) == [True]  # the backup thread, meanwhile
    backend.go_on.set()
    hit_query.join(5)
    assert w.flush_ledger(5)
    assert ledger.leading_present("kv", [page]) == 1
    other = "cd" * 32
    assert w.batch_set_v1([other], None) == [True]
    del backend.data[other]  # L3 lost it
    assert w.batch_exists([other]) == 0  # no write meanwhile: the absence is learnt
    assert w.flush_ledger(5)
    assert ledger.leading_present("kv", [other]) == 0
    w.close()


def test_wrapper_needs_a_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a URL (env or extra config) the wrapper refuses to start, saying how."""
    monkeypatch.delenv("HICACHE_EXISTENCE_RECONCILER__REDIS_URL", raising=False)
    monkeypatch.delenv("HICACHE_EXISTENCE_CONFIG", raising=False)
    with pytest.raises(ValueError, match="HICACHE_EXISTENCE_RECONCILER__REDIS_URL"):
        storage_adapters.LedgerRecordingStorage(StorageConfig(), {}, inner=FakeBackend())


def test_the_objects_a_truth_leased_are_exported_and_never_go_back() -> None:
    """``objects_leased`` is the ground truth's own ``leased_objects()`` (Mooncake's
    read leases), 0 for a truth without it or one whose count fails; the tree-cache
    truth keeps the count of a backend it replaced, so the counter never falls."""
    from hicache_existence.config import ReconcilerSection
    from hicache_existence.core.cache import StorageExistenceCache
    from hicache_existence.integrations.sglang.tree_cache_truth import TreeCacheGroundTruth
    from hicache_existence.reconcile.reconciler import Reconciler

    class Leasing:
        def __init__(self, n: int) -> None:
            self.n = n

        def leased_objects(self) -> int:
            return self.n

    class Broken:
        def leased_objects(self) -> int:
            raise RuntimeError("no")

    for truth, want in ((Leasing(7), 7), (Broken(), 0), (object(), 0)):
        rec = Reconciler(StorageExistenceCache(16), truth)  # type: ignore[arg-type]
        assert rec.snapshot().objects_leased == want
        rec.close()
    tree_truth = TreeCacheGroundTruth(ReconcilerSection())
    tree_truth._truth = Leasing(5)  # type: ignore[assignment]
    tree_truth._leased_before = 3
    assert tree_truth.leased_objects() == 8


# -- the breaker and the budget under races (a reviewer's reproducers) --------------------


def test_a_probe_voided_before_the_worker_takes_it_lets_another_go() -> None:
    """A probe whose pool is cleared before the worker takes it is skipped unasked:
    the breaker must hear of it, or it waits for that probe for good and no rank
    admits a query again (admission is MIN-agreed), Redis healthy or not."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "raise")
    breaker = CircuitBreaker(failures=1, backoff_s=0.02, backoff_max_s=0.04)
    cache, rec = wired(truth, breaker=breaker)
    kv = cache.pool("kv")
    chains = [chain(("p", i), 3) for i in range(150)]
    for c in chains:
        kv.add(c)
        mem.record_stored("kv", c)
    kv.contains_all(chains[0])
    deadline = time.monotonic() + 5
    while rec.snapshot().circuit_opened == 0 and time.monotonic() < deadline:
        rec.apply(0)
        time.sleep(0.002)
    assert rec.snapshot().circuit_opened == 1
    step_until_idle(rec)
    time.sleep(0.05)  # the backoff passed: a probe is due
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the worker cannot take the probe before the clear
    try:
        kv.contains_all(chains[1])
        rec.apply(0)
        assert rec.outstanding() == 1
        cache.clear()
    finally:
        sys.setswitchinterval(old)
    truth.mode = "ok"
    calls = truth.calls
    for i, c in enumerate(chains[2:]):
        kv.add(c)
        kv.contains_all(c)
        rec.apply(i)
        time.sleep(0.003)
    snap = rec.snapshot()
    rec.close()
    assert truth.calls > calls, "no query was asked again: the breaker waits for a voided probe"
    assert snap.circuit_state == CLOSED


def test_a_circuit_opening_during_the_agreement_sends_one_probe_not_a_burst() -> None:
    """``permits`` is read before the collective; the worker can open the circuit
    while the scheduler waits in it. Of the queries admitted then, only a due probe
    may do I/O: the rest fail fast, and the backoff is not doubled once per query."""

    class FailuresDuringCollective(SingleRank):
        def __init__(self, breaker: CircuitBreaker) -> None:
            self.breaker = breaker
            self.fire = False

        def min_reduce(self, values: Any) -> Any:
            if self.fire:
                self.fire = False
                for _ in range(5):
                    self.breaker.failure(False)  # five queries failed meanwhile
            return list(values)

    now = [0.0]
    breaker = CircuitBreaker(failures=5, backoff_s=1.0, backoff_max_s=60.0, clock=lambda: now[0])
    agreement = FailuresDuringCollective(breaker)
    truth = FaultyTruth(InMemoryGroundTruth(), "raise")
    cache, rec = wired(truth, breaker=breaker, agreement=agreement, timeout_s=5.0)
    kv = cache.pool("kv")
    for i in range(8):
        c = chain(("b", i), 3)
        kv.add(c)
        kv.contains_all(c)
    agreement.fire = True
    rec.apply(0)  # admits 8 (closed when read); the circuit opens in the collective
    deadline = time.monotonic() + 5
    while rec.snapshot().queries.get(("kv", "rejected"), 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    rec.close()
    assert truth.calls == 0
    assert breaker.state == OPEN and breaker._backoff == 1.0
    now[0] = 1.0  # the backoff passed: exactly one probe is due
    assert breaker.permits() == 1 and breaker.admitted() and not breaker.admitted()


@pytest.mark.parametrize(("per_s", "step_ms"), [(0.5, 1), (1.5, 1), (0.9, 1), (2.5, 3), (7.0, 1)])
def test_the_budget_refills_at_fractional_rates_and_short_intervals(
    per_s: float, step_ms: int
) -> None:
    """Each refill rounded down to whole thousandths and moved its origin anyway:
    at 0.5/s with an agreement every millisecond nothing ever refilled."""
    from hicache_existence.reconcile.bucket import TokenBucket

    b = TokenBucket(per_s)
    b.milli = 0  # the burst was spent
    b.refill(0)
    admitted = 0
    for ms in range(step_ms, 20_000 + 1, step_ms):
        b.refill(ms)
        while b.tokens() >= 1:
            b.spend()
            admitted += 1
    assert abs(admitted - per_s * 20) <= 1


@pytest.mark.parametrize("bad", [None, -900, True, 2, "1"])
def test_a_mooncake_code_outside_0_and_1_is_an_error_not_an_absence(bad: Any) -> None:
    """A garbage code read as absence would be trusted evidence and drop beliefs
    L3 holds; ``None`` slipped past the check as its own sentinel."""
    from hicache_existence.reconcile.mooncake_truth import MooncakeGroundTruth

    class Store:
        def batch_is_exist(self, keys: Sequence[str]) -> list[Any]:
            return [1, bad, 1][: len(keys)]

    class Backend:
        is_mla_backend, mla_suffix, mha_suffix, should_split_heads = True, "", "0", False
        store = Store()

        def _tag_keys(self, keys: Sequence[str]) -> Sequence[str]:
            return keys

    with pytest.raises(GroundTruthError):
        MooncakeGroundTruth(Backend()).leading_present("kv", ["a" * 64, "b" * 64, "c" * 64])
