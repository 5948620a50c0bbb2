"""Write accounting: what the beliefs saved and what they failed to save.

The write path (SGLang's buffer-mode backup) calls one method per decision with
page *counts*, never once per page:

* ``written(pool, pages, already_stored=0)``: ``pages`` pages were written to L3;
  ``already_stored`` of them were already there according to ground truth (the
  reconciler), i.e. redundant writes the beliefs failed to prevent;
* ``avoided(pool, pages)``: ``pages`` pages were admitted without a write because
  they were believed stored (the cache's whole purpose);
* ``redundant(pool, pages)``: ground truth learned later that ``pages`` written
  pages were already stored.

Recording bumps plain ints on the scheduler thread; ``stats()`` returns immutable
snapshots (pages and bytes) that subtract to deltas, like ``stats.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hicache_existence.core import _validate

#: Counters of one pool, in snapshot order.
WRITE_FIELDS: tuple[str, ...] = ("written", "avoided", "redundant")


class _PoolWrites:
    __slots__ = WRITE_FIELDS

    def __init__(self) -> None:
        self.written = 0
        self.avoided = 0
        self.redundant = 0


@dataclass(frozen=True, slots=True)
class PoolWriteStats:
    """One pool's write accounting: pages, and bytes at ``page_size_bytes``."""

    pool: str
    written: int = 0
    avoided: int = 0
    redundant: int = 0
    page_size_bytes: int = 0

    @property
    def written_bytes(self) -> int:
        return self.written * self.page_size_bytes

    @property
    def avoided_bytes(self) -> int:
        return self.avoided * self.page_size_bytes

    @property
    def redundant_bytes(self) -> int:
        return self.redundant * self.page_size_bytes

    @property
    def avoided_ratio(self) -> float:
        """Pages admitted without a write over pages admitted (0.0 with none)."""
        admitted = self.written + self.avoided
        return self.avoided / admitted if admitted else 0.0

    def __sub__(self, other: PoolWriteStats) -> PoolWriteStats:
        if not isinstance(other, PoolWriteStats):
            return NotImplemented
        return PoolWriteStats(
            self.pool,
            self.written - other.written,
            self.avoided - other.avoided,
            self.redundant - other.redundant,
            self.page_size_bytes,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "written": self.written,
            "avoided": self.avoided,
            "redundant": self.redundant,
            "page_size_bytes": self.page_size_bytes,
            "written_bytes": self.written_bytes,
            "avoided_bytes": self.avoided_bytes,
            "redundant_bytes": self.redundant_bytes,
        }


@dataclass(frozen=True, slots=True)
class WriteStats(Mapping[str, PoolWriteStats]):
    """An immutable snapshot of every pool's write accounting."""

    pools: Mapping[str, PoolWriteStats]

    def __getitem__(self, pool: str) -> PoolWriteStats:
        return self.pools[pool]

    def __iter__(self) -> Iterator[str]:
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    def __sub__(self, other: WriteStats) -> WriteStats:
        """Per-pool deltas; a pool absent from ``other`` counts from zero."""
        if not isinstance(other, WriteStats):
            return NotImplemented
        return WriteStats(
            MappingProxyType(
                {
                    name: s - other.pools.get(name, PoolWriteStats(name, page_size_bytes=0))
                    for name, s in self.pools.items()
                }
            )
        )

    def as_dict(self) -> dict[str, object]:
        return {name: s.as_dict() for name, s in self.pools.items()}


class WriteAccounting:
    """Per-pool write counters fed by the write path.

    ``page_size_bytes`` is the L3 size of one page (all layers); ``page_sizes``
    overrides it per pool (a Mamba state page differs from a KV page).
    Bad input raises before any counter changes.
    """

    def __init__(
        self, page_size_bytes: int = 0, page_sizes: Mapping[str, int] | None = None
    ) -> None:
        self.page_size_bytes = _validate.count(page_size_bytes, "page_size_bytes")
        sizes: dict[str, int] = {}
        for pool, size in (page_sizes or {}).items():
            sizes[_validate.pool_name(pool, "page_sizes key")] = _validate.count(
                size, f"page_sizes[{pool!r}]"
            )
        self._sizes = sizes
        self._pools: dict[str, _PoolWrites] = {}

    def _pool(self, pool: str) -> _PoolWrites:
        rec = self._pools.get(pool) if type(pool) is str else None
        if rec is None:
            name = _validate.pool_name(pool)
            rec = self._pools.get(name)
            if rec is None:
                rec = self._pools[name] = _PoolWrites()
        return rec

    def written(self, pool: str, pages: int, already_stored: int = 0) -> None:
        """``pages`` pages of ``pool`` were written; ``already_stored`` of them
        were already in L3 according to ground truth."""
        pages = _validate.count(pages, "pages")
        already = _validate.count(already_stored, "already_stored")
        if already > pages:
            raise ValueError(
                f"already_stored must be <= pages, got already_stored={already}, pages={pages}"
            )
        rec = self._pool(pool)
        rec.written += pages
        rec.redundant += already

    def avoided(self, pool: str, pages: int) -> None:
        """``pages`` pages of ``pool`` were admitted without a write (believed stored)."""
        pages = _validate.count(pages, "pages")
        self._pool(pool).avoided += pages

    def redundant(self, pool: str, pages: int) -> None:
        """Ground truth found ``pages`` already-written pages of ``pool`` had
        been stored before their write (learned after ``written``)."""
        pages = _validate.count(pages, "pages")
        name = _validate.pool_name(pool)
        rec = self._pools.get(name) or _PoolWrites()
        if rec.redundant + pages > rec.written:
            raise ValueError(
                f"pages={pages} would make redundant writes exceed pages written "
                f"({rec.redundant} + {pages} > {rec.written}) for pool {name!r}"
            )
        self._pool(name).redundant += pages

    def page_size(self, pool: str) -> int:
        """Bytes of one page of ``pool``."""
        return self._sizes.get(pool, self.page_size_bytes)

    def pool_names(self) -> tuple[str, ...]:
        return tuple(self._pools)

    def stats(self) -> WriteStats:
        """An immutable snapshot, O(pools); safe from another thread."""
        return WriteStats(
            MappingProxyType(
                {
                    name: PoolWriteStats(
                        name, rec.written, rec.avoided, rec.redundant, self.page_size(name)
                    )
                    for name, rec in list(self._pools.items())
                }
            )
        )
