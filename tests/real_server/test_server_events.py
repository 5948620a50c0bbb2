"""Storage-tier KV events from real SGLang servers, read with sglang's own classes.

Two real CPU ``sglang.launch_server`` processes (buffer mode, 16-token pages) over
one L3 directory (the file backend), started together once for the module, each
with ``events.enabled`` and the reconciler verifying against the file backend's own
``batch_exists``; ZeroMQ subscribers decode every message with sglang's
``KVEventBatch``.  Server ``a`` publishes on the package's own socket, server ``b``
on SGLang's ``--kv-events-config`` stream.

On ``a``: A (24 pages, above the 256-token prefetch threshold) is served: when its
write is acknowledged the subscriber has one ``BlockStored`` per page file A made,
with A's tokens, chained from the root, medium ``DISK``.  Those page files are then
deleted behind the server's back and A + B served after ``/flush_cache``: its
prefetch hit query finds nothing, which removes A's 24 blocks (source
``hit_query``), and its own write publishes the 32 pages again.  The series agree
with what the subscriber saw.

On ``b`` the same events ride SGLang's own publisher: one sequence with its device
events, and every ``DISK`` block is a block SGLang's own ``GPU`` events stored, with
the same tokens and parent: a consumer joins the tiers on the block hash.

Against truth (issue 30 item 3): a multi-turn workload over both servers, an
outside evictor deleting page files, and the consumer's index of the storage tier
sampled against the page files for SGLang's own events, belief-only events and
ours (``test_the_consumers_index_against_the_page_files``; docs/kv-events.md).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Server,
    ServerSpec,
    block_tokens_for,
    conversation_requests,
    free_port,
    launch_together,
    poll,
)

pytestmark = [pytest.mark.real_server]

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

PAGE = 16
P = "hicache_existence_"


def block_hash(page: str) -> int:
    value = int(page[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


class Subscriber:
    """Every batch the server publishes, decoded by sglang's ``KVEventBatch``, with
    the time (monotonic) each event arrived."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
        self.events: list[Any] = []
        self.arrived: list[float] = []
        self.seqs: list[int] = []

    def pump(self) -> list[Any]:
        while self.socket.poll(50):
            _topic, seq, payload = self.socket.recv_multipart()
            now = time.monotonic()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = self.decoder.decode(payload).events
            self.events.extend(batch)
            self.arrived.extend([now] * len(batch))
        return self.events

    def blocks(self, kind: type) -> list[int]:
        return [h for e in self.pump() if isinstance(e, kind) for h in e.block_hashes]

    def close(self) -> None:
        self.socket.close(linger=0)


def files(srv: Server) -> set[str]:
    return {name[:64] for name in srv.l3_pages()}


def series(srv: Server) -> dict[str, float]:
    out = {
        f"{kind}": srv.value(P + "events_published_blocks_total", kind=kind)
        for kind in ("stored", "removed")
    }
    out["hit_query"] = srv.value(P + "events_removals_total", source="hit_query")
    out["reconciler"] = srv.value(P + "events_removals_total", source="reconciler")
    out["queue_full"] = srv.value(P + "events_dropped_blocks_total", reason="queue_full")
    out["unknown"] = srv.value(P + "events_unknown_blocks_total")
    return out


#: The reconciler of both servers: every lookup a candidate (sampling 1.0), the
#: default budget, and ground truth from the file backend's own ``batch_exists``
#: (no Redis: ``tree_cache_truth`` falls back to the backend itself).
RECONCILER: dict[str, Any] = {
    "enabled": True,
    "sampling_rate": 1.0,
    "verifications_per_s": 50.0,
    "timeout_ms": 1000.0,
}


@dataclass
class Pair:
    """Two prefill servers over one L3 directory (the file backend): ``a`` publishes
    the storage tier on the package's own socket, ``b`` on SGLang's
    ``--kv-events-config`` stream (with its own device events)."""

    a: Server
    b: Server
    sub_a: Subscriber
    sub_b: Subscriber
    l3: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workdir = tmp_path_factory.mktemp("events")
    l3 = workdir / "l3"
    own, sglangs = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    # Subscribers connect before the servers bind: ZeroMQ retries.
    sub_a, sub_b = Subscriber(own), Subscriber(sglangs)
    metrics = {"flush_interval_s": 0.25}
    specs = [
        ServerSpec(
            config={
                "events": {"enabled": True, "endpoint": own},
                "metrics": metrics,
                "reconciler": RECONCILER,
            },
            l3_dir=l3,
        ),
        ServerSpec(
            config={"events": {"enabled": True}, "metrics": metrics, "reconciler": RECONCILER},
            l3_dir=l3,
            extra_args=(
                "--kv-events-config",
                json.dumps({"publisher": "zmq", "endpoint": sglangs, "bind": True}),
            ),
        ),
    ]
    try:
        with launch_together(specs, workdir) as (a, b):
            time.sleep(0.5)  # the subscriptions reach the bound sockets
            yield Pair(a, b, sub_a, sub_b, l3)
    finally:
        sub_a.close()
        sub_b.close()


def test_stores_at_the_ack_and_removals_on_a_verified_absence(pair: Pair) -> None:
    """Stored blocks are exactly L3's page files, with their tokens and chain;
    deleted files are removed by the next hit query, then stored again."""
    _stores_and_removals(pair.a, pair.sub_a)


def _stores_and_removals(srv: Server, sub: Subscriber) -> None:
    a = block_tokens_for(1, PAGE * 24, salt="events")
    b = block_tokens_for(2, PAGE * 8, salt="events")
    before = files(srv)  # the L3 directory is shared with the other server
    srv.generate(a, max_new_tokens=1)
    srv.wait_writes_settled()
    written = files(srv) - before
    assert len(written) == 24
    poll(lambda: len(sub.blocks(kv.BlockStored)) >= 24)
    stored = [e for e in sub.pump() if isinstance(e, kv.BlockStored)]
    assert sorted(h for e in stored for h in e.block_hashes) == sorted(map(block_hash, written))
    assert [t for e in stored for t in e.token_ids] == a
    assert stored[0].parent_block_hash is None
    assert all(e.parent_block_hash == p.block_hashes[-1] for p, e in itertools.pairwise(stored))
    assert {(e.medium, e.block_size) for e in stored} == {("DISK", PAGE)}
    assert sub.blocks(kv.BlockRemoved) == []

    for name in list(srv.l3_pages()):
        if name[:64] in written:
            (srv.l3_dir / name).unlink()
    srv.flush_cache()
    srv.generate(a + b, max_new_tokens=1)
    srv.wait_writes_settled()
    poll(lambda: len(sub.blocks(kv.BlockStored)) >= 24 + 32)
    removed = sub.blocks(kv.BlockRemoved)
    assert sorted(removed) == sorted(map(block_hash, written))
    assert {e.medium for e in sub.pump() if isinstance(e, kv.BlockRemoved)} == {"DISK"}
    again = sub.blocks(kv.BlockStored)[24:]
    assert sorted(again) == sorted(map(block_hash, files(srv) - before))
    assert sub.seqs == list(range(len(sub.seqs)))  # nothing lost on the way
    counts = poll(lambda: (s := series(srv))["stored"] == 56 and s)
    assert counts == {
        "stored": 56,
        "removed": 24,
        "hit_query": 24,
        "reconciler": 0,
        "queue_full": 0,
        "unknown": 0,
    }


def test_on_sglangs_stream_the_tiers_join(pair: Pair) -> None:
    """With --kv-events-config the storage-tier events ride SGLang's own stream
    (one sequence with its device events) and every DISK block is a block SGLang's
    own GPU events stored, with the same tokens and parent."""
    srv, sub = pair.b, pair.sub_b
    a = block_tokens_for(3, PAGE * 24, salt="events-join")
    before = files(srv)
    srv.generate(a, max_new_tokens=1)
    srv.wait_writes_settled()
    written = files(srv) - before
    poll(lambda: sum(len(e.block_hashes) for e in sub.pump() if _stored(e, "DISK")) >= 24)
    events = sub.pump()
    disk = [e for e in events if _stored(e, "DISK")]
    gpu = [e for e in events if _stored(e, "GPU")]
    assert gpu, "SGLang published no device events"
    assert sorted(h for e in disk for h in e.block_hashes) == sorted(map(block_hash, written))
    tokens_of, parent_of = _blocks(gpu)
    ours_tokens, ours_parent = _blocks(disk)
    assert set(ours_tokens) <= set(tokens_of)
    for h, toks in ours_tokens.items():
        assert toks == tokens_of[h] and ours_parent[h] == parent_of[h], h
    # One stream, SGLang's sequence: consecutive from the first message this
    # subscriber saw (the server's warm-up may precede the subscription).
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))


def _stored(event: Any, medium: str) -> bool:
    return isinstance(event, kv.BlockStored) and event.medium == medium


def _blocks(events: list[Any]) -> tuple[dict[int, list[int]], dict[int, int | None]]:
    """Per block hash: its tokens and its parent, from BlockStored events."""
    tokens: dict[int, list[int]] = {}
    parents: dict[int, int | None] = {}
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens[h] = list(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            parents[h] = parent
            parent = h
    return tokens, parents


# -- measured against truth: the consumer's index of L3 vs the page files ------------------

#: Conversations and turns of the multi-turn workload; the first BUILD turns fill
#: L3, the rest run after the evictor.
CONVERSATIONS, TURNS, BUILD = 8, 5, 3


def _index(sub: Subscriber, upto: int, removals: bool) -> set[int]:
    """The storage tier a consumer of ``sub``'s first ``upto`` events holds: blocks
    of ``BlockStored(DISK)``, less those of ``BlockRemoved(DISK)`` when ``removals``."""
    held: set[int] = set()
    for e in sub.events[:upto]:
        if getattr(e, "medium", None) not in ("DISK", "EXTERNAL"):
            continue
        if isinstance(e, kv.BlockStored):
            held.update(e.block_hashes)
        elif removals and isinstance(e, kv.BlockRemoved):
            held.difference_update(e.block_hashes)
    return held


@dataclass
class Point:
    """One sample: seconds since the eviction; per publisher the precision of its
    (instance, block) claims against the page files; recall of acknowledged blocks."""

    t: float
    ours: float
    belief: float
    recall: float
    stale_ours: int
    stale_belief: int


class Truth:
    """Samples the consumer's index of both servers against the L3 directory."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.subs = (pair.sub_a, pair.sub_b)
        self.t0 = time.monotonic()
        self.points: list[Point] = []

    def pages(self) -> set[int]:
        return {block_hash(n[:64]) for n in self.pair.a.l3_pages()}

    def sample(self, settled: bool = False) -> Point:
        for sub in self.subs:
            sub.pump()
        # One snapshot: the events received so far, then the files.
        upto = [len(sub.events) for sub in self.subs]
        ours = [_index(s, n, removals=True) for s, n in zip(self.subs, upto)]
        belief = [_index(s, n, removals=False) for s, n in zip(self.subs, upto)]
        held = self.pages()
        acked = set().union(*belief) & held  # files whose write an instance acknowledged

        def precision(index: list[set[int]]) -> tuple[float, int]:
            claims = sum(len(i) for i in index)
            stale = sum(len(i - held) for i in index)
            return (1.0 - stale / claims if claims else 1.0), stale

        p_ours, s_ours = precision(ours)
        p_belief, s_belief = precision(belief)
        recall = len(acked & set().union(*ours)) / len(acked) if acked else 1.0
        point = Point(time.monotonic() - self.t0, p_ours, p_belief, recall, s_ours, s_belief)
        if not settled:
            self.points.append(point)
        return point


def _chains(
    subs: tuple[Subscriber, ...], prompts: dict[int, tuple[int, ...]]
) -> dict[int, list[int]]:
    """Each conversation's page chain (block hashes from the root), read from the
    stored events: a block is known by its parent and its tokens."""
    by: dict[tuple[int | None, tuple[int, ...]], int] = {}
    for sub in subs:
        for e in sub.pump():
            if isinstance(e, kv.BlockStored) and e.medium == "DISK":
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    by[(parent, tuple(e.token_ids[i * PAGE : (i + 1) * PAGE]))] = h
                    parent = h
    out: dict[int, list[int]] = {}
    for c, prompt in prompts.items():
        chain: list[int] = []
        parent: int | None = None
        for j in range(len(prompt) // PAGE):
            h = by.get((parent, tuple(prompt[j * PAGE : (j + 1) * PAGE])))
            if h is None:
                break
            chain.append(h)
            parent = h
        out[c] = chain
    return out


def _quiet(pair: Pair) -> None:
    """Both servers' writes settled and their events received."""
    for srv in (pair.a, pair.b):
        srv.wait_writes_settled()
    for sub in (pair.sub_a, pair.sub_b):
        seen = -1
        while seen != len(sub.pump()):
            seen = len(sub.events)
            time.sleep(0.5)


def test_the_consumers_index_against_the_page_files(pair: Pair) -> None:
    """Issue 30 item 3, file backend: two servers over one L3, a multi-turn workload,
    then an outside evictor deletes page files.  Sampled over time, the consumer's
    index of the storage tier against the page files, for three publishers:
    SGLang's own events (no storage tier: recall 0), belief-only (our stores, no
    verified removals: what an emitter without verification publishes while its
    LRU forgets nothing) and ours.  Recall of acknowledged blocks stays 1.0, our
    precision is never below belief-only's and is back to >= 0.99 within the
    window the reconciler's configuration predicts; belief-only's is not."""
    a, b = pair.a, pair.b
    turns = conversation_requests(CONVERSATIONS, TURNS, salt="events-truth")
    served_at: dict[tuple[int, int], float] = {}  # (server, conversation) -> last done

    def serve(k: int, after: Truth | None = None) -> None:
        for t in turns:
            if t.turn != k:
                continue
            i = (t.conversation + k) % 2  # a router without the storage tier alternates
            (a, b)[i].generate(t.input_ids, max_new_tokens=1)
            served_at[(i, t.conversation)] = time.monotonic()
            if after is not None:
                after.sample()

    for k in range(BUILD):
        serve(k)
    _quiet(pair)
    truth = Truth(pair)
    built = truth.sample(settled=True)
    assert (built.ours, built.belief, built.recall) == (1.0, 1.0, 1.0), built

    # The evictor: the tail (second half) of every other conversation's chain.
    prompts = {t.conversation: t.input_ids for t in turns if t.turn == BUILD - 1}
    chains = _chains((pair.sub_a, pair.sub_b), prompts)
    assert all(len(chains[c]) >= len(prompts[c]) // PAGE - 1 for c in chains), chains
    names = {block_hash(n[:64]): n for n in a.l3_pages()}
    doomed = {h for c in range(0, CONVERSATIONS, 2) for h in chains[c][len(chains[c]) // 2 :]}
    truth.t0 = time.monotonic()
    for h in doomed:
        (pair.l3 / names[h]).unlink()
    evicted = truth.sample()
    assert evicted.ours < 0.9 and evicted.recall == 1.0, evicted

    # The workload goes on: every conversation served by each server once more.
    # (Stale claims end either in a verified BlockRemoved or in the page's rewrite.)
    before = {s: s.value(P + "reconciler_queries_total", absent_ok=True) for s in (a, b)}
    for k in range(BUILD, TURNS):
        serve(k, after=truth)
    looked_up = max(served_at.values()) - truth.t0
    # The window the reconciler's configuration predicts: with sampling_rate 1
    # every lookup is a candidate and, while verifications stay under
    # verifications_per_s, every candidate is verified; the verdict is applied
    # within one query (timeout_ms) and two agreements.  So a stale claim is
    # gone by its instance's next lookup through it + timeout_ms (+ 1 s for the
    # agreements, the publisher thread and this sampler); each instance looks up
    # every conversation once by ``looked_up``.
    window = looked_up + RECONCILER["timeout_ms"] / 1000.0 + 1.0
    time.sleep(max(0.0, truth.t0 + window - time.monotonic()))
    at_window = truth.sample()
    elapsed = time.monotonic() - truth.t0
    rates = {
        s.port: (s.value(P + "reconciler_queries_total", absent_ok=True) - before[s]) / elapsed
        for s in (a, b)
    }
    _quiet(pair)
    end = truth.sample(settled=True)

    # SGLang's own events: no storage-tier block at all (every DISK block on b's
    # stream is one our emitter published).
    sglang_storage = [
        h
        for e in pair.sub_b.pump()
        if isinstance(e, kv.BlockStored) and e.medium in ("DISK", "EXTERNAL")
        for h in e.block_hashes
    ]
    assert len(sglang_storage) == b.value(P + "events_published_blocks_total", kind="stored")
    # Belief-only is our stores without removals only while the LRU forgets nothing.
    assert a.value(P + "evictions_total") == b.value(P + "evictions_total") == 0
    sources = {
        src: sum(s.value(P + "events_removals_total", source=src) for s in (a, b))
        for src in ("reconciler", "hit_query")
    }
    delays = _removal_delays(pair, truth.t0, doomed)
    figures = {
        "evicted_pages": len(doomed),
        "looked_up_s": round(looked_up, 2),
        "window_s": round(window, 2),
        "first_ours_ge_0.99_s": next((round(p.t, 2) for p in truth.points if p.ours >= 0.99), None),
        "min_precision": {
            "ours": round(min(p.ours for p in truth.points), 3),
            "belief": round(min(p.belief for p in truth.points), 3),
        },
        "at_window": at_window,
        "end": end,
        "recall_min_sampled": round(min(p.recall for p in truth.points), 3),
        "removals": sources,
        "delay_s": delays,
        "verifications_per_s": rates,
    }
    print("events-truth", json.dumps(figures, default=lambda o: o.__dict__))

    for p in truth.points:
        assert p.ours >= p.belief, (p, truth.points)
    assert end.recall == 1.0, end
    assert at_window.ours >= 0.99, (window, truth.points)
    assert end.ours == 1.0 and end.stale_ours == 0, end
    assert end.belief < 0.99, end  # stale claims only a verification removes
    assert sources["reconciler"] > 0, sources
    # The window's premise: verifications stayed under the budget.
    assert all(r < RECONCILER["verifications_per_s"] for r in rates.values()), rates


def _removal_delays(pair: Pair, t0: float, doomed: set[int]) -> dict[str, float | int]:
    """Seconds from the eviction to each BlockRemoved of an evicted block."""
    delays = [
        at - t0
        for sub in (pair.sub_a, pair.sub_b)
        for e, at in zip(sub.pump(), sub.arrived)
        if isinstance(e, kv.BlockRemoved) and at >= t0
        for h in e.block_hashes
        if h in doomed
    ]
    if not delays:
        return {"blocks": 0}
    delays.sort()
    return {
        "blocks": len(delays),
        "median": round(delays[len(delays) // 2], 2),
        "max": round(delays[-1], 2),
    }
