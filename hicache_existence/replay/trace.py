"""Read and validate request traces, failing with the offending line number.

JSON Lines in three shapes (docs/replay.md, "Traces" and "The recorded format"):
Mooncake (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``),
this project's pages (a header, then ``timestamp``, ``pages``, ``pool``) and its
version 2, the recorder's events (``accounting.recorder``; gzip compressed, or a
directory of recorder files read as one trace).  Every value is checked (types,
signs, ranges, non-decreasing timestamps) and the whole file is read before
anything is returned, so a caller never writes partial output for a bad trace.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from hicache_existence.accounting import recorder as _recorder

TraceFormat = Literal["mooncake", "pages"]

FORMAT_TAG = _recorder.FORMAT_TAG
#: Version 1: one request per line.  Version 2: the recorder's events.
FORMAT_VERSIONS = (1, _recorder.VERSION)
#: Mooncake's block size in tokens.
MOONCAKE_BLOCK_TOKENS = 512

#: Upper bounds that reject corrupt values before they allocate anything.
MAX_TOKENS = 2**31 - 1
MAX_BLOCK_ID = 2**63 - 1
MAX_TIMESTAMP_MS = float(2**53)
MAX_PAGES_PER_REQUEST = 2**24
MAX_HASH_CHARS = 256
MAX_POOL_CHARS = 64
#: Longest line read (bytes): a compressed line is never inflated past it (a gzip
#: bomb of one long line would otherwise take ~3x its inflated size in memory).
MAX_LINE_BYTES = 1 << 27
#: A gzip member's lines are held until its end is read, up to this many bytes (the
#: recorder's members hold about ``recorder.CHUNK_BYTES``); a larger one streams.
HOLD_BYTES = 8 << 20
#: Bytes a compressed file is inflated by at a time.
INFLATE_BYTES = 1 << 20


class TraceError(ValueError):
    """A trace cannot be read; ``line`` is the 1-based line number (0: the file)."""

    def __init__(self, source: str, line: int, problem: str) -> None:
        self.source = source
        self.line = line
        self.problem = problem
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace (either format)."""

    line: int
    timestamp_ms: float
    pool: str
    #: Prompt tokens (Mooncake); 0 for page traces, whose unit is the page.
    input_length: int
    output_length: int
    #: Mooncake block ids (empty for page traces).
    hash_ids: tuple[int, ...]
    #: Explicit page hashes (empty for Mooncake traces).
    pages: tuple[str, ...]
    #: Recorded traces: the instance (``Trace.instances`` index) that served it.
    instance: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded event of a version-2 trace."""

    line: int
    timestamp_ms: float
    #: One of ``recorder.KINDS``.
    kind: str
    pool: str
    #: The recorded (sampled) pages of the operation, in order.
    pages: tuple[str, ...]
    #: Lookups: how many of ``pages`` the lookup walked (hits or rescues).
    walked: int = 0
    #: Lookups: the lookup stopped at ``pages[walked]`` (a recorded page).
    miss: bool = False
    #: Lookups made inside a request's insert, and request records: its number (0: none).
    request: int = 0
    #: Prefetch hit queries: how many of ``pages`` L3 held.
    hit: int = 0
    #: Index into ``Trace.instances``.
    instance: int = 0
    #: The recording process of that instance (0, 1, ... in start order: a restart
    #: begins with an empty cache, and its request numbers start again).
    run: int = 0


@dataclass(frozen=True)
class Trace:
    """A whole validated trace."""

    source: str
    format: TraceFormat
    requests: tuple[Request, ...]
    #: Mooncake: tokens per hash id.  Page traces: 0.
    block_tokens: int
    #: Page traces may declare the page size their hashes were made with.
    page_size: int | None = None
    #: Page traces: 1, or 2 for a recorded trace (``events``).
    version: int = 1
    #: Version 2: the share of pages recorded (1 for other traces).
    sample_rate: float = 1.0
    #: Version 2: the recorded events, instance by instance, each in time order.
    events: tuple[Event, ...] = ()
    #: Version 2: the instances recorded (``Event.instance`` indexes it).
    instances: tuple[str, ...] = field(default=())
    #: What was read around, for the reader to see: a recorder file's last flush
    #: cut short and left out, or a file with no complete flush skipped.
    notes: tuple[str, ...] = ()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _raw_lines(path: Path, source: str, notes: list[str]) -> Iterator[bytes]:
    """The file's lines as bytes, decompressed when it is gzip (``TraceError`` for a
    truncated or corrupt compressed file, naming the last complete line; ``notes``
    gets what was read around)."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(source, 0, f"cannot read the trace: {exc.strerror or exc}") from None
    with handle:
        if handle.read(2) != b"\x1f\x8b":
            handle.seek(0)
            number = 0
            while line := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES:
                    raise TraceError(source, number, _too_long())
                yield line
            return
        handle.seek(0)
        yield from _gzip_lines(handle, source, notes)


def _too_long() -> str:  # read at the call: a test lowers MAX_LINE_BYTES
    return f"line longer than {MAX_LINE_BYTES} bytes (a corrupt or hostile trace)"


class _CutShort(TraceError):
    """A compressed file whose first member is cut short: nothing in it is whole."""


def _gzip_lines(handle: Any, source: str, notes: list[str]) -> Iterator[bytes]:
    """The lines of a gzip stream of one or more members (the recorder writes one
    per flush), or ``TraceError`` naming the first line it could not read.

    A member's lines are held until its end (and CRC) is read, so a last member
    cut short (a recorder still writing it, a server killed mid-flush) is left out
    whole, with a note, and the file reads up to its last complete flush.  Only a
    member larger than ``HOLD_BYTES`` streams; cut short, it fails the read."""
    lines = members = held_bytes = 0
    held: list[bytes] = []  # the current member's lines, not yet given
    streamed = False  # the current member has given lines before its end
    tail: list[bytes] = []  # the pieces of a line not yet ended
    tail_bytes = 0
    start_tail: list[bytes] = []  # the same where the member began
    inflate: Any = None  # the current member's decompressor
    pending = b""
    while True:
        if not pending:
            try:
                pending = handle.read(1 << 16)
            except OSError as exc:
                raise TraceError(source, lines + 1, f"cannot read the trace: {exc}") from None
            if not pending:
                break
        if inflate is None:
            pending = pending.lstrip(b"\0")  # padding between members, as gzip allows
            if not pending:
                continue
            inflate, start_tail, streamed = zlib.decompressobj(wbits=31), list(tail), False
        try:  # at most INFLATE_BYTES at a time: deflate inflates up to ~1000x
            data = inflate.decompress(pending, INFLATE_BYTES)
        except zlib.error as exc:
            raise TraceError(
                source, lines + 1, f"not a readable gzip stream after line {lines} ({exc})"
            ) from None
        pending = inflate.unconsumed_tail
        parts = data.split(b"\n")
        if len(parts) > 1:
            parts[0] = b"".join((*tail, parts[0]))
            tail, tail_bytes = [], 0
        for part in parts[:-1]:
            if len(part) >= MAX_LINE_BYTES:
                raise TraceError(source, lines + len(held) + 1, _too_long())
            held.append(part + b"\n")
            held_bytes += len(part) + 1
        if parts[-1]:
            tail.append(parts[-1])
            tail_bytes += len(parts[-1])
            if tail_bytes > MAX_LINE_BYTES:
                raise TraceError(source, lines + len(held) + 1, _too_long())
        if inflate.eof or held_bytes > HOLD_BYTES:
            lines += len(held)
            yield from held
            held, held_bytes, streamed = [], 0, not inflate.eof
        if inflate.eof:
            members += 1
            pending, inflate = inflate.unused_data, None
    if inflate is not None:
        ends = f"the compressed file ends early after line {lines}: truncated (a recorder "
        if streamed or not members:
            err = _CutShort if not members and not streamed else TraceError
            raise err(
                source,
                lines + 1,
                ends + "still writing it, or a server stopped without closing it)",
            )
        notes.append(
            f"{source}: {ends}still writing it, or a server killed mid-flush); read up to its "
            "last complete flush"
        )
        tail = start_tail
    if tail:
        yield b"".join(tail)


def _lines(path: Path, source: str, notes: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line, or ``TraceError``."""
    for number, raw in enumerate(_raw_lines(path, source, notes), 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(source, number, f"not UTF-8 text ({exc.reason})") from None
        if not text.strip():
            continue
        # Without its line break, so an error at the end of a truncated line
        # reports that line's column, not column 1 of a line after it.
        text = text.rstrip("\r\n")
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise TraceError(
                source, number, f"invalid JSON: {exc.msg} (column {exc.pos + 1})"
            ) from None
        except (ValueError, RecursionError) as exc:
            raise TraceError(source, number, f"invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceError(source, number, f"expected a JSON object, got {type(obj).__name__}")
        yield number, obj


@dataclass(frozen=True, slots=True)
class _Fields:
    """Typed field accessors that word errors with the source and line."""

    source: str
    line: int
    obj: dict[str, Any]

    def fail(self, problem: str) -> TraceError:
        return TraceError(self.source, self.line, problem)

    def require(self, name: str) -> Any:
        if name not in self.obj:
            raise self.fail(f"missing field {name!r}")
        return self.obj[name]

    def integer(self, name: str, maximum: int, *, default: int | None = None) -> int:
        if default is not None and name not in self.obj:
            return default
        value = self.require(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"field {name!r} must be an integer, got {_show(value)}")
        if value < 0:
            raise self.fail(f"field {name!r} must be >= 0, got {value}")
        if value > maximum:
            raise self.fail(f"field {name!r} is too large: {value} > {maximum}")
        return value

    def timestamp(self) -> float:
        value = self.require("timestamp")
        if not _is_number(value):
            raise self.fail(f"field 'timestamp' must be a number (ms), got {_show(value)}")
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise self.fail(f"field 'timestamp' must be a finite number >= 0, got {value}")
        if number > MAX_TIMESTAMP_MS:
            raise self.fail(f"field 'timestamp' is too large: {value} > {MAX_TIMESTAMP_MS:.0f}")
        return number

    def array(self, name: str) -> list[Any]:
        value = self.require(name)
        if not isinstance(value, list):
            raise self.fail(f"field {name!r} must be an array, got {_show(value)}")
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else None
    if text is None:
        return "an object" if isinstance(value, dict) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _mooncake(f: _Fields, block_tokens: int) -> Request:
    timestamp = f.timestamp()
    input_length = f.integer("input_length", MAX_TOKENS)
    output_length = f.integer("output_length", MAX_TOKENS)
    ids = tuple(f.array("hash_ids"))
    for index, block in enumerate(ids):
        if isinstance(block, bool) or not isinstance(block, int):
            raise f.fail(f"hash_ids[{index}] must be an integer, got {_show(block)}")
        if not 0 <= block <= MAX_BLOCK_ID:
            raise f.fail(f"hash_ids[{index}] must be within [0, 2**63), got {block}")
    blocks = len(ids)
    low = (blocks - 1) * block_tokens
    high = blocks * block_tokens
    if not (low < input_length <= high or (blocks == 0 and input_length == 0)):
        raise f.fail(
            f"input_length {input_length} does not match {blocks} hash_ids of "
            f"{block_tokens} tokens (needs {max(low, 0) + (1 if blocks else 0)}"
            f"..{high} tokens)"
        )
    return Request(f.line, timestamp, "kv", input_length, output_length, ids, ())


def _pages(f: _Fields) -> Request:
    timestamp, pages = f.timestamp(), _page_list(f)
    return Request(f.line, timestamp, _pool(f), 0, 0, (), pages)


@dataclass
class _Header:
    version: int
    page_size: int | None
    sample_rate: float = 1.0
    instance: str = ""
    started_unix: float = 0.0
    part: int = 0
    pid: int = 0


def _header(f: _Fields) -> _Header:
    if f.obj.get("format") != FORMAT_TAG:
        raise f.fail(f"header 'format' must be {FORMAT_TAG!r}, got {_show(f.obj.get('format'))}")
    version = f.obj.get("version")
    if isinstance(version, bool) or version not in FORMAT_VERSIONS:
        raise f.fail(
            f"unsupported trace version {_show(version)}; expected one of "
            f"{', '.join(map(str, FORMAT_VERSIONS))}"
        )
    page_size = f.integer("page_size", MAX_TOKENS, default=0) or None
    if version == 1:
        return _Header(1, page_size)
    rate = f.require("sample_rate")
    if not _is_number(rate) or not 0 < rate <= 1:
        raise f.fail(f"header 'sample_rate' must be a number within (0, 1], got {_show(rate)}")
    instance = f.obj.get("instance", "")
    if not isinstance(instance, str) or len(instance) > 256:
        raise f.fail("header 'instance' must be a string of <= 256 characters")
    started = f.obj.get("started_unix", 0.0)
    if not _is_number(started) or not 0 <= started < MAX_TIMESTAMP_MS / 1000:
        raise f.fail(f"header 'started_unix' must be a time in seconds, got {_show(started)}")
    part = f.integer("part", MAX_TOKENS, default=0)
    pid = f.integer("pid", MAX_TOKENS, default=0)
    return _Header(int(version), page_size, float(rate), instance, float(started), part, pid)


def _pool(f: _Fields) -> str:
    pool = f.obj.get("pool", "kv")
    if not isinstance(pool, str) or not 0 < len(pool) <= MAX_POOL_CHARS:
        raise f.fail(f"field 'pool' must be a non-empty string of <= {MAX_POOL_CHARS} characters")
    return pool


def _event(f: _Fields) -> Event:
    timestamp = f.timestamp()
    kind = f.require("kind")
    if kind not in _recorder.KINDS:
        raise f.fail(f"field 'kind' must be one of {', '.join(_recorder.KINDS)}, got {_show(kind)}")
    if kind == _recorder.REQUEST:
        number = f.integer("request", MAX_BLOCK_ID)
        return Event(f.line, timestamp, kind, "", (), request=number)
    pool = _pool(f)
    if kind == _recorder.CLEAR:
        return Event(f.line, timestamp, kind, pool, ())
    pages = _page_list(f)
    walked = hit = request = 0
    miss = False
    if kind == _recorder.LOOKUP:
        walked = f.integer("walked", len(pages))
        miss = f.obj.get("miss", False)
        if not isinstance(miss, bool):
            raise f.fail(f"field 'miss' must be true or false, got {_show(miss)}")
        if miss and walked >= len(pages):
            raise f.fail("a lookup that missed at a recorded page needs walked < len(pages)")
        request = f.integer("request", MAX_BLOCK_ID, default=0)
    elif kind == _recorder.PREFETCH:
        hit = f.integer("hit", len(pages))
    return Event(f.line, timestamp, kind, pool, pages, walked, miss, request, hit)


def _page_list(f: _Fields) -> tuple[str, ...]:
    pages = f.array("pages")
    if len(pages) > MAX_PAGES_PER_REQUEST:
        raise f.fail(f"field 'pages' has too many entries: {len(pages)} > {MAX_PAGES_PER_REQUEST}")
    for index, page in enumerate(pages):
        if not isinstance(page, str):
            raise f.fail(f"pages[{index}] must be a string page hash, got {_show(page)}")
        if not 0 < len(page) <= MAX_HASH_CHARS:
            raise f.fail(f"pages[{index}] must have 1..{MAX_HASH_CHARS} characters")
    return tuple(pages)


def read_trace(
    path: str | Path,
    fmt: Literal["auto", "mooncake", "pages"] = "auto",
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Read and validate a whole trace; ``TraceError`` names the line of the first
    problem.  ``path`` may be a directory of recorder files (version 2), read as one
    trace whose instances each keep their own events."""
    path = Path(path)
    if path.is_dir():
        return _read_recorded_dir(path)
    source = str(path)
    notes: list[str] = []
    header, detected, requests, events = _parse(path, fmt, block_tokens, notes)
    if header is not None and header.version >= 2:
        return _recorded(source, [(header, events)], notes)
    if not requests:
        raise TraceError(source, 0, "the trace has no requests")
    assert detected is not None
    return Trace(
        source,
        detected,
        tuple(requests),
        block_tokens if detected == "mooncake" else 0,
        header.page_size if header is not None else None,
        notes=tuple(notes),
    )


def _parse(
    path: Path, fmt: str, block_tokens: int, notes: list[str]
) -> tuple[_Header | None, TraceFormat | None, list[Request], list[Event]]:
    """One file's header, format and requests (or version-2 events), validated."""
    source = str(path)
    requests: list[Request] = []
    events: list[Event] = []
    detected: TraceFormat | None = None
    header: _Header | None = None
    last_time = 0.0
    for number, obj in _lines(path, source, notes):
        f = _Fields(source, number, obj)
        if detected is None:
            is_header = "format" in obj
            if fmt == "mooncake" and is_header:
                raise f.fail("a page-trace header, but the format was given as mooncake")
            if fmt == "pages" and not is_header:
                raise f.fail(
                    f'page traces start with a header line {{"format": "{FORMAT_TAG}", ...}}'
                )
            if is_header:
                detected = "pages"
                header = _header(f)
                continue
            detected = "mooncake"
        elif "format" in obj and "timestamp" not in obj:
            raise f.fail("a header line is only allowed as the first line")
        if header is not None and header.version >= 2:
            event = _event(f)
            stamp = event.timestamp_ms
            events.append(event)
        else:
            request = _mooncake(f, block_tokens) if detected == "mooncake" else _pages(f)
            stamp = request.timestamp_ms
            requests.append(request)
        if stamp < last_time:
            raise f.fail(f"timestamps must not decrease: {stamp:g} after {last_time:g}")
        last_time = stamp
    return header, detected, requests, events


def _read_recorded_dir(path: Path) -> Trace:
    """Every recorder file of a directory: parts of one process are joined in order."""
    files = sorted(p for p in path.iterdir() if p.name.endswith(_recorder.SUFFIX))
    if not files:
        raise TraceError(str(path), 0, f"no recorder files (*{_recorder.SUFFIX}) in the directory")
    parts: list[tuple[_Header, list[Event]]] = []
    notes: list[str] = []
    for file in files:
        try:
            header, _, _, events = _parse(file, "pages", MOONCAKE_BLOCK_TOKENS, notes)
        except _CutShort as exc:  # a file's first flush cut short: nothing to read
            notes.append(f"{exc}; skipped")
            continue
        if header is None or header.version < 2:
            raise TraceError(str(file), 1, "a directory holds recorder files (version 2) only")
        parts.append((header, events))
    if not parts:
        raise TraceError(str(path), 0, "no recorder file has a complete flush: " + "; ".join(notes))
    return _recorded(str(path), parts, notes)


def _recorded(source: str, parts: list[tuple[_Header, list[Event]]], notes: list[str]) -> Trace:
    """One trace from recorded parts: timestamps made absolute per instance (ms
    after the earliest start), instances numbered, requests rebuilt."""
    rates = {header.sample_rate for header, _ in parts}
    if len(rates) > 1:
        raise TraceError(
            source, 0, f"the files were recorded at different sample rates: {sorted(rates)}"
        )
    pages = {header.page_size for header, _ in parts if header.page_size}
    if len(pages) > 1:
        raise TraceError(source, 0, f"the files declare different page sizes: {sorted(pages)}")
    start = min(header.started_unix for header, _ in parts)
    instances: dict[str, int] = {}
    ordered = sorted(
        parts, key=lambda hp: (hp[0].instance, hp[0].started_unix, hp[0].pid, hp[0].part)
    )
    events: list[Event] = []
    runs: dict[str, list[tuple[float, int]]] = {}
    pools: dict[str, dict[str, None]] = {}
    for header, part in ordered:
        index = instances.setdefault(header.instance, len(instances))
        offset = (header.started_unix - start) * 1000.0
        seen = runs.setdefault(header.instance, [])
        process = (header.started_unix, header.pid)
        if not seen or seen[-1] != process:
            seen.append(process)
            # A new process of the instance starts with an empty cache.
            for pool in pools.get(header.instance, {}):
                events.append(Event(0, offset, _recorder.CLEAR, pool, (), instance=index))
        run = len(seen) - 1
        known = pools.setdefault(header.instance, {})
        for e in part:
            if e.pool:
                known[e.pool] = None
            events.append(replace(e, timestamp_ms=e.timestamp_ms + offset, instance=index, run=run))
    if not events:
        left_out = f" ({'; '.join(notes)})" if notes else ""
        raise TraceError(source, 0, f"the trace has no recorded events{left_out}")
    return Trace(
        source,
        "pages",
        _requests_of(events),
        0,
        next(iter(pages)) if pages else None,
        version=_recorder.VERSION,
        sample_rate=rates.pop(),
        events=tuple(events),
        instances=tuple(instances),
        notes=tuple(notes),
    )


def _requests_of(events: list[Event]) -> tuple[Request, ...]:
    """Requests rebuilt from request records: per pool, the recorded pages of the
    lookups its insert walk made, in order, each page once; ordered by time over
    all instances."""
    chains: dict[tuple[int, int, int], dict[str, dict[str, None]]] = {}
    out: list[Request] = []
    for e in events:
        if e.kind == _recorder.LOOKUP and e.request:
            pools = chains.setdefault((e.instance, e.run, e.request), {})
            pools.setdefault(e.pool, {}).update(dict.fromkeys(e.pages))
        elif e.kind == _recorder.REQUEST:
            pools = chains.pop((e.instance, e.run, e.request), {}) or {"kv": {}}
            out.extend(
                Request(e.line, e.timestamp_ms, pool, 0, 0, (), tuple(pages), e.instance)
                for pool, pages in pools.items()
            )
    return tuple(sorted(out, key=lambda r: r.timestamp_ms))  # stable: ties keep their order
