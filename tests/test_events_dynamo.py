"""Routers and indexers written by someone else read the storage-tier events,
fed the way Dynamo feeds them from an SGLang engine: their own ZeroMQ listener
subscribed to the engine's publisher, decoding SGLang's ``KVEventBatch`` itself.

- NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from
  ``ai-dynamo-runtime``, ``--workers id=tcp://host:port``): its HTTP ``/query``
  answers, per instance, how many tokens of a prompt each tier holds (``gpu``,
  ``cpu``, ``disk``) and the longest match.  Dynamo 1.6.1 counts both storage media
  (``DISK``, ``EXTERNAL``) in its ``disk`` tier; the indexer's own ``scores`` count
  the device tier only.
- Dynamo's KV router, as its runtime-free selection service (``python -m
  dynamo.select_service``: the router's worker selection and load accounting over
  HTTP, the workers registered with their KV-event endpoints): its cost per worker
  credits a prompt's storage-tier blocks at ``disk_cache_hit_weight`` (0.25 by
  default), so the events change which instance it chooses.
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


class _Service:
    """A Dynamo HTTP service in a subprocess on a free port, up when ``/health``
    (or the subclass's ``ready``) answers."""

    def __init__(self, module: str, argv: list[str]) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *argv, "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{module} exited: {self.process.stderr.read()!r}")  # type: ignore[union-attr]
            try:
                self.ready()
                return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"{module} did not answer")

    def ready(self) -> None:
        self.call("GET", "/health")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read() or b"null")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


class Indexer(_Service):
    """Dynamo's standalone KV indexer in a subprocess, subscribed to ``workers``."""

    def __init__(self, workers: dict[int, str]) -> None:
        spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
        super().__init__("dynamo.indexer", ["--workers", spec, "--block-size", str(PAGE)])

    def ready(self) -> None:
        self.query([1, 2, 3, 4])

    def query(self, tokens: list[int]) -> dict[str, Any]:
        answer: dict[str, Any] = self.call(
            "POST", "/query", {"token_ids": tokens, "model_name": "default"}
        )
        return answer

    def disk_tokens(self, tokens: list[int]) -> dict[str, int]:
        return {wid: tier["disk"] for wid, tier in self.query(tokens)["instances"].items()}


class Router(_Service):
    """Dynamo's KV router as its selection service, the ``workers`` registered with
    their KV-event endpoints (it subscribes to each with its own ZeroMQ listener)."""

    MODEL = "hx"

    def __init__(self, workers: dict[int, str]) -> None:
        super().__init__("dynamo.select_service", [])
        try:
            for wid, endpoint in workers.items():
                self.call(
                    "POST",
                    "/workers",
                    {
                        "worker_id": wid,
                        "model_name": self.MODEL,
                        "endpoint": f"http://127.0.0.1:{free_port()}",
                        "block_size": PAGE,
                        "kv_events_endpoints": {"0": endpoint},
                    },
                )
        except BaseException:
            self.close()
            raise

    def select(self, tokens: list[int]) -> dict[str, Any]:
        """The worker the router would send ``tokens`` to (nothing booked)."""
        choice: dict[str, Any] = self.call(
            "POST", "/select", {"model_name": self.MODEL, "token_ids": tokens}
        )
        return choice

    def disk_blocks(self, tokens: list[int]) -> dict[int, int]:
        """The prompt's blocks the router's index holds in each worker's disk tier."""
        answer = self.call(
            "POST", "/overlap_scores", {"model_name": self.MODEL, "token_ids": tokens}
        )
        return {w["worker_id"]: w["disk_blocks"] for w in answer["workers"]}

    def book(self, wid: int, tokens: list[int]) -> None:
        """Book a request of ``tokens`` on worker ``wid`` (its load goes up)."""
        self.call(
            "POST",
            "/reservations",
            {
                "selection_id": f"load-{wid}-{len(tokens)}",
                "model_name": self.MODEL,
                "worker_id": wid,
                "dp_rank": 0,
                "token_ids": tokens,
                "isl_tokens": len(tokens),
            },
        )


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


def _instances(endpoints: dict[int, str], cap: int) -> tuple[list[em.KvEvents], list[Any]]:
    """Instance 1 (file backend: DISK) and 2 (Mooncake: EXTERNAL), each a cache of
    ``cap`` entries whose observer publishes on that instance's endpoint."""
    emitters, caches = [], []
    for wid, medium in ((1, "DISK"), (2, "EXTERNAL")):
        sink = ZmqSink(endpoints[wid])
        events = em.KvEvents(lambda sink=sink: sink, medium=medium)
        assert events.start()
        emitters.append(events)
        caches.append(StorageExistenceCache(cap, observer=Tee(events)))
    return emitters, caches


def test_dynamo_indexes_stores_and_verified_removals(endpoints: dict[int, str]) -> None:
    """Dynamo's indexer, subscribed to two instances publishing storage-tier events
    (file backend: DISK; Mooncake: EXTERNAL), counts the acknowledged blocks in its
    disk tier; a verified removal shortens the match; the LRU forgetting beliefs
    does not."""
    emitters, caches = _instances(endpoints, cap=2)
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


def test_dynamo_router_chooses_the_instance_whose_l3_holds_the_prefix(
    endpoints: dict[int, str],
) -> None:
    """Dynamo's KV router credits the storage-tier blocks our events publish:
    instance 1, a little busier, is not chosen while nothing tells the router what
    its L3 holds; once it acknowledges the prompt's pages (DISK) the router sends
    the prompt there; an EXTERNAL prefix on instance 2 is credited too, and after a
    verified removal on instance 1 the router goes back to instance 2."""
    emitters, caches = _instances(endpoints, cap=64)
    router = Router(endpoints)
    try:
        n = 16
        pages = [hashlib.sha256(f"prompt{i}".encode()).hexdigest() for i in range(n)]
        tokens = list(range(1000, 1000 + n * PAGE))
        blocks: list[em.Block] = [
            (page, pages[i - 1] if i else None, tokens[i * PAGE : (i + 1) * PAGE])
            for i, page in enumerate(pages)
        ]
        # Instance 1 serves another request: 2 blocks more load, so the choice
        # without storage-tier knowledge is instance 2, not a coin toss between equals.
        router.book(1, list(range(5000, 5000 + 2 * PAGE)))

        # Events off (nothing published): no credit, the less loaded instance wins.
        choice = router.select(tokens)
        assert (choice["worker_id"], choice["overlap"]["disk"]) == (2, 0)
        assert choice["effective_prefill_tokens"] == n * PAGE

        # Instance 1's L3 acknowledges the whole prompt (file backend: DISK).
        assert _publish_until(router, emitters[0], caches[0], blocks, tokens, {1: n, 2: 0})
        choice = router.select(tokens)
        assert (choice["worker_id"], choice["overlap"]["disk"]) == (1, n * PAGE)
        # Its cost: the prompt less 0.25 (disk_cache_hit_weight) of each disk block.
        assert choice["effective_prefill_tokens"] == n * PAGE - n * PAGE // 4

        # Instance 2's L3 acknowledges the first 4 pages (Mooncake: EXTERNAL), credited
        # as disk too; 16 disk blocks less 2 blocks of load still win over 4.
        assert _publish_until(router, emitters[1], caches[1], blocks[:4], tokens, {1: n, 2: 4})
        assert router.select(tokens)["worker_id"] == 1

        # A prefetch hit query on instance 1 finds pages[2] gone: the verified removal
        # leaves it 2 disk blocks, and the router goes back to instance 2.
        caches[0].pool("kv").invalidate_beyond(pages, 2)
        assert until(lambda: router.disk_blocks(tokens) == {1: 2, 2: 4})
        choice = router.select(tokens)
        assert (choice["worker_id"], choice["overlap"]["disk"]) == (2, 4 * PAGE)
    finally:
        router.close()
        for events in emitters:
            events.close()


def _publish_until(
    router: Router,
    events: em.KvEvents,
    cache: Any,
    blocks: list[em.Block],
    tokens: list[int],
    expected: dict[int, int],
) -> bool:
    """Acknowledge ``blocks`` on one instance until the router's index shows
    ``expected`` disk blocks of ``tokens`` per worker: stores may race the subscription
    (ZeroMQ's slow joiner), so each round removes them first (a verdict), which
    makes the next acknowledgement publish again."""
    pages = [page for page, _, _ in blocks]

    def seen() -> bool:
        return router.disk_blocks(tokens) == expected

    def again() -> bool:
        cache.pool("kv").invalidate_beyond(pages, 0)
        events.stored(blocks)
        return until(seen, timeout_s=0.5)

    return until(lambda: seen() or again())
