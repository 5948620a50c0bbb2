"""The seed's ``StorageExistenceCache``: the baseline every benchmark compares against.

This is a reimplementation, for benchmarking only, of the code printed in the
analysis of the upstream change this project grew from (the flat
``(pool, page_hash)`` ``OrderedDict`` at 512K entries with the hoisted-method hot
path).  It is the one upstream reference this repository may carry; it has no
accounting and must stay byte-for-byte equivalent in behaviour to the seed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

SEED_MAX_ENTRIES = 512 * 1024


class SeedStorageExistenceCache:
    """Seed baseline: one LRU keyed by ``(pool, page_hash)`` with a shared cap."""

    def __init__(self, max_entries: int = SEED_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], None] = OrderedDict()

    def add(self, pool: str, hashes: Iterable[str]) -> None:
        entries = self._entries
        move_to_end = entries.move_to_end
        for h in hashes:
            key = (pool, h)
            entries[key] = None
            move_to_end(key)
        pop_oldest = entries.popitem
        for _ in range(len(entries) - self.max_entries):
            pop_oldest(last=False)

    def contains(self, pool: str, page_hash: str) -> bool:
        entries = self._entries
        key = (pool, page_hash)
        if key not in entries:
            return False
        entries.move_to_end(key)
        return True

    def contains_all(self, pool: str, hashes: Iterable[str]) -> bool:
        entries = self._entries
        move_to_end = entries.move_to_end
        for h in hashes:
            key = (pool, h)
            try:
                move_to_end(key)
            except KeyError:
                return False
        return True

    def covers_all(
        self,
        pool: str,
        hashes: Iterable[str],
        extra_cover: Container[str] = frozenset(),
    ) -> bool:
        entries = self._entries
        move_to_end = entries.move_to_end
        if extra_cover:
            for h in hashes:
                key = (pool, h)
                if key in entries:
                    move_to_end(key)
                elif h not in extra_cover:
                    return False
            return True
        return self.contains_all(pool, hashes)

    def invalidate_beyond(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        pop = self._entries.pop
        for h in hashes[keep_pages:]:
            pop((pool, h), None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
