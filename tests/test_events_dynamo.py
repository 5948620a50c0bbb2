"""A router-side index written by someone else reads the storage-tier events:
NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from
``ai-dynamo-runtime``), fed the way Dynamo feeds it from an SGLang engine: its own
ZeroMQ listener subscribed to the engine's publisher (``--workers
id=tcp://host:port``), decoding SGLang's ``KVEventBatch`` itself.  Its HTTP
``/query`` answers, per instance, how many tokens of a prompt each tier holds
(``gpu``, ``cpu``, ``disk``) and the longest match.

Dynamo 1.6.1 counts both storage media (``DISK``, ``EXTERNAL``) in its ``disk`` tier;
its ``scores`` (what its router weighs) count the device tier only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.observers import Tee
from hicache_existence.events import emitter as em
from hicache_existence.events.zmq_sink import ZmqSink

pytest.importorskip("dynamo.llm")

PAGE = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Indexer:
    """Dynamo's standalone KV indexer in a subprocess, subscribed to ``workers``."""

    def __init__(self, workers: dict[int, str]) -> None:
        self.port = free_port()
        spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
        argv = ["--workers", spec, "--block-size", str(PAGE), "--port", str(self.port)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", *argv, "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited: {self.process.stderr.read()!r}")  # type: ignore[union-attr]
            try:
                self.query([1, 2, 3, 4])
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("dynamo.indexer did not answer")

    def query(self, tokens: list[int]) -> dict[str, Any]:
        body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/query",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer

    def disk_tokens(self, tokens: list[int]) -> dict[str, int]:
        return {wid: tier["disk"] for wid, tier in self.query(tokens)["instances"].items()}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def endpoints() -> Iterator[dict[int, str]]:
    yield {1: f"tcp://127.0.0.1:{free_port()}", 2: f"tcp://127.0.0.1:{free_port()}"}


def test_dynamo_indexes_stores_and_verified_removals(endpoints: dict[int, str]) -> None:
    """Dynamo's indexer, subscribed to two instances publishing storage-tier events
    (file backend: DISK; Mooncake: EXTERNAL), counts the acknowledged blocks in its
    disk tier; a verified removal shortens the match; the LRU forgetting beliefs
    does not."""
    emitters, caches = [], []
    for wid, medium in ((1, "DISK"), (2, "EXTERNAL")):
        sink = ZmqSink(endpoints[wid])
        events = em.KvEvents(lambda sink=sink: sink, medium=medium)
        assert events.start()
        emitters.append(events)
        caches.append(StorageExistenceCache(2, observer=Tee(events)))
    indexer = Indexer(endpoints)
    try:
        pages = [hashlib.sha256(f"page{i}".encode()).hexdigest() for i in range(3)]
        tokens = list(range(100, 100 + 3 * PAGE))
        blocks: list[em.Block] = [
            (page, pages[i - 1] if i else None, tokens[i * PAGE : (i + 1) * PAGE])
            for i, page in enumerate(pages)
        ]
        # Stores may race the subscription (ZeroMQ's slow joiner): publish until seen,
        # as a removal and a second acknowledgement after it would.
        assert until(lambda: _store(emitters, caches, blocks) or _seen(indexer, tokens, 12))
        caches[0].pool("kv").add(pages)  # cap 2: the LRU forgets a belief
        time.sleep(0.5)
        assert indexer.disk_tokens(tokens) == {"1": 12, "2": 12}
        before = emitters[0].snapshot().removals["hit_query"]
        caches[0].pool("kv").invalidate_beyond(pages, 1)  # a verdict: pages[1] is gone
        assert until(lambda: indexer.disk_tokens(tokens) == {"1": 4, "2": 12})
        assert indexer.query(tokens)["instances"]["1"]["longest_matched"] == 4
        assert indexer.query(tokens)["scores"] == {}  # no device-tier block anywhere
        assert emitters[0].snapshot().removals["hit_query"] == before + 2
    finally:
        indexer.close()
        for events in emitters:
            events.close()


def _store(emitters: list[em.KvEvents], caches: list[Any], blocks: list[em.Block]) -> bool:
    """Acknowledge ``blocks`` on every instance (again: a removal first, so the
    second acknowledgement is published too)."""
    pages = [page for page, _, _ in blocks]
    for events, cache in zip(emitters, caches):
        cache.pool("kv").invalidate_beyond(pages, 0)
        events.stored(blocks)
    time.sleep(0.3)
    return False


def _seen(indexer: Indexer, tokens: list[int], n: int) -> bool:
    return indexer.disk_tokens(tokens) == {"1": n, "2": n}
