"""Verified L3 residency as KV events: stores at the ack, removals only when verified.

SGLang publishes the device and host tiers only; this emitter publishes the storage
tier (docs/kv-events.md says what a consumer may rely on):

* ``BlockStored`` when the storage drain acknowledges a write (``stored``), for
  the pages this rank's backend stored; never at launch, never for a page only
  believed.  A page whose block hash, parent or tokens are not SGLang's own (a
  namespaced or bigram key) is counted ``unknown``, not published.
* ``BlockRemoved`` only when absence is verified: ``invalidate_beyond(chain, keep)``
  is only ever called on a verdict, and every page past ``chain[keep]`` is
  unreachable by a prefix lookup (a page hash chains its prefix).  An LRU eviction
  and a ``clear`` of the beliefs say nothing about L3: no event.
* The scheduler thread puts one item per call on a bounded queue, whatever the
  number of pages, and never blocks (a full queue drops and counts); the
  publisher thread does everything per page, in the scheduler's call order.

Nothing here raises into the cache: a failure is counted (``errors``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from hicache_existence.events.wire import Event, Removed, Stored, block_hash
from hicache_existence.events.zmq_sink import ZmqSink

if TYPE_CHECKING:
    from hicache_existence.config import EventsSection

logger = logging.getLogger(__name__)

#: Removal sources (label ``source``).
REMOVAL_SOURCES = ("reconciler", "hit_query")
#: Published kinds (label ``kind``).
KINDS = ("stored", "removed")
#: Drop reasons (label ``reason``).
DROP_REASONS = ("queue_full", "send_error")
#: The pool whose pages are KV blocks (the other pools have no block events).
KV = "kv"

#: One acknowledged page: (page hash, parent page hash or None at the root, tokens).
Block = tuple[str, "str | None", Sequence[int]]
#: Gives an acknowledgement's blocks and how many of its pages have no known block
#: hash (called on the publisher thread).
Resolve = Callable[..., "tuple[Sequence[Block], int]"]

# Queue item tags: (tag, clock, ...); a refresh only is a verdict without a source.
_STORE, _VERDICT, _CLEARED = 0, 1, 2


def _given(blocks: Sequence[Block]) -> tuple[Sequence[Block], int]:
    return blocks, 0


class Sink(Protocol):
    """Where encoded batches go (on the publisher thread)."""

    def send(self, ts: float, events: Sequence[Event]) -> None:
        """Publish one batch; raise on failure (counted as ``send_error``)."""

    def close(self) -> None:
        """Release the socket."""


@dataclass(frozen=True)
class EventsSnapshot:
    """The emitter's counters (exported as metrics)."""

    #: Blocks published, by kind (``stored``, ``removed``).
    published: dict[str, int]
    #: Blocks dropped, by reason.
    dropped: dict[str, int]
    #: Blocks removed, by the verdict's source.
    removals: dict[str, int]
    #: Acknowledged pages not published: their block hash is not known.
    unknown: int
    #: Seconds since the least recently confirmed published block was confirmed.
    oldest_unverified_s: float
    #: Blocks published and not removed (bounded by ``max_blocks``).
    blocks: int
    errors: int


class KvEvents:
    """The storage tier's KV events of one publishing scheduler (module docstring).

    Threads: the scheduler thread only calls ``stored``, ``stored_from``,
    ``invalidated`` and ``verified``, each of which puts one item on the queue;
    the publisher thread alone reads and writes ``_published`` and builds events.
    Every counter has one writing thread: ``dropped["queue_full"]`` and
    ``_hot_errors`` the scheduler's, every other counter the publisher's;
    ``snapshot`` (any thread) reads them (whole ints and a ``dict`` copy, atomic
    under the GIL) and never iterates ``_published``.
    """

    def __init__(
        self,
        sink: Callable[[], Sink | None],
        *,
        medium: str,
        queue_size: int = 4096,
        max_blocks: int = 1 << 20,
        source: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._open = sink
        self.medium = medium
        self._max = max_blocks
        #: Names the source of the verdict behind an invalidation (the runtime
        #: sets it: ``reconciler`` while the reconciler applies its verdicts).
        self.source: Callable[[], str] = source or (lambda: "hit_query")
        self._clock = clock
        self._wall = wall
        #: Publisher thread only: page hash -> when it was last confirmed present
        #: (clock), oldest first.
        self._published: OrderedDict[str, float] = OrderedDict()
        #: Publisher thread only: each page the batch being built published or
        #: removed, with its state before the batch (None: not published; else when
        #: it was confirmed), so a batch the sink refuses is undone: subscribers saw
        #: none of it, and the next ack or verdict sends it again.  The first change
        #: of a page in the batch names its state before (a store then a removal of
        #: one page leaves it unpublished, as it was).
        self._before: dict[str, float | None] = {}
        #: Publisher thread only: blocks the batch being built removed, by source
        #: (counted in ``removals`` once the batch is sent).
        self._removing: dict[str, int] = {}
        #: When the least recently confirmed published block was confirmed (None:
        #: none); written by the publisher thread after each batch.
        self._first: float | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        #: Whether a store was ever queued (scheduler thread): before the first one,
        #: nothing is published and a verdict has nothing to remove or refresh.
        self._any_store = False
        self.published = dict.fromkeys(KINDS, 0)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.removals = dict.fromkeys(REMOVAL_SOURCES, 0)
        self.unknown = 0
        self._hot_errors = 0
        self._pub_errors = 0
        self._sink: Sink | None = None
        self._thread: threading.Thread | None = None
        self.running = False

    @property
    def where(self) -> str:
        """Where the batches go (the start-up line names it: subscribers connect
        there); ``off`` when the sink could not be opened."""
        if not self.running or self._sink is None:
            return "off"
        return str(getattr(self._sink, "where", type(self._sink).__name__))

    @property
    def errors(self) -> int:
        """Updates skipped on a failure (either thread)."""
        return self._hot_errors + self._pub_errors

    # -- life cycle ------------------------------------------------------------
    def start(self) -> bool:
        """Open the sink and start the publisher thread; False (and no events
        from then on) when the sink cannot be opened (its factory warned)."""
        try:
            self._sink = self._open()
        except Exception as exc:
            logger.warning("hicache-existence: KV events off: publisher failed (%r)", exc)
            self._sink = None
        if self._sink is None:
            return False
        self.running = True
        self._thread = threading.Thread(
            target=self._run, name="hicache-existence-kv-events", daemon=True
        )
        self._thread.start()
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the sink."""
        if not self.running:
            return
        self.running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:
                logger.debug("KV event sink close failed", exc_info=True)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued before this call is processed and sent
        (tests, shutdown; never the scheduler thread).  False on timeout."""
        if not self.running:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    # -- the write path (scheduler thread): one queue item per call ----------------
    def stored(self, blocks: Sequence[Block]) -> None:
        """L3 acknowledged these pages (this rank's backend stored them), in chain
        order: publish those not published since their last removal."""
        self.stored_from(_given, (blocks,), len(blocks))

    def stored_from(self, resolve: Resolve, args: tuple[Any, ...], pages: int) -> None:
        """An acknowledgement whose blocks ``resolve(*args)`` gives, with how many
        acknowledged pages have no known block hash; it runs on the publisher thread,
        so ``args`` must be the write's own snapshot, never mutated after the ack.
        ``pages``: the pages acknowledged (what a full queue counts as dropped)."""
        if self.running and self._put(lambda: (_STORE, self._clock(), resolve, args), pages):
            self._any_store = True

    def storage_cleared(self) -> None:
        """L3 itself was emptied (SGLang's ``clear_storage_backend`` succeeded): every
        published block is removed (one queue item; the publisher thread builds it)."""
        if self.running and self._any_store:
            # A full queue loses the removal of every published block: count them
            # (len() of the publisher's dict: one atomic read).
            self._put(lambda: (_CLEARED, self._clock()), max(1, len(self._published)))

    def _put(self, item: Callable[[], tuple[Any, ...]], pages: int) -> bool:
        """Queue ``item()`` without waiting; a full queue drops it and counts
        ``pages``; a failure (building the item included) is counted, never raised."""
        try:
            self._queue.put_nowait(item())
            return True
        except queue.Full:
            self.dropped["queue_full"] += pages
        except Exception as exc:
            self._hot_errors += 1
            _skipped(self._hot_errors, exc)
        return False

    # -- BeliefObserver (the cache's operation stream, scheduler thread) ----------
    def added(self, pool: str, hashes: Sequence[str]) -> None:
        """Beliefs added: not an L3 acknowledgement by itself (``stored`` is)."""

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        """A lookup: says nothing about L3."""

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """A write launched or retired: not an acknowledgement."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        """The beliefs were reset: L3 itself is unchanged, nothing is removed."""

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """A verdict: ``hashes[keep_pages]`` is missing from L3, the pages past it
        are unreachable; ``hashes[:keep_pages]`` were found.  The chain is copied
        (a tuple of references: the caller may reuse its list) and the verdict's
        source named now, while it is known."""
        if self.running and pool == KV and self._any_store:
            self._put(
                lambda: (_VERDICT, self._clock(), tuple(hashes), keep_pages, self.source()),
                max(0, len(hashes) - keep_pages),
            )

    def verified(self, pool: str, chain: Sequence[str], leading: int) -> None:
        """A reconciler verdict found ``chain[:leading]`` in L3 (its absences come
        through ``invalidated``).  A full queue loses this refresh only: the blocks
        look older than they are, never fresher."""
        if self.running and pool == KV and self._any_store and leading > 0:
            self._put(lambda: (_VERDICT, self._clock(), tuple(chain[:leading]), leading, ""), 0)

    # -- the publisher thread --------------------------------------------------------
    def _run(self) -> None:
        get = self._queue.get
        while True:
            try:
                item = get(timeout=0.5)
            except queue.Empty:
                if not self.running:
                    return
                continue
            batch: list[Event] = []
            waiting: list[threading.Event] = []
            n = 0
            while item is not None:  # None: ``close``
                if isinstance(item, threading.Event):
                    waiting.append(item)
                else:
                    self._apply(item, batch)
                n += 1
                if n >= 256 or len(batch) >= 1024:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._send(batch)
            self._before.clear()
            self._removing.clear()
            self._first = next(iter(self._published.values()), None)
            for event in waiting:
                event.set()
            if item is None:
                return

    def _apply(self, item: tuple[Any, ...], batch: list[Event]) -> None:
        try:
            if item[0] == _STORE:
                _, now, resolve, args = item
                blocks, unknown = resolve(*args)
                self.unknown += unknown
                self._build_stored(now, blocks, batch)
            elif item[0] == _CLEARED:  # every published block
                self._unpublish(list(self._published), batch)
            else:  # a verdict, or a refresh only (no source)
                _, now, hashes, keep, source = item
                self._build_removed(now, hashes, keep, source, batch)
        except Exception as exc:
            self._pub_errors += 1
            _skipped(self._pub_errors, exc)

    def _build_stored(self, now: float, blocks: Sequence[Block], out: list[Event]) -> None:
        published = self._published
        run: list[int] = []
        tokens: list[int] = []
        parent: int | None = None
        size = 0
        last: str | None = None
        for page, parent_page, page_tokens in blocks:
            if page in published:
                published[page] = now
                published.move_to_end(page)
                continue
            published[page] = now
            self._before.setdefault(page, None)
            h = block_hash(page)
            if run and parent_page == last and len(page_tokens) == size:
                run.append(h)
                tokens.extend(page_tokens)
            else:
                if run:
                    out.append(Stored(tuple(run), parent, tuple(tokens), size, self.medium))
                run, tokens, size = [h], list(page_tokens), len(page_tokens)
                parent = block_hash(parent_page) if parent_page is not None else None
            last = page
        if run:
            out.append(Stored(tuple(run), parent, tuple(tokens), size, self.medium))
        while len(published) > self._max:
            published.popitem(last=False)

    def _build_removed(
        self, now: float, hashes: Sequence[str], keep: int, source: str, out: list[Event]
    ) -> None:
        published = self._published
        for page in hashes[:keep]:
            if page in published:
                published[page] = now
                published.move_to_end(page)
        if not source:  # a refresh only (``verified``)
            return
        gone = self._unpublish(hashes[keep:], out)
        if gone:
            self._removing[source] = self._removing.get(source, 0) + gone

    def _unpublish(self, pages: Sequence[str], out: list[Event]) -> int:
        """Remove the published ``pages`` (their state before kept for an undo) in
        one ``Removed`` event; how many were published."""
        published, before = self._published, self._before
        gone = []
        for page in pages:
            when = published.pop(page, None)
            if when is not None:
                before.setdefault(page, when)
                gone.append(block_hash(page))
        if gone:
            out.append(Removed(tuple(gone), self.medium))
        return len(gone)

    def _send(self, batch: list[Event]) -> None:
        sink = self._sink
        try:
            assert sink is not None
            sink.send(self._wall(), batch)
        except Exception as exc:
            published = self._published  # subscribers saw none of it: undo it
            restored = False
            for page, when in self._before.items():
                if when is None:
                    published.pop(page, None)
                else:
                    published[page] = when
                    restored = True
            if restored:  # back in confirmation order (oldest first): one sorted run
                self._published = OrderedDict(sorted(published.items(), key=lambda kv: kv[1]))
            self.dropped["send_error"] += _blocks(batch)
            if self.dropped["send_error"] == _blocks(batch):
                logger.warning("hicache-existence: a KV event batch was not sent (%r)", exc)
            return
        for event in batch:
            kind = "stored" if isinstance(event, Stored) else "removed"
            self.published[kind] += len(event.block_hashes)
        for source, n in self._removing.items():
            self.removals[source] = self.removals.get(source, 0) + n

    def snapshot(self) -> EventsSnapshot:
        """Counters now (any thread; what the publisher thread has processed)."""
        first = self._first
        oldest = 0.0 if first is None else max(0.0, self._clock() - first)
        return EventsSnapshot(
            dict(self.published),
            dict(self.dropped),
            dict(self.removals),
            self.unknown,
            oldest,
            len(self._published),
            self.errors,
        )


@dataclass(frozen=True)
class Placement:
    """Where this process's events go: whether it publishes (one scheduler per
    KV cache: TP and PP rank 0), the DP rank tagged on its batches, the storage
    backend (for ``medium: auto``) and the sink (``None``: the package's own
    ZeroMQ publisher at ``events.endpoint``)."""

    publishes: bool
    dp_rank: int = 0
    backend: str = ""
    sink: Callable[[], Sink | None] | None = None


def medium_for(setting: str, backend: str) -> str:
    """``events.medium`` resolved: ``auto`` gives ``DISK`` to the file backend
    (pages are files on a file system this host mounts) and ``EXTERNAL`` to every
    other one (Mooncake, 3FS, NIXL, dynamic: a pool shared over the network)."""
    if setting != "auto":
        return setting
    return "DISK" if backend == "file" else "EXTERNAL"


def from_config(section: EventsSection, placement: Placement) -> KvEvents | None:
    """The emitter this process runs, or ``None`` (events off, or a rank whose
    replica's events another rank publishes)."""
    if not section.enabled or not placement.publishes:
        return None
    own = partial(ZmqSink.open, section.endpoint, dp_rank=placement.dp_rank)
    return KvEvents(
        placement.sink or own,
        medium=medium_for(section.medium, placement.backend),
        queue_size=section.queue_size,
        max_blocks=section.max_blocks,
    )


def _blocks(events: Sequence[Event]) -> int:
    return sum(len(e.block_hashes) for e in events)


def _skipped(errors: int, exc: BaseException) -> None:
    """Warn of the first three failures of either thread."""
    if errors <= 3:
        logger.warning("hicache-existence: KV events skipped an update: %r", exc)
