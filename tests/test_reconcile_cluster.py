"""The ledger on a real Redis Cluster (3 primaries + 3 replicas started by the
tests, ``redis-cli --cluster create``): URL parsing and redaction, hash-tagged
keys in one slot per (shard, pool), agreement with the in-memory ledger, two
instances learning through the cluster, a cluster down at start, and a primary
killed under a running reconciler and ledger writer (failover, errors never
evidence, nothing invalidated, recovery time measured)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reconcile_helpers import chain, step_until_idle, wired
from reconcile_redis_server import free_port, need_binary

pytestmark = pytest.mark.redis

redis = pytest.importorskip("redis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from redis_cluster_server import RedisCluster  # noqa: E402

from hicache_existence.config import Config, ConfigError, redact_url  # noqa: E402
from hicache_existence.reconcile.breaker import CircuitBreaker  # noqa: E402
from hicache_existence.reconcile.ground_truth import (  # noqa: E402
    GroundTruthError,
    InMemoryGroundTruth,
    LedgerEmpty,
    TruthUnavailable,
)
from hicache_existence.reconcile.ledger_writer import LedgerWriter  # noqa: E402
from hicache_existence.reconcile.ledgers import ledger_from_section, open_ledger  # noqa: E402
from hicache_existence.reconcile.redis_cluster import RedisClusterLedger  # noqa: E402
from hicache_existence.reconcile.redis_truth import (  # noqa: E402
    LedgerSettings,
    RedisLedger,
    cluster_seeds,
    validate_redis_url,
)

#: Figures for the notes, printed when the module finishes (visible with -s).
FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    if FIGURES:
        print("\ncluster figures:", {k: FIGURES[k] for k in sorted(FIGURES)})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    need_binary("redis-server")
    c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        t0 = time.monotonic()
        c.start()
        FIGURES["cluster_start_s"] = round(time.monotonic() - t0, 2)
        yield c
    finally:
        c.close()


def cluster_ledger(url: str, shard: str = "s0", **kw: Any) -> RedisClusterLedger:
    kw.setdefault("socket_timeout_s", 0.2)
    kw.setdefault("connect_timeout_s", 0.2)
    return RedisClusterLedger(LedgerSettings(url, namespace="t", shard=shard, **kw))


# -- configuration (no server) -------------------------------------------------------


def test_cluster_urls_parse_validate_and_redact() -> None:
    """Cluster URLs give their seeds (default port 6379, IPv6 in brackets), bad
    ones are refused naming the key, and the password never shows."""
    url = "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002/0?ssl_cert_reqs=none"
    assert cluster_seeds(url) == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)]
    assert validate_redis_url(url) == url
    assert "s3cret" not in redact_url(url) and "app:***@" in redact_url(url)
    config = Config.from_mapping({"reconciler": {"redis_url": url}})
    assert config.reconciler.redis_url == url
    assert "s3cret" not in str(config.redacted())
    assert "s3cret" not in repr(open_ledger(LedgerSettings(url)))
    # docs/reconciler.md: masked in every repr (the settings every ledger keeps too).
    assert "s3cret" not in repr(LedgerSettings(url)) and "app:***@" in repr(LedgerSettings(url))
    assert "s3cret" not in repr(config) and "app:***@" in repr(config.reconciler)
    for bad, words in (
        ("redis+cluster://h:1/3", "database 0"),
        ("redis+cluster://h:1?db=2", "database 0"),
        ("redis+cluster://:pw@h:99999", "bad port"),
        ("redis+cluster://h:1,,h:2", "empty host"),
        ("redis+cluster://u:pw@h:x", "bad port"),
    ):
        with pytest.raises(ConfigError, match=words) as info:
            validate_redis_url(bad, "reconciler.redis_url")
        assert "pw" not in str(info.value)
    with pytest.raises(ConfigError, match="redis\\+cluster"):
        Config.from_mapping({"reconciler": {"redis_url": "memcached://h:1"}})


def test_a_query_without_a_path_reaches_redis_py_whole() -> None:
    """The node list ends at the path or, without one, at the query: a query value
    holding a '/' (``ssl_ca_certs=/etc/...``) was cut at it."""
    import redis.cluster

    from hicache_existence.reconcile.redis_cluster import build_cluster_client

    for url, tail in (
        ("rediss+cluster://u:pw@10.0.0.11:7000,10.0.0.12:7000?ssl_ca_certs=/etc/ca.pem", "/?ssl"),
        ("redis+cluster://10.0.0.11:7000/0?ssl_ca_certs=/etc/ca.pem", "/0?ssl"),
        ("redis+cluster://10.0.0.11:7000,10.0.0.12", ""),
    ):
        with mock.patch.object(redis.cluster.RedisCluster, "from_url") as from_url:
            build_cluster_client(LedgerSettings(url))
        first = from_url.call_args.args[0]
        assert first.split("10.0.0.11:7000", 1)[1] in (tail + "_ca_certs=/etc/ca.pem", "/"), first


def test_cluster_url_opens_the_cluster_ledger_and_standalone_stays() -> None:
    """``open_ledger`` picks the cluster ledger for redis+cluster:// only; braces in
    the namespace (they would break the hash tag) are refused."""
    assert type(open_ledger(LedgerSettings("redis://127.0.0.1:1/0"))) is RedisLedger
    led = open_ledger(LedgerSettings("redis+cluster://127.0.0.1:1", namespace="n", shard="m_0_2"))
    assert isinstance(led, RedisClusterLedger)
    assert led.prefix("kv") == "{n:m_0_2:kv}:" and led.epoch_key("kv") == "{n:m_0_2:kv}"
    with pytest.raises(ValueError, match="namespace"):
        RedisClusterLedger(LedgerSettings("redis+cluster://127.0.0.1:1", namespace="a{b}"))
    with pytest.raises(ValueError, match=r"redis\+cluster://"):
        RedisClusterLedger(LedgerSettings("redis://127.0.0.1:1/0"))


def test_an_injected_client_is_used_at_first_use_and_closed_only_then() -> None:
    """A client handed in (tests, tools) counts as built at its first use, as a
    built one does: a ledger closed before any use leaves it alone."""
    client = mock.MagicMock()
    led = RedisClusterLedger(LedgerSettings("redis+cluster://127.0.0.1:1"), client=client)
    assert led._lazy.built is None
    led.close()
    client.close.assert_not_called()
    led = RedisClusterLedger(LedgerSettings("redis+cluster://127.0.0.1:1"), client=client)
    assert led._lazy.get() is client and led._lazy.built is client


def test_cluster_errors_map_to_unavailable() -> None:
    """What redis-py raises while a cluster fails over or reshards is a
    ``connection`` error (never an answer); standalone mappings are unchanged."""
    import redis.exceptions as rx

    from hicache_existence.reconcile.ground_truth import ServerError, TruthTimeout
    from hicache_existence.reconcile.redis_truth import map_error

    for exc in (
        rx.ClusterDownError("CLUSTERDOWN The cluster is down"),
        rx.MasterDownError("MASTERDOWN"),
        rx.TryAgainError("TRYAGAIN"),
        rx.MovedError("3999 127.0.0.1:6381"),
        rx.SlotNotCoveredError("slot 12 is not covered"),
        rx.RedisClusterException("Redis Cluster cannot be connected"),
    ):
        assert type(map_error(exc)) is TruthUnavailable, exc
    assert type(map_error(rx.TimeoutError("t"))) is TruthTimeout
    assert type(map_error(rx.ResponseError("ERR x"))) is ServerError


def test_cluster_down_at_start_is_an_error_not_a_crash() -> None:
    """No node answers: building the ledger does no I/O; every read and write
    raises TruthUnavailable (never an absence), and ping says False."""
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    led = cluster_ledger(url)
    for call in (
        lambda: led.leading_present("kv", chain("x", 4)),
        lambda: led.present("kv", chain("x", 4)),
        lambda: led.record_stored("kv", chain("x", 4)),
        lambda: led.clear_shard(),
    ):
        with pytest.raises(TruthUnavailable):
            call()
    assert not led.ping()
    assert not led.absence_is_evidence()  # an error starts the distrust window
    led.close()


# -- a running cluster ---------------------------------------------------------------


def test_a_shard_pool_lives_in_one_slot(cluster: RedisCluster) -> None:
    """Every key of a (shard, pool), the epoch included, hashes to one slot;
    other shards land elsewhere."""
    led = cluster_ledger(cluster.url, shard="m_0_4")
    c = chain("slot", 64)
    led.record_stored("kv", c)
    probe = cluster.nodes[0].client()
    slots = {
        int(probe.execute_command("CLUSTER", "KEYSLOT", k))
        for k in [led.epoch_key("kv"), *(led.prefix("kv") + h for h in c)]
    }
    assert len(slots) == 1
    others = {
        int(
            probe.execute_command(
                "CLUSTER", "KEYSLOT", cluster_ledger(cluster.url, f"m_{r}_4").tag("kv")
            )
        )
        for r in range(4)
    }
    assert len(others) == 4
    assert led.leading_present("kv", c) == 64
    led.clear_shard()
    led.close()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "query", "present"]),
        st.sampled_from(["kv", "swa"]),
        st.integers(0, 5),
        st.integers(0, 12),
        st.integers(1, 12),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS, ttl=st.sampled_from([0.0, 600.0]), method=st.sampled_from(["lua", "pipeline"]))
def test_cluster_ledger_agrees_with_in_memory(
    cluster: RedisCluster, ops: list[tuple[str, str, int, int, int]], ttl: float, method: str
) -> None:
    """Differential: any sequence of records, removals and queries answers like
    the in-memory ledger (both read methods, with and without a TTL)."""
    led = cluster_ledger(cluster.url, shard="diff", ttl_s=ttl, method=method)  # type: ignore[arg-type]
    ref = InMemoryGroundTruth()
    pools_written: set[str] = set()
    try:
        led.clear_shard()
        for op, pool, which, start, length in ops:
            c = chain(("d", which), 24)[start : start + length]
            if op == "store":
                assert led.record_stored(pool, c) == ref.record_stored(pool, c)
                pools_written.add(pool)
            elif op == "remove":
                if pool in pools_written:
                    led.record_removed(pool, c)
                    ref.record_removed(pool, c)
            elif pool not in pools_written and not led_has_epoch(led, pool):
                with pytest.raises(LedgerEmpty):
                    led.leading_present(pool, c)
            elif op == "query":
                assert led.leading_present(pool, c) == ref.leading_present(pool, c)
            else:
                assert led.present(pool, c) == ref.present(pool, c)
    finally:
        led.clear_shard()
        led.close()


def led_has_epoch(led: RedisClusterLedger, pool: str) -> bool:
    return bool(led._lazy.get().exists(led.epoch_key(pool)))


def test_instances_learn_through_the_cluster(cluster: RedisCluster) -> None:
    """Instance B records into the cluster ledger; instance A's reconciler learns
    those pages (pages_learnt) and drops a belief the ledger lacks."""
    writer_b = cluster_ledger(cluster.url, shard="learn")
    shared = [chain(("shared", i), 8) for i in range(10)]
    for c in shared:
        writer_b.record_stored("kv", c)
    stale = chain("never-stored", 8)
    cache, rec = wired(cluster_ledger(cluster.url, shard="learn"), timeout_s=0.5)
    kv = cache.pool("kv")
    for c in shared:
        kv.add(c[:1])
    kv.add(stale)
    for i, c in enumerate([*shared, stale]):
        kv.contains_all(c)
        rec.apply(i)  # at most max_verdicts_per_step candidates are admitted per step
    step_until_idle(rec)
    snap = rec.snapshot()
    assert snap.pages_learnt == {"kv": 70}
    assert snap.pages_invalidated == {"kv": 8}
    assert all(set(c) <= set(kv.lru_keys()) for c in shared)
    rec.close()
    writer_b.clear_shard()


def test_reconciler_section_builds_the_cluster_ledger(cluster: RedisCluster) -> None:
    """The one configuration (``reconciler.redis_url``) is all it takes."""
    config = Config.from_mapping(
        {"reconciler": {"redis_url": cluster.url, "namespace": "cfg", "failover_distrust_s": 5}}
    )
    led = ledger_from_section(config.reconciler, "m_0_1")
    assert isinstance(led, RedisClusterLedger)
    assert led.failover_distrust_s == 5.0
    led.record_stored("kv", chain("cfg", 3))
    assert led.leading_present("kv", chain("cfg", 5)) == 3
    led.clear_shard()
    led.close()


# -- failover ------------------------------------------------------------------------


def read_when_reachable(led: RedisClusterLedger, pages: list[str], within_s: float = 5.0) -> int:
    """``leading_present`` once the ledger reaches the cluster again: errors (a stale
    slot map right after a failover) are retried for ``within_s``, never answers."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return led.leading_present("kv", pages)
        except GroundTruthError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_primary_killed_failover_errors_are_never_evidence(tmp_path: Path) -> None:
    """SIGKILL the primary serving the ledger's tag while a reconciler verifies and
    a writer records: queries fail (counted, never absences), nothing is
    invalidated, a replica takes over with every page, the reader distrusts
    absence for its window after the failover, then trusts it again."""
    c = RedisCluster(tmp_path).start()
    try:
        led = cluster_ledger(c.url, shard="fo", failover_distrust_s=4.0)
        chains = [chain(("fo", i), 16) for i in range(40)]
        for ch in chains:
            led.record_stored("kv", ch)
        owner = c.owner_of(led.tag("kv"))
        assert int(owner.client().execute_command("WAIT", 1, 2000)) >= 1
        cache, rec = wired(
            led,
            timeout_s=0.3,
            breaker=CircuitBreaker(failures=3, backoff_s=0.1, backoff_max_s=0.4),
        )
        kv = cache.pool("kv")
        for ch in chains:
            kv.add(ch)
        writer = LedgerWriter(cluster_ledger(c.url, shard="fo"), batch_pages=64)
        probe = cluster_ledger(c.url, shard="fo")
        assert probe.leading_present("kv", chains[0]) == 16
        step = 0

        def steps(n: int) -> None:
            nonlocal step
            for _ in range(n):
                kv.contains_all(chains[step % len(chains)])
                rec.apply(step)
                step += 1
                time.sleep(0.002)

        steps(60)
        before = rec.snapshot()
        assert before.queries.get(("kv", "present"), 0) > 0

        owner.kill()
        t_kill = time.monotonic()
        recovered_at = None
        fresh = [chain(("during", i), 8) for i in range(200)]
        i = 0
        while time.monotonic() - t_kill < 20:
            steps(10)
            writer.stored("kv", fresh[i % len(fresh)])
            i += 1
            try:
                if probe.leading_present("kv", chains[1]) == 16:
                    recovered_at = time.monotonic()
                    break
            except GroundTruthError:
                pass
        assert recovered_at is not None, "no failover within 20 s"
        recovery_s = recovered_at - t_kill
        cluster_ok_s = c.wait_ok(20) + recovery_s
        # Verification resumes once the breaker's last backoff (at most 0.4 s) ends and
        # the reconciler's client has refreshed its slot map (its first read after the
        # failover may still meet the dead primary: one more error, one more backoff).
        # A fixed 200 steps was sometimes shorter than that (present 60 > 60 failed).
        steps(200)
        resumed_by = time.monotonic() + 10
        present_before = before.queries.get(("kv", "present"), 0)
        while rec.snapshot().queries.get(("kv", "present"), 0) <= present_before:
            if time.monotonic() > resumed_by:
                break
            steps(10)
        snap = rec.snapshot()
        FIGURES["failover_recovery_s"] = round(recovery_s, 2)
        FIGURES["failover_cluster_ok_s"] = round(cluster_ok_s, 2)
        FIGURES["failover_reconciler_errors"] = dict(snap.errors)
        # Errors happened and were never read as absence; nothing was invalidated.
        assert sum(snap.errors.values()) > 0 or snap.queries.get(("kv", "timeout"), 0) > 0
        assert snap.queries.get(("kv", "absent"), 0) == 0
        assert snap.pages_invalidated == {} and snap.stale_positives == {}
        assert set(kv.lru_keys()) >= {h for ch in chains for h in ch}
        # The replica took over with every page; verification resumed.  A read may
        # still meet the dead primary once (the client refreshes its slot map after
        # the error: a full run saw "connection refused" here); it is an error, never
        # an answer, and the next read goes to the new primary.
        assert c.owner_of(led.tag("kv")) is not owner
        assert all(read_when_reachable(led, ch) == 16 for ch in chains)
        assert snap.queries.get(("kv", "present"), 0) > before.queries.get(("kv", "present"), 0)
        # Absence right after the failover is not evidence; after the window it is.
        assert led.failovers >= 1 or sum(snap.errors.values()) > 0
        stale = chain("stale", 8)
        kv.add(stale)
        assert not led.absence_is_evidence()
        assert led.leading_present("kv", stale) == 0
        kv.contains_all(stale)
        step_until_idle(rec)
        assert rec.snapshot().queries.get(("kv", "untrusted"), 0) >= 1
        assert rec.snapshot().pages_invalidated == {}
        assert stale[0] in set(kv.lru_keys())
        deadline = time.monotonic() + 6
        while not led.absence_is_evidence() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert led.absence_is_evidence()
        kv.contains_all(stale)
        step_until_idle(rec)
        assert rec.snapshot().pages_invalidated == {"kv": 8}
        # The writer records again once its client has the new slot map.
        deadline = time.monotonic() + 10
        while writer.counts()["pages"].get("stored/ok", 0) == 0 and time.monotonic() < deadline:
            writer.stored("kv", fresh[i % len(fresh)])
            i += 1
            writer.flush(5)
            time.sleep(0.05)
        counts = writer.counts()
        FIGURES["failover_writer"] = counts
        assert counts["pages"].get("stored/ok", 0) > 0
        assert counts["pages"].get("stored/error", 0) > 0  # records during the failover failed
        rec.close()
        writer.close()
        probe.close()
    finally:
        c.close()
