"""A spatially sampled trace of the existence cache's traffic, recorded in the live server.

What is recorded, the sampling rule, the costs and the format: docs/replay.md,
"Recording a trace from a live server".  Each file starts with a header naming the
instance and the sampling rate.  A page is recorded iff its hash compares below
``bound(rate)`` (the rate as 8 lowercase hex digits): a pure function of hash and
rate (unlike the advisor's salted ``str`` hash), so a page is recorded at all its
references or never, on every TP rank and across restarts: a SHARDS sample.

The scheduler thread pays little and never waits: the cache's ``Tee`` calls ``tap``
(``_recorder.Tap``, compiled; ``PyTap`` without a compiler), one C call per
operation that tests the pages (nothing allocated) and, only when one is recorded,
logs one record in C arrays (no Python object made; the GIL orders it: no lock); no
hashing, encoding or I/O.  With ``queue_records`` waiting, the next is dropped and
counted.  A writer thread takes them every ``flush_interval_s``, in the order they
happened, encodes JSON lines (compiled too: the writer holds the GIL the scheduler
needs), writes each chunk as one complete gzip member (a file cut short by a killed
server keeps every member before the cut readable), rotates at ``file_bytes`` and
deletes this instance's oldest files beyond ``max_bytes``.  A failed open or write
drops and counts that chunk's records and is retried later; nothing here raises
into the cache.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import logging
import operator
import os
import re
import socket
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_existence.core import _validate, lru

if TYPE_CHECKING:
    from hicache_existence.config import RecorderSection

logger = logging.getLogger("hicache_existence.recorder")

#: The header tag shared with the replay reader (``replay.trace``).
FORMAT_TAG = "hicache-existence-trace"
#: Version 2: events with kinds, request boundaries and the instance.
VERSION = 2
#: How the recorded pages were chosen (the header's ``sampling``).
SAMPLING = "hash-prefix-32"
#: File name suffix of the recorder's files.
SUFFIX = ".jsonl.gz"
#: Uncompressed bytes written between two flushes (and disk-bound checks).
CHUNK_BYTES = 64 * 1024
#: Records a take makes into tuples at most (one take holds the GIL throughout).
TAKE_RECORDS = 4096
#: Seconds between two attempts after a failed open or write.
RETRY_S = 5.0

#: Event kinds, in the ``kind`` field (and the ``kind`` label of the records metric).
KINDS: tuple[str, ...] = ("lookup", "add", "invalidate", "clear", "write", "prefetch", "request")
LOOKUP, ADD, INVALIDATE, CLEAR, WRITE, PREFETCH, REQUEST = KINDS
#: Why records were dropped (the ``reason`` label).
DROP_REASONS: tuple[str, ...] = ("queue_full", "write_error")

_native = lru.compiled("accounting._recorder")


def bound(rate: float) -> str | None:
    """The str a page hash must compare below to be recorded (``None``: rate 1,
    every page).  Rates are resolved to 2^-32."""
    if not 0.0 < _validate.number(rate, "sample_rate") <= 1.0:
        raise ValueError(f"sample_rate must be within (0, 1], got {rate}")
    if rate >= 1.0:
        return None
    return format(max(1, int(rate * 2.0**32)), "08x")


def py_below(keys: Sequence[str], bound: str, /) -> list[int]:
    """Indices of ``keys`` that compare below ``bound`` (the compiled test's twin:
    a list or tuple and a str, else TypeError)."""
    if not isinstance(keys, (list, tuple)):
        raise TypeError("keys must be a list or a tuple")
    if not isinstance(bound, str):
        raise TypeError("bound must be a str")
    return [i for i, key in enumerate(keys) if key < bound]


#: ``Recorder._encode`` compiled (``None``: not built): the same line for ~20x less
#: GIL a record; TypeError for a record it does not take (a non-ASCII pool, say).
_native_encode: Callable[[tuple[Any, ...], float], str | None] | None = (
    _native.encode if _native is not None else None
)


class PyTap:
    """The compiled ``Tap``'s twin, the recorder's ``BeliefObserver`` in the cache's
    ``Tee``: an operation with a recorded page logs ``(time, kind, pool, recorded
    pages, their indices (None: all), extra (lookup: stop; invalidate: keep_pages;
    prefetch: hit), request)``, a request's end ``(time, "request", "", (), None,
    number, 0)``, in the order they happen, until the writer ``take``s them (dropped
    and counted at ``capacity`` waiting).  Never raises (failures count in ``errors``)."""

    __slots__ = (
        "bound",
        "capacity",
        "clock",
        "request",
        "numbered",
        "dropped",
        "errors",
        "log",
        "_taking",
    )

    def __init__(self, bound: str | None, capacity: int, clock: Callable[[], float]) -> None:
        if bound is not None and not isinstance(bound, str):
            raise TypeError("bound must be a str or None")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if not callable(clock):
            raise TypeError("clock must be callable")
        self.bound = bound
        self.capacity = capacity
        self.clock = clock
        self.request = 0
        self.numbered = 0
        self.dropped = 0
        self.errors = 0
        self.log: collections.deque[tuple[Any, ...]] = collections.deque()
        self._taking = False

    @property
    def waiting(self) -> int:
        """Records waiting for the writer (``take``)."""
        return len(self.log)

    def take(self, limit: int, /) -> list[tuple[Any, ...]]:
        """At most ``limit`` records, oldest first (a take inside a take: none)."""
        limit = operator.index(limit)
        if self._taking:
            return []
        self._taking = True
        try:
            log = self.log
            return [log.popleft() for _ in range(max(0, min(limit, len(log))))]
        finally:
            self._taking = False

    def _put(
        self,
        kind: str,
        pool: str,
        pages: tuple[str, ...],
        idx: list[int] | None,
        extra: Any,
        request: int,
    ) -> None:
        try:
            t = self.clock()  # first: a clock may log other records
            if isinstance(t, (str, bytes, bytearray, memoryview)):  # a number, as in C
                raise TypeError("the clock must return a number")
            t = float(t)
        except Exception:
            self.errors += 1
            return
        if len(self.log) >= self.capacity:
            self.dropped += 1
            return
        self.log.append((t, kind, pool, pages, idx, extra, request))

    def _recorded(self, hashes: Sequence[str]) -> tuple[tuple[str, ...], list[int] | None] | None:
        """The recorded pages of ``hashes`` and their indices (``None``: every page);
        ``None`` when the test fails (counted)."""
        try:
            if self.bound is None:
                return tuple(hashes), None
            if type(hashes) is not tuple:  # a copy: a comparison cannot change it
                hashes = tuple(hashes)
            idx = py_below(hashes, self.bound)
            return tuple([hashes[i] for i in idx]), idx
        except Exception:
            self.errors += 1
            return None

    def _offer(self, kind: str, pool: str, hashes: Sequence[str], extra: Any) -> None:
        request = self.request  # the call's, whatever the test's Python code does
        got = self._recorded(hashes)
        if got is not None and (got[0] or self.bound is None):
            self._put(kind, pool, got[0], got[1], extra, request)

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        self._offer(LOOKUP, pool, hashes, stop)

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self._offer(ADD, pool, hashes, None)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        self._offer(INVALIDATE, pool, hashes, keep_pages)

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """In-flight refs are not part of the recorded stream."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        request = self.request
        try:
            only = bool(inflight_only)
        except Exception:
            self.errors += 1
            return
        if not only:
            self._put(CLEAR, pool, (), None, None, request)

    def written(self, pool: str, pages: Sequence[str]) -> None:
        """The write path launched an L3 write of ``pages`` (no request's)."""
        got = self._recorded(pages)
        if got is not None and got[0]:
            self._put(WRITE, pool, got[0], None, None, 0)

    def prefetch(self, pool: str, chain: Sequence[str], hit_pages: int) -> None:
        """A prefetch hit query on ``chain`` whose first ``hit_pages`` L3 holds: the
        recorded pages, and how many of them are among those held (no request's)."""
        try:
            hit = operator.index(hit_pages)
        except Exception:
            self.errors += 1
            return
        got = self._recorded(chain)
        if got is not None and got[0]:
            pages, idx = got
            held = min(max(hit, 0), len(pages)) if idx is None else bisect_left(idx, hit)
            self._put(PREFETCH, pool, pages, None, held, 0)

    def ended(self, number: int) -> None:
        """Request ``number`` ended: logged for the writer."""
        number = operator.index(number)
        if not -sys.maxsize - 1 <= number <= sys.maxsize:
            raise OverflowError("request number out of range")
        self._put(REQUEST, "", (), None, number, 0)

    def bracket(self, insert: Callable[..., Any]) -> Callable[..., Any]:
        """``insert`` with each call one request (the compiled ``Bracket``'s twin):
        numbered, carried by the lookups inside it, its end noted however the call
        ends."""

        def bracketed(*a: Any, **kw: Any) -> Any:
            number = self.numbered = self.numbered + 1 if self.numbered < sys.maxsize else 1
            self.request = number
            try:
                return insert(*a, **kw)
            finally:
                self.request = 0
                self.ended(number)

        bracketed.hx_brackets = insert  # type: ignore[attr-defined]
        return bracketed


#: The tap the recorder puts in the cache's ``Tee``: compiled when built.
Tap: Callable[..., Any] = _native.Tap if _native is not None else PyTap


def sampled(page: str, rate: float) -> bool:
    """Whether ``page`` is recorded at ``rate`` (the rule, for readers and tests)."""
    b = bound(rate)
    return b is None or page < b


@dataclass(frozen=True)
class RecorderSnapshot:
    """The recorder's counters (exported as metrics)."""

    #: Records written to disk, by kind.
    records: Mapping[str, int]
    #: Records dropped, by reason (``DROP_REASONS``).
    dropped: Mapping[str, int]
    #: Compressed bytes written (all files, deleted ones included).
    written_bytes: int
    #: Bytes on disk now, over this instance's files.
    disk_bytes: int
    files_deleted: int


def instance_name(host: str, port: int | None, labels: Mapping[str, Any]) -> str:
    """``host:port`` (or ``host``) plus the DP/TP/PP ranks: the trace's instance."""
    name = f"{host}:{port}" if port else host
    ranks = "".join(
        f"-{key[:2]}{labels[key]}" for key in ("dp_rank", "tp_rank", "pp_rank") if key in labels
    )
    return name + ranks


class Recorder:
    """Records the cache's traffic (module docstring): a ``BeliefObserver`` (in a
    ``Tee``); the write path calls ``written`` and ``prefetch``; the tree's insert is
    ``bracket``-ed (``begin_request``/``end_request`` do the same around code a
    caller runs itself: tests, tools).  ``start()`` starts the writer thread,
    ``close()`` drains and closes the file.  Scheduler-thread methods never raise
    and never block."""

    def __init__(
        self,
        section: RecorderSection,
        *,
        instance: str | None = None,
        header: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rate = float(section.sample_rate)
        self._bound = bound(self.rate)
        # Already absolute through Config (config._PATHS); a hand-built section's here.
        self.directory = Path(section.path).expanduser().absolute()
        self.max_bytes = int(section.max_bytes)
        self.file_bytes = min(int(section.file_bytes), self.max_bytes // 2)
        self.capacity = int(section.queue_records)
        self.flush_interval_s = float(section.flush_interval_s)
        self.instance = instance or socket.gethostname()
        self._prefix = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.instance)[:120] or "instance"
        self._clock = clock
        self._t0 = clock()
        self.started_unix = wall()
        self._header_extra = dict(header or {})
        self.page_size = 0
        #: What the cache's ``Tee`` calls (``Tap``): the hot path, in C; it holds the
        #: records until the writer takes them.
        self.tap = Tap(self._bound, self.capacity, clock)
        #: ``written(pool, pages)``: the write path launched an L3 write of ``pages``;
        #: ``prefetch(pool, chain, hit_pages)``: a rank-agreed prefetch hit query on
        #: ``chain``, L3 holding its first ``hit_pages``.  The tap's own (compiled: one
        #: C call, where the Python methods ran four frames, cold, once a query).
        self.written: Callable[[str, Sequence[str]], None] = self.tap.written
        self.prefetch: Callable[[str, Sequence[str], int], None] = self.tap.prefetch
        # counters (the writer's; the tap counts drops and its own failures)
        self.write_errors = 0
        self._records = dict.fromkeys(KINDS, 0)
        self.written_bytes = 0
        self.files_deleted = 0
        # writer state (writer thread only, after start)
        self._files: list[tuple[Path, int]] = []  # closed files of this instance, oldest first
        self._current: Path | None = None
        self._raw: Any = None
        self._part = 0
        self._retry_at = 0.0
        self._warned = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # writer vs close(): one drain at a time

    @classmethod
    def from_config(
        cls,
        section: RecorderSection,
        labels: Any,
        *,
        instance: str | None = None,
        host_mode: str = "",
    ) -> Recorder | None:
        """The recorder this process runs, or ``None`` (disabled, or ``ranks: first``
        off TP and PP rank 0); ``labels`` (``DeploymentLabels``) go in every header."""
        if not section.enabled:
            return None
        values = labels.as_dict()
        if section.ranks == "first" and (values["tp_rank"] != "0" or values["pp_rank"] != "0"):
            return None
        name = instance or instance_name(socket.gethostname(), None, values)
        header = {"labels": values, "host_memory_mode": host_mode}
        return cls(section, instance=name, header=header)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Recorder:
        """Start the writer thread (records queue up before it)."""
        if self._thread is None:
            logger.info(
                "hicache-existence: recording a trace (sample rate %g) to %s/%s-*%s",
                self.rate,
                self.directory,
                self._prefix,
                SUFFIX,
            )
            self._thread = threading.Thread(target=self._run, name="hx-recorder", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, close the file, stop the writer (bounded wait)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if thread is None or not thread.is_alive():
            with self._lock:
                self._drain()
                self._close_file()

    def set_page_size(self, page_size: int) -> None:
        """Tokens per page, for the header of the files opened from now on."""
        if isinstance(page_size, int) and page_size > 0:
            self.page_size = page_size

    # -- the scheduler side ------------------------------------------------------------
    # BeliefObserver, through the tap (the runtime puts ``tap`` itself in the Tee)
    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        """A lookup walked ``hashes[:stop]`` (and missed at ``hashes[stop]``)."""
        self.tap.touched(pool, hashes, stop)

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self.tap.added(pool, hashes)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        self.tap.invalidated(pool, hashes, keep_pages)

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """In-flight refs are not part of the stream (writes are recorded at launch)."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        self.tap.cleared(pool, inflight_only)

    def begin_request(self) -> None:
        """An insert of a request's prompt starts: its lookups carry its number."""
        tap = self.tap
        tap.numbered += 1
        tap.request = tap.numbered

    def bracket(self, insert: Callable[..., Any]) -> Callable[..., Any]:
        """``insert`` with each call one request (``begin_request``, the call,
        ``end_request``, even when it raises; a full queue's drop counts in the tap):
        what the tree's insert becomes in a server with a recorder.  Compiled, one C
        call per insert (``Tap.bracket``): those Python frames cost 4-8 us an insert
        in the server's cold state."""
        return self.tap.bracket(insert)  # type: ignore[no-any-return]

    def end_request(self) -> None:
        number = self.tap.request
        self.tap.request = 0
        if number:
            self.tap.ended(number)

    # -- reading -----------------------------------------------------------------------
    def snapshot(self) -> RecorderSnapshot:
        """Counters now (any thread)."""
        return RecorderSnapshot(
            dict(self._records),
            {
                "queue_full": self.tap.dropped,
                "write_error": self.write_errors + self.tap.errors,
            },
            self.written_bytes,
            self._disk_bytes(),
            self.files_deleted,
        )

    def _disk_bytes(self) -> int:
        """This instance's closed files plus the open one (any thread)."""
        disk = sum(size for _, size in list(self._files))
        raw = self._raw
        if raw is not None:
            with contextlib.suppress(Exception):
                disk += raw.tell()
        return disk

    # -- the writer thread -------------------------------------------------------------
    def _run(self) -> None:
        with contextlib.suppress(Exception):
            self._scan()
        while not self._stop.wait(self.flush_interval_s):
            with self._lock:
                try:
                    self._drain()
                except Exception as exc:  # never let the writer die silently
                    self._warn(f"recorder writer error: {exc!r}")
        with self._lock:
            with contextlib.suppress(Exception):
                self._drain()
            self._close_file()

    def _scan(self) -> None:
        """This instance's files from earlier runs count against ``max_bytes``."""
        found = []
        for path in self.directory.glob(f"{self._prefix}-*{SUFFIX}"):
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path.name, path, path.stat().st_size))
        found.sort()
        self._files = [(path, size) for _, _, path, size in found]

    def _drain(self) -> None:
        """Write what the tap holds, in the order it happened (a request's lookups
        before its end), taken ``TAKE_RECORDS`` at a time: each take holds the GIL
        while it makes its tuples."""
        chunk: list[str] = []
        kinds: list[str] = []
        size = 0
        t0 = self._t0
        # (The compiled encoder takes float times only: a test's int clock skips it.)
        encode = _native_encode if type(t0) is float else None
        take = self.tap.take
        while True:
            batch = take(TAKE_RECORDS)
            for record in batch:
                try:
                    try:
                        line = self._encode(record) if encode is None else encode(record, t0)
                    except TypeError:  # a record the compiled encoder does not take
                        line = self._encode(record)
                except Exception:
                    self.write_errors += 1
                    continue
                if line is None:
                    continue
                chunk.append(line)
                kinds.append(record[1])
                size += len(line)
                if size >= CHUNK_BYTES:
                    self._write(chunk, kinds)
                    chunk, kinds, size = [], [], 0
            if len(batch) < TAKE_RECORDS:
                break
        if chunk:
            self._write(chunk, kinds)

    def _encode(self, r: tuple[Any, ...]) -> str | None:
        """One record as a JSON line (``None``: nothing left to record)."""
        t, kind, pool, pages, idx, extra, request = r
        out: dict[str, Any] = {"timestamp": round((t - self._t0) * 1000.0, 3), "kind": kind}
        if kind == REQUEST:
            out["request"] = extra
            return json.dumps(out, separators=(",", ":")) + "\n"
        out["pool"] = str(pool)
        if kind == LOOKUP:
            if idx is None:
                walked, miss = min(extra, len(pages)), extra < len(pages)
            else:
                walked = bisect_left(idx, extra)
                miss = walked < len(idx) and idx[walked] == extra
            out["pages"] = [str(p) for p in pages]
            out["walked"] = walked
            if miss:
                out["miss"] = True
            if request:
                out["request"] = request
        elif kind == INVALIDATE:
            first = extra if idx is None else bisect_left(idx, extra)
            if first >= len(pages):
                return None
            out["pages"] = [str(p) for p in pages[first:]]
        elif kind != CLEAR:
            out["pages"] = [str(p) for p in pages]
            if kind == PREFETCH:
                out["hit"] = extra
        return json.dumps(out, separators=(",", ":")) + "\n"

    def _write(self, lines: list[str], kinds: list[str]) -> None:
        """Write one chunk as one complete gzip member (its records dropped and
        counted on failure, the partial member cut off again)."""
        if self._raw is None and not self._open():
            self.write_errors += len(lines)
            return
        raw = self._raw
        assert raw is not None
        before = 0
        try:
            before = raw.tell()
            self._member(raw, "".join(lines))
            self.written_bytes += raw.tell() - before
        except Exception as exc:
            self.write_errors += len(lines)
            self._warn(f"cannot write the trace to {self._current}: {exc!r}; records dropped")
            with contextlib.suppress(Exception):
                raw.seek(before)
                raw.truncate()
            self._close_file()
            self._retry_at = self._clock() + RETRY_S
            return
        for kind in kinds:
            self._records[kind] += 1
        if raw.tell() >= self.file_bytes:
            self._close_file()
        self._bound_disk()

    @staticmethod
    def _member(raw: Any, text: str) -> None:
        """``text`` as one gzip member: a file cut short by a killed process keeps
        every member before the cut readable."""
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as gz:
            gz.write(text.encode("utf-8"))
        raw.flush()

    def _open(self) -> bool:
        if self._clock() < self._retry_at:
            return False
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started_unix))
        stamp += f"{self.started_unix % 1:.3f}"[1:]
        raw: Any = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for _ in range(1000):  # a name taken (another recorder of this process): the next
                self._part += 1
                name = f"{self._prefix}-{stamp}-{os.getpid()}-{self._part:05d}{SUFFIX}"
                path = self.directory / name
                with contextlib.suppress(FileExistsError):
                    raw = open(path, "xb")  # noqa: SIM115 (closed by _close_file)
                    break
            else:
                raise FileExistsError(f"no free file name for {self._prefix} in {self.directory}")
            self._member(raw, self._header_line())
        except Exception as exc:
            what = f"open a trace file in {self.directory}"
            if raw is not None:  # opened, but its header could not be written
                what = f"write the trace header to {path}"
                with contextlib.suppress(Exception):
                    raw.close()
                with contextlib.suppress(OSError):
                    path.unlink()
            self._warn(f"cannot {what}: {exc!r}; records dropped")
            self._retry_at = self._clock() + RETRY_S
            return False
        self._raw, self._current = raw, path
        self.written_bytes += raw.tell()
        return True

    def _header_line(self) -> str:
        header: dict[str, Any] = {
            "format": FORMAT_TAG,
            "version": VERSION,
            "sample_rate": self.rate,
            "sampling": SAMPLING,
            "instance": self.instance,
            "started_unix": round(self.started_unix, 3),
            "pid": os.getpid(),
            "part": self._part,
        }
        if self.page_size:
            header["page_size"] = self.page_size
        header = {**self._header_extra, **header}  # the extra never overrides
        return json.dumps(header, separators=(",", ":"), sort_keys=True) + "\n"

    def _close_file(self) -> None:
        raw, path = self._raw, self._current
        self._raw = self._current = None
        if raw is None or path is None:
            return
        size = 0
        with contextlib.suppress(Exception):
            size = raw.tell()
        try:
            raw.close()
        except Exception as exc:
            self._warn(f"cannot close the trace file {path}: {exc!r}")
        with contextlib.suppress(OSError):
            size = path.stat().st_size
        self._files.append((path, size))

    def _bound_disk(self) -> None:
        """Delete this instance's oldest files while the total exceeds ``max_bytes``."""
        total = self._disk_bytes()
        while self._files and total > self.max_bytes:
            path, size = self._files.pop(0)
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
            self.files_deleted += 1

    def _warn(self, message: str) -> None:
        now = self._clock()
        if now - self._warned >= 60.0 or not self._warned:
            self._warned = now or 1e-9
            logger.warning("hicache-existence: %s", message)

    def __repr__(self) -> str:
        return (
            f"<Recorder rate={self.rate:g} path={str(self.directory)!r} waiting={self.tap.waiting}>"
        )
