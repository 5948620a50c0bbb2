"""The seed's baseline: a reimplementation of the seed generation's ``StorageExistenceCache``.

This is NOT part of ``hicache_existence``.  It re-creates, method for method, the
flat ``(pool, page_hash)`` ``OrderedDict`` cache whose code is printed in the seed
analysis (shared/seed-storage-existence-cache.md: the upstream change that raised
the cap to 512K entries and hoisted the hot-path methods), so that
``hicache_existence.FlatStorageExistenceCache`` can be checked against it
(tests/upstream/test_flat_seed_differential.py) and benchmarked beside it.

It is deliberately plain: no accounting, no argument validation, the seed's exact
control flow (including the EAFP ``move_to_end`` walk and the batch eviction after
the whole ``add``).  Anything that differs from the seed's behaviour here is a bug
in this file, not a design choice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

#: The seed's cap: one LRU over every pool's pages.
SEED_MAX_ENTRIES = 512 * 1024

_NO_COVER: frozenset[str] = frozenset()


class SeedStorageExistenceCache:
    """Seed baseline: one LRU of ``(pool, page_hash)`` beliefs; the cap is shared."""

    def __init__(self, max_entries: int = SEED_MAX_ENTRIES) -> None:
        # A plain attribute, read at every add: lowering it evicts at the next add.
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], None] = OrderedDict()

    def add(self, pool: str, hashes: Iterable[str]) -> None:
        """Insert or refresh each page in order, then evict oldest-first to the cap
        (a batch may overshoot the cap until its end)."""
        entries = self._entries
        touch = entries.move_to_end
        for page in hashes:
            key = (pool, page)
            entries[key] = None
            touch(key)
        evict = entries.popitem
        for _ in range(len(entries) - self.max_entries):
            evict(last=False)

    def contains(self, pool: str, page_hash: str) -> bool:
        """Whether one page is believed stored; a hit becomes most recent."""
        key = (pool, page_hash)
        entries = self._entries
        if key not in entries:
            return False
        entries.move_to_end(key)
        return True

    def contains_all(self, pool: str, hashes: Iterable[str]) -> bool:
        """Whether every page is believed stored; stops at the first miss, the
        pages before it having been touched."""
        touch = self._entries.move_to_end
        for page in hashes:
            try:
                touch((pool, page))
            except KeyError:
                return False
        return True

    def covers_all(
        self,
        pool: str,
        hashes: Iterable[str],
        extra_cover: Container[str] = _NO_COVER,
    ) -> bool:
        """Every page believed stored (touched) or in ``extra_cover`` (not touched);
        an empty ``extra_cover`` is plain ``contains_all``, as in the seed."""
        if not extra_cover:
            return self.contains_all(pool, hashes)
        entries = self._entries
        touch = entries.move_to_end
        for page in hashes:
            key = (pool, page)
            if key in entries:
                touch(key)
            elif page not in extra_cover:
                return False
        return True

    def invalidate_beyond(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """Drop the beliefs for ``hashes[keep_pages:]``; absent pages are skipped."""
        drop = self._entries.pop
        for page in hashes[keep_pages:]:
            drop((pool, page), None)

    def clear(self) -> None:
        """Forget every belief of every pool."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
