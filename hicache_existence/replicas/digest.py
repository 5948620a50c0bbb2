"""Deterministic digests of one cache replica, for cross-rank divergence checks.

``ReplicaDigest``, a ``BeliefObserver``, folds each pool's operation stream into a
running CRC-32 plus exact operation and page counts, once per operation (never
once per page in Python; a lookup in O(1)); a check adds the state sizes and,
when asked, an exact O(entries) audit of the membership.  docs/tp-divergence.md
gives the records, their costs and what each part catches.

Only deterministic functions (CRC-32, BLAKE2b, decimal formatting): never
``hash()`` of a ``str``, which Python randomises per process.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from hicache_existence.core.protocol import ExistenceCache, PoolView

#: Bumped whenever the serialisation changes; ranks compare it at start-up.
DIGEST_VERSION = 1

#: Digest words are 63-bit so that a word and its negation both fit an int64.
MASK63 = (1 << 63) - 1

#: Pages per ``join`` while auditing a large pool (bounds the transient copy).
_AUDIT_CHUNK = 8192

_crc32 = zlib.crc32
# Page hashes are ASCII in practice (the encoder then only copies); any str,
# lone surrogates included, still encodes instead of raising.
_ENC = "utf-8"
_ERR = "surrogatepass"


@dataclass(slots=True)
class _Stream:
    """One pool's running operation digest (mutable, scheduler thread only)."""

    crc: int = 0
    ops: int = 0
    pages: int = 0


@dataclass(frozen=True)
class PoolDigest:
    """One pool's digest word and the sizes that went into it."""

    pool: str
    #: 63-bit digest of the operation stream, the sizes and the last audit.
    digest: int
    entries: int
    #: Distinct pages with an in-flight ref.
    inflight: int
    capacity: int
    #: Operations folded since the pool's start (or its last reset).
    ops: int


def mix(*parts: object) -> int:
    """A deterministic 63-bit value of ``parts`` (their decimal/str forms)."""
    text = "\x1f".join(map(str, parts)).encode(_ENC, _ERR)
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & MASK63


def slot_of(pool: str, slots: int) -> int:
    """The fixed slot of ``pool`` among ``slots``: the same on every rank and process."""
    return _crc32(pool.encode(_ENC, _ERR)) % slots


class ReplicaDigest:
    """A ``BeliefObserver`` keeping per-pool incremental digests of one replica.
    Install it as the cache's ``observer`` (or in a ``Tee``) before the first
    operation; ``pool_digests(cache)`` then summarises the replica.  Equal
    operation streams give equal digests in every process."""

    __slots__ = ("_streams", "_audits", "errors")

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        # pool (or "" for a flat cache's one global LRU) -> (stream key, audit)
        self._audits: dict[str, tuple[object, int]] = {}
        #: Observer calls that failed (each also poisons that pool's digest).
        self.errors = 0

    # -- BeliefObserver ------------------------------------------------------
    def _stream(self, pool: str) -> _Stream:
        s = self._streams.get(pool)
        if s is None:
            s = self._streams[pool] = _Stream()
        return s

    def _fold(self, pool: str, tag: bytes, pages: Sequence[str]) -> None:
        """One batch operation: its tag and page count, then every page (in C)."""
        try:
            s = self._stream(pool)
            crc = _crc32(b"\0%s%d\0" % (tag, len(pages)), s.crc)
            s.crc = _crc32("\0".join(pages).encode(_ENC, _ERR), crc)
            s.ops += 1
            s.pages += len(pages)
        except Exception:  # never raise into the scheduler
            self._poison(pool)

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self._fold(pool, b"A", hashes)

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        # The hot path: O(1) per call whatever the chain length.  ``stop`` enters
        # through the CRC's initial value (an injective step), which saves
        # formatting an int; a pool's first touch takes the slow path.
        try:
            s = self._streams[pool]
            s.crc = _crc32(f"\0T{hashes[0]}\0{hashes[stop - 1]}".encode(), s.crc ^ stop)
            s.ops += 1
        except Exception:
            self._touched_slow(pool, hashes, stop)

    def _touched_slow(self, pool: str, hashes: Sequence[str], stop: int, order: str = "") -> None:
        """A pool's first touch, or pages that are not valid UTF-8 (same bytes as
        the fast path would produce for valid ones)."""
        try:
            s = self._stream(pool)
            data = f"{order}\0T{hashes[0]}\0{hashes[stop - 1]}".encode(_ENC, _ERR)
            s.crc = _crc32(data, s.crc ^ stop)
            s.ops += 1
        except Exception:
            self._poison(pool)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        # Only the tail decides the effect (absent pages are skipped).
        self._fold(pool, b"V", hashes[keep_pages:])

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        self._fold(pool, b"I%+d\0" % delta, hashes)

    def cleared(self, pool: str, inflight_only: bool) -> None:
        try:
            s = self._stream(pool)
            s.crc = _crc32(b"\0F" if inflight_only else b"\0C", s.crc)
            s.ops += 1
        except Exception:
            self._poison(pool)

    def _poison(self, pool: object) -> None:
        """Record a failed fold so that this replica reads as diverged, not equal."""
        self.errors += 1
        try:
            s = self._stream(str(pool))
            s.crc = _crc32(b"\0E", s.crc)
            s.ops += 1
        except Exception:  # pragma: no cover - str() of a pool name failed
            pass

    # -- lifecycle -----------------------------------------------------------
    def reset(self, pool: str) -> None:
        """Forget ``pool``'s history: call right after clearing that pool on every
        rank (an empty pool with no history is the common start state)."""
        self._streams.pop(pool, None)
        self._audits.pop(pool, None)
        self._audits.pop("", None)

    def reset_all(self) -> None:
        """Forget every pool's history (after clearing the whole cache on every rank)."""
        self._streams.clear()
        self._audits.clear()

    def pools(self) -> tuple[str, ...]:
        """Pools with a history, in first-seen order."""
        return tuple(self._streams)

    def stream(self, pool: str) -> tuple[int, int, int]:
        """``(crc, ops, pages)`` of ``pool``'s operation digest (zeros if unseen)."""
        s = self._streams.get(pool)
        return (0, 0, 0) if s is None else (s.crc, s.ops, s.pages)

    # -- digests -------------------------------------------------------------
    def pool_digests(
        self, cache: ExistenceCache | None = None, *, audit: bool = False
    ) -> dict[str, PoolDigest]:
        """Each pool's digest word, O(pools) (plus O(entries) when ``audit``).

        With ``cache``, state sizes are folded in and every cache pool included; a
        pool with no history, entries or in-flight pages is left out (unused on one
        rank equals absent).  ``audit`` recomputes the audit of pools whose
        operation digest changed since their last one, else reuses it (the same
        rule on every rank, so equal replicas stay equal).
        """
        stats = cache.stats() if cache is not None else {}
        shared_audit = 0
        if cache is not None and cache.shared_lru:
            # One LRU is shared by every pool: any pool's operations can evict from
            # another, so the audit is global and keyed on every pool's stream.
            streams = tuple(sorted((name, self.stream(name)) for name in self._streams))
            shared_audit = self._audit("", streams, audit, partial(audit_shared, cache))
        out: dict[str, PoolDigest] = {}
        for name in sorted({*self._streams, *stats}):
            crc, ops, pages = self.stream(name)
            st = stats.get(name)
            entries, inflight, capacity = (
                (st.entries, st.inflight, st.capacity) if st is not None else (0, 0, 0)
            )
            if not ops and not entries and not inflight:
                continue
            audit_value = shared_audit
            if cache is not None and not cache.shared_lru:
                in_cache = audit and name in cache.pool_names()
                pool_audit = partial(_audit_of_pool, cache, name)
                audit_value = self._audit(name, (crc, ops, pages), in_cache, pool_audit)
            word = mix(
                DIGEST_VERSION, name, crc, ops, pages, entries, inflight, capacity, audit_value
            )
            out[name] = PoolDigest(name, word, entries, inflight, capacity, ops)
        return out

    def _audit(self, slot: str, key: object, audit: bool, compute: Callable[[], int]) -> int:
        """The audit kept under ``slot`` ("": the shared LRU's), recomputed when
        ``audit`` and the streams (``key``) changed since; 0 before the first."""
        cached = self._audits.get(slot)
        if audit and (cached is None or cached[0] != key):
            cached = self._audits[slot] = (key, compute())
        return cached[1] if cached is not None else 0


class SharedLruDigest(ReplicaDigest):
    """The digest for a ``shared_lru`` cache (the seed generation's): its one LRU
    over every pool makes the *interleaving* of operations decide evictions too,
    so each operation also folds its global index (one more CRC update).  The
    current generation's pools are independent LRUs: interleaving does not matter.
    """

    __slots__ = ("_seq",)

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0

    def _order(self, pool: str) -> None:
        self._seq += 1
        s = self._stream(pool)
        s.crc = _crc32(b"\0#%d" % self._seq, s.crc)

    def _fold(self, pool: str, tag: bytes, pages: Sequence[str]) -> None:
        # added, invalidated, inflight: the global index, then the batch.
        self._order(pool)
        super()._fold(pool, tag, pages)

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        # Inlined (the hot path): the global index joins the lookup's record.
        self._seq = seq = self._seq + 1
        try:
            s = self._streams[pool]
            data = f"\0#{seq}\0T{hashes[0]}\0{hashes[stop - 1]}".encode()
            s.crc = _crc32(data, s.crc ^ stop)
            s.ops += 1
        except Exception:  # first touch of the pool, or pages not valid UTF-8
            self._touched_slow(pool, hashes, stop, f"\0#{seq}")

    def cleared(self, pool: str, inflight_only: bool) -> None:
        self._order(pool)
        super().cleared(pool, inflight_only)

    def reset_all(self) -> None:
        super().reset_all()
        self._seq = 0


def _crc_strings(items: Sequence[str], crc: int) -> int:
    """CRC-32 of ``items``, each followed by NUL, in C, in bounded chunks."""
    for start in range(0, len(items), _AUDIT_CHUNK):
        chunk = items[start : start + _AUDIT_CHUNK]
        crc = _crc32("\0".join(chunk).encode(_ENC, _ERR), crc)
        crc = _crc32(b"\0", crc)
    return crc


def _audit_of_pool(cache: ExistenceCache, name: str) -> int:
    return audit_pool(cache.pool(name))


def audit_pool(pool: PoolView) -> int:
    """An exact 63-bit digest of one pool's *membership*: the believed pages, the
    in-flight refcounts and the cap.  O(entries), in C.  Pages are read in LRU
    order, identical in both index implementations (the compiled one walks its
    list at ~10 ns a page at 512K entries), so equal histories give equal audits
    whatever backend each rank runs.
    """
    keys = pool.lru_keys()
    crc = _crc_strings(keys, 0)
    items = sorted(pool.inflight_refs().items())
    crc2 = _crc_strings([k for k, _ in items], 0)
    counts = ",".join([str(v) for _, v in items])
    return mix("pool", crc, len(keys), crc2, counts, len(items), pool.max_entries)


def audit_shared(cache: ExistenceCache) -> int:
    """An exact 63-bit digest of a ``shared_lru`` cache's membership over every
    pool, in the one shared LRU order, and the shared cap."""
    keys = [f"{pool}\x01{key}" for pool, key in cache.lru_items()]
    crc = _crc_strings(keys, 0)
    return mix("flat", crc, len(keys), cache.max_entries)


def combine(digests: Mapping[str, PoolDigest]) -> int:
    """One 63-bit word for the whole replica (order of pools does not matter)."""
    total = 0
    for d in digests.values():
        total = (total + d.digest) & MASK63
    return mix("replica", total, len(digests))
