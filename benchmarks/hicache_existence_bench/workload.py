"""Synthetic page-hash chains shaped like SGLang's.

SGLang keys a page by a 64-hex SHA-256 chained from its parent page, so a
request's pages form a chain and equal chains share prefixes.  The benchmark
chains are built the same way (deterministically from a seed), and every cache
under test receives the *same* string objects, as it would from SGLang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator


def chain(seed: int, length: int, salt: str = "") -> list[str]:
    """``length`` chained 64-hex page hashes, deterministic in ``(seed, salt)``."""
    out: list[str] = []
    prev = hashlib.sha256(f"{salt}root:{seed}".encode()).digest()
    for page in range(length):
        prev = hashlib.sha256(prev + page.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def chains(count: int, length: int, salt: str = "", start: int = 0) -> list[list[str]]:
    """``count`` independent chains."""
    return [chain(start + i, length, salt) for i in range(count)]


def round_robin(items: list[list[str]], rounds: int) -> Iterator[list[str]]:
    """Yield ``items`` ``rounds`` times (helper for warm-up loops)."""
    for _ in range(rounds):
        yield from items
