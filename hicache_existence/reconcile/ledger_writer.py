"""Records L3 writes into a ledger from a background thread.

The storage thread must not wait on Redis: ``stored`` / ``removed`` only enqueue
(bounded; when full the record is dropped and counted, which at worst costs a
redundant write later).  A record thus reaches the ledger after the storage ack
that made its page believed, so ``WrittenLedgerTruth`` answers only once every
record offered before the question is written, waiting on the reconciler's
worker thread for a bounded time, past which the question fails (``LedgerBehind``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Protocol

from hicache_existence.reconcile.ground_truth import (
    GroundTruth,
    GroundTruthError,
    LedgerBehind,
    absence_is_evidence,
)

logger = logging.getLogger(__name__)

#: A record: (op, pool, pages); op is stored, removed or cleared.
Record = tuple[str, str, tuple[str, ...]]


class Ledger(GroundTruth, Protocol):
    def record_stored(self, pool: str, hashes: Iterable[str]) -> int: ...

    def record_removed(self, pool: str, hashes: Iterable[str]) -> int: ...

    def clear_shard(self) -> int: ...


class LedgerWriter:
    """Asynchronous, bounded, lossy-by-design ledger recording."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        max_pending: int = 1024,
        batch_pages: int = 512,
        name: str = "hicache-existence-ledger-writer",
    ) -> None:
        self._ledger = ledger
        self._queue: queue.Queue[Record | None] = queue.Queue(maxsize=max_pending)
        self._batch = max(1, batch_pages)
        self._lock = threading.Lock()
        #: Records accepted into the queue, and records whose write was attempted
        #: (both in queue order, under ``_lock``): the barrier of ``wait_written``.
        self._offered = 0
        self._written = 0
        self._written_changed = threading.Condition(self._lock)
        #: (op, result) -> pages; op in stored/removed/cleared, result ok/error/dropped.
        self.pages: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[str] = Counter()
        #: Pages stored in L3 whose record failed or was dropped (under ``_lock``,
        #: at most ``LOST_CAP``; beyond it the ledger is told it missed writes):
        #: the ledger's absence of them is not evidence.
        self._lost: dict[tuple[str, str], None] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- producer side (storage thread): never blocks ------------------------------
    def stored(self, pool: str, hashes: Iterable[str]) -> None:
        self._offer(("stored", pool, tuple(hashes)))

    def removed(self, pool: str, hashes: Iterable[str]) -> None:
        self._offer(("removed", pool, tuple(hashes)))

    def cleared(self) -> None:
        self._offer(("cleared", "", ()))

    def _offer(self, item: Record) -> None:
        if self._closed or (not item[2] and item[0] != "cleared"):
            return
        # One lock around the put and the count, so that the first ``_offered``
        # records of the queue are exactly the ones counted (storage threads may
        # offer concurrently).  Never blocks: put_nowait.
        with self._lock:
            if item[0] == "removed":
                # The backend proved these pages gone after any lost record of them
                # (a later lost store marks them again): their absence is evidence.
                self._forget_lost(item[1], item[2])
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.pages[(item[0], "dropped")] += len(item[2])
                if item[0] == "stored":
                    self._note_lost(item[1], item[2])
            else:
                self._offered += 1

    # -- consumer side -----------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            items: list[Record] = []
            pages = 0
            item = self._queue.get()
            while item is not None:  # a batch: what is queued, up to batch_pages
                items.append(item)
                pages += len(item[2])
                if pages >= self._batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            stop = item is None  # None: stop, once what came before is written
            try:
                self._write(items)
            finally:
                with self._lock:
                    self._written += len(items)
                    self._written_changed.notify_all()

    def _write(self, items: list[Record]) -> None:
        # Coalesce consecutive records of the same (op, pool), keeping order.
        groups: list[tuple[str, str, list[str]]] = []
        for op, pool, pages in items:
            if groups and groups[-1][0] == op and groups[-1][1] == pool and op != "cleared":
                groups[-1][2].extend(pages)
            else:
                groups.append((op, pool, list(pages)))
        for op, pool, hashes in groups:
            kind = ""
            try:
                if op == "stored":
                    self._ledger.record_stored(pool, hashes)
                elif op == "removed":
                    self._ledger.record_removed(pool, hashes)
                else:
                    self._ledger.clear_shard()
            except GroundTruthError as exc:
                kind = exc.kind
                logger.debug("ledger %s failed: %s", op, kind)
            except Exception:  # never let the writer thread die
                kind = "internal"
                logger.exception("ledger %s failed", op)
            with self._lock:
                if kind:
                    self.errors[kind] += 1
                self.pages[(op, "error" if kind else "ok")] += len(hashes) if op != "cleared" else 1
                if op == "stored":
                    if kind:
                        self._note_lost(pool, hashes)
                    else:
                        self._forget_lost(pool, hashes)
                elif op == "cleared":
                    self._lost.clear()

    #: Lost pages remembered at most.
    LOST_CAP = 1 << 16

    def _note_lost(self, pool: str, hashes: Iterable[str]) -> None:
        """Under ``_lock``: remember pages whose record is lost (oldest forgotten
        past ``LOST_CAP``, and the ledger then told it missed writes)."""
        lost = self._lost
        lost.update(dict.fromkeys((pool, h) for h in hashes))
        if len(lost) > self.LOST_CAP:
            for key in list(islice(lost, len(lost) - self.LOST_CAP)):
                del lost[key]
            missed = getattr(self._ledger, "missed_writes", None)
            if missed is not None:
                try:
                    missed()
                except Exception:
                    logger.debug("ledger missed_writes failed", exc_info=True)

    def _forget_lost(self, pool: str, hashes: Iterable[str]) -> None:
        if self._lost:  # under ``_lock``
            for h in hashes:
                self._lost.pop((pool, h), None)

    def lost(self, pool: str, page: str) -> bool:
        """Whether ``page``'s last record of ``pool`` failed or was dropped."""
        with self._lock:
            return (pool, page) in self._lost

    # -- readers of the ledger (never the storage or scheduler thread) --------------
    def wait_written(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record offered before this call was written (or failed
        and was counted), not those offered meanwhile; False after ``timeout_s``."""
        with self._lock:
            target = self._offered
            return self._written_changed.wait_for(lambda: self._written >= target, timeout_s)

    flush = wait_written

    def truth(self, wait_s: float) -> WrittenLedgerTruth:
        """The ledger as ground truth behind this writer (``WrittenLedgerTruth``)."""
        return WrittenLedgerTruth(self._ledger, self, wait_s)

    # -- lifecycle -----------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending (bounded by ``timeout_s``) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def counts(self) -> dict[str, dict[str, int]]:
        """A copy of the counters: ``pages`` by "op/result" and ``errors`` by kind."""
        with self._lock:
            return {
                "pages": {f"{op}/{res}": n for (op, res), n in self.pages.items()},
                "errors": dict(self.errors),
            }


class WrittenLedgerTruth:
    """A ledger as ground truth behind its ``LedgerWriter``: each question waits
    (``wait_s`` at most, on the asking thread) for the records offered before it,
    else raises ``LedgerBehind``, so a page acked before the question is in the answer."""

    def __init__(self, ledger: Ledger, writer: LedgerWriter, wait_s: float) -> None:
        #: The ledger itself (its settings, its epoch, its other readers).
        self.ledger = ledger
        self._writer = writer
        self._wait_s = float(wait_s)
        #: Per asking thread: the last ``leading_present`` stopped at a page whose
        #: record was lost (its absence is then not evidence).
        self._local = threading.local()

    def _barrier(self) -> None:
        if not self._writer.wait_written(self._wait_s):
            raise LedgerBehind(f"ledger records not written within {self._wait_s:g} s")

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        self._local.lost = False
        self._barrier()
        count = self.ledger.leading_present(pool, hashes)
        if 0 <= count < len(hashes):
            self._local.lost = self._writer.lost(pool, hashes[count])
        return count

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        self._barrier()
        return self.ledger.present(pool, hashes)

    def absence_is_evidence(self) -> bool:
        """The ledger's, and not right after an answer that stopped at a page
        whose record was lost (asked on the same thread, as the worker does)."""
        if getattr(self._local, "lost", False):
            return False
        return absence_is_evidence(self.ledger)

    def __repr__(self) -> str:
        return f"{self.ledger!r} (answers after its writer's queued records)"
