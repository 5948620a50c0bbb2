"""Miss reasons: a bounded memory of pages that recently left a pool's beliefs.

A page miss costs one redundant L3 write; the operator asks *why* the page was
not believed.  ``FingerprintGhosts`` answers for one pool: every page leaving the
beliefs (evicted by the cap, dropped by ``invalidate_beyond``, a heal or a clear)
leaves a one-byte trace, which a later miss on the page finds (``evicted`` /
``invalidated`` / ``cleared``) or not (``cold``).

Layout: a direct-mapped table of one-byte slots.  The slot index comes from the
first 24 bits of the page hash, a 6-bit fingerprint from the next byte, and the
slot's low 2 bits hold the reason (1..3; 0 is empty).  A newer page landing on
the slot overwrites it, so traces fade gradually rather than at a window edge:
after ``n`` later departures one survives with probability ``exp(-n / slots)``.
A cold page is misreported only when its slot holds a trace with the same
fingerprint: at most 1/64 of the time with a full table (docs/metrics.md).

Cost: ``remember`` runs on the eviction path, so per-page work is C loops over
bytes (``_ghosts.c``, else: one ``bytes.fromhex`` of a batch of 64-hex keys,
extended slices and ``bytes.translate``, one C-level ``map(setitem, ...)``): no
Python bytecode per page, no ``hash()``.  Keys of another shape take a per-key
path (correct, slower).  ``classify`` runs in batches over the misses recorded
since the table last changed (a miss only appends its key).
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from operator import setitem
from types import MappingProxyType
from typing import Any

from hicache_existence import logs
from hicache_existence.core import _validate, lru
from hicache_existence.core.stats import CLEARED, COLD, EVICTED, INVALIDATED, MISS_REASONS

#: Bytes one cached entry costs in either cache generation at full cap, hash
#: strings excluded (tracemalloc, 524,288 entries, CPython 3.11; see docs/metrics.md):
#: 40.0 with the compiled index, 77.3 with the pure-Python one.
CACHE_BYTES_PER_ENTRY = lru.BYTES_PER_ENTRY

#: The compiled scatter/gather (hicache_existence/accounting/_ghosts.c), or None.
_native = lru.compiled("accounting._ghosts")

#: Smallest table: below this, collisions make the classification meaningless.
MIN_SLOTS = 64
#: Upper bound of a memory's bytes besides its table (the object, the top map).
_FIXED_BYTES = 1024

_exhaust = deque[object](maxlen=0).extend
_HEX_KEY_LEN = 64
_SEP = "\n"
_FP_MASK = 0xFC
_REASONS = (EVICTED, INVALIDATED, CLEARED)
#: ``bytes.translate`` tables turning a fingerprint byte into a slot byte.
_SLOT_BYTES = {r: bytes((b & _FP_MASK) | r for b in range(256)) for r in _REASONS}
_LITTLE = sys.byteorder == "little"
if struct.calcsize("I") != 4:  # pragma: no cover - every CPython platform in use
    raise ImportError("hicache_existence.accounting.ghosts needs a 4-byte C unsigned int")


def _layout(slots: int) -> tuple[int, int, int]:
    """``(levels, top, size)`` for a table of at most ``slots`` one-byte slots: the
    index is ``levels`` bytes of hash, the top one scaled to ``top`` values, so the
    size ``top * 256 ** (levels - 1)`` tracks the budget, not powers of two."""
    slots = max(MIN_SLOTS, slots)
    if slots >= 1 << 16:
        levels, unit = 3, 1 << 16
    elif slots >= 1 << 8:
        levels, unit = 2, 1 << 8
    else:
        levels, unit = 1, 1
    top = min(256, slots // unit)
    return levels, top, top * unit


class FingerprintGhosts:
    """One pool's ``MissMemory``: a one-byte-per-slot table of recent departures.
    Scheduler thread only, but ``nbytes`` and ``slots`` (constants) any thread."""

    __slots__ = (
        "_countdown",
        "_levels",
        "_lo_mask",
        "_lo_shift",
        "_limiter",
        "_logger",
        "_sample_every",
        "_table",
        "_top",
        "_top_index",
        "pool",
        "slots",
    )

    def __init__(
        self,
        slots: int,
        *,
        pool: str = "kv",
        debug_events_per_s: float = 1.0,
        sample_every: int = 16,
        clock: Callable[[], float] | None = None,
    ) -> None:
        slots = _validate.count(slots, "slots", 1)
        self.pool = _validate.pool_name(pool, "pool")
        if not _validate.number(debug_events_per_s, "debug_events_per_s") >= 0:
            raise ValueError(f"debug_events_per_s must be >= 0, got {debug_events_per_s}")
        self._sample_every = _validate.count(sample_every, "sample_every", 1)
        self._levels, top, self.slots = _layout(slots)
        # index = top byte scaled, then the next (levels - 1) bytes of the word.
        hi_shift = 8 * (self._levels - 1)
        self._lo_shift = 32 - 8 * self._levels
        self._lo_mask = (1 << hi_shift) - 1
        self._top = bytes((b * top) >> 8 for b in range(256))
        self._top_index = tuple(t << hi_shift for t in self._top)
        self._table = bytearray(self.slots)
        self._logger = logs.get_logger("hicache_existence.accounting.ghosts")
        self._limiter = (
            logs.RateLimiter(float(debug_events_per_s), burst=1.0, clock=clock)
            if debug_events_per_s > 0
            else None
        )
        self._countdown = self._sample_every

    # -- the MissMemory protocol ---------------------------------------------
    def remember(self, keys: Sequence[str], reason: int) -> None:
        """Leave a trace of ``reason`` for every page of ``keys`` (later wins)."""
        if reason not in _SLOT_BYTES:
            raise ValueError(
                f"reason must be one of EVICTED, INVALIDATED, CLEARED (1..3), got {reason!r}"
            )
        n = len(keys)
        if not n:
            return
        if _native is not None:
            if not _native.remember(self._table, keys, reason, self._top, self._levels):
                self._remember_slow(keys, reason)
            return
        digests = self._digests(keys, n)
        if digests is None:
            self._remember_slow(keys, reason)
            return
        values = digests[3::4].translate(_SLOT_BYTES[reason])
        _exhaust(map(setitem, repeat(self._table), self._indices(digests, n), values))

    def classify(self, keys: Sequence[str]) -> list[int]:
        """``reason`` for a batch of misses (C loops for 64-hex keys), called from
        the cache's ``settle()``: a miss pays only a list append on the hot path."""
        n = len(keys)
        if not n:
            return []
        native = _native
        codes = native and native.classify(self._table, keys, self._top, self._levels)
        if codes is not None:
            reasons = list(codes)  # 0 is COLD, 1..3 the recorded reasons
        elif (digests := self._digests(keys, n)) is None:
            reasons = [self._lookup(key) for key in keys]
        else:
            slots = bytes(map(self._table.__getitem__, self._indices(digests, n)))
            reasons = [
                s & 3 if s and not (s ^ f) & _FP_MASK else COLD
                for s, f in zip(slots, digests[3::4])
            ]
        self._countdown -= n
        if self._countdown <= 0:
            self._trace(keys[-1], reasons[-1])
        return reasons

    def _indices(self, digests: bytes, n: int) -> memoryview:
        """Slot indices of ``n`` raw 32-byte digests, as a native ``'I'`` view."""
        idx = bytearray(4 * n)
        hi, mid, lo = digests[0::4].translate(self._top), digests[1::4], digests[2::4]
        # Index bytes, least significant first, laid out for a native 'I' view.
        lanes: tuple[bytes, ...]
        if self._levels == 3:
            lanes = (lo, mid, hi)
        elif self._levels == 2:
            lanes = (mid, hi)
        else:
            lanes = (hi,)
        for pos, lane in enumerate(lanes):
            idx[(pos if _LITTLE else 3 - pos) :: 4] = lane
        return memoryview(idx).cast("I")

    def reason(self, key: str) -> int:
        """The ``MISS_REASONS`` index for a miss on ``key``: the trace its slot
        holds, or ``COLD`` when the slot is empty or holds another page's trace."""
        found = self._lookup(key)
        self._countdown -= 1
        if self._countdown <= 0:
            self._trace(key, found)
        return found

    def remembered(self, key: str) -> int:
        """``reason(key)`` without the sampled debug event: a pure lookup, for a
        reader that is not classifying a miss (the causes of redundant writes)."""
        return self._lookup(key)

    def _lookup(self, key: str) -> int:
        word = self._word(key)
        slot = self._table[self._top_index[word >> 24] | ((word >> self._lo_shift) & self._lo_mask)]
        return slot & 3 if slot and (slot ^ word) & _FP_MASK == 0 else COLD

    # -- introspection ---------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Real memory held: the table plus this object (translate tables shared)."""
        return sys.getsizeof(self._table) + sys.getsizeof(self) + sys.getsizeof(self._top)

    def occupancy(self) -> float:
        """Fraction of slots holding a trace (O(slots); for tests and reports)."""
        return 1.0 - self._table.count(0) / self.slots

    def clear(self) -> None:
        """Forget every trace (later misses are ``cold``)."""
        self._table[:] = bytes(self.slots)

    def __repr__(self) -> str:
        return f"FingerprintGhosts(pool={self.pool!r}, slots={self.slots}, nbytes={self.nbytes})"

    # -- internals -------------------------------------------------------------
    @staticmethod
    def _digests(keys: Sequence[str], n: int) -> bytes | None:
        """The first 4 bytes of every key's hash (its first 8 hex digits), as one
        ``bytes`` of ``4 * n``, when every key is 64 characters starting with 8 hex
        digits; else None (the per-key path).  All in C: in the keys joined with a
        separator, character ``i`` of every key is ``joined[i::65]``; the 8 leading
        lanes are interleaved and parsed by one ``bytes.fromhex``."""
        joined = _SEP.join(keys)
        stride = _HEX_KEY_LEN + 1
        if len(joined) != stride * n - 1:
            return None
        if n > 1 and joined[_HEX_KEY_LEN::stride] != _SEP * (n - 1):
            return None
        if joined.count(_SEP) != n - 1:  # a separator inside a key shifts the lanes
            return None
        head = bytearray(8 * n)
        try:
            for i in range(8):
                head[i::8] = joined[i::stride].encode("ascii")
            digests = bytes.fromhex(head.decode("ascii"))
        except ValueError:  # not ASCII, or not hex
            return None
        return digests if len(digests) == 4 * n else None

    @staticmethod
    def _word(key: str) -> int:
        """32 bits of ``key``'s hash: its first 8 hex digits for a 64-character key
        (as the batch path reads), else ``hash()``.  Odd 64-character keys (a sign,
        ``0x``) parse too: only consistency with ``reason`` matters for them."""
        if len(key) == _HEX_KEY_LEN:
            try:
                return int(key[:8], 16)
            except ValueError:
                pass
        return hash(key) & 0xFFFFFFFF

    def _slot(self, key: str) -> tuple[int, int]:
        """``(index, fingerprint)`` of one key, equal to what the batch path
        computes for 64-hex keys."""
        word = self._word(key)
        index = self._top_index[word >> 24] | ((word >> self._lo_shift) & self._lo_mask)
        return index, word & _FP_MASK

    def _remember_slow(self, keys: Sequence[str], reason: int) -> None:
        table = self._table
        for key in keys:
            index, fingerprint = self._slot(key)
            table[index] = fingerprint | reason

    def _trace(self, key: str, reason: int) -> None:
        """Every ``sample_every``-th miss: a rate-limited debug event, if enabled.
        Never raises (the miss path belongs to the scheduler)."""
        self._countdown = self._sample_every
        try:
            limiter = self._limiter
            if limiter is None or not self._logger.is_enabled_for_debug():
                # Debug is off: look again only after many more misses.
                self._countdown = self._sample_every * 64
                return
            if limiter.allow():
                self._logger.debug(
                    logs.MISS_TRACED,
                    pool=self.pool,
                    reason=MISS_REASONS[reason],
                    page_hash_prefix=key[:12],
                )
        except Exception:  # pragma: no cover - logging must never break a lookup
            pass


class GhostFactory:
    """The cache's ``miss_memory=`` factory: one ``FingerprintGhosts`` per pool,
    sized to ``memory_fraction`` of a full pool of ``max_entries`` entries; keeps
    the memories it made so exporters can report their real size."""

    def __init__(
        self,
        max_entries: int,
        *,
        memory_fraction: float = 0.10,
        bytes_per_entry: float = CACHE_BYTES_PER_ENTRY,
        debug_events_per_s: float = 1.0,
        sample_every: int = 16,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.max_entries = _validate.count(max_entries, "max_entries", 1)
        for name, value in (
            ("memory_fraction", memory_fraction),
            ("bytes_per_entry", bytes_per_entry),
        ):
            if not _validate.number(value, name) > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if memory_fraction > 1:
            raise ValueError(f"memory_fraction must be <= 1, got {memory_fraction}")
        self.memory_fraction = float(memory_fraction)
        # The budget covers the table and the memory object's fixed part.
        budget = int(memory_fraction * bytes_per_entry * self.max_entries) - _FIXED_BYTES
        self.slots = _layout(budget)[2]
        self._debug_events_per_s = debug_events_per_s
        self._sample_every = _validate.count(sample_every, "sample_every", 1)
        self._clock = clock
        self._memories: dict[str, FingerprintGhosts] = {}

    @classmethod
    def from_config(cls, config: Any, max_entries: int | None = None) -> GhostFactory:
        """Build from a ``Config`` (its ``miss_reasons`` and ``cache`` sections)."""
        section = config.miss_reasons
        return cls(
            config.cache.max_entries if max_entries is None else max_entries,
            memory_fraction=section.memory_fraction,
            debug_events_per_s=section.debug_events_per_s,
            sample_every=section.sample_every,
        )

    def __call__(self, pool: str) -> FingerprintGhosts:
        memory = FingerprintGhosts(
            self.slots,
            pool=pool,
            debug_events_per_s=self._debug_events_per_s,
            sample_every=self._sample_every,
            clock=self._clock,
        )
        self._memories[memory.pool] = memory
        return memory

    def memories(self) -> Mapping[str, FingerprintGhosts]:
        """The memories made so far, by pool (a read-only view)."""
        return MappingProxyType(self._memories)

    def nbytes_by_pool(self) -> dict[str, int]:
        """Real bytes held per pool, O(pools); any thread (the dict is copied in one
        C call before it is walked)."""
        return {pool: memory.nbytes for pool, memory in self._memories.copy().items()}
