"""Storage-tier KV events against the installed sglang: its own event classes decode
what the package publishes, its own recorder gives the same blocks for the same node,
and its own ZeroMQ publisher carries the events on SGLang's stream.

Real parts: sglang's ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` (msgspec),
its ``KVCacheEventRecorder``, ``TreeNode``, ``RadixKey``, ``BufferBackupSnapshot`` and
``ZmqEventPublisher``; real ZeroMQ sockets on loopback.
"""

from __future__ import annotations

import errno
import logging
import time
from array import array
from types import SimpleNamespace as NS
from typing import Any

import pytest

from hicache_existence.config import Config
from hicache_existence.events import emitter as em
from hicache_existence.events.wire import Removed, Stored, encode_batch
from hicache_existence.events.zmq_sink import ZmqSink
from hicache_existence.integrations.sglang import kv_events

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

PAGE = 4


class Subscriber:
    """A SUB socket decoding every message with sglang's own ``KVEventBatch``."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
        time.sleep(0.3)  # the subscription reaches the publisher (ZeroMQ's slow joiner)

    def receive(self, n: int, timeout_s: float = 10.0) -> list[tuple[int, Any, bytes]]:
        out = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            if self.socket.poll(100):
                _topic, seq, payload = self.socket.recv_multipart()
                out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload), payload))
        return out

    def close(self) -> None:
        self.socket.close(linger=0)


def tree(tokens_per_node: list[int]) -> list[Any]:
    """A path of sglang ``TreeNode``s under a root, hashed as sglang hashes them."""
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
    from sglang.srt.mem_cache.utils import compute_node_hash_values

    root = TreeNode()
    root.key = RadixKey(array("q"))
    root.hash_value = []
    nodes, parent, start = [], root, 1000
    for n in tokens_per_node:
        node = TreeNode()
        node.key = RadixKey(array("q", range(start, start + n)))
        node.parent = parent
        node.hash_value = compute_node_hash_values(node, PAGE)
        nodes.append(node)
        parent, start = node, start + n
    return nodes


def intent_of(node: Any, extra_key: str | None = None) -> Any:
    """The write intent of a buffer-mode backup of ``node`` (sglang's snapshot)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
        BufferBackupSnapshot,
    )

    parent = node.parent
    is_root = parent.parent is None
    snapshot = BufferBackupSnapshot(
        node_id=node.id,
        parent_node_id=parent.id,
        parent_is_root=is_root,
        parent_last_hash=None if is_root else parent.hash_value[-1],
        hash_values=list(node.hash_value),
        key=RadixKey(array("q", node.key.token_ids), extra_key=extra_key),
        prefix_keys=None,
    )
    return NS(snapshot=snapshot)


class Capture:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def send(self, ts: float, events: Any) -> None:
        self.events.extend(events)

    def close(self) -> None:
        pass


def test_sglang_decodes_what_the_package_publishes() -> None:
    """sglang's own KVEventBatch decodes the package's publisher's messages: the
    event classes, every field, the medium, the DP rank and consecutive sequence
    numbers; the bytes equal sglang's own encoding of the same batch."""
    sink = ZmqSink("tcp://127.0.0.1:*")
    events = em.KvEvents(lambda: sink, medium="EXTERNAL")
    sub = Subscriber(sink.where)
    try:
        assert events.start()
        events.stored([("ab" * 32, None, [1, 2, 3, 4]), ("cd" * 32, "ab" * 32, [5, 6, 7, 8])])
        time.sleep(0.2)
        events.invalidated("kv", ["ab" * 32, "cd" * 32], 1)
        got = sub.receive(2)
    finally:
        events.close()
        sub.close()
    assert [seq for seq, _, _ in got] == [0, 1]
    (stored,), (removed,) = (batch.events for _, batch, _ in got)
    assert isinstance(stored, kv.BlockStored) and isinstance(removed, kv.BlockRemoved)
    h1, h2 = int("ab" * 8, 16) - (1 << 64), int("cd" * 8, 16) - (1 << 64)
    assert stored.block_hashes == [h1, h2]
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (stored.block_size, stored.lora_id, stored.medium) == (PAGE, None, "EXTERNAL")
    assert removed.block_hashes == [h2] and removed.medium == kv.StorageMedium.EXTERNAL
    assert got[0][1].attn_dp_rank == 0
    ours = encode_batch(got[0][1].ts, [Stored((h1, h2), None, tuple(range(1, 9)), PAGE, "DISK")], 2)
    theirs = kv.KVEventBatch(
        ts=got[0][1].ts,
        events=[
            kv.BlockStored(
                block_hashes=[h1, h2],
                parent_block_hash=None,
                token_ids=list(range(1, 9)),
                block_size=PAGE,
                lora_id=None,
                medium=kv.StorageMedium.DISK,
            )
        ],
        attn_dp_rank=2,
    )
    assert ours == msgspec.msgpack.Encoder().encode(theirs)
    removal = kv.KVEventBatch(
        ts=1.5, events=[kv.BlockRemoved(block_hashes=[-1, 7], medium="DISK")], attn_dp_rank=None
    )
    assert encode_batch(1.5, [Removed((-1, 7), "DISK")], None) == msgspec.msgpack.Encoder().encode(
        removal
    )


def test_acknowledged_blocks_join_sglangs_own_events() -> None:
    """For the same tree node, the blocks of its acknowledged L3 write carry exactly
    the block hashes, parent hash and token ids of sglang's own BlockStored (so a
    consumer joins the tiers); only the stored leading pages are published."""
    parent, node = tree([8, 12])
    recorder = kv_events_recorder()
    recorder.record_store(node, medium=kv.StorageMedium.CPU)
    (theirs,) = recorder.take()
    sink = Capture()
    events = em.KvEvents(lambda: sink, medium="DISK")
    assert events.start()
    kv_events.feed(events, intent_of(node), node.hash_value, 3)
    kv_events.feed(events, intent_of(parent), parent.hash_value, 2)
    events.close()
    ours, first = sink.events
    assert isinstance(ours, Stored) and isinstance(first, Stored)
    assert list(ours.block_hashes) == theirs.block_hashes
    assert ours.parent_block_hash == theirs.parent_block_hash is not None
    assert list(ours.token_ids) == theirs.token_ids
    assert ours.block_size == theirs.block_size == PAGE
    assert first.parent_block_hash is None  # under the root, as sglang's
    assert events.snapshot().published["stored"] == 5
    part = Capture()
    events = em.KvEvents(lambda: part, medium="DISK")
    assert events.start()
    kv_events.feed(events, intent_of(node), node.hash_value, 1)
    events.close()
    assert [list(e.block_hashes) for e in part.events] == [theirs.block_hashes[:1]]


def test_a_namespaced_page_gives_no_event_and_is_counted() -> None:
    """A node keyed in a namespace (its event hashes are not its storage hashes):
    no event, every stored page counted as unknown."""
    (node,) = tree([8])
    sink = Capture()
    events = em.KvEvents(lambda: sink, medium="DISK")
    assert events.start()
    kv_events.feed(events, intent_of(node, extra_key="tenant-a"), node.hash_value, 2)
    events.close()
    assert sink.events == []
    assert events.snapshot().unknown == 2


def kv_events_recorder() -> Any:
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    return KVCacheEventRecorder(enabled=True, page_size=PAGE)


def test_events_ride_sglangs_own_publisher() -> None:
    """With SGLang's publisher found (the init_kv_events hook), the storage-tier
    events go on its stream: one sequence with its own device events."""
    publisher = kv.EventPublisherFactory.create(
        '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "bind": true}', 0
    )
    kv_events.after_init_kv_events(
        None, NS(enable_kv_cache_events=True, kv_event_publisher=publisher)
    )
    endpoint = publisher._local_pub_endpoint
    sub = Subscriber(endpoint)
    events = em.KvEvents(kv_events.SglangSink, medium="DISK")
    try:
        publisher.publish(
            kv.KVEventBatch(ts=1.0, events=[kv.BlockRemoved(block_hashes=[9], medium="GPU")])
        )
        assert events.start()
        events.stored([("ef" * 32, None, [1, 2, 3, 4])])
        got = sub.receive(2)
    finally:
        events.close()
        sub.close()
        publisher.shutdown()
        kv_events._PUBLISHER.clear()
    assert [seq for seq, _, _ in got] == [0, 1]
    device, storage = (batch.events[0] for _, batch, _ in got)
    assert device.medium == "GPU"
    assert isinstance(storage, kv.BlockStored) and storage.medium == "DISK"
    assert got[1][1].attn_dp_rank == 0
    assert events.snapshot().published["stored"] == 1


def test_without_sglangs_publisher_the_batch_is_a_send_error() -> None:
    """SGLang's stream chosen but its publisher never found: counted, not raised."""
    kv_events._PUBLISHER.clear()
    events = em.KvEvents(kv_events.SglangSink, medium="DISK")
    assert events.start()
    events.stored([("ef" * 32, None, [1, 2, 3, 4])])
    events.close()
    assert events.snapshot().dropped["send_error"] == 1


def test_an_endpoint_that_cannot_bind_warns_once_and_runs_without_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The package's own endpoint is taken: one warning naming it, no emitter
    thread, and the write path's calls do nothing."""
    taken = ZmqSink("tcp://127.0.0.1:*")
    try:
        section = Config.from_mapping({"events": {"enabled": True, "endpoint": taken.where}}).events
        events = em.from_config(section, em.Placement(True, 0, "file"))
        assert events is not None
        with caplog.at_level(logging.WARNING):
            assert not events.start()
            events.stored([("ef" * 32, None, [1, 2, 3, 4])])
    finally:
        taken.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and taken.where in warnings[0].getMessage()
    assert not events.running and events.snapshot().blocks == 0


def test_where_names_the_bound_endpoint_or_sglangs_stream_or_off() -> None:
    """The start-up line's ``events=``: the endpoint actually bound (port 0
    resolved), SGLang's stream, or ``off`` once the sink could not be opened."""
    own = em.KvEvents(lambda: ZmqSink("tcp://127.0.0.1:0"), medium="DISK")
    assert own.where == "off"  # not started
    assert own.start()
    try:
        host, port = own.where.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        own.close()
    theirs = em.KvEvents(kv_events.SglangSink, medium="DISK")
    assert theirs.start()
    theirs.close()
    assert "--kv-events-config" in kv_events.SglangSink.where
    failing = em.KvEvents(lambda: None, medium="DISK")
    assert not failing.start() and failing.where == "off"


@pytest.mark.parametrize("port", ["0", "*"])
def test_a_port_of_the_systems_choosing_is_not_offset(port: str) -> None:
    """DP rank 1 of ``tcp://127.0.0.1:0`` binds a port of its own, not port 1."""
    sink = ZmqSink(f"tcp://127.0.0.1:{port}", dp_rank=1)
    try:
        assert sink.endpoint == f"tcp://127.0.0.1:{port}"
        assert int(sink.where.rsplit(":", 1)[1]) > 1024
    finally:
        sink.close()


def test_own_publisher_offsets_its_port_by_dp_rank() -> None:
    """DP rank r publishes on the endpoint's port + r, tagged r, as sglang's own."""
    for _ in range(20):  # port + 1 may belong to another process: try another base
        base = ZmqSink("tcp://127.0.0.1:*")
        port = int(base.where.rsplit(":", 1)[1])
        base.close()
        try:
            sink = ZmqSink(f"tcp://127.0.0.1:{port}", dp_rank=1)
            break
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    else:
        pytest.fail("no free pair of adjacent ports in 20 tries")
    sub = Subscriber(f"tcp://127.0.0.1:{port + 1}")
    try:
        sink.send(2.0, [Removed((5,), "DISK")])
        ((_, batch, _),) = sub.receive(1)
    finally:
        sub.close()
        sink.close()
    assert sink.where.endswith(f":{port + 1}") and batch.attn_dp_rank == 1
