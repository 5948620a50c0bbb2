"""The storage-tier KV events' rules (hicache_existence.events), on the real cache.

A capture sink stands in for the ZeroMQ socket (the wire and the real consumers are
tested in test_events_sglang.py and test_events_dynamo.py); the cache, its observer
stream and the runtime are the package's own.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

import pytest

from hicache_existence.config import Config, ConfigError
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.observers import Tee
from hicache_existence.events import emitter as em
from hicache_existence.events.wire import Event, Removed, Stored, block_hash
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.runtime import ExistenceRuntime

PAGE = 4


def pages(n: int, salt: str = "") -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def chain(hashes: Sequence[str], first_parent: str | None = None) -> list[em.Block]:
    """Blocks of a chain: each page's parent is the one before it."""
    out: list[em.Block] = []
    parent = first_parent
    for i, page in enumerate(hashes):
        out.append((page, parent, list(range(i * PAGE, (i + 1) * PAGE))))
        parent = page
    return out


class Capture:
    """A sink that keeps what it is sent (optionally held until released)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[list[Event]] = []
        self.gate = gate
        self.sent = threading.Event()

    def send(self, ts: float, events: Sequence[Event]) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(list(events))
        self.sent.set()

    def close(self) -> None:
        pass

    def events(self) -> list[Event]:
        return [e for batch in self.batches for e in batch]

    def stored(self) -> list[int]:
        return [h for e in self.events() if isinstance(e, Stored) for h in e.block_hashes]

    def removed(self) -> list[int]:
        return [h for e in self.events() if isinstance(e, Removed) for h in e.block_hashes]


def emitter(sink: Capture, **kw: object) -> em.KvEvents:
    events = em.KvEvents(lambda: sink, medium="DISK", **kw)  # type: ignore[arg-type]
    assert events.start()
    return events


def drain(events: em.KvEvents) -> None:
    """Wait until the publisher thread sent everything queued."""
    assert events.flush()


def test_stored_blocks_carry_hash_parent_and_tokens_as_one_chain() -> None:
    """An acknowledged chain becomes one BlockStored: the pages' 64-bit hashes, the
    first page's parent, every page's tokens, the page size and the medium."""
    sink = Capture()
    events = emitter(sink)
    root = pages(1, "root")[0]
    hashes = pages(3)
    events.stored(chain(hashes, first_parent=root))
    events.close()
    (event,) = sink.events()
    assert isinstance(event, Stored)
    assert event.block_hashes == tuple(block_hash(p) for p in hashes)
    assert event.parent_block_hash == block_hash(root)
    assert event.token_ids == tuple(range(3 * PAGE))
    assert event.block_size == PAGE
    assert event.medium == "DISK"
    assert events.snapshot().published["stored"] == 3


def test_block_hash_is_the_signed_first_64_bits() -> None:
    """The block hash is the page hash's first 16 hex digits as a signed int64."""
    assert block_hash("0" * 15 + "1" + "f" * 48) == 1
    assert block_hash("f" * 64) == -1
    assert block_hash("8" + "0" * 63) == -(1 << 63)
    assert block_hash("7" + "f" * 15 + "0" * 48) == (1 << 63) - 1


def test_a_block_is_published_once_until_removed() -> None:
    """A second acknowledgement of a published block publishes nothing; after a
    verified removal, the next acknowledgement publishes it again."""
    sink = Capture()
    events = emitter(sink)
    hashes = pages(2)
    events.stored(chain(hashes))
    events.stored(chain(hashes))
    drain(events)
    assert sink.stored() == [block_hash(p) for p in hashes]
    events.invalidated("kv", hashes, 1)
    events.stored(chain(hashes))
    events.close()
    assert sink.stored() == [block_hash(p) for p in hashes] + [block_hash(hashes[1])]
    assert sink.removed() == [block_hash(hashes[1])]


def test_a_chain_broken_by_a_published_page_starts_a_new_event() -> None:
    """Pages after an already published one are linked to it, not to the page
    before it (the parent of every published block is its real parent)."""
    sink = Capture()
    events = emitter(sink)
    hashes = pages(3)
    events.stored(chain(hashes[1:2], first_parent=hashes[0]))
    events.stored(chain(hashes))
    events.close()
    last = sink.events()[-2:]
    assert [e.block_hashes for e in last] == [(block_hash(hashes[0]),), (block_hash(hashes[2]),)]
    assert isinstance(last[1], Stored) and last[1].parent_block_hash == block_hash(hashes[1])


def test_lru_eviction_and_clear_remove_nothing() -> None:
    """The cache forgetting beliefs (an LRU eviction inside add, a clear) says
    nothing about L3: no BlockRemoved."""
    sink = Capture()
    events = emitter(sink)
    cache = StorageExistenceCache(2, observer=Tee(events))
    hashes = pages(4)
    events.stored(chain(hashes))
    cache.pool("kv").add(hashes)  # cap 2: two evicted
    cache.clear()
    events.close()
    assert sink.removed() == []
    assert events.snapshot().blocks == 4


def test_invalidation_removes_published_pages_past_the_verdict() -> None:
    """invalidate_beyond (a verdict) removes the published pages past the kept
    prefix, once, and names its source; unpublished pages and other pools give no
    event."""
    sink = Capture()
    events = emitter(sink)
    cache = StorageExistenceCache(64, observer=Tee(events))
    hashes = pages(4)
    events.stored(chain(hashes[:3]))
    kv = cache.pool("kv")
    kv.add(hashes)
    cache.pool("swa").invalidate_beyond(hashes, 0)
    kv.invalidate_beyond(hashes, 1)
    kv.invalidate_beyond(hashes, 1)
    events.close()
    assert sink.removed() == [block_hash(p) for p in hashes[1:3]]
    assert events.snapshot().removals == {"reconciler": 0, "hit_query": 2}


def test_removal_source_is_the_reconciler_while_it_applies() -> None:
    """The runtime names the reconciler as the source of an invalidation made
    while it applies its verdicts, a hit query otherwise."""
    from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth

    config = Config.from_mapping(
        {
            "events": {"enabled": True},
            "reconciler": {"enabled": True, "sampling_rate": 1.0},
            "metrics": {"enabled": False},
        }
    )
    sink = Capture()
    runtime = ExistenceRuntime(
        config,
        DeploymentLabels(storage_backend="file"),
        truth=InMemoryGroundTruth(),
        events=em.Placement(True, 0, "file", lambda: sink),
    )
    events, reconciler = runtime.events, runtime.reconciler
    assert events is not None and reconciler is not None
    assert events.medium == "DISK"
    runtime.start()
    try:
        hashes = pages(2)
        events.stored(chain(hashes))
        reconciler._applying = True
        runtime.cache.pool("kv").invalidate_beyond(hashes, 1)
        reconciler._applying = False
        runtime.cache.pool("kv").invalidate_beyond(hashes, 0)
    finally:
        runtime.close()
    assert events.snapshot().removals == {"reconciler": 1, "hit_query": 1}


def test_full_queue_drops_and_counts_without_blocking() -> None:
    """A publisher that cannot keep up: the scheduler-side calls return at once,
    the events that do not fit are dropped and counted by block."""
    gate = threading.Event()
    sink = Capture(gate)
    events = emitter(sink, queue_size=1)
    hashes = pages(40)
    start = time.monotonic()
    for i in range(0, 40, 2):
        events.stored(chain(hashes[i : i + 2], first_parent=hashes[i - 1] if i else None))
    elapsed = time.monotonic() - start
    gate.set()
    events.close()
    snap = events.snapshot()
    assert elapsed < 1.0
    assert snap.dropped["queue_full"] > 0
    assert snap.published["stored"] + snap.dropped["queue_full"] == 40
    assert len(sink.stored()) == snap.published["stored"]


def test_send_error_is_counted() -> None:
    """A batch the sink refuses is counted as send_error, not published."""

    class Broken(Capture):
        def send(self, ts: float, events: Sequence[Event]) -> None:
            raise OSError("refused")

    events = emitter(Broken())
    events.stored(chain(pages(3)))
    events.close()
    snap = events.snapshot()
    assert snap.dropped["send_error"] == 3
    assert snap.published["stored"] == 0


class Flaky(Capture):
    """A sink that refuses the batches it is told to (a transient socket error)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def send(self, ts: float, events: Sequence[Event]) -> None:
        if self.refuse:
            raise OSError("refused")
        super().send(ts, events)


def test_a_refused_batch_is_sent_again_by_the_next_ack_or_verdict() -> None:
    """Subscribers saw nothing of a refused batch: its stores are not published (the
    next ack of those pages sends them) and its removals are not done (the next
    verdict sends them), so the subscribers' index and ours stay the same."""
    sink = Flaky()
    events = emitter(sink)
    cache = StorageExistenceCache(64, observer=Tee(events))
    kv = cache.pool("kv")
    hashes = pages(4)
    sink.refuse = True
    events.stored(chain(hashes[:2]))
    drain(events)
    sink.refuse = False
    events.stored(chain(hashes))
    drain(events)
    assert sink.stored() == [block_hash(p) for p in hashes]
    kv.add(hashes)
    sink.refuse = True
    kv.invalidate_beyond(hashes, 1)
    drain(events)
    sink.refuse = False
    events.stored(chain(hashes[:1]))  # a refresh of what stays: no event
    kv.add(hashes)
    kv.invalidate_beyond(hashes, 1)
    events.close()
    assert sink.stored() == [block_hash(p) for p in hashes]
    assert sink.removed() == [block_hash(p) for p in hashes[1:]]
    snap = events.snapshot()
    assert snap.dropped["send_error"] == 2 + 3
    assert snap.published == {"stored": 4, "removed": 3}


def test_no_sink_means_no_events_and_no_cost() -> None:
    """A sink that cannot be opened: start reports it, every later call is a no-op."""
    events = em.KvEvents(lambda: None, medium="DISK")
    assert not events.start()
    events.stored(chain(pages(2)))
    events.invalidated("kv", pages(2), 0)
    assert events.snapshot().blocks == 0
    assert events._queue.empty()


def test_oldest_unverified_store_age_follows_confirmations() -> None:
    """The age of the least recently confirmed published block: an acknowledgement,
    a hit query's kept prefix or a reconciler verdict confirms a block again."""
    now = [100.0]
    sink = Capture()
    events = emitter(sink, clock=lambda: now[0])
    a, b = pages(2)
    events.stored(chain([a]))
    now[0] = 110.0
    events.stored(chain([b], first_parent=a))
    now[0] = 130.0
    drain(events)
    assert events.snapshot().oldest_unverified_s == pytest.approx(30.0)
    events.verified("kv", [a], 1)
    drain(events)
    assert events.snapshot().oldest_unverified_s == pytest.approx(20.0)
    now[0] = 135.0
    events.invalidated("kv", [a, b], 2)  # a hit query found both
    drain(events)
    assert events.snapshot().oldest_unverified_s == pytest.approx(0.0)
    events.close()


def test_max_blocks_bounds_the_published_set() -> None:
    """At most max_blocks published blocks are remembered, oldest confirmed first."""
    events = emitter(Capture(), max_blocks=3)
    events.stored(chain(pages(5)))
    drain(events)
    assert events.snapshot().blocks == 3
    events.close()


def test_placement_and_medium() -> None:
    """Only the publishing rank gets an emitter; auto gives DISK to the file
    backend, EXTERNAL to the others; events are off by default."""
    on = Config.from_mapping({"events": {"enabled": True}}).events
    assert em.from_config(Config().events, em.Placement(True)) is None
    assert em.from_config(on, em.Placement(False)) is None
    made = em.from_config(on, em.Placement(True, 0, "mooncake", lambda: Capture()))
    assert made is not None and made.medium == "EXTERNAL"
    assert em.medium_for("auto", "file") == "DISK"
    for backend in ("mooncake", "hf3fs", "nixl", "dynamic", ""):
        assert em.medium_for("auto", backend) == "EXTERNAL"
    assert em.medium_for("DISK", "mooncake") == "DISK"


def test_runtime_without_events_has_none() -> None:
    """Events off (the default): the runtime builds no emitter and exports no series."""
    runtime = ExistenceRuntime(Config.from_mapping({"metrics": {"enabled": False}}))
    assert runtime.events is None
    assert runtime.telemetry is not None


def test_bad_events_configuration_is_refused() -> None:
    """Out-of-range events settings are refused, naming the key."""
    for bad, key in (
        ({"queue_size": 0}, "events.queue_size"),
        ({"max_blocks": 0}, "events.max_blocks"),
        ({"endpoint": ""}, "events.endpoint"),
        ({"medium": "GPU"}, "events.medium"),
    ):
        with pytest.raises(ConfigError, match=key):
            Config.from_mapping({"events": bad})


def test_the_scheduler_side_is_one_queue_item_per_call() -> None:
    """An acknowledgement of any number of pages, a verdict and a refresh each put
    one item on the queue and touch nothing per page on the calling thread: the
    blocks are resolved, deduplicated and built on the publisher thread."""
    gate = threading.Event()
    sink = Capture(gate)
    events = emitter(sink)
    events.stored(chain(pages(1, "first")))
    assert sink.sent.wait(0) is False
    time.sleep(0.05)  # the publisher holds the first batch at the gate
    threads: list[str] = []

    def resolve(blocks: list[em.Block]) -> tuple[list[em.Block], int]:
        threads.append(threading.current_thread().name)
        return blocks, 2

    hashes = pages(500)
    events.stored_from(resolve, (chain(hashes),), 502)
    events.invalidated("kv", hashes, 250)
    events.verified("kv", hashes, 250)
    assert events._queue.qsize() == 3
    assert threads == [] and events.snapshot().blocks == 1
    gate.set()
    drain(events)
    assert threads == ["hicache-existence-kv-events"]
    snap = events.snapshot()
    assert snap.unknown == 2
    assert snap.published == {"stored": 501, "removed": 250}
    assert snap.blocks == 251
    events.close()


def test_a_verdict_chain_is_copied_at_the_call() -> None:
    """The publisher reads a verdict later: a caller reusing its chain list after
    the call changes nothing (the emitter keeps its own tuple)."""
    gate = threading.Event()
    sink = Capture(gate)
    events = emitter(sink)
    hashes = pages(4)
    events.stored(chain(hashes))
    time.sleep(0.05)
    verdict = list(hashes)
    events.invalidated("kv", verdict, 2)
    verdict[2:] = pages(2, "other")
    gate.set()
    events.close()
    assert sink.removed() == [block_hash(p) for p in hashes[2:]]


def test_counters_stay_consistent_while_read_from_another_thread() -> None:
    """Stores and verdicts from one thread, snapshots from another, the publisher
    in a third: no error, and every published block is accounted for (published
    stored minus removed is the published set; the sink got exactly those)."""
    sink = Capture()
    events = emitter(sink, queue_size=1 << 16)
    stop = threading.Event()
    seen: list[em.EventsSnapshot] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(events.snapshot())

    t = threading.Thread(target=reader)
    t.start()
    try:
        for round_ in range(200):
            hashes = pages(16, f"r{round_ % 20}-")
            events.stored(chain(hashes))
            events.invalidated("kv", hashes, round_ % 17)
            events.verified("kv", hashes, 3)
        drain(events)
    finally:
        stop.set()
        t.join()
    snap = events.snapshot()
    assert snap.errors == 0 and snap.dropped == {"queue_full": 0, "send_error": 0}
    assert snap.published["stored"] - snap.published["removed"] == snap.blocks
    assert len(sink.stored()) == snap.published["stored"]
    assert len(sink.removed()) == snap.published["removed"] == sum(snap.removals.values())
    assert seen and all(s.errors == 0 for s in seen)
    events.close()


def test_a_refused_batch_holding_a_store_and_its_removal_leaves_the_page_unpublished() -> None:
    """A refused batch is undone to the state before it: a page first stored then
    removed in that batch was not published before, so the next ack publishes it."""

    class Gated(Capture):
        def __init__(self) -> None:
            super().__init__()
            self.release, self.held, self.calls = threading.Event(), threading.Event(), 0

        def send(self, ts: float, events: Sequence[Event]) -> None:
            self.calls += 1
            if self.calls == 1:  # hold the publisher: what follows is one batch
                self.held.set()
                self.release.wait(10)
            elif self.calls == 2:
                raise OSError("refused")
            super().send(ts, events)

    sink = Gated()
    events = emitter(sink)
    cache = StorageExistenceCache(64, observer=Tee(events))
    kv = cache.pool("kv")
    hashes = pages(2)
    events.stored(chain(pages(1, "other")))
    assert sink.held.wait(5)
    events.stored(chain(hashes))  # acknowledged ...
    kv.add(hashes)
    kv.invalidate_beyond(hashes, 0)  # ... and found gone, in the same (refused) batch
    sink.release.set()
    drain(events)
    assert sink.calls == 2
    events.stored(chain(hashes))
    events.close()
    assert sink.stored()[-2:] == [block_hash(p) for p in hashes]


def test_an_undone_removal_keeps_its_place_among_the_oldest() -> None:
    """A removal a refused batch undoes goes back where its confirmation time puts
    it: the oldest-verification gauge and the max_blocks eviction still see the
    least recently confirmed block first."""
    now = [100.0]
    sink = Flaky()
    events = emitter(sink, clock=lambda: now[0])
    a, b, c = pages(3)
    for page, t in ((a, 100.0), (b, 200.0), (c, 300.0)):
        now[0] = t
        events.stored(chain([page]))
        drain(events)
    now[0] = 400.0
    assert events.snapshot().oldest_unverified_s == pytest.approx(300.0)
    sink.refuse = True
    events.invalidated("kv", [a], 0)  # a verdict finds a gone; its batch is refused
    drain(events)
    snap = events.snapshot()
    assert snap.blocks == 3 and snap.oldest_unverified_s == pytest.approx(300.0)
    assert list(events._published) == [a, b, c]
    events.close()


def test_a_refused_removal_is_counted_once_when_sent() -> None:
    """removals{source} counts removals subscribers received: a refused one counts
    when the next verdict sends it, not twice."""
    sink = Flaky()
    events = emitter(sink)
    (a,) = pages(1)
    events.stored(chain([a]))
    drain(events)
    sink.refuse = True
    events.invalidated("kv", [a], 0)
    drain(events)
    assert events.snapshot().removals.get("hit_query", 0) == 0
    sink.refuse = False
    events.invalidated("kv", [a], 0)
    drain(events)
    snap = events.snapshot()
    assert snap.published["removed"] == 1 and snap.removals["hit_query"] == 1
    events.close()


def test_a_storage_clear_lost_to_a_full_queue_is_counted() -> None:
    """Emptying L3 removes every published block in one queue item: when the queue
    is full, its loss shows in dropped{queue_full} (the blocks stay published)."""
    go = threading.Event()

    class Held(Capture):
        def send(self, ts: float, events: Sequence[Event]) -> None:
            go.wait(5)
            super().send(ts, events)

    sink = Held()
    events = emitter(sink, queue_size=2)
    hashes = pages(3)
    events.stored(chain(hashes[:1]))  # the publisher takes it and waits in send
    time.sleep(0.3)
    events.stored(chain(hashes[1:2], first_parent=hashes[0]))
    events.stored(chain(hashes[2:], first_parent=hashes[1]))  # the queue is full
    events.storage_cleared()
    go.set()
    drain(events)
    snap = events.snapshot()
    events.close()
    assert not sink.removed() and snap.dropped["queue_full"] >= 1
