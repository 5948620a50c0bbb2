"""Write accounting: what the beliefs saved and what they failed to save.

The write path (``integrations.sglang.write_path``, ``cache_mode``) calls one method
per decision with page *counts*, never once per page (what each counter means, and
where upstream it is taken: docs/metrics.md, "Write accounting").  Recording bumps
plain ints on the scheduler thread; ``stats()`` returns immutable snapshots (pages
and bytes) that subtract to deltas, like ``stats.py``.  Avoided pages may also be
counted where the decision is made (``avoided_from``: buffer mode's admissions,
tallied by the existence cache itself), and added at each snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING

from hicache_existence.accounting.causes import CAUSES
from hicache_existence.core import _validate
from hicache_existence.core.stats import counter, fields_of_kind, gauge

_NO_CAUSES: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PoolWriteStats:
    """One pool's write accounting: pages, and bytes at ``page_size_bytes``.  Its
    ``counter()`` fields declare the write counters (``_PoolWrites``, ``WRITE_FIELDS``)."""

    pool: str
    #: Pages whose L3 write was launched.
    written: int = counter()
    #: Pages of write intents skipped because they were believed stored or in flight.
    avoided: int = counter()
    #: Written pages the L3 already held (ground truth: the backend's own answer).
    redundant: int = counter()
    #: Bytes of one page of this pool (kept, not subtracted, by ``-``).
    page_size_bytes: int = gauge()
    #: Written pages this rank's storage write reported stored / not stored.
    acknowledged: int = counter()
    failed: int = counter()
    #: Redundant pages that were believed stored when their write launched.
    redundant_believed: int = counter()
    #: Redundant pages by cause (``accounting/causes.CAUSES``); subtracted by ``-``.
    causes: Mapping[str, int] = field(default_factory=lambda: _NO_CAUSES)

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
    def acknowledged_bytes(self) -> int:
        return self.acknowledged * self.page_size_bytes

    @property
    def failed_bytes(self) -> int:
        return self.failed * self.page_size_bytes

    @property
    def avoided_ratio(self) -> float:
        """Pages admitted without a write over pages admitted (0.0 with none)."""
        admitted = self.written + self.avoided
        return self.avoided / admitted if admitted else 0.0

    def __sub__(self, other: PoolWriteStats) -> PoolWriteStats:
        """Counters become deltas; the page size is this snapshot's."""
        if not isinstance(other, PoolWriteStats):
            return NotImplemented
        deltas = {name: getattr(self, name) - getattr(other, name) for name in WRITE_FIELDS}
        causes = {c: n - other.causes.get(c, 0) for c, n in self.causes.items()}
        return PoolWriteStats(
            self.pool,
            page_size_bytes=self.page_size_bytes,
            causes=MappingProxyType(causes),
            **deltas,
        )

    def as_dict(self) -> dict[str, object]:
        """Fields, plus ``<counter>_bytes`` for the counters that have bytes."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["causes"] = dict(self.causes)
        for name in WRITE_FIELDS:
            if hasattr(self, f"{name}_bytes"):
                out[f"{name}_bytes"] = getattr(self, f"{name}_bytes")
        return out


#: Counters of one pool, in snapshot order (derived: declare in ``PoolWriteStats``).
WRITE_FIELDS: tuple[str, ...] = fields_of_kind(PoolWriteStats, "counter")


class _PoolWrites:
    """The live counters of one pool: one int slot per declared write counter."""

    __slots__ = WRITE_FIELDS

    def __init__(self) -> None:
        for name in WRITE_FIELDS:
            setattr(self, name, 0)

    if TYPE_CHECKING:  # the slots come from WRITE_FIELDS; each holds an int

        def __getattr__(self, name: str) -> int: ...
        def __setattr__(self, name: str, value: int) -> None: ...


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
    """Per-pool write counters fed by the write path.  ``page_size_bytes``: L3
    bytes of one page (all layers); ``page_sizes`` overrides it per pool (a Mamba
    state page differs from a KV page); ``set_page_size`` sets it once the running
    server's KV layout is known.  Bad input raises before any counter changes."""

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
        self._causes: dict[str, dict[str, int]] = {}
        self._avoided_from: Callable[[], Iterable[tuple[str, int]]] | None = None

    def avoided_from(self, source: Callable[[], Iterable[tuple[str, int]]] | None) -> None:
        """Add ``source``'s ``(pool, pages)`` to ``avoided`` at each snapshot: pages
        avoided as counted where they are decided, each pool's count never falling
        (read from any thread, so a snapshot needs no lock).  ``None``: none."""
        self._avoided_from = source

    def _pool(self, pool: str) -> _PoolWrites:
        """Pool ``pool``'s live counters (one int slot per counter, never replaced),
        made on first use; ``live`` for a hot path that bumps ``written`` / ``avoided``
        itself with counts it made (cache mode's node write): no call per event."""
        rec = self._pools.get(pool) if type(pool) is str else None
        if rec is None:
            rec = self._pools.setdefault(_validate.pool_name(pool), _PoolWrites())
        return rec

    live = _pool

    def written(self, pool: str, pages: int, already_stored: int = 0) -> None:
        """``pages`` pages of ``pool`` were written; ``already_stored`` of them
        were already in L3 according to ground truth."""
        # The common case checked inline (the scheduler thread, every launch).
        if type(pages) is not int or pages < 0:
            pages = _validate.count(pages, "pages")
        already = already_stored
        if type(already) is not int or already < 0:
            already = _validate.count(already_stored, "already_stored")
        if already > pages:
            raise ValueError(
                f"already_stored must be <= pages, got already_stored={already}, pages={pages}"
            )
        rec = self._pools.get(pool) if type(pool) is str else None
        if rec is None:
            rec = self._pool(pool)
        rec.written += pages
        rec.redundant += already

    def avoided(self, pool: str, pages: int) -> None:
        """``pages`` pages of ``pool`` were admitted without a write (believed stored)."""
        if type(pages) is not int or pages < 0:
            pages = _validate.count(pages, "pages")
        rec = self._pools.get(pool) if type(pool) is str else None
        if rec is None:
            rec = self._pool(pool)
        rec.avoided += pages

    def acked(
        self,
        pool: str,
        stored: int,
        failed: int = 0,
        already_stored: int = 0,
        believed: int = 0,
    ) -> None:
        """This rank's storage write of ``stored + failed`` written pages of
        ``pool`` finished; ``already_stored`` of the stored pages were already in
        L3 (the backend said so), ``believed`` of those were believed stored
        when the write launched (a node is written whole when any page is not)."""
        already = already_stored
        # The common case checked inline (the scheduler thread, every storage ack): an
        # OR of ints is negative iff one of them is.
        if not (
            type(stored) is type(failed) is type(already) is type(believed) is int
            and stored | failed | already | believed >= 0
        ):
            stored = _validate.count(stored, "stored")
            failed = _validate.count(failed, "failed")
            already = _validate.count(already_stored, "already_stored")
            believed = _validate.count(believed, "believed")
        if already > stored:
            raise ValueError(
                f"already_stored must be <= stored, got already_stored={already}, stored={stored}"
            )
        if believed > already:
            raise ValueError(
                f"believed must be <= already_stored, got believed={believed}, "
                f"already_stored={already}"
            )
        rec = self._pools.get(pool) if type(pool) is str else None
        if rec is None:
            rec = self._pool(pool)
        rec.acknowledged += stored
        rec.failed += failed
        rec.redundant += already
        rec.redundant_believed += believed

    def redundant_cause(self, pool: str, cause: str, pages: int) -> None:
        """``pages`` redundant pages of ``pool`` were written again because of
        ``cause`` (one of ``accounting.causes.CAUSES``); they must already be
        counted redundant."""
        pages = _validate.count(pages, "pages")
        if cause not in CAUSES:
            raise ValueError(f"cause must be one of {list(CAUSES)}, got {cause!r}")
        name = _validate.pool_name(pool)
        rec = self._pool(name)
        causes = self._causes.setdefault(name, {})
        classified = sum(causes.values())
        if classified + pages > rec.redundant:
            raise ValueError(
                f"pages={pages} would classify more pages than are redundant "
                f"({classified} + {pages} > {rec.redundant}) for pool {name!r}"
            )
        causes[cause] = causes.get(cause, 0) + pages

    def set_page_size(self, pool: str, size: int) -> None:
        """Bytes of one page of ``pool`` (read from the server's KV layout)."""
        name = _validate.pool_name(pool, "pool")
        self._sizes[name] = _validate.count(size, "size")

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

    def stats(self) -> WriteStats:
        """An immutable snapshot, O(pools); safe from another thread (each dict is
        copied in one C call before it is walked)."""
        pools = self._pools.copy()
        extra: dict[str, int] = {}
        if self._avoided_from is not None:
            for pool, pages in self._avoided_from():
                if pages:
                    extra[pool] = extra.get(pool, 0) + pages
                    pools.setdefault(pool, _PoolWrites())
        out: dict[str, PoolWriteStats] = {}
        for name, rec in pools.items():
            counts = {field: getattr(rec, field) for field in WRITE_FIELDS}
            counts["avoided"] += extra.get(name, 0)
            out[name] = PoolWriteStats(
                name,
                page_size_bytes=self.page_size(name),
                causes=MappingProxyType(dict(self._causes.get(name, {}))),
                **counts,
            )
        return WriteStats(MappingProxyType(out))
