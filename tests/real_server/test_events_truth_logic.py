"""The events truth check's verdicts (``events_truth.Truth.unexplained_removals``) on
made-up streams, no server: a removal of a block L3 holds passes only with evidence
that no lookup could reach the block after its last store, and a store after that
evidence.  The real-server tests trust this check to tell a wrong verdict from an
eviction undone by a rewrite; these cases are the ones it must get right."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from typing import Any

import pytest
from events_truth import STORAGE_MEDIA, Truth

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")

MEDIUM = STORAGE_MEDIA[1]


def stored(hashes: list[int], parent: int | None = None) -> Any:
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=MEDIUM,
    )


def removed(hashes: list[int]) -> Any:
    return kv.BlockRemoved(block_hashes=hashes, medium=MEDIUM)


class Stream:
    """A subscriber's events as ``Truth`` reads them, each stamped as it is added."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.arrived: list[float] = []

    def pump(self) -> list[Any]:
        return self.events

    def add(self, event: Any) -> None:
        time.sleep(0.001)  # distinct arrival times
        self.events.append(event)
        self.arrived.append(time.monotonic())


Steps = Callable[[Stream, Stream, set[int], Truth], None]


def run(steps: Steps, watch: bool = False, before: Steps | None = None) -> tuple[Truth, set[int]]:
    """Instance a holds chain 1-2-3, b holds 4; L3 holds all four; ``before`` runs
    before the eviction (at ``t0``), then ``steps``."""
    a, b = Stream(), Stream()
    held = {1, 2, 3, 4}
    truth = Truth((a, b), lambda: set(held))  # type: ignore[arg-type]
    a.add(stored([1, 2, 3]))
    b.add(stored([4]))
    if before is not None:
        before(a, b, held, truth)
    truth.sample(settled=True)
    time.sleep(0.002)
    truth.t0 = time.monotonic()
    if watch:
        truth.watch(0.001)
    try:
        steps(a, b, held, truth)
    finally:
        truth.stop()
    return truth, held


def verdict(
    steps: Steps, gone: Collection[int] = (), watch: bool = False, before: Steps | None = None
) -> list[tuple[int, int]]:
    """The (subscriber, block) pairs nothing explains."""
    truth, _ = run(steps, watch, before)
    return truth.unexplained_removals(gone)


def settle_watch() -> None:
    time.sleep(0.03)  # several watch reads


def test_a_wrong_removal_is_flagged_though_its_own_rewrite_follows() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        a.add(removed([1]))
        t.sample()
        a.add(stored([1]))
        t.sample()

    assert verdict(steps) == [(0, 1)]
    assert verdict(steps, watch=True) == [(0, 1)]  # never absent: the watch adds nothing


def test_another_instances_store_before_a_wrong_removal_does_not_explain_it() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        b.add(stored([1]))
        t.sample()
        a.add(removed([1]))
        t.sample()

    assert verdict(steps) == [(0, 1)]


def test_an_eviction_seen_absent_explains_the_block_and_those_behind_it() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        t.sample()
        a.add(removed([2, 3]))
        t.sample()
        held.add(2)
        b.add(stored([2], 1))
        b.add(stored([3], 2))
        t.sample()

    assert verdict(steps) == []


def test_an_eviction_undone_between_samples_needs_the_doomed_set_or_the_watch() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        settle_watch()
        a.add(removed([2, 3]))
        held.add(2)
        b.add(stored([2], 1))
        b.add(stored([3], 2))
        t.sample()

    assert verdict(steps) == [(0, 2), (0, 3)]
    assert verdict(steps, gone={2}) == []
    truth, _ = run(steps, watch=True)
    assert truth.unexplained_removals() == []
    assert truth.unexplained_removals(watched=False) == [(0, 2), (0, 3)]
    history = truth.history(3)
    assert history["block"] == 3 and history["watched"] > 0 and not history["watch_errors"]
    assert [kind for kind, _ in history["events"][0]] == ["BlockStored", "BlockRemoved"]
    assert [kind for kind, _ in history["events"][1]] == ["BlockStored"]
    assert history["chain"] == 3 and not history["samples_out_of_reach"]
    report = json.loads(truth.report([(0, 3)]))
    assert report["unexplained"][0]["subscriber"] == 0
    assert report["unexplained"][0]["block"] == 3 and len(report["points"]) == 1
    assert {why for _, why in history["watch_out_of_reach"]} == {"behind"}


def test_an_absence_after_a_wrong_removal_does_not_explain_it() -> None:
    """A removal of a block L3 held then, seen held at the next sample; L3 drops it
    later (only the watch sees that) and b writes it again."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        a.add(removed([1]))
        t.sample()
        held.discard(1)
        settle_watch()
        held.add(1)
        b.add(stored([1]))
        t.sample()

    assert verdict(steps) == [(0, 1)]
    assert verdict(steps, watch=True) == [(0, 1)]


def test_an_absence_seen_before_the_eviction_is_no_evidence() -> None:
    """Block 1 missing at the last sample before ``t0`` (then written again with no
    store event of its own on a's stream), removed after it."""

    def gap(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(1)
        t.sample()
        held.add(1)

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        a.add(removed([1]))
        t.sample()
        b.add(stored([1]))
        t.sample()

    assert verdict(steps, before=gap) == [(0, 1)]


def test_an_absence_before_the_blocks_last_store_is_no_evidence() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(1)
        settle_watch()
        held.add(1)
        a.add(stored([1, 2, 3]))
        settle_watch()
        a.add(removed([1]))
        t.sample()
        a.add(stored([1]))
        t.sample()

    assert verdict(steps, watch=True) == [(0, 1)]


def test_a_removal_of_a_block_l3_no_longer_holds_is_not_judged() -> None:
    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.difference_update({2, 3})
        t.sample()
        a.add(removed([2, 3]))
        t.sample()

    assert verdict(steps) == []


def test_a_block_removed_behind_an_evicted_one_needs_no_store_of_its_own() -> None:
    """What the failed full run's figures fit: a verdict removes the evicted block 2
    and block 3 behind it; b writes 2 again; 3, held all along, is never stored
    again (no instance writes it)."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        a.add(removed([2, 3]))
        t.sample()
        held.add(2)
        b.add(stored([2], 1))
        t.sample()

    assert verdict(steps, gone={2}) == []
    assert verdict(steps) == []  # the first sample saw 2 missing and 3 behind it


def test_a_removal_behind_a_block_stored_again_before_it_is_flagged() -> None:
    """3 was behind the missing 2 at a sample; b wrote 2 again; only then did a remove
    3, which a lookup could reach by then."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        t.sample()
        held.add(2)
        b.add(stored([2], 1))
        t.sample()
        a.add(removed([3]))
        t.sample()

    assert verdict(steps) == [(0, 3)]
    assert verdict(steps, gone={2}) == [(0, 3)]


def test_a_later_eviction_before_a_wrongly_removed_block_does_not_explain_it() -> None:
    """a removes 3 while 1-2-3 are all held; only after that does L3 drop 2."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        a.add(removed([3]))
        t.sample()
        held.discard(2)
        t.sample()

    assert verdict(steps) == [(0, 3)]


def test_a_removal_before_the_eviction_is_not_explained_by_it() -> None:
    def wrong(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        a.add(removed([3]))

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        t.sample()

    assert verdict(steps, gone={2}, before=wrong) == [(0, 3)]


def test_behind_two_missing_blocks_one_stored_again_is_still_out_of_reach() -> None:
    """1 and 2 evicted; b writes 1 again; a removes 3 (2 still missing); b writes 2."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.difference_update({1, 2})
        t.sample()
        held.add(1)
        b.add(stored([1]))
        a.add(removed([3]))
        held.add(2)
        b.add(stored([2], 1))
        t.sample()

    assert verdict(steps, gone={1, 2}) == []


def test_on_one_stream_a_store_then_a_removal_in_one_pump_keep_their_order() -> None:
    """a writes 2 again, then removes 3 behind it, both received by one pump."""

    def steps(a: Stream, b: Stream, held: set[int], t: Truth) -> None:
        held.discard(2)
        t.sample()
        held.add(2)
        a.add(stored([2], 1))
        a.add(removed([3]))
        a.arrived[-2] = a.arrived[-1]  # one pump: one arrival time
        t.sample()

    assert verdict(steps) == [(0, 3)]
