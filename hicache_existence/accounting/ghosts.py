"""Miss reasons: a bounded memory of pages that recently left a pool's beliefs.

A page miss costs one redundant L3 write; the operator asks *why* the page was
not believed.  ``FingerprintGhosts`` answers for one pool: every page leaving the
beliefs (evicted by the cap, dropped by ``invalidate_beyond``, a heal or a clear)
leaves a one-byte trace, which a later miss on the page finds (``evicted`` /
``invalidated`` / ``cleared``) or not (``cold``).

Layout (docs/metrics.md, "Miss reasons"): a direct-mapped table of one-byte slots;
the first 32 bits of the page hash times the table size give the slot index (the
product's high 32 bits: an even share of hashes per slot, whatever the size), their
last byte a 6-bit fingerprint, the slot's low 2 bits the reason (1..3; 0 is empty).
A newer page on the slot overwrites it, so traces fade gradually rather than at a
window edge.  A cold page is misreported only when its slot holds a trace with the
same fingerprint: at most 1/64 of the time with a full table.

Cost: ``remember`` runs on the eviction path, so per-page work is C loops over
bytes (``_ghosts.c``, else C-level byte operations on a batch of 64-hex keys): no
Python bytecode per page, no ``hash()``.  Keys of another shape take a per-key
path (correct, slower).  ``classify`` runs in batches over the misses recorded
since the table last changed (a miss only appends its key).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import mul, rshift, setitem
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
#: Upper bound of a memory's bytes besides its table (the object, its logger and
#: rate limiter: about 1.5 KiB measured with tracemalloc).
_FIXED_BYTES = 2048

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


#: The largest table (16 MiB): the index is the high half of the hash's 32-bit
#: word times the size, the fingerprint the word's low byte, independent of the
#: index while every slot spans at least 256 words.
MAX_SLOTS = 1 << 24


def _size(slots: int) -> int:
    """The table's size for a budget of ``slots`` one-byte slots: the budget itself
    (any size spreads evenly: the index scales the word, it does not cut it)."""
    return min(max(MIN_SLOTS, slots), MAX_SLOTS)


class FingerprintGhosts:
    """One pool's ``MissMemory``: a one-byte-per-slot table of recent departures.
    Scheduler thread only, but ``nbytes`` and ``slots`` (constants) any thread."""

    __slots__ = (
        "_countdown",
        "_limiter",
        "_logger",
        "_sample_every",
        "_table",
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
        self.slots = _size(slots)
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
        table = self._table
        if not len(keys) or (_native is not None and _native.remember(table, keys, reason)):
            return  # none, or taken by the compiled loop (64-hex keys)
        batch = None if _native is not None else self._batch(keys)
        if batch is None:
            self._remember_slow(keys, reason)
        else:
            indices, fingerprints = batch
            values = fingerprints.translate(_SLOT_BYTES[reason])
            _exhaust(map(setitem, repeat(table), indices, values))

    def classify(self, keys: Sequence[str]) -> list[int]:
        """``reason`` for a batch of misses (C loops for 64-hex keys), called from
        the cache's ``settle()``: a miss pays only a list append on the hot path."""
        n = len(keys)
        if not n:
            return []
        native = _native
        codes = native and native.classify(self._table, keys)
        if codes is not None:
            reasons = list(codes)  # 0 is COLD, 1..3 the recorded reasons
        elif (batch := self._batch(keys)) is None:
            reasons = [self.remembered(key) for key in keys]
        else:
            indices, fps = batch
            slots = bytes(map(self._table.__getitem__, indices))
            reasons = [s & 3 if s and not (s ^ f) & _FP_MASK else COLD for s, f in zip(slots, fps)]
        self._countdown -= n
        if self._countdown <= 0:
            self._trace(keys[-1], reasons[-1])
        return reasons

    def reason(self, key: str) -> int:
        """The ``MISS_REASONS`` index for a miss on ``key``: the trace its slot
        holds, or ``COLD`` when the slot is empty or holds another page's trace."""
        return self.classify([key])[0]

    def remembered(self, key: str) -> int:
        """``reason(key)`` without the sampled debug event: a pure lookup, for a
        reader that is not classifying a miss (the causes of redundant writes)."""
        index, fingerprint = self._slot(key)
        slot = self._table[index]
        return slot & 3 if slot and (slot ^ fingerprint) & _FP_MASK == 0 else COLD

    # -- introspection ---------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Real memory held: the table plus this object (translate tables shared)."""
        return sys.getsizeof(self._table) + sys.getsizeof(self)

    def occupancy(self) -> float:
        """Fraction of slots holding a trace (O(slots); for tests and reports)."""
        return 1.0 - self._table.count(0) / self.slots

    def clear(self) -> None:
        """Forget every trace (later misses are ``cold``)."""
        self._table[:] = bytes(self.slots)

    def __repr__(self) -> str:
        return f"FingerprintGhosts(pool={self.pool!r}, slots={self.slots}, nbytes={self.nbytes})"

    # -- internals -------------------------------------------------------------
    def _batch(self, keys: Sequence[str]) -> tuple[Iterator[int], bytes] | None:
        """Slot indices and fingerprint bytes of every key (as ``_slot``: ``word *
        slots``'s high 32 bits and the word's low byte), when every key is 64
        characters starting with 8 hex digits; else None (the per-key path).  All in
        C: in the keys joined with a separator, character ``i`` of every key is
        ``joined[i::65]``; the 8 leading lanes are interleaved and parsed by one
        ``bytes.fromhex`` into big-endian 4-byte words, then C-level maps."""
        n = len(keys)
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
        if len(digests) != 4 * n:
            return None
        words = array("I", digests)  # machine order: swapped back to big-endian
        if _LITTLE:
            words.byteswap()
        return map(rshift, map(mul, words, repeat(self.slots)), repeat(32)), digests[3::4]

    def _slot(self, key: str) -> tuple[int, int]:
        """``(index, fingerprint)`` of one key from 32 bits of its hash: its first 8
        hex digits for a 64-character key (as the batch path reads), else ``hash()``.
        Odd 64-character keys (a sign, ``0x``) parse too: only consistency with
        ``reason`` matters for them."""
        try:
            word = int(key[:8], 16) if len(key) == _HEX_KEY_LEN else hash(key) & 0xFFFFFFFF
        except ValueError:
            word = hash(key) & 0xFFFFFFFF
        return (word * self.slots) >> 32, word & _FP_MASK

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
        # The budget covers the table and the memory object's fixed part (a tiny
        # cap keeps half its budget for the table rather than a useless one).
        budget = int(memory_fraction * bytes_per_entry * self.max_entries)
        self.slots = _size(max(budget - _FIXED_BYTES, budget // 2))
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
