"""Storage-tier KV events from a real SGLang server, read with sglang's own classes.

A real CPU ``sglang.launch_server`` (buffer mode, file backend, 16-token pages) with
``events.enabled`` and the package's own publisher on a loopback port; a ZeroMQ
subscriber decodes every message with sglang's ``KVEventBatch``.  A (24 pages, above
the 256-token prefetch threshold) is served: when its write is acknowledged the
subscriber has one ``BlockStored`` per page file in L3, with A's tokens, chained
from the root, medium ``DISK``.  The page files are then deleted behind the server's
back and A + B served after ``/flush_cache``: its prefetch hit query finds nothing,
which removes A's 24 blocks (source ``hit_query``), and its own write publishes the
32 pages again.  The series agree with what the subscriber saw.

With ``--kv-events-config`` (a second server) the same events ride SGLang's own
publisher: one sequence with its device events, and every ``DISK`` block is a block
SGLang's own ``GPU`` events stored, with the same tokens and parent: a consumer joins
the tiers on the block hash.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Server, ServerSpec, block_tokens_for, free_port, launch, poll

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
    """Every batch the server publishes, decoded by sglang's ``KVEventBatch``."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
        self.events: list[Any] = []
        self.seqs: list[int] = []

    def pump(self) -> list[Any]:
        while self.socket.poll(50):
            _topic, seq, payload = self.socket.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self.decoder.decode(payload).events)
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


@contextlib.contextmanager
def served(workdir: Path, sglang_stream: bool) -> Iterator[tuple[Server, Subscriber]]:
    """A server publishing storage-tier events on the package's own socket, or
    (``sglang_stream``) on SGLang's ``--kv-events-config`` publisher; a subscriber."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(endpoint)  # connects before the server binds: ZeroMQ retries
    events: dict[str, Any] = {"enabled": True}
    extra: tuple[str, ...] = ()
    if sglang_stream:
        extra = (
            "--kv-events-config",
            json.dumps({"publisher": "zmq", "endpoint": endpoint, "bind": True}),
        )
    else:
        events["endpoint"] = endpoint
    config = {"events": events, "metrics": {"flush_interval_s": 0.25}}
    try:
        with launch(ServerSpec(config=config, extra_args=extra), workdir / "server") as srv:
            time.sleep(0.5)  # the subscription reaches the bound socket
            yield srv, sub
    finally:
        sub.close()


def test_stores_at_the_ack_and_removals_on_a_verified_absence(tmp_path: Path) -> None:
    """Stored blocks are exactly L3's page files, with their tokens and chain;
    deleted files are removed by the next hit query, then stored again."""
    with served(tmp_path, sglang_stream=False) as (srv, sub):
        _stores_and_removals(srv, sub)


def _stores_and_removals(srv: Server, sub: Subscriber) -> None:
    a = block_tokens_for(1, PAGE * 24, salt="events")
    b = block_tokens_for(2, PAGE * 8, salt="events")
    srv.generate(a, max_new_tokens=1)
    srv.wait_writes_settled()
    written = files(srv)
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
        (srv.l3_dir / name).unlink()
    srv.flush_cache()
    srv.generate(a + b, max_new_tokens=1)
    srv.wait_writes_settled()
    poll(lambda: len(sub.blocks(kv.BlockStored)) >= 24 + 32)
    removed = sub.blocks(kv.BlockRemoved)
    assert sorted(removed) == sorted(map(block_hash, written))
    assert {e.medium for e in sub.pump() if isinstance(e, kv.BlockRemoved)} == {"DISK"}
    again = sub.blocks(kv.BlockStored)[24:]
    assert sorted(again) == sorted(map(block_hash, files(srv)))
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


def test_on_sglangs_stream_the_tiers_join(tmp_path: Path) -> None:
    """With --kv-events-config the storage-tier events ride SGLang's own stream
    (one sequence with its device events) and every DISK block is a block SGLang's
    own GPU events stored, with the same tokens and parent."""
    with served(tmp_path, sglang_stream=True) as (srv, sub):
        a = block_tokens_for(3, PAGE * 24, salt="events-join")
        srv.generate(a, max_new_tokens=1)
        srv.wait_writes_settled()
        written = files(srv)
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
