"""Read and validate request traces, failing with the offending line number.

Two formats, both JSON Lines (one object per line, blank lines ignored):

* **Mooncake** (the FAST'25 release): ``timestamp`` (ms), ``input_length`` and
  ``output_length`` (tokens) and ``hash_ids``, one id per ``block_tokens``-token
  block (512 in Mooncake), equal ids meaning an equal prefix up to and including
  that block.  The last block may be partial, so a request must satisfy
  ``(len(hash_ids) - 1) * block_tokens < input_length <= len(hash_ids) * block_tokens``.
* **pages** (this project's): a header line
  ``{"format": "hicache-existence-trace", "version": 1}`` (optional ``page_size``),
  then one request per line: ``timestamp`` (ms), ``pages`` (the request's page
  hashes in chain order, as SGLang computes them) and an optional ``pool``
  (default ``kv``).

Every value is checked (types, signs, ranges, non-decreasing timestamps) and the
whole file is read before anything is returned, so a caller that validates first
never writes partial output for a bad trace.  Unknown extra fields are ignored,
so traces with more columns still load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TraceFormat = Literal["mooncake", "pages"]

#: The header tag of the project's own format.
FORMAT_TAG = "hicache-existence-trace"
FORMAT_VERSION = 1
#: Mooncake's block size in tokens.
MOONCAKE_BLOCK_TOKENS = 512

#: Upper bounds that reject corrupt values before they allocate anything.
MAX_TOKENS = 2**31 - 1
MAX_BLOCK_ID = 2**63 - 1
MAX_TIMESTAMP_MS = float(2**53)
MAX_PAGES_PER_REQUEST = 2**24
MAX_HASH_CHARS = 256
MAX_POOL_CHARS = 64


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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _lines(path: Path, source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line, or ``TraceError``."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(source, 0, f"cannot read the trace: {exc.strerror or exc}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
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
                raise TraceError(
                    source, number, f"expected a JSON object, got {type(obj).__name__}"
                )
            yield number, obj


class _Fields:
    """Typed field accessors that word errors with the source and line."""

    def __init__(self, source: str, line: int, obj: dict[str, Any]) -> None:
        self.source = source
        self.line = line
        self.obj = obj

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
        if isinstance(value, bool) or not isinstance(value, (int, float)):
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


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else None
    if text is None:
        return "an object" if isinstance(value, dict) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _mooncake(f: _Fields, block_tokens: int) -> Request:
    timestamp = f.timestamp()
    input_length = f.integer("input_length", MAX_TOKENS)
    output_length = f.integer("output_length", MAX_TOKENS)
    raw_ids = f.array("hash_ids")
    ids = tuple(raw_ids)
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
    timestamp = f.timestamp()
    pages = f.array("pages")
    if len(pages) > MAX_PAGES_PER_REQUEST:
        raise f.fail(f"field 'pages' has too many entries: {len(pages)} > {MAX_PAGES_PER_REQUEST}")
    for index, page in enumerate(pages):
        if not isinstance(page, str):
            raise f.fail(f"pages[{index}] must be a string page hash, got {_show(page)}")
        if not 0 < len(page) <= MAX_HASH_CHARS:
            raise f.fail(f"pages[{index}] must have 1..{MAX_HASH_CHARS} characters")
    pool = f.obj.get("pool", "kv")
    if not isinstance(pool, str) or not 0 < len(pool) <= MAX_POOL_CHARS:
        raise f.fail(f"field 'pool' must be a non-empty string of <= {MAX_POOL_CHARS} characters")
    return Request(f.line, timestamp, pool, 0, 0, (), tuple(pages))


def _header(f: _Fields, source: str) -> int | None:
    if f.obj.get("format") != FORMAT_TAG:
        raise f.fail(f"header 'format' must be {FORMAT_TAG!r}, got {_show(f.obj.get('format'))}")
    version = f.obj.get("version")
    if version != FORMAT_VERSION:
        raise f.fail(f"unsupported trace version {_show(version)}; expected {FORMAT_VERSION}")
    if "page_size" not in f.obj:
        return None
    return f.integer("page_size", MAX_TOKENS) or None


def read_trace(
    path: str | Path,
    fmt: Literal["auto", "mooncake", "pages"] = "auto",
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Read and validate a whole trace; ``TraceError`` names the line of the first problem."""
    if fmt not in ("auto", "mooncake", "pages"):
        raise ValueError(f"fmt must be 'auto', 'mooncake' or 'pages', got {fmt!r}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    path = Path(path)
    source = str(path)
    requests: list[Request] = []
    detected: TraceFormat | None = None
    page_size: int | None = None
    last_time = 0.0
    for number, obj in _lines(path, source):
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
                page_size = _header(f, source)
                continue
            detected = "mooncake"
        elif "format" in obj and "timestamp" not in obj:
            raise f.fail("a header line is only allowed as the first line")
        request = _mooncake(f, block_tokens) if detected == "mooncake" else _pages(f)
        if request.timestamp_ms < last_time:
            raise f.fail(
                f"timestamps must not decrease: {request.timestamp_ms:g} after {last_time:g}"
            )
        last_time = request.timestamp_ms
        requests.append(request)
    if not requests:
        raise TraceError(source, 0, "the trace has no requests")
    assert detected is not None
    return Trace(
        source,
        detected,
        tuple(requests),
        block_tokens if detected == "mooncake" else 0,
        page_size,
    )
