"""Expand a trace into SGLang-shaped page-hash chains (docs/replay.md, "From
blocks to pages").

A Mooncake block is ``block_tokens / page_size`` pages, each hash the SHA-256 hex
of (parent digest, block id as 8 bytes LE, index in the block as 4 bytes LE) from
a fixed root, so two requests share exactly the pages of their common prefix.
Equal ids under another parent (which a consistent trace never has) give other
pages, as a real chain would.  Page traces carry their hashes; they are only
interned (one object per string, as the radix tree shares them) and cut into
model nodes of ``node_pages`` pages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from hicache_existence.replay.trace import MAX_PAGES_PER_REQUEST, Request, Trace, TraceError

PartialPages = Literal["ceil", "floor"]

DEFAULT_PAGE_SIZE = 64
#: Model node size for page traces, which carry no blocks (a Mooncake block at 64 tokens/page).
DEFAULT_NODE_PAGES = 8
_ROOT = hashlib.sha256(b"hicache-existence/replay/root").digest()
_T = TypeVar("_T")


def counted(items: Sequence[_T], progress: Callable[[int, int], None] | None) -> Iterator[_T]:
    """``items``, calling ``progress(done, total)`` after every twentieth of them."""
    total = len(items)
    step = max(1, total // 20)
    for number, item in enumerate(items, 1):
        yield item
        if progress is not None and number % step == 0:
            progress(number, total)


@dataclass(frozen=True, slots=True)
class PageRequest:
    """One request as the existence cache sees it."""

    timestamp_ms: float
    pool: str
    #: The request's page hashes, in chain order.
    pages: tuple[str, ...]
    #: End index (exclusive) of each radix node of the chain, ascending; the last is ``len(pages)``.
    node_ends: tuple[int, ...]


@dataclass(frozen=True)
class PageTrace:
    """A trace expanded to pages."""

    source: str
    format: str
    page_size: int
    requests: tuple[PageRequest, ...]

    @property
    def references(self) -> int:
        """Page references over all requests."""
        return sum(len(r.pages) for r in self.requests)


def chained(parent: bytes, tag: bytes, count: int) -> tuple[tuple[str, ...], bytes]:
    """The ``count`` chained page hashes of ``tag`` (a block id, 8 bytes LE) under
    ``parent``, and the last digest."""
    out = []
    digest = parent
    for index in range(count):
        digest = hashlib.sha256(digest + tag + index.to_bytes(4, "little")).digest()
        out.append(digest.hex())
    return tuple(out), digest


def chunk_ends(length: int, node_pages: int) -> tuple[int, ...]:
    """Node end indices cutting ``length`` pages into nodes of ``node_pages``."""
    return tuple(min(end, length) for end in range(node_pages, length + node_pages, node_pages))


def expand(
    trace: Trace,
    page_size: int = DEFAULT_PAGE_SIZE,
    *,
    partial_pages: PartialPages = "ceil",
    node_pages: int = DEFAULT_NODE_PAGES,
    salt: bytes = b"",
    progress: Callable[[int, int], None] | None = None,
) -> PageTrace:
    """Expand every request of ``trace`` to its page chain (deterministic).

    ``salt`` changes every Mooncake page hash while keeping the sharing structure
    (for experiments that need independent hash draws, e.g. sampling variance)."""
    requests = counted(trace.requests, progress)
    if trace.format == "mooncake":
        if trace.block_tokens % page_size:
            raise ValueError(
                f"page_size {page_size} must divide the trace's block size "
                f"{trace.block_tokens} tokens"
            )
        if trace.block_tokens // page_size > MAX_PAGES_PER_REQUEST:
            raise ValueError(
                f"a block of {trace.block_tokens} tokens is more than {MAX_PAGES_PER_REQUEST} "
                f"pages of {page_size} tokens"
            )
        memo: dict[tuple[bytes, int], tuple[tuple[str, ...], bytes]] = {}
        root = hashlib.sha256(_ROOT + salt).digest() if salt else _ROOT
        out = []
        for r in requests:
            # The page traces' bound, before anything is hashed: a few bytes of ids
            # must not expand to tens of millions of pages.
            if -(-r.input_length // page_size) > MAX_PAGES_PER_REQUEST:
                raise TraceError(
                    trace.source,
                    r.line,
                    f"input_length {r.input_length} is more than {MAX_PAGES_PER_REQUEST} "
                    f"pages of {page_size} tokens",
                )
            out.append(
                _expand_mooncake(r, trace.block_tokens, page_size, partial_pages, memo, root)
            )
    else:
        canon: dict[str, str] = {}
        out = []
        for request in requests:
            pages = tuple(map(canon.setdefault, request.pages, request.pages))
            out.append(
                PageRequest(
                    request.timestamp_ms, request.pool, pages, chunk_ends(len(pages), node_pages)
                )
            )
    return PageTrace(trace.source, trace.format, page_size, tuple(out))


def _expand_mooncake(
    request: Request,
    block_tokens: int,
    page_size: int,
    partial_pages: PartialPages,
    memo: dict[tuple[bytes, int], tuple[tuple[str, ...], bytes]],
    root: bytes,
) -> PageRequest:
    ids = request.hash_ids
    pages: list[str] = []
    ends: list[int] = []
    parent = root
    last = len(ids) - 1
    for index, block in enumerate(ids):
        key = (parent, block)
        found = memo.get(key)
        if found is None:
            tag = block.to_bytes(8, "little")
            found = memo[key] = chained(parent, tag, block_tokens // page_size)
        hexes, parent = found
        if index == last:
            remaining = request.input_length - last * block_tokens
            ceil = partial_pages == "ceil"
            pages.extend(hexes[: -(-remaining // page_size) if ceil else remaining // page_size])
        else:
            pages.extend(hexes)
        if not ends or ends[-1] != len(pages):
            ends.append(len(pages))
    return PageRequest(request.timestamp_ms, request.pool, tuple(pages), tuple(ends))
