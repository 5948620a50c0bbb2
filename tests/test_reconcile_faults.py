"""Reconciler faults found by review, each reproduced against real parts (a real
redis-server where Redis is involved, sglang's own storage config): lockstep kept
through a rank-local error, one failed probe doubling the backoff once, ledger records
that cannot be lost to a racing reader or a Redis outage, DCP key spaces apart."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from reconcile_helpers import chain, step_until_idle, wired
from reconcile_redis_server import RedisServer, need_binary
from redis_cluster_server import RedisCluster
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from hicache_existence.reconcile import reconciler as reconciler_module
from hicache_existence.reconcile import storage_adapters
from hicache_existence.reconcile.agreement import InProcessGroup
from hicache_existence.reconcile.breaker import CircuitBreaker
from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth, ServerError
from hicache_existence.reconcile.ledger_writer import LedgerWriter
from hicache_existence.reconcile.redis_cluster import RedisClusterLedger
from hicache_existence.reconcile.redis_truth import (
    LedgerSettings,
    RedisLedger,
    shard_from_storage_config,
    shard_id,
)
from hicache_existence.reconcile.storage_adapters import _is_storage_writer


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.close()


@pytest.fixture
def persistent_server(tmp_path):
    s = RedisServer(tmp_path, persistent=True).start()
    yield s
    s.close()


# A rank-local exception while applying one agreed verdict aborts the rest of
# that agreement on that rank only: the remaining agreed verdicts stay in its queue,
# its admission is skipped, and from then on the ranks' queues are misaligned, so
# the same agreed slot is applied to different chains on different ranks
# (replicas diverge, a lockstep violation).

N_CHAINS = 12
STEPS = 300


def _rank(rank: int, group: InProcessGroup, out: dict) -> None:
    truth = InMemoryGroundTruth()
    chains = [chain(f"c{i}", 8) for i in range(N_CHAINS)]
    for i, c in enumerate(chains):
        truth.record_stored("kv", c[: i % 8])  # L3 lost the tail of every chain
    cache, rec = wired(
        truth,
        agreement=group.member(rank),
        max_verdicts_per_step=2,
        timeout_s=5.0,
        queue_size=2,
    )
    calls = {"n": 0}

    def observer(pool, ch, leading):  # rank-local hook (events live on rank 0 only)
        calls["n"] += 1
        if rank == 1 and calls["n"] == 1:
            raise RuntimeError("rank-local failure in one verdict")

    rec.verdict_observer = observer
    kv = cache.pool("kv")
    for c in chains:
        kv.add(c)
    for c in chains:
        kv.contains_all(c)  # lookups: every rank the same
    for s in range(STEPS):
        rec.apply(s)
        time.sleep(0.002)
    out[rank] = (
        [len(kv.believed(c)) for c in chains],
        rec.counters.internal_errors,
        rec.outstanding(),
    )
    rec.close()


def test_replicas_identical_after_a_rank_local_apply_error() -> None:
    group = InProcessGroup(2, timeout_s=20)
    out: dict = {}
    threads = [threading.Thread(target=_rank, args=(r, group, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print("rank0 believed per chain:", out[0])
    print("rank1 believed per chain:", out[1])
    assert out[0][0] == out[1][0], "replicas diverged"


# CircuitBreaker: a failure of a query that is not the probe (admitted before it,
# failing late) while the probe is out re-opens the circuit, doubles the backoff and
# forgets the probe: after the new backoff a second probe goes while the first is
# still out ("one probe per backoff" broken), and ``abandoned()`` of either frees a
# third.


def test_stale_non_probe_failure_does_not_release_a_second_probe() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=1, backoff_s=1.0, backoff_max_s=60.0, clock=lambda: now[0])
    b.failure(False)  # opens
    now[0] = 1.0
    assert b.permits() == 1 and b.admitted() is True  # probe 1 out
    b.failure(False)  # a query admitted before probe 1 fails late
    backoff_after = b._backoff
    now[0] = 10.0
    second = b.permits()
    print("backoff after stale failure:", backoff_after, "permits while probe 1 out:", second)
    assert backoff_after == 1.0
    assert second == 0, "a second probe is released while probe 1 is still out"


# Redis stopped (SIGSTOP: connects, never answers).  One probe that times out
# at the scheduler AND then fails in the worker counts as two failed probes: the
# backoff is multiplied by 4 per probe instead of 2 (docs: "its failure re-opens it
# with the backoff doubled").  Also every timed-out query the worker was asking is
# counted as two consecutive failures.


def test_one_failed_probe_doubles_the_backoff_once(server) -> None:
    ledger = RedisLedger(
        LedgerSettings(url=server.url, socket_timeout_s=0.05, connect_timeout_s=0.05, retries=1)
    )
    ledger.record_stored("kv", chain("x", 1))
    breaker = CircuitBreaker(failures=1, backoff_s=0.2, backoff_max_s=1000.0)
    cache, rec = wired(ledger, breaker=breaker, timeout_s=0.03, agree_interval_steps=1)
    kv = cache.pool("kv")
    server.stop_process()
    try:
        history = []
        i = 0
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            c = chain(("q", i), 2)
            i += 1
            kv.add(c)
            kv.contains_all(c)
            rec.apply(i)
            b = breaker._backoff
            if not history or history[-1] != b:
                history.append(b)
            time.sleep(0.005)
        print(
            "backoff history:",
            history,
            "opened:",
            breaker.opened,
            "timeouts:",
            dict(rec.counters.scheduler_results),
            "errors:",
            dict(rec.counters.errors),
        )
    finally:
        server.continue_process()
        rec.close()
    # Each failed probe re-opens the circuit once and doubles the backoff once.
    probes_failed = breaker.opened - 1  # the first opening is the threshold's
    doublings = len(history) - 1
    assert probes_failed >= 1
    assert doublings == probes_failed, f"{probes_failed} failed probes, {doublings} doublings"


# MLA: every TP rank shares one ledger shard (``shard_id(is_mla=True)``), only the
# storage-writer rank writes L3, every rank runs prefetch ``batch_exists``.  The
# learnt-absence guard (``since != self._writes_recorded``) is per process, so a
# non-writer rank's ``batch_exists`` that read L3 before the writer rank's write of
# the page landed erases the writer's fresh record: L3 holds the page, the ledger
# says it is absent, and the reconciler trusts that absence.


class SharedL3:
    """One L3 every rank reads (MLA); batch_exists can be held mid-read."""

    def __init__(self) -> None:
        self.pages: set[str] = set()
        self.read_done = threading.Event()
        self.go_on = threading.Event()
        self.hold = False

    def backend(self):
        l3 = self

        class Inner:
            def batch_exists(self, keys, extra_info=None):
                n = next((i for i, k in enumerate(keys) if k not in l3.pages), len(keys))
                if l3.hold:
                    l3.read_done.set()
                    l3.go_on.wait(5)  # the answer is on its way back
                return n

            def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
                l3.pages.update(keys)
                return True

        return Inner()


def _wrapper(url: str, l3: SharedL3, rank: int, mla: bool = True):
    shard = shard_id("org/mla-model", rank, 2, is_mla=mla)  # same for both writers
    ledger = RedisLedger(
        LedgerSettings(url=url, shard=shard, socket_timeout_s=2, connect_timeout_s=2)
    )
    cfg = SimpleNamespace(extra_config={}, tp_rank=rank, tp_size=2, is_mla_model=mla)
    return storage_adapters._build_class()(cfg, inner=l3.backend(), ledger=ledger)


def test_non_writer_rank_prefetch_does_not_erase_writer_rank_record(server) -> None:
    l3 = SharedL3()
    writer, reader = _wrapper(server.url, l3, 0), _wrapper(server.url, l3, 1)
    keys = chain("mla", 4)
    assert writer.batch_set(keys[:2]) and writer.flush_ledger(5)

    # Rank 1's prefetch hit query reads L3 (pages 2.. absent) ...
    l3.hold = True
    t = threading.Thread(target=lambda: reader.batch_exists(keys))
    t.start()
    assert l3.read_done.wait(5)
    l3.hold = False
    # ... meanwhile rank 0 (the MLA storage writer) writes page 2 and records it.
    assert writer.batch_set(keys[2:3]) and writer.flush_ledger(5)
    l3.go_on.set()
    t.join(5)
    assert reader.flush_ledger(5)

    truth = writer.ledger_ground_truth()
    print(
        "L3 leading:",
        l3.backend().batch_exists(keys),
        "ledger leading:",
        truth.leading_present("kv", keys),
    )
    # Rank 0 believes keys[:3] (its acks): a verification now drops a true belief.
    cache, rec = wired(truth, timeout_s=2.0)
    kv = cache.pool("kv")
    kv.add(keys[:3])
    kv.contains_all(keys)
    step_until_idle(rec)
    print(
        "believed after verification:",
        len(kv.believed(keys[:3])),
        "of 3; snapshot:",
        rec.snapshot().pages_invalidated,
    )
    rec.close()
    writer.close()
    reader.close()
    assert truth.leading_present("kv", keys) == 3, "ledger lost a page L3 holds"


# MLA with decode context parallel (dcp_size > 1): each DCP group writes its own
# slice of every page (sglang's HiCacheFile adds ``_tp<T>_dcp<r>_<n>_page<p>`` to
# its key suffix; ``is_storage_writer`` is tp_rank == dcp_rank, so there are
# dcp_size writers).  ``shard_from_storage_config`` ignores DCP, so every DCP
# writer records into the same ledger shard: one slice recorded makes the page
# "present" for a rank whose own slice was never stored, and one rank's learnt
# absence erases the others' records.


def _cfg(tp_rank: int, dcp_rank: int) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=4,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="org/dsv3",
        dcp_size=2,
        dcp_rank=dcp_rank,
        logical_page_size=64,
    )


def test_dcp_writers_get_distinct_ledger_shards(tmp_path, monkeypatch) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    a, b = _cfg(0, 0), _cfg(1, 1)  # the two storage writers
    assert a.is_storage_writer and b.is_storage_writer
    fa, fb = HiCacheFile(a, file_path=str(tmp_path)), HiCacheFile(b, file_path=str(tmp_path))
    sa, sb = shard_from_storage_config(a), shard_from_storage_config(b)
    print(
        "upstream L3 key suffixes:", fa.config_suffix, fb.config_suffix, "| ledger shards:", sa, sb
    )
    assert fa.config_suffix != fb.config_suffix  # upstream: two key spaces
    assert sa != sb, "two L3 key spaces share one ledger shard"


# Redis restarted empty (no persistence) before this process's reader ever read
# the epoch: the writer re-creates the epoch, the reader's first read sees it as the
# first epoch ever (``known is None``), trusts absence, and invalidates pages stored
# (and recorded) before the restart that L3 still holds.


def test_reset_seen_although_the_reader_never_read_before(server) -> None:
    ledger = RedisLedger(
        LedgerSettings(url=server.url, socket_timeout_s=0.5, connect_timeout_s=0.5)
    )
    writer = LedgerWriter(ledger)
    old, new = chain("old", 4), chain("new", 4)
    writer.stored("kv", old)  # acked and recorded; no verification yet
    assert writer.flush(5)
    server.restart()  # empty: the ledger lost every record
    writer.stored("kv", new)  # the next record re-creates the epoch
    assert writer.flush(5)
    cache, rec = wired(writer.truth(1.0), timeout_s=2.0)
    kv = cache.pool("kv")
    kv.add(old)
    kv.add(new)
    kv.contains_all(old)
    step_until_idle(rec)
    print(
        "resets seen:",
        ledger.resets,
        "believed old:",
        len(kv.believed(old)),
        "of 4;",
        "invalidated:",
        rec.snapshot().pages_invalidated,
    )
    rec.close()
    writer.close()
    assert len(kv.believed(old)) == 4


# Redis (with persistence) killed mid-run and restarted: the records of pages
# stored in L3 while it was down failed (counted as errors) and are lost; the
# epoch survived, so nothing marks the ledger as having missed writes and the
# reconciler trusts the absence and invalidates true beliefs.  docs/reconciler.md's
# fault table says "Redis down mid-run | same [no invalidation]; with persistence
# the ledger survives the restart and verification resumes".


def test_pages_stored_while_redis_was_down_are_not_invalidated(persistent_server) -> None:
    ledger = RedisLedger(
        LedgerSettings(url=persistent_server.url, socket_timeout_s=0.5, connect_timeout_s=0.5)
    )
    writer = LedgerWriter(ledger)
    keys = chain("down", 6)
    writer.stored("kv", keys[:3])
    assert writer.flush(5)
    persistent_server.kill()
    writer.stored("kv", keys[3:])  # L3 write acked while Redis is down
    assert writer.flush(5)
    print("writer counts:", writer.counts())
    persistent_server.start()  # AOF: the epoch and keys[:3] survive
    cache, rec = wired(writer.truth(1.0), timeout_s=2.0)
    kv = cache.pool("kv")
    kv.add(keys)  # the storage acks: all six pages are in L3
    kv.contains_all(keys)
    step_until_idle(rec)
    snap = rec.snapshot()
    print("believed:", len(kv.believed(keys)), "of 6; invalidated:", snap.pages_invalidated)
    rec.close()
    writer.close()
    assert len(kv.believed(keys)) == 6


def test_a_probe_voided_while_asked_that_then_fails_lets_another_go() -> None:
    """A late answer is not counted twice when the scheduler timed it out, but a
    probe voided while the worker was asking (its pool cleared) was counted nowhere:
    its failure must still reach the breaker, or no probe would ever go again."""
    from hicache_existence.reconcile import worker as wk
    from hicache_existence.reconcile.counters import ReconcilerCounters
    from hicache_existence.reconcile.ground_truth import TruthUnavailable

    asked, release = threading.Event(), threading.Event()

    class Hanging(InMemoryGroundTruth):
        def leading_present(self, pool: str, hashes: object) -> int:
            asked.set()
            release.wait(5)
            raise TruthUnavailable("refused")

    now = [0.0]
    breaker = CircuitBreaker(failures=1, backoff_s=1.0, backoff_max_s=60.0, clock=lambda: now[0])
    breaker.failure(False)  # open
    now[0] = 1.0
    assert breaker.admitted()  # the probe
    worker = wk.QueryWorker(Hanging(), breaker, ReconcilerCounters())
    q = wk.Query(1, "kv", ("a",), 0.0, probe=True)
    worker.submit(q)
    assert asked.wait(5)
    assert worker.give_up(q, wk.VOIDED)  # its pool was cleared meanwhile
    release.set()
    worker.close(5)
    now[0] = 100.0
    assert breaker.permits() == 1 and breaker.admitted(), "the breaker waits for a voided probe"


# Test gap: the try/except around _apply_verdict (reconciler.py) is not exercised by
# tests/test_reconcile_faults.py (its fault is in the verdict observer, which has its own
# guard now).  This test raises in apply_verdict itself on one rank: it passes on the
# current code and fails when the outer guard is removed (mutant reconciler_no_isolation).


def _rank_apply(rank: int, group: InProcessGroup, out: dict) -> None:
    truth = InMemoryGroundTruth()
    chains = [chain(f"c{i}", 8) for i in range(N_CHAINS)]
    for i, c in enumerate(chains):
        truth.record_stored("kv", c[: i % 8])
    cache, rec = wired(
        truth, agreement=group.member(rank), max_verdicts_per_step=2, timeout_s=5.0, queue_size=2
    )
    kv = cache.pool("kv")
    for c in chains:
        kv.add(c)
    for c in chains:
        kv.contains_all(c)
    for s in range(STEPS):
        rec.apply(s)
        time.sleep(0.002)
    out[rank] = {tuple(c): len(kv.believed(c)) for c in chains}
    rec.close()


def test_replicas_identical_after_apply_verdict_raises_on_one_rank(monkeypatch) -> None:
    real = reconciler_module.apply_verdict
    fired = []

    def flaky(*a, **kw):
        if threading.current_thread().name == "rank1" and not fired:
            fired.append(tuple(a[2]))  # apply_verdict(cache, pool, chain, ...)
            raise RuntimeError("rank-local failure inside apply_verdict")
        return real(*a, **kw)

    monkeypatch.setattr(reconciler_module, "apply_verdict", flaky)
    group = InProcessGroup(2, timeout_s=20)
    out: dict = {}
    threads = [
        threading.Thread(target=_rank_apply, args=(r, group, out), name=f"rank{r}") for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert fired
    # The failed verdict itself is lost on rank 1; every other must match.
    rest = [c for c in out[0] if c != fired[0]]
    assert [out[0][c] for c in rest] == [out[1][c] for c in rest], "replicas diverged"


# Test gaps of the lost-records set (ledger_writer.py): tests/test_reconcile_faults.py
# covers a failed record only.  Each test passes on the current code and fails on the
# named mutant: dropped_not_lost (queue full), overflow_no_missed (past LOST_CAP),
# lost_not_popped_on_store (a page rewritten and recorded stays untrusted forever).
class Held(InMemoryGroundTruth):
    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.fail = False
        self.missed = 0

    def record_stored(self, pool, hashes):
        self.go.wait(5)
        if self.fail:
            raise ServerError("down")
        return super().record_stored(pool, hashes)

    def missed_writes(self) -> None:
        self.missed += 1


def test_a_record_dropped_by_a_full_queue_makes_absence_untrusted() -> None:
    ledger = Held()
    w = LedgerWriter(ledger, max_pending=1)
    a, b, c = chain("q", 3)
    w.stored("kv", [a])  # taken by the writer thread, held
    time.sleep(0.2)
    w.stored("kv", [b])  # queued
    w.stored("kv", [c])  # dropped: queue full
    assert w.pages[("stored", "dropped")] == 1
    ledger.go.set()
    assert w.flush(5)
    truth = w.truth(1.0)
    assert truth.leading_present("kv", [a, b, c]) == 2
    assert truth.absence_is_evidence() is False
    w.close()


def test_past_the_cap_the_ledger_is_told_it_missed_writes(monkeypatch) -> None:
    monkeypatch.setattr(LedgerWriter, "LOST_CAP", 4)
    ledger = Held()
    ledger.fail = True
    ledger.go.set()
    w = LedgerWriter(ledger)
    w.stored("kv", chain("x", 5))
    assert w.flush(5)
    assert ledger.missed == 1
    w.close()


def test_a_lost_page_recorded_later_is_evidence_again() -> None:
    ledger = Held()
    ledger.go.set()
    ledger.fail = True
    w = LedgerWriter(ledger)
    (a,) = chain("y", 1)
    w.stored("kv", [a])
    assert w.flush(5) and w.lost("kv", a)
    ledger.fail = False
    w.stored("kv", [a])  # rewritten, recorded
    assert w.flush(5)
    ledger.record_removed("kv", [a])  # then its record expired (ttl_s): absence is right
    truth = w.truth(1.0)
    assert truth.leading_present("kv", [a]) == 0
    assert truth.absence_is_evidence() is True
    w.close()


# A page whose record failed stays in the writer's lost set after the backend proved it
# absent (batch_exists shortfall -> removed record written OK): every later answer that
# stops at it is untrusted, so the stale belief is never invalidated (until the page is
# rewritten, which the write path skips because the cache believes it stored).
class FailingRecords(InMemoryGroundTruth):
    fail = True

    def record_stored(self, pool, hashes):
        if self.fail:
            raise ServerError("redis down")
        return super().record_stored(pool, hashes)


def test_removed_record_clears_the_lost_mark() -> None:
    ledger = FailingRecords()
    w = LedgerWriter(ledger)
    (a,) = chain("p", 1)
    w.stored("kv", [a])  # Redis down: record lost
    assert w.flush(5) and w.lost("kv", a)
    ledger.fail = False
    w.removed("kv", [a])  # later the backend proves the page gone (learnt absence)
    assert w.flush(5)
    truth = w.truth(1.0)
    assert truth.leading_present("kv", [a]) == 0
    assert truth.absence_is_evidence() is True, "proven absence still untrusted"
    w.close()


# Test gap: nothing checks that upstream's own is_storage_writer property is used
# (mutant is_writer_prop_ignored survives tests/test_reconcile_faults.py).  Under MLA with
# DCP, tp_rank 1 / dcp_rank 1 writes its DCP shard (sglang: tp_rank == dcp_rank), so it
# must learn absence; the 'older configs' fallback (MLA rank 0 only) says it does not.
def test_dcp_writers_are_upstreams() -> None:
    assert [_is_storage_writer(_cfg(r, r % 2)) for r in range(4)] == [True, True, False, False]


# The 'reset seen by the writer' fix (redis_truth.RedisLedger.record_stored reads the
# epoch it wrote under) does not reach RedisClusterLedger.record_stored (LUA_RECORD returns
# only a count): the same scenario as tests/test_reconcile_faults.py::
# test_reset_seen_although_the_reader_never_read_before, on a real Redis Cluster.
@pytest.fixture
def cluster(tmp_path):
    need_binary("redis-server")
    c = RedisCluster(tmp_path)
    c.start()
    yield c
    c.close()


def test_cluster_reset_seen_although_the_reader_never_read_before(cluster) -> None:
    ledger = RedisClusterLedger(
        LedgerSettings(
            cluster.url, namespace="t", shard="s0", socket_timeout_s=0.5, connect_timeout_s=0.5
        )
    )
    writer = LedgerWriter(ledger)
    old, new = chain("old", 4), chain("new", 4)
    writer.stored("kv", old)
    assert writer.flush(5)
    client = cluster.client()
    client.flushall(target_nodes=client.PRIMARIES)  # the ledger lost every record
    writer.stored("kv", new)  # re-creates the epoch
    assert writer.flush(5)
    cache, rec = wired(writer.truth(1.0), timeout_s=2.0)
    kv = cache.pool("kv")
    kv.add(old)
    kv.add(new)
    kv.contains_all(old)
    step_until_idle(rec)
    believed = len(kv.believed(old))
    rec.close()
    writer.close()
    print("resets seen:", ledger.resets, "believed old:", believed)
    assert believed == 4, f"old pages L3 holds invalidated ({ledger.resets} resets seen)"
