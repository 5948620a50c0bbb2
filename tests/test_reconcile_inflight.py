"""Verdicts racing writes: an absence answer taken at time T says nothing about a
page whose write was in flight at T or launched after it.  Deterministic races
for both API generations, and a hypothesis property over random interleavings
of writes, lookups, L3 changes, answers and verdicts: no verdict removes a
belief whose page is in flight, or was acknowledged or added after the query's
answer."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reconcile_helpers import FaultyTruth, chain, step_until_idle, wired

from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.observers import Tee
from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth
from hicache_existence.reconcile.reconciler import Reconciler


def _query_out(truth: FaultyTruth, rec: Reconciler) -> None:
    """Admit the picked chain and wait until the worker is inside the truth."""
    rec.apply(0)
    deadline = time.monotonic() + 5
    while truth.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert truth.calls == 1


def test_absence_of_a_page_in_flight_keeps_the_beliefs_beyond_it() -> None:
    """The replay's race: L3 holds p2 p3 (believed); a0 a1 are being written
    (in flight, not yet in L3 nor the ledger); a lookup of [a0 a1 p2 p3] is
    verified: the answer (leading 0) is stale, so p2 p3 stay believed."""
    truth = InMemoryGroundTruth()
    cache, rec = wired(truth)
    kv = cache.pool("kv")
    a, p = chain("a", 2), chain("p", 2)
    kv.add(p)
    truth.record_stored("kv", p)
    kv.track_inflight(a)  # D2H launched, storage ack pending
    assert kv.covered([*a, *p])  # the write path's admission check: picked
    step_until_idle(rec)
    assert set(p) <= set(kv.lru_keys())
    snap = rec.snapshot()
    assert snap.invalidations_withheld == {"kv": 1} and not snap.pages_invalidated
    assert snap.queries == {("kv", "absent"): 1}
    rec.close()


def test_a_later_page_acked_while_the_query_is_out_is_spared() -> None:
    """A true stale positive (c1: believed, not in L3, not being written) drops
    the beliefs after it, but not c2, whose write was in flight when the query
    left and was acknowledged (added) before the verdict: the answer predates
    that write."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "block")
    cache, rec = wired(truth, timeout_s=5.0)
    kv = cache.pool("kv")
    c = chain("q", 4)
    kv.add(c[:2])
    kv.add(c[3:])
    mem.record_stored("kv", c[:1])
    kv.track_inflight(c[2:3])
    assert kv.covered(c)
    _query_out(truth, rec)
    kv.add(c[2:3])  # the storage ack lands while the query is out
    kv.untrack_inflight(c[2:3])
    mem.record_stored("kv", c[2:3])
    truth.release.set()
    step_until_idle(rec)
    assert set(kv.lru_keys()) == {c[0], c[2]}
    snap = rec.snapshot()
    assert snap.pages_invalidated == {"kv": 2} and not snap.invalidations_withheld
    rec.close()


def test_a_pipeline_reset_voids_the_answers_out() -> None:
    """clear_inflight (upstream's reset: the dropped writes may still land, with no
    ack) voids the queries out; their answers change nothing."""
    mem = InMemoryGroundTruth()
    truth = FaultyTruth(mem, "block")
    cache, rec = wired(truth, timeout_s=5.0)
    kv = cache.pool("kv")
    a, p = chain("ra", 1), chain("rp", 2)
    kv.add(p)
    mem.record_stored("kv", p)
    kv.track_inflight(a)
    assert kv.covered([*a, *p])
    _query_out(truth, rec)
    cache.clear_inflight()
    truth.release.set()
    step_until_idle(rec)
    assert len(kv) == 2
    snap = rec.snapshot()
    assert snap.queries.get(("kv", "void")) == 1 and not snap.pages_invalidated
    rec.close()


def test_later_pages_written_since_the_query_are_spared() -> None:
    """A true stale positive at page 1 drops the beliefs beyond it, except a page
    whose write is in flight when the verdict applies."""
    truth = InMemoryGroundTruth()
    cache, rec = wired(truth)
    kv = cache.pool("kv")
    c = chain("s", 5)
    kv.add(c)
    truth.record_stored("kv", c[:1])
    kv.track_inflight(c[3:4])  # c[3] rewritten (e.g. its node spans new pages)
    assert kv.contains_all(c)
    step_until_idle(rec)
    assert set(kv.lru_keys()) == {c[0], c[3]}
    snap = rec.snapshot()
    assert snap.pages_invalidated == {"kv": 3} and snap.stale_positives == {"kv": 1}
    assert not snap.invalidations_withheld
    rec.close()


def test_absence_of_a_page_acked_before_the_query_is_acted_on() -> None:
    """The rule withholds only what the answer cannot know: a write acked before
    the query left and missing from L3 (lost) is a stale positive as before."""
    truth = InMemoryGroundTruth()
    cache, rec = wired(truth)
    kv = cache.pool("kv")
    c = chain("l", 4)
    kv.track_inflight(c)
    kv.add(c)
    kv.untrack_inflight(c)  # acked; L3 then lost c[2:]
    truth.record_stored("kv", c[:2])
    assert kv.contains_all(c)
    step_until_idle(rec)
    assert len(kv) == 2 and rec.snapshot().pages_invalidated == {"kv": 2}
    rec.close()


def test_flat_generation_reads_the_pipelines_in_flight_set() -> None:
    """The seed cache keeps no in-flight refs (the pipeline passes its own set as
    ``extra_cover``): the reconciler reads the same set through the pool's
    ``inflight_pages()`` and withholds the stale verdict."""
    truth = InMemoryGroundTruth()
    tee = Tee()
    cache = FlatStorageExistenceCache(1000, observer=tee)
    inflight: dict[str, int] = {}
    rec = Reconciler(cache, truth, sampling_rate=1.0, agree_interval_steps=1)
    tee.observers = (rec,)
    a, p = chain("fa", 2), chain("fp", 2)
    cache.add("kv", p)
    truth.record_stored("kv", p)
    inflight.update(dict.fromkeys(a, 1))
    assert cache.covers_all("kv", [*a, *p], extra_cover=inflight)
    step_until_idle(rec)
    assert len(cache) == 2 and rec.snapshot().invalidations_withheld == {"kv": 1}
    rec.close()


class _Broken:
    """An ``extra_cover`` whose membership test raises (never consulted by a
    lookup whose pages are all believed)."""

    def __contains__(self, page: object) -> bool:
        raise RuntimeError("pipeline gone")


def test_an_unreadable_inflight_set_withholds_and_never_raises() -> None:
    """An in-flight set that raises means "cannot tell": the verdict is withheld,
    the error counted as internal, and apply() does not raise."""
    truth = InMemoryGroundTruth()
    tee = Tee()
    cache = FlatStorageExistenceCache(1000, observer=tee)
    rec = Reconciler(cache, truth, sampling_rate=1.0, agree_interval_steps=1)
    tee.observers = (rec,)
    c = chain("x", 3)
    cache.add("kv", c)
    assert cache.covers_all("kv", c, extra_cover=_Broken())
    step_until_idle(rec)
    snap = rec.snapshot()
    assert len(cache) == 3 and snap.invalidations_withheld == {"kv": 1}
    assert snap.errors == {"internal": 1}
    rec.close()


# -- the property --------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class GatedTruth:
    """Answers one query at a time when the test says so, recording the moment
    (the test's operation clock) of each answer: the query's time T."""

    def __init__(self, clock: list[int]) -> None:
        self.inner = InMemoryGroundTruth()
        self.clock = clock
        self.go = threading.Semaphore(0)
        self.answered = threading.Semaphore(0)
        self.waiting = 0
        self.opened = False  # after drain(): answer at once
        #: (clock at the answer, chain, leading count) per answered query.
        self.answers: list[tuple[int, tuple[str, ...], int]] = []
        self._lock = threading.Lock()

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        with self._lock:
            if self.opened:
                return self.inner.leading_present(pool, hashes)
            self.waiting += 1
        self.go.acquire()
        try:
            leading = self.inner.leading_present(pool, hashes)
            self.answers.append((self.clock[0], tuple(hashes), leading))
            return leading
        finally:
            self.answered.release()

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        return list(self.inner.present(pool, hashes))

    def answer_one(self, admitted: int) -> bool:
        """Answer the oldest query not yet answered, once the (single) worker
        holds it; nothing when every admitted query was answered."""
        deadline = time.monotonic() + 10
        while not self.waiting and len(self.answers) < admitted:
            assert time.monotonic() < deadline
            time.sleep(0.0002)
        with self._lock:
            if not self.waiting:
                return False
            self.waiting -= 1
        self.go.release()
        assert self.answered.acquire(timeout=10)
        return True

    def drain(self) -> None:
        while True:
            with self._lock:
                self.opened = True
                if not self.waiting:
                    return
                self.waiting -= 1
            self.go.release()


PAGES = [f"{i:064x}" for i in range(5)]
_SPAN = st.tuples(st.integers(0, 4), st.integers(1, 3))
_OPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["launch", "ack", "fail", "write", "store", "lose"]), _SPAN),
        st.tuples(st.just("lookup"), st.tuples(st.integers(0, 4), st.integers(1, 5))),
        st.tuples(st.sampled_from(["answer", "apply"]), st.just((0, 0))),
    ),
    max_size=50,
)
#: The fleet replay's race: p1 written and believed; p0 in flight; [p0 p1] verified.
_RACE = [
    ("write", (1, 1)),
    ("launch", (0, 1)),
    ("lookup", (0, 2)),
    ("apply", (0, 0)),
    ("answer", (0, 0)),
    ("apply", (0, 0)),
]


@settings(max_examples=300, deadline=None)
@given(ops=_OPS)
@example(ops=_RACE)
def test_no_verdict_acts_on_a_page_written_since_its_query(ops: list[Any]) -> None:
    """Random interleavings of launches, storage acks (add + untrack, as
    upstream's ack), failed launches (untrack only: never written), lookups, L3
    stores and losses, answers and verdicts: a verdict removes beliefs only if
    the page where its answer stopped was neither in flight when the verdict
    applied nor acked after the answer, and it never removes a belief whose
    page was."""
    clock = [0]
    truth = GatedTruth(clock)
    cache, rec = wired(truth, timeout_s=60.0, max_verdicts_per_step=1)
    kv = cache.pool("kv")
    last_event: dict[str, int] = {}  # page -> clock of its last ack
    applied = 0
    try:
        for op, (start, n) in ops:
            clock[0] += 1
            pages = PAGES[start : start + n]
            if op == "launch":
                kv.track_inflight(pages)
            elif op in ("ack", "fail", "write"):
                if op == "write":  # launched and acked between two steps
                    kv.track_inflight(pages)
                mine = [h for h in pages if h in kv.inflight_refs()]
                if not mine:
                    continue
                if op != "fail":
                    truth.inner.record_stored("kv", mine)
                    kv.add(mine)
                    for h in mine:
                        last_event[h] = clock[0]
                kv.untrack_inflight(mine)
            elif op == "lookup":
                kv.covered(pages)
            elif op == "store":
                truth.inner.record_stored("kv", pages)
            elif op == "lose":
                truth.inner.record_removed("kv", pages)
            elif op == "answer":
                truth.answer_one(rec.snapshot().candidates_admitted)
            else:
                before = set(kv.lru_keys())
                rec.apply(clock[0])
                removed = before - set(kv.lru_keys())
                done = sum(rec.snapshot().verdicts_applied.values())
                if done == applied:
                    assert not removed
                    continue
                t_query, queried, leading = truth.answers[applied]
                applied = done
                inflight = kv.inflight_refs()

                def written_since(h: str, t: int = t_query, refs: Any = inflight) -> bool:
                    return h in refs or last_event.get(h, -1) > t

                if removed:
                    assert leading < len(queried), ops
                    assert not written_since(queried[leading]), ops
                    assert not any(map(written_since, removed)), ops
    finally:
        truth.drain()
        rec.close()
