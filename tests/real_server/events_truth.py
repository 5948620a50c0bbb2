"""The consumer's index of the storage tier, measured against what L3 holds.

Shared by the real-server event tests of each L3 backend (issue 30 item 3): the
file backend (``test_server_events.py``, truth: the page files) and Mooncake
(``test_server_events_mooncake.py``, truth: the master's keys).  Two prefill
servers, each with a ZeroMQ subscriber decoding its events with sglang's own
``KVEventBatch``; a multi-turn workload builds L3, an evictor the test supplies
removes pages behind the servers' backs, the workload goes on, and the index a
consumer of each publisher builds is sampled against ``held()``, the backend's
truth: precision of the (instance, block) claims, recall of acknowledged blocks,
and the delay from the eviction to each ``BlockRemoved``.  Only the evictor and
the truth differ per backend; everything measured is computed here once.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from harness import Server, conversation_requests, free_port

from hicache_existence.integrations.sglang.kv_events import SglangSink

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

PAGE = 16
P = "hicache_existence_"
#: Conversations and turns of the multi-turn workload; the first BUILD turns fill
#: L3, the rest run after the evictor.
CONVERSATIONS, TURNS, BUILD = 8, 5, 3
STORAGE_MEDIA = ("DISK", "EXTERNAL")


def block_hash(page: str) -> int:
    """SGLang's event hash of a page: the first 64 bits of its SHA-256 hex, signed."""
    value = int(page[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


class Subscriber:
    """Every batch the server publishes, decoded by sglang's ``KVEventBatch``, with
    the time (monotonic) each event arrived."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        # Watched from before the connect: ``await_streams`` waits for the handshake.
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.handshakes = 0
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

    def connected(self) -> bool:
        """Whether a ZeroMQ handshake with the publisher ever succeeded."""
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.handshakes += 1
        return self.handshakes > 0

    def summary(self) -> dict[str, Any]:
        """What this subscriber received: for a failure message."""
        stored = [e for e in self.events if isinstance(e, kv.BlockStored)]
        return {
            "endpoint": self.endpoint,
            "handshakes": self.handshakes,
            "batches": len(self.seqs),
            "first_seqs": self.seqs[:3],
            "seq_gaps": sum(1 for x, y in zip(self.seqs, self.seqs[1:]) if y != x + 1),
            "events": len(self.events),
            "stored_by_medium": {
                m: sum(1 for e in stored if e.medium == m) for m in {e.medium for e in stored}
            },
        }

    def blocks(self, kind: type) -> list[int]:
        return [h for e in self.pump() if isinstance(e, kind) for h in e.block_hashes]

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


#: What our package logs when its publisher cannot bind (``zmq_sink.ZmqSink.open``).
EVENTS_OFF = "KV events off"


def published_at(srv: Server) -> str:
    """Where ``srv`` publishes its storage-tier events: the ``events=`` of its
    start-up line (with port 0 in ``events.endpoint``, the port it bound)."""
    log = srv.launch_log()
    off = [line for line in log.splitlines() if EVENTS_OFF in line]
    assert not off, f"{srv.url}: its events publisher is off:\n" + "\n".join(off)
    found = set(re.findall(r" events=([^,]+), facts from", log))
    assert len(found) == 1 and "off" not in found, (srv.url, found)
    return found.pop()


def await_streams(subs: Sequence[Subscriber], timeout_s: float = 60.0) -> None:
    """Every subscriber is connected to its publisher before the workload starts:
    an event sent before the subscription reached the publisher is lost (ZeroMQ
    PUB/SUB), which would show up later as blocks missing from one stream."""
    deadline = time.monotonic() + timeout_s
    while not all(sub.connected() for sub in subs):
        assert time.monotonic() < deadline, (
            f"no ZeroMQ handshake within {timeout_s:g}s: {[s.summary() for s in subs]}"
        )
        time.sleep(0.05)
    time.sleep(0.2)  # the subscription message, sent right after the handshake


#: Server a's events endpoint: the package's own publisher on a free port (its
#: start-up line names it; no port chosen in advance that another process can take).
OWN = "tcp://127.0.0.1:0"


class Streams:
    """The pair's two event streams: a's on the package's own socket (``OWN``), b's
    on SGLang's ``--kv-events-config`` publisher (``sglang_args``), whose
    subscriber connects before the server binds (ZeroMQ retries)."""

    def __init__(self) -> None:
        self.sglangs = f"tcp://127.0.0.1:{free_port()}"
        self.b = Subscriber(self.sglangs)
        self.a: Subscriber | None = None

    def sglang_args(self) -> tuple[str, str]:
        """Server b's arguments: SGLang's publisher, bound at ``sglangs``."""
        config = {"publisher": "zmq", "endpoint": self.sglangs, "bind": True}
        return ("--kv-events-config", json.dumps(config))

    def connect(self, a: Server, b: Server) -> tuple[Subscriber, Subscriber]:
        """Subscribe where a's start-up line says, check b's, and wait until both
        subscribers are connected: before any traffic."""
        self.a = Subscriber(published_at(a))
        assert published_at(b) == SglangSink.where
        await_streams((self.a, self.b))
        return self.a, self.b

    def close(self) -> None:
        for sub in (self.a, self.b):
            if sub is not None:
                sub.close()


def index_of(sub: Subscriber, upto: int, removals: bool) -> set[int]:
    """The storage tier a consumer of ``sub``'s first ``upto`` events holds: blocks
    of ``BlockStored(DISK/EXTERNAL)``, less those of ``BlockRemoved`` when ``removals``."""
    held: set[int] = set()
    for e in sub.events[:upto]:
        if getattr(e, "medium", None) not in STORAGE_MEDIA:
            continue
        if isinstance(e, kv.BlockStored):
            held.update(e.block_hashes)
        elif removals and isinstance(e, kv.BlockRemoved):
            held.difference_update(e.block_hashes)
    return held


def parents(subs: Sequence[Subscriber]) -> dict[int, int | None]:
    """Each storage-tier block's parent, from the stored events received so far."""
    out: dict[int, int | None] = {}
    for sub in subs:
        for e in sub.events:
            if isinstance(e, kv.BlockStored) and e.medium in STORAGE_MEDIA:
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    out[h] = parent
                    parent = h
    return out


def reachable(held: set[int], parent_of: dict[int, int | None]) -> set[int]:
    """The held blocks a prefix lookup can reach: held, and so is every block
    before them in their chain (a lookup such as ``batch_exists`` counts leading
    pages and stops at the first missing one)."""
    memo: dict[int, bool] = {}

    def ok(h: int) -> bool:
        path: list[int] = []
        while h not in memo:
            if h not in held or h not in parent_of:
                memo[h] = False
                break
            path.append(h)
            p = parent_of[h]
            if p is None:
                memo[h] = True
                break
            h = p
        result = memo[h]
        for x in path:
            memo[x] = result
        return result

    return {h for h in held if ok(h)}


def missing(chain: list[int], held: Collection[int]) -> list[int]:
    """The blocks of ``chain`` (``chain_of``) L3 does not hold: the block itself first
    when it is absent; any at all and no prefix lookup reaches it."""
    return [b for b in chain if b not in held]


def chain_of(h: int, parent_of: dict[int, int | None]) -> list[int]:
    """``h`` and the blocks before it in its chain, nearest first (as far as the
    stored events tell; a cycle ends it)."""
    chain: list[int] = []
    node: int | None = h
    while node is not None and node not in chain:
        chain.append(node)
        node = parent_of.get(node)
    return chain


@dataclass
class Point:
    """One sample: seconds since the eviction; per publisher the precision of its
    (instance, block) claims against the truth; recall of acknowledged blocks
    (``recall``: of every held one; ``recall_reachable``: of those a prefix lookup
    can reach)."""

    t: float
    ours: float
    belief: float
    recall: float
    stale_ours: int
    stale_belief: int
    recall_reachable: float = 1.0
    #: (instance, block) claims ours removed that L3 holds at the sample: each must be
    #: a removal of a block no lookup could reach then, since written again or held
    #: all along behind a missing one (``Truth.unexplained_removals``).
    removed_held: int = 0


class Truth:
    """Samples the consumer's index of both servers against ``held()``, the
    storage blocks L3 holds (by event hash)."""

    def __init__(self, subs: Sequence[Subscriber], held: Callable[[], set[int]]) -> None:
        self.subs = tuple(subs)
        self.held = held
        self.t0 = time.monotonic()
        self.points: list[Point] = []
        #: Per sample, per subscriber: the events it had, and the blocks its removals
        #: took out of ours that L3 held then.
        self.removed: list[list[tuple[int, set[int]]]] = []
        #: What L3 held at each sample (time the read began, the blocks), and the same
        #: read between the samples by ``watch``.
        self.sampled: list[tuple[float, frozenset[int]]] = []
        self.watched: list[tuple[float, frozenset[int]]] = []
        self.watch_errors: list[str] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, period_s: float) -> None:
        """Read ``held()`` every ``period_s`` on a thread of its own until ``stop``.
        A store that can evict on its own (Mooncake, should the servers' writes fill
        it after the burst) could drop a page that a lookup then finds absent and
        the server rewrites, all between two samples; a read between them is the
        evidence the samples miss.  Only reads up to the removal count
        (``unexplained_removals``): a later absence says nothing of the block when
        it was removed."""

        def run() -> None:
            while not self._stop.wait(period_s):
                began = time.monotonic()
                try:
                    held = frozenset(self.held())
                except Exception as exc:  # the store busy or restarting: say so at the end
                    self.watch_errors.append(repr(exc))
                    continue
                if not self._stop.is_set():  # a read that outlasted ``stop`` is dropped
                    self.watched.append((began, held))

        self._watcher = threading.Thread(target=run, name="events-truth-watch", daemon=True)
        self._watcher.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout_s)
            if self._watcher.is_alive():  # held() hung: its reads would race the verdicts
                raise RuntimeError(f"the truth's watch did not stop within {timeout_s} s")

    def sample(self, settled: bool = False) -> Point:
        for sub in self.subs:
            sub.pump()
        # One snapshot: the events received so far, then the truth.
        upto = [len(sub.events) for sub in self.subs]
        ours = [index_of(s, n, removals=True) for s, n in zip(self.subs, upto)]
        belief = [index_of(s, n, removals=False) for s, n in zip(self.subs, upto)]
        read_at = time.monotonic()
        held = self.held()
        self.sampled.append((read_at, frozenset(held)))
        acked = set().union(*belief) & held  # held blocks whose write an instance acknowledged
        reach = reachable(held, parents(self.subs))
        findable = acked & reach

        def precision(index: list[set[int]]) -> tuple[float, int]:
            claims = sum(len(i) for i in index)
            stale = sum(len(i - held) for i in index)
            return (1.0 - stale / claims if claims else 1.0), stale

        def recall(of: set[int]) -> float:
            return len(of & set().union(*ours)) / len(of) if of else 1.0

        p_ours, s_ours = precision(ours)
        p_belief, s_belief = precision(belief)
        removed = [(n, (b - o) & held) for n, b, o in zip(upto, belief, ours)]
        point = Point(
            time.monotonic() - self.t0,
            p_ours,
            p_belief,
            recall(acked),
            s_ours,
            s_belief,
            recall(findable),
            sum(len(r) for _, r in removed),
        )
        self.removed.append(removed)
        if not settled:
            self.points.append(point)
        return point

    def history(self, h: int) -> dict[str, Any]:
        """Block ``h``'s storage-tier events and the samples that saw it out of reach,
        in seconds since the eviction: what a failed check needs to be read."""

        def events(sub: Subscriber) -> list[tuple[str, float]]:
            return [
                (type(e).__name__, round(at - self.t0, 3))
                for e, at in zip(sub.events, sub.arrived)
                if getattr(e, "medium", None) in STORAGE_MEDIA
                and h in getattr(e, "block_hashes", ())
            ]

        chain = chain_of(h, parents(self.subs))

        def out_of_reach(reads: list[tuple[float, frozenset[int]]]) -> list[tuple[float, str]]:
            gaps = ((at, missing(chain, held)) for at, held in reads)
            return [
                (round(at - self.t0, 3), "absent" if gap[0] == h else "behind")
                for at, gap in gaps
                if gap
            ]

        return {
            "block": h,
            "chain": len(chain),
            "events": [events(sub) for sub in self.subs],
            "samples_out_of_reach": out_of_reach(self.sampled),
            "watch_out_of_reach": out_of_reach(self.watched),
            "watched": len(self.watched),
            "watch_errors": self.watch_errors[:3],
            "samples": [round(p.t, 3) for p in self.points],
        }

    def report(self, unexplained: Sequence[tuple[int, int]]) -> str:
        """One JSON line for a failed check: each flagged removal's block history and
        every sample.  Printed whole: pytest cuts an assertion message to a few
        hundred characters, middle out, at CI's verbosity."""
        return json.dumps(
            {
                "unexplained": [{"subscriber": i, **self.history(h)} for i, h in unexplained],
                "points": [vars(p) for p in self.points],
            }
        )

    def unexplained_removals(
        self, gone: Collection[int] = (), watched: bool = True
    ) -> list[tuple[int, int]]:
        """(subscriber, block) pairs whose removal nothing explains.  Ours is
        belief-only less its removals, so its precision is below belief-only's only when
        it removed a block L3 holds at the sample: a wrong verdict (a block a lookup
        could reach), or one right when made, of a block L3 holds again or held all
        along behind a missing one.  So each such removal needs evidence that no lookup
        could reach the block after its last store before the removal: the evictor
        removed it or a block before it (``gone``, for a removal after the eviction), or
        a sample since the eviction up to the one that brought the removal in, or a
        ``watch`` read up to the removal, saw it absent or behind an absent block (a
        verified absence removes the pages after the missing one too).  Behind missing
        blocks, the block needs no store of its own, unless every one of them was
        stored again between that evidence and the removal (the block was back in reach
        then).  A block itself absent must have been stored again after the evidence,
        since L3 holds it (on the remover's stream, after the removal too; or on
        another's: another instance wrote it).  Events are ordered by their position on
        one stream, across streams by arrival (the time of the pump that received
        them), so a store and a removal on different streams received in one pump are
        not ordered by when they happened.  ``watched=False`` leaves the ``watch``
        reads out (to count what only they explain).  Call once the streams are
        quiet."""
        for sub in self.subs:
            sub.pump()
        parent_of = parents(self.subs)
        # Each block's storage-tier stores (subscriber, position, arrival), and each
        # subscriber's storage-tier removals of it (positions, ascending).
        stores: dict[int, list[tuple[int, int, float]]] = {}
        removals: list[dict[int, list[int]]] = []
        for k, sub in enumerate(self.subs):
            mine: dict[int, list[int]] = {}
            for j, (e, at) in enumerate(zip(sub.events, sub.arrived)):
                if getattr(e, "medium", None) not in STORAGE_MEDIA:
                    continue
                if isinstance(e, kv.BlockStored):
                    for h in e.block_hashes:
                        stores.setdefault(h, []).append((k, j, at))
                elif isinstance(e, kv.BlockRemoved):
                    for h in e.block_hashes:
                        mine.setdefault(h, []).append(j)
            removals.append(mine)

        def stored_between(b: int, after: float, i: int, last: int, at_removal: float) -> bool:
            """A store of ``b`` that arrived after ``after`` and before subscriber i's
            removal at position ``last``, arrived at ``at_removal`` (earlier on i's own
            stream)."""
            return any(
                at > after and (j < last if k == i else at < at_removal)
                for k, j, at in stores.get(b, [])
            )

        def explained(i: int, h: int, last: int) -> bool:
            """Whether subscriber i's removal of h at position ``last`` is explained."""
            at_removal = self.subs[i].arrived[last]
            h_stores = stores.get(h, [])
            before = max(
                (at for k, j, at in h_stores if (j < last if k == i else at <= at_removal)),
                default=self.t0,
            )
            since = max(before, self.t0)
            chain = chain_of(h, parent_of)
            # Samples up to the first read after the removal arrived (its pump's sample):
            # a later absence says nothing of the block when it was removed.
            upto = min((at for at, _ in self.sampled if at >= at_removal), default=math.inf)
            reads = [r for r in self.sampled if since <= r[0] <= upto]
            if watched:  # reads up to the removal only (``watch``)
                reads += [r for r in self.watched if since <= r[0] <= at_removal]
            absent: list[float] = []  # h itself out of L3
            behind: list[tuple[float, list[int]]] = []  # h held, blocks before it not
            for at, held in reads:
                if gap := missing(chain, held):
                    if gap[0] == h:
                        absent.append(at)
                    else:
                        behind.append((at, gap))
            if before <= self.t0 <= at_removal:
                if h in gone:
                    absent.append(self.t0)
                elif evicted := [b for b in chain[1:] if b in gone]:
                    behind.append((self.t0, evicted))
            # Behind a missing block, h needs no store of its own to be held again; but
            # if every missing block was stored again before the removal, h was back in
            # reach when it was removed.
            if any(
                not all(stored_between(b, at, i, last, at_removal) for b in gap)
                for at, gap in behind
            ):
                return True
            if not absent:
                return False
            first = min(absent)
            return any(at >= first and (k != i or j > last) for k, j, at in h_stores)

        out: set[tuple[int, int]] = set()
        judged: dict[tuple[int, int, int], bool] = {}
        for removed in self.removed:
            for i, (upto, blocks) in enumerate(removed):
                for h in blocks:
                    positions = removals[i][h]
                    last = positions[bisect.bisect_left(positions, upto) - 1]
                    key = (i, h, last)
                    if key not in judged:
                        judged[key] = explained(i, h, last)
                    if not judged[key]:
                        out.add((i, h))
        return sorted(out)


def chains(subs: Sequence[Subscriber], prompts: dict[int, tuple[int, ...]]) -> dict[int, list[int]]:
    """Each conversation's page chain (block hashes from the root), read from the
    stored events: a block is known by its parent and its tokens."""
    by: dict[tuple[int | None, tuple[int, ...]], int] = {}
    for sub in subs:
        for e in sub.pump():
            if isinstance(e, kv.BlockStored) and e.medium in STORAGE_MEDIA:
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


def quiet(servers: Sequence[Server], subs: Sequence[Subscriber]) -> None:
    """The servers' writes settled and their events received."""
    for srv in servers:
        srv.wait_writes_settled()
    for sub in subs:
        seen = -1
        while seen != len(sub.pump()):
            seen = len(sub.events)
            time.sleep(0.5)


def removal_delays(
    subs: Sequence[Subscriber], t0: float, doomed: set[int]
) -> dict[str, float | int]:
    """Seconds from the eviction to each BlockRemoved of an evicted block."""
    delays = [
        at - t0
        for sub in subs
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


def alternate(conversation: int, turn: int) -> int:
    """A router without the storage tier: each turn to the other server."""
    return (conversation + turn) % 2


def stay_once(conversation: int, turn: int) -> int:
    """As ``alternate`` until the eviction; then the first turn stays on the server
    of the turn before (session affinity) and the next one moves: the instance
    that wrote the last pages looks its chain up again before anyone rewrites it."""
    return alternate(conversation, turn - 1 if turn >= BUILD else turn)


@dataclass
class Measured:
    """One run of the measurement: the samples, the eviction and the window."""

    truth: Truth
    built: Point
    evicted: Point
    at_window: Point
    end: Point
    doomed: set[int]
    looked_up: float
    window: float
    #: Reconciler queries per second of each server (by port) over the run.
    rates: dict[int, float]
    #: Every storage-tier block on server b's stream (SGLang's own events included).
    storage_blocks_b: list[int]
    sources: dict[str, float]
    delays: dict[str, float | int]

    def figures(self, **extra: Any) -> dict[str, Any]:
        points = self.truth.points
        return {
            "evicted_pages": len(self.doomed),
            "looked_up_s": round(self.looked_up, 2),
            "window_s": round(self.window, 2),
            "first_ours_ge_0.99_s": next((round(p.t, 2) for p in points if p.ours >= 0.99), None),
            "min_precision": {
                "ours": round(min(p.ours for p in points), 3),
                "belief": round(min(p.belief for p in points), 3),
            },
            "at_window": self.at_window,
            "end": self.end,
            "recall_min_sampled": round(min(p.recall for p in points), 3),
            "recall_reachable_min_sampled": round(min(p.recall_reachable for p in points), 3),
            "removals": self.sources,
            "delay_s": self.delays,
            "verifications_per_s": self.rates,
            # (t, ours, belief, recall, recall_reachable) at every sample
            "series": [
                [round(x, 3) for x in (p.t, p.ours, p.belief, p.recall, p.recall_reachable)]
                for p in points
            ],
            **extra,
        }


def measure(
    servers: tuple[Server, Server],
    subs: tuple[Subscriber, Subscriber],
    held: Callable[[], set[int]],
    evict: Callable[[dict[int, list[int]]], set[int]],
    timeout_ms: float,
    salt: str,
    check_built: Callable[[Point], None] = lambda p: None,
    route: Callable[[int, int], int] = alternate,
    watch_s: float | None = None,
) -> Measured:
    """The workload's BUILD turns, then ``evict(chains)`` (it removes pages behind
    the servers' backs and returns the blocks it removed), then the other turns,
    sampling after every request, then a sample at the window the reconciler's
    configuration predicts and one once everything settled.  ``check_built`` sees
    the sample before the eviction; ``watch_s``, when given, has ``held()`` read
    that often between the samples too (``Truth.watch``); ``route(conversation,
    turn)`` is the index of the server a turn goes to (each server must serve every
    conversation once after the eviction: the window counts on it)."""
    turns = conversation_requests(CONVERSATIONS, TURNS, salt=salt)
    served_at: dict[tuple[int, int], float] = {}  # (server, conversation) -> last done

    def serve(k: int, after: Truth | None = None) -> None:
        for t in turns:
            if t.turn != k:
                continue
            i = route(t.conversation, k)
            servers[i].generate(t.input_ids, max_new_tokens=1)
            served_at[(i, t.conversation)] = time.monotonic()
            if after is not None:
                after.sample()

    for k in range(BUILD):
        serve(k)
    quiet(servers, subs)
    truth = Truth(subs, held)
    built = truth.sample(settled=True)
    check_built(built)

    prompts = {t.conversation: t.input_ids for t in turns if t.turn == BUILD - 1}
    known = chains(subs, prompts)
    assert all(len(known[c]) >= len(prompts[c]) // PAGE - 1 for c in known), (
        {c: len(chain) for c, chain in known.items()},
        [sub.summary() for sub in subs],
    )
    truth.t0 = time.monotonic()
    if watch_s is not None:
        truth.watch(watch_s)
    try:
        doomed = evict(known)
        evicted = truth.sample()

        # The workload goes on: every conversation served by each server once more.
        # (Stale claims end either in a verified BlockRemoved or in the page's rewrite.)
        before = {s: s.value(P + "reconciler_queries_total", absent_ok=True) for s in servers}
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
        window = looked_up + timeout_ms / 1000.0 + 1.0
        time.sleep(max(0.0, truth.t0 + window - time.monotonic()))
        at_window = truth.sample()
        elapsed = time.monotonic() - truth.t0
        rates = {
            s.port: (s.value(P + "reconciler_queries_total", absent_ok=True) - before[s]) / elapsed
            for s in servers
        }
        quiet(servers, subs)
        end = truth.sample(settled=True)
    finally:
        truth.stop()
    storage_b = [
        h
        for e in subs[1].pump()
        if isinstance(e, kv.BlockStored) and e.medium in STORAGE_MEDIA
        for h in e.block_hashes
    ]
    sources = {
        src: sum(s.value(P + "events_removals_total", source=src) for s in servers)
        for src in ("reconciler", "hit_query")
    }
    return Measured(
        truth,
        built,
        evicted,
        at_window,
        end,
        doomed,
        looked_up,
        window,
        rates,
        storage_b,
        sources,
        removal_delays(subs, truth.t0, doomed),
    )
