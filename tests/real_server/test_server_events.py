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
ours (``test_the_consumers_index_against_the_page_files``; docs/kv-events.md; the
measurement is ``events_truth.py``'s, shared with the Mooncake test).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from events_truth import (
    CONVERSATIONS,
    OWN,
    PAGE,
    P,
    Point,
    Streams,
    Subscriber,
    block_hash,
    kv,
    measure,
)
from harness import (
    Server,
    ServerSpec,
    block_tokens_for,
    launch_together,
    poll,
)

pytestmark = [pytest.mark.real_server]


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
    streams = Streams()
    metrics = {"flush_interval_s": 0.25}
    specs = [
        ServerSpec(
            config={
                "events": {"enabled": True, "endpoint": OWN},
                "metrics": metrics,
                "reconciler": RECONCILER,
            },
            l3_dir=l3,
        ),
        ServerSpec(
            config={"events": {"enabled": True}, "metrics": metrics, "reconciler": RECONCILER},
            l3_dir=l3,
            extra_args=streams.sglang_args(),
        ),
    ]
    try:
        with launch_together(specs, workdir) as (a, b):
            sub_a, sub_b = streams.connect(a, b)
            yield Pair(a, b, sub_a, sub_b, l3)
    finally:
        streams.close()


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


def test_the_consumers_index_against_the_page_files(pair: Pair) -> None:
    """Issue 30 item 3, file backend: two servers over one L3, a multi-turn workload,
    then an outside evictor deletes page files.  Sampled over time, the consumer's
    index of the storage tier against the page files, for three publishers:
    SGLang's own events (no storage tier: recall 0), belief-only (our stores, no
    verified removals: what an emitter without verification publishes while its
    LRU forgets nothing) and ours.  Recall of acknowledged blocks stays 1.0, no
    removal of ours took out a block a lookup could still reach (our precision is below
    belief-only's only while a rewrite's stored event is on its way), and ours is
    back to >= 0.99 within the window the reconciler's configuration predicts;
    belief-only's is not."""
    a, b = pair.a, pair.b

    def pages() -> set[int]:
        return {block_hash(n[:64]) for n in a.l3_pages()}

    def built_ok(built: Point) -> None:
        assert (built.ours, built.belief, built.recall) == (1.0, 1.0, 1.0), built

    def evict(chains: dict[int, list[int]]) -> set[int]:
        """The evictor: the tail (second half) of every other conversation's chain."""
        names = {block_hash(n[:64]): n for n in a.l3_pages()}
        doomed = {h for c in range(0, CONVERSATIONS, 2) for h in chains[c][len(chains[c]) // 2 :]}
        for h in doomed:
            (pair.l3 / names[h]).unlink()
        return doomed

    m = measure(
        (a, b),
        (pair.sub_a, pair.sub_b),
        pages,
        evict,
        RECONCILER["timeout_ms"],
        salt="events-truth",
        check_built=built_ok,
    )
    evicted, at_window, end, sources = m.evicted, m.at_window, m.end, m.sources
    assert evicted.ours < 0.9 and evicted.recall == 1.0, evicted
    # SGLang's own events: no storage-tier block at all (every DISK block on b's
    # stream is one our emitter published).
    assert len(m.storage_blocks_b) == b.value(P + "events_published_blocks_total", kind="stored")
    # Belief-only is our stores without removals only while the LRU forgets nothing.
    assert a.value(P + "evictions_total") == b.value(P + "evictions_total") == 0
    print("events-truth", json.dumps(m.figures(), default=lambda o: o.__dict__))

    # Ours is belief-only less its removals: below it only where a removal took out a
    # block L3 holds, which must be one a rewrite undid (its stored event then on its
    # way), never a block a lookup could still reach.
    unexplained = m.truth.unexplained_removals(m.doomed)
    if unexplained:
        print("events-truth-unexplained", m.truth.report(unexplained))
    assert not unexplained, f"{len(unexplained)} removals unexplained (printed above)"
    assert end.recall == 1.0, end
    assert at_window.ours >= 0.99, (m.window, m.truth.points)
    assert end.ours == 1.0 and end.stale_ours == 0, end
    assert end.belief < 0.99, end  # stale claims only a verification removes
    assert sources["reconciler"] > 0, sources
    # The window's premise: verifications stayed under the budget.
    assert all(r < RECONCILER["verifications_per_s"] for r in m.rates.values()), m.rates
