"""The reconciler's backend ground truth over a real Mooncake store: a real
``mooncake_master`` on loopback and SGLang's own ``MooncakeStore`` (no server).
Our key derivation agrees with SGLang's ``batch_exists`` while the master is up;
with the master killed, SGLang's ``batch_exists`` answers 0 (the client's error
codes read as absence) while ``MooncakeGroundTruth`` raises, so the reconciler
invalidates nothing; after the master restarts empty the lost pages really are
gone and the reconciler drops those beliefs.  And what two writers racing on one
page see: a put of an object already stored answers like a first store."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mooncake_master import MooncakeMaster, need_mooncake, sglang_mooncake_store
from reconcile_helpers import chain, step_until_idle, wired

from hicache_existence.reconcile.breaker import CircuitBreaker
from hicache_existence.reconcile.ground_truth import TruthUnavailable, UnsupportedPool
from hicache_existence.reconcile.mooncake_truth import MooncakeGroundTruth, is_mooncake_backend

pytest.importorskip("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    need_mooncake()
    m = MooncakeMaster(tmp_path).start()
    try:
        yield m
    finally:
        m.close()


def store_pages(store: Any, truth: MooncakeGroundTruth, pages: list[str]) -> None:
    """Put every object of ``pages`` the way the backend names them."""
    keys, _ = truth._objects(pages)
    for key in keys:
        assert store.store.put(key, b"\x01" * 64) == 0


def test_truth_agrees_with_sglang_batch_exists(master: MooncakeMaster) -> None:
    """Master up: leading counts and presence match SGLang's own batch_exists on
    chains with gaps at every position; other pools are refused, not guessed."""
    store = sglang_mooncake_store(master)
    truth = MooncakeGroundTruth(store)
    assert is_mooncake_backend(store)
    full = chain("agree", 12)
    store_pages(store, truth, full[:5] + full[6:9])
    for start in range(0, 12):
        c = full[start:]
        assert truth.leading_present("kv", c) == store.batch_exists(c), start
    assert truth.present("kv", full) == [i < 5 or 6 <= i < 9 for i in range(12)]
    assert truth.leading_present("kv", []) == 0
    with pytest.raises(UnsupportedPool):
        truth.leading_present("swa", full)
    store.store.close()  # while the master is up: closing is quick then


def test_master_down_is_an_error_and_a_restart_heals(master: MooncakeMaster) -> None:
    """Master killed: SGLang's batch_exists answers 0 for stored pages, our truth
    raises and the reconciler invalidates nothing; master restarted (empty): the
    pages are gone for real and the reconciler drops exactly those beliefs."""
    store = sglang_mooncake_store(master)
    truth = MooncakeGroundTruth(store)
    chains = [chain(("mc", i), 8) for i in range(6)]
    for c in chains:
        store_pages(store, truth, c)
    assert [truth.leading_present("kv", c) for c in chains] == [8] * 6
    cache, rec = wired(
        truth,
        timeout_s=0.3,
        breaker=CircuitBreaker(failures=2, backoff_s=0.2, backoff_max_s=1.0),
    )
    kv = cache.pool("kv")
    for c in chains:
        kv.add(c)

    master.kill()
    assert store.batch_exists(chains[0]) == 0  # upstream: the outage reads as absence
    t0 = time.monotonic()
    with pytest.raises(TruthUnavailable, match="error code"):
        truth.leading_present("kv", chains[0])
    down_call_s = time.monotonic() - t0
    for step in range(40):
        kv.contains_all(chains[step % len(chains)])
        rec.apply(step)
        time.sleep(0.02)
    snap = rec.snapshot()
    assert snap.pages_invalidated == {} and snap.queries.get(("kv", "absent"), 0) == 0
    assert sum(snap.errors.values()) + snap.queries.get(("kv", "timeout"), 0) > 0

    master.restart()
    deadline = time.monotonic() + 60
    step = 100
    while time.monotonic() < deadline and rec.snapshot().pages_invalidated.get("kv", 0) < 48:
        kv.contains_all(chains[step % len(chains)])
        rec.apply(step)
        step += 1
        time.sleep(0.02)
    step_until_idle(rec, max_steps=3000, pause_s=0.01)
    snap = rec.snapshot()
    assert snap.pages_invalidated == {"kv": 48}, snap
    assert snap.stale_positives == {"kv": 6}
    assert not set(kv.lru_keys()) & {h for c in chains for h in c}
    print(
        f"\nmooncake: a query with the master down took {down_call_s:.2f} s; errors {snap.errors}"
    )
    rec.close()
    store.store.close()


def test_ledger_wrapper_does_not_learn_absence_from_a_mooncake_outage(
    master: MooncakeMaster,
) -> None:
    """The recording backend around SGLang's MooncakeStore: a batch_exists
    shortfall while the master is down (0 for stored pages) removes nothing from
    the ledger by default; other backends keep learning absence."""
    from types import SimpleNamespace

    from hicache_existence.reconcile import storage_adapters
    from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth

    store = sglang_mooncake_store(master)
    truth = MooncakeGroundTruth(store)
    pages = chain("wrapped", 4)
    store_pages(store, truth, pages)
    ledger = InMemoryGroundTruth()
    ledger.record_stored("kv", pages)
    cls = storage_adapters.LedgerRecordingStorage
    wrapper = cls(SimpleNamespace(extra_config={}), inner=store, ledger=ledger)
    assert wrapper.batch_exists(pages) == 4
    master.kill()
    assert wrapper.batch_exists(pages) == 0  # SGLang's answer while the master is down
    assert wrapper.flush_ledger(5)
    assert ledger.leading_present("kv", pages) == 4
    assert wrapper.ledger_counts()["pages"].get("removed/ok", 0) == 0
    explicit = cls(
        SimpleNamespace(extra_config={"ledger_learn_absence": True}), inner=store, ledger=ledger
    )
    assert explicit._learns_absence(store) and not wrapper._learns_absence(store)
    assert wrapper._learns_absence(SimpleNamespace(batch_exists=lambda k, e=None: 0))
    master.restart()  # closing the client is quick while a master answers
    store.store.close()


def test_a_put_of_a_stored_object_is_reported_as_a_success(master: MooncakeMaster) -> None:
    """Two SGLang MooncakeStores on one master, the way two prefill servers race
    on a shared page: both ask existence first (absent for both), both put; the
    second put answers 0 like a first store (SGLang, and so our accounting, count
    a first write), while the master holds one copy and counts the second put's
    objects as failed PutStart items: the only place the duplicate shows."""
    import torch

    first, second = sglang_mooncake_store(master), sglang_mooncake_store(master)
    truth = MooncakeGroundTruth(first)
    keys, per_page = truth._objects(chain("raced", 3))
    buffers = []
    for store in (first, second):
        buf = torch.ones(len(keys) * 64, dtype=torch.uint8)
        store.register_buffer(buf)
        buffers.append(buf)
    assert first._batch_exist(keys) == second._batch_exist(keys) == [0] * len(keys)
    before = master.metrics()
    answers = []
    for store, buf in zip((first, second), buffers, strict=True):
        ptrs = [buf.data_ptr() + 64 * i for i in range(len(keys))]
        answers.append(store._put_batch_zero_copy_impl(keys, ptrs, [64] * len(keys)))
    after = master.metrics()
    assert answers == [[0] * len(keys)] * 2
    assert after["master_key_count"] - before["master_key_count"] == 3 * per_page
    failed = "master_batch_put_start_failed_items_total"
    assert after[failed] - before[failed] == 3 * per_page
    assert first._batch_exist(keys) == [1] * len(keys)
    for store in (first, second):
        store.store.close()


def test_objects_in_a_departed_clients_segment_are_gone(master: MooncakeMaster) -> None:
    """The master spreads objects over every mounted segment; when one client
    (a prefill server) goes away its segment goes with it, taking objects other
    clients put: those now answer absent (code 0, not an error), so a later
    write of them finds nothing stored."""
    staying, leaving = sglang_mooncake_store(master), sglang_mooncake_store(master)
    truth = MooncakeGroundTruth(staying)
    # A page is two objects (K and V), each on a segment the master picks at random:
    # a page survives with odds 1/4, so 16 pages all went with the leaving segment in
    # about 1% of runs (seen once in CI); with 64, (3/4)**64 is about 1e-8.
    n = 64
    pages = chain("spread", n)
    store_pages(staying, truth, pages)  # put by the client that stays
    assert truth.present("kv", pages) == [True] * n
    leaving.store.close()
    present = poll_present(truth, pages, lambda k: k < n)
    assert 0 < present.count(True) < n, present
    assert master.metrics()["master_key_count"] < 2 * n
    staying.store.close()


def poll_present(
    truth: MooncakeGroundTruth, pages: list[str], done: Any, timeout_s: float = 15.0
) -> list[bool]:
    """``truth.present`` until ``done(pages present)`` or the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        present = truth.present("kv", pages)
        if done(present.count(True)) or time.monotonic() > deadline:
            return present
        time.sleep(0.2)
