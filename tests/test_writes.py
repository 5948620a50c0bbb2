"""Write accounting: pages and bytes per pool, snapshots and deltas, bad input
leaves every counter as it was."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from hicache_existence.accounting.writes import PoolWriteStats, WriteAccounting


def test_counts_pages_and_bytes_per_pool():
    """written/avoided/redundant accumulate per pool; bytes use the page size."""
    w = WriteAccounting(page_size_bytes=1000, page_sizes={"mamba": 50})
    w.written("kv", 10, already_stored=3)
    w.written("kv", 5)
    w.avoided("kv", 7)
    w.redundant("kv", 2)
    w.written("mamba", 4)
    s = w.stats()
    assert s["kv"] == PoolWriteStats("kv", 15, 7, 5, 1000)
    assert (s["kv"].written_bytes, s["kv"].avoided_bytes, s["kv"].redundant_bytes) == (
        15000,
        7000,
        5000,
    )
    assert s["mamba"].written_bytes == 200
    assert s["kv"].avoided_ratio == pytest.approx(7 / 22)
    assert list(s) == ["kv", "mamba"]


def test_snapshots_are_frozen_and_subtract():
    """A snapshot is immutable; newer - older gives the interval's writes."""
    w = WriteAccounting(page_size_bytes=10)
    w.written("kv", 3)
    before = w.stats()
    w.written("kv", 4, already_stored=1)
    w.avoided("swa", 2)
    delta = w.stats() - before
    assert delta["kv"] == PoolWriteStats("kv", 4, 0, 1, 10)
    assert delta["swa"].avoided == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        before["kv"].written = 0  # type: ignore[misc]
    assert w.stats().as_dict()["kv"]["written_bytes"] == 70


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda w: w.written("kv", -1), ValueError, "pages"),
        (lambda w: w.written("kv", 1.5), TypeError, "pages"),
        (lambda w: w.written("kv", True), TypeError, "pages"),
        (lambda w: w.written("kv", 2, already_stored=3), ValueError, "already_stored"),
        (lambda w: w.written("", 1), ValueError, "pool"),
        (lambda w: w.written(5, 1), TypeError, "pool"),
        (lambda w: w.avoided("kv", -2), ValueError, "pages"),
        (lambda w: w.redundant("kv", 100), ValueError, "redundant"),
        (lambda w: w.redundant("new", 1), ValueError, "redundant"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc, match):
    """Bad arguments raise naming the argument; counters and pools stay as they were."""
    w = WriteAccounting(page_size_bytes=8)
    w.written("kv", 5, already_stored=1)
    before = w.stats()
    with pytest.raises(exc, match=match):
        call(w)
    assert w.stats() == before


def test_constructor_validates_page_sizes():
    """Negative or non-int page sizes are refused, naming the argument."""
    with pytest.raises(ValueError, match="page_size_bytes"):
        WriteAccounting(-1)
    with pytest.raises(TypeError, match="page_sizes"):
        WriteAccounting(1, {"kv": 1.5})


def test_snapshot_from_another_thread_never_goes_backwards():
    """A reader thread's successive snapshots are monotonic while a writer records."""
    w = WriteAccounting(page_size_bytes=1)
    stop = threading.Event()
    seen: list[int] = []

    def reader():
        while not stop.is_set():
            s = w.stats()
            seen.append(s["kv"].written if "kv" in s else 0)

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20000):
        w.written("kv", 1)
    stop.set()
    t.join()
    assert seen == sorted(seen)
    assert w.stats()["kv"].written == 20000


def test_acks_count_stored_failed_and_redundant_with_causes():
    """acked() adds stored/failed pages and the redundant ones (believed ones a
    subset); set_page_size gives a pool its measured page bytes."""
    w = WriteAccounting(page_size_bytes=10)
    w.written("kv", 10)
    w.acked("kv", 8, failed=2, already_stored=5, believed=3)
    w.set_page_size("kv", 4096)
    s = w.stats()["kv"]
    assert (s.written, s.acknowledged, s.failed, s.redundant, s.redundant_believed) == (
        10,
        8,
        2,
        5,
        3,
    )
    assert (s.acknowledged_bytes, s.failed_bytes, s.redundant_bytes) == (
        8 * 4096,
        2 * 4096,
        5 * 4096,
    )
    assert (w.stats() - w.stats())["kv"].acknowledged == 0


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda w: w.acked("kv", 2, already_stored=3), ValueError, "already_stored"),
        (lambda w: w.acked("kv", 5, already_stored=1, believed=2), ValueError, "believed"),
        (lambda w: w.acked("kv", -1), ValueError, "stored"),
        (lambda w: w.acked("kv", 1, failed=1.0), TypeError, "failed"),
        (lambda w: w.set_page_size("kv", -5), ValueError, "size"),
        (lambda w: w.set_page_size("", 5), ValueError, "pool"),
    ],
)
def test_bad_acks_raise_and_change_nothing(call, exc, match):
    """Inconsistent ack counts raise naming the argument; nothing changes."""
    w = WriteAccounting(page_size_bytes=8)
    w.written("kv", 5)
    before = w.stats()
    with pytest.raises(exc, match=match):
        call(w)
    assert w.stats() == before


def test_avoided_pages_counted_elsewhere_are_added_at_each_snapshot():
    """``avoided_from``: a source's pages per pool join ``avoided`` (and its bytes and
    ratio) in every snapshot, a pool only the source knows included; zero adds no pool."""
    w = WriteAccounting(page_size_bytes=10)
    tally = {"kv": 3, "swa": 0}
    w.avoided(pool="kv", pages=2)
    w.written(pool="kv", pages=5)
    w.avoided_from(lambda: list(tally.items()))
    s = w.stats()
    assert (s["kv"].avoided, s["kv"].avoided_bytes, "swa" not in s) == (5, 50, True)
    tally["swa"] = 4
    s = w.stats()
    assert (s["swa"].avoided, s["swa"].written, s["kv"].avoided_ratio) == (4, 0, 0.5)
    w.avoided_from(None)
    assert w.stats()["kv"].avoided == 2 and "swa" not in w.stats()


def test_live_counters_are_the_ones_every_snapshot_reads():
    """``live``: a pool's own counters, stable across calls, so a hot path bumping
    them directly is what the next snapshot (and the method API) sees; a bad pool
    name gets the same error as everywhere."""
    w = WriteAccounting(page_size_bytes=10)
    kv = w.live("kv")
    assert w.live("kv") is kv
    kv.written += 4
    kv.avoided += 2
    w.written(pool="kv", pages=1)
    s = w.stats()["kv"]
    assert (s.written, s.avoided, s.written_bytes) == (5, 2, 50)
    with pytest.raises((TypeError, ValueError)):
        w.live("")
