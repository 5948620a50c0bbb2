"""SHARDS reuse-distance sampling of one LRU's reference stream, fed from the index
(docs/capacity.md, "How it works").  A Python observer per cache operation cost the hot
path 10-50% on short lookups, hence ``LruIndex.attach(tag, sampler)``: the index feeds
it inside ``touch_prefix`` (complete walks), ``add``, ``discard`` and ``clear``, and the
cache reports a lookup that stops short with ``walked``.

``core._lru.Sampler`` (C, ``_sampler.h``: an exact LRU stack over sampled keys,
distances by a Fenwick tree over a timestamp bitmap) and ``PySampler`` (below: used
with the pure-Python index and as the C sampler's test oracle) share these semantics
per recorded call: distances are taken before the call's updates; a key repeated in
the call is a hit at distance 0 for all but its last occurrence; a lookup does not
insert a key the stack lacks, and the page it missed at counts in the lookup curve
but is not moved; beyond ``max_keys`` the least recent keys are forgotten (their next
reference is cold).  Identity is ``(tag, hash)``: colliding 64-bit hashes count as
one (probability about ``max_keys**2 / 2**58``, nil in practice).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import accumulate, islice
from typing import Any, Protocol

from hicache_existence.core import _validate

_M64 = (1 << 64) - 1
_RESCALE_AT = 2.0**40
#: Timestamps per block of the stack (a few KiB: cheap to shift, few blocks to sum).
_BLOCK = 512


class SamplerType(Protocol):
    """The interface both implementations provide."""

    def added(self, hashes: Sequence[str], tag: int = 0, /) -> None: ...
    def walked(self, hashes: Sequence[str], stop: int, tag: int = 0, /) -> None: ...
    def removed(self, hashes: Sequence[str], tag: int = 0, /) -> None: ...
    def clear(self) -> None: ...
    def cumulative(self, limits: Sequence[int], lookups: bool = False, /) -> list[float]: ...
    def counts(self) -> dict[str, Any]: ...


def threshold(rate: float) -> int:
    """The hash threshold that samples a fraction ``rate`` of pages (2**64: all)."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"sampling rate must be within (0, 1], got {rate}")
    return min(int(rate * 2.0**64), 1 << 64)


class _Stack:
    """An exact LRU stack with O(log n) distances: a key's distance is the number of live
    timestamps after its last reference's, kept in a blocked sorted list (new ones are
    the largest: they append).  An operation touches one block plus a C sum of lengths."""

    __slots__ = ("times", "blocks", "maxes", "clock")

    def __init__(self) -> None:
        self.times: OrderedDict[Any, int] = OrderedDict()
        self.blocks: list[list[int]] = []
        self.maxes: list[int] = []
        self.clock = 0

    def after(self, t: int) -> int:
        """How many live timestamps are greater than the live timestamp ``t``."""
        i = bisect_left(self.maxes, t)
        block = self.blocks[i]
        later = sum(map(len, islice(self.blocks, i + 1, None)))
        return later + len(block) - bisect_right(block, t)

    def _discard(self, t: int) -> None:
        maxes = self.maxes
        blocks = self.blocks
        i = bisect_left(maxes, t)
        block = blocks[i]
        j = bisect_left(block, t)
        del block[j]
        if not block:
            del blocks[i]
            del maxes[i]
            return
        if j == len(block):
            maxes[i] = block[-1]
        if len(block) < _BLOCK // 4:
            # Merge a thinned-out block into a neighbour so the block count stays ~n/B.
            if i + 1 < len(blocks) and len(blocks[i + 1]) + len(block) <= _BLOCK:
                blocks[i + 1][:0] = block
                del blocks[i]
                del maxes[i]
            elif i > 0 and len(blocks[i - 1]) + len(block) <= _BLOCK:
                blocks[i - 1].extend(block)
                maxes[i - 1] = maxes[i]
                del blocks[i]
                del maxes[i]

    def push(self, key: Any) -> None:
        self.remove(key)
        t = self.clock
        self.clock = t + 1
        self.times[key] = t
        blocks = self.blocks
        if blocks and len(blocks[-1]) < _BLOCK:
            blocks[-1].append(t)
            self.maxes[-1] = t
        else:
            blocks.append([t])
            self.maxes.append(t)

    def remove(self, key: Any) -> None:
        old = self.times.pop(key, None)
        if old is not None:
            self._discard(old)

    def trim(self, max_keys: int) -> None:
        times = self.times
        while len(times) > max_keys:
            _, old = times.popitem(last=False)
            self._discard(old)

    def clear(self) -> None:
        self.times.clear()
        self.blocks.clear()
        self.maxes.clear()


class _Curve:
    """A weighted histogram of sampled stack distances."""

    __slots__ = ("hist", "cold", "sampled", "references")

    def __init__(self) -> None:
        self.hist: list[float] = []
        self.cold = 0.0
        self.sampled = 0.0
        self.references = 0.0

    def bucket(self, d: int, w: float) -> None:
        hist = self.hist
        if d >= len(hist):
            hist.extend([0.0] * (d + 1 - len(hist)))
        hist[d] += w

    def scale(self, f: float) -> None:
        self.hist = [v * f for v in self.hist]
        self.cold *= f
        self.sampled *= f
        self.references *= f


class PySampler:
    """Pure-Python ``Sampler`` (see the module docstring)."""

    __slots__ = (
        "_threshold",
        "max_keys",
        "_growth",
        "_weight",
        "_stack",
        "_stream",
        "_lookups",
        "_raw",
    )

    def __init__(self, threshold: int, max_keys: int, half_life: int = 0) -> None:
        args = (("threshold", threshold), ("max_keys", max_keys), ("half_life", half_life))
        for name, value in args:
            if not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= threshold <= 1 << 64:
            raise ValueError("threshold must be in [0, 2**64]")
        if not 1 <= max_keys <= 1 << 28:
            raise ValueError(f"max_keys must be in [1, {1 << 28}], got {max_keys}")
        if half_life < 0:
            raise ValueError(f"half_life must be >= 0, got {half_life}")
        self._threshold = threshold
        self.max_keys = max_keys
        self._growth = 2.0 ** (1.0 / half_life) if half_life else 1.0
        self._weight = 1.0
        self._stack = _Stack()
        self._stream = _Curve()
        self._lookups = _Curve()
        # raw references, raw sampled, raw lookups, lost
        self._raw = [0, 0, 0, 0]

    def _sampled(
        self, hashes: Sequence[str], tag: int, hasher: Callable[[str], int] = str.__hash__
    ) -> list[Any]:
        """Identities of ``hashes``' sampled pages, in order: one C hash pass, one comparison
        a page.  ``str.__hash__`` hashes a str subclass as its value, as the C sampler does;
        the index passes the faster ``hash`` (its items are plain str, or hashed so)."""
        thr = self._threshold
        if thr <= 1 << 63:
            # (unsigned) h < thr  <=>  0 <= h < thr for the signed hash.
            values = [v for v in map(hasher, hashes) if 0 <= v < thr]
        else:
            values = [u for u in (v & _M64 for v in map(hasher, hashes)) if u < thr]
        return values if tag == 0 else [(tag, v) for v in values]

    def _advance(self, total: int, lookups: int) -> float:
        if self._growth != 1.0:
            try:
                growth = math.pow(self._growth, total)
            except OverflowError:  # C's pow gives inf: everything so far weighs 0
                growth = math.inf
            self._weight *= growth
            if self._weight > _RESCALE_AT:
                f = 1.0 / self._weight
                self._stream.scale(f)
                self._lookups.scale(f)
                self._weight = 1.0
        w = self._weight
        self._stream.references += w * total
        self._raw[0] += total
        if lookups:
            self._lookups.references += w * lookups
            self._raw[2] += lookups
        return w

    def _reference(
        self,
        keys: list[Any],
        total: int,
        lookup: bool,
        lookups: int = 0,
        missed: Any = None,
    ) -> None:
        w = self._advance(total, lookups)
        stack = self._stack
        times = stack.times
        stream = self._stream
        lk = self._lookups if lookup else None
        if lk is not None:
            lk.sampled += w * (len(keys) + (missed is not None))
        if missed is not None:
            assert lk is not None
            t = times.get(missed)
            if t is None:
                lk.cold += w
            else:
                lk.bucket(stack.after(t), w)
        if not keys:
            return
        self._raw[1] += len(keys)
        stream.sampled += w * len(keys)
        if len(keys) > 1 and len(set(keys)) != len(keys):
            last = {key: i for i, key in enumerate(keys)}
            kept = []
            for i, key in enumerate(keys):
                if last[key] == i:
                    kept.append(key)
                else:
                    stream.bucket(0, w)
                    if lk is not None:
                        lk.bucket(0, w)
            keys = kept
        push = []
        for key in keys:
            t = times.get(key)
            if t is None:
                stream.cold += w
                if lk is not None:
                    lk.cold += w
                    continue
            else:
                d = stack.after(t)
                stream.bucket(d, w)
                if lk is not None:
                    lk.bucket(d, w)
            push.append(key)
        for key in push:
            stack.push(key)
            stack.trim(self.max_keys)

    def _fed(
        self,
        hashes: Sequence[str],
        tag: int,
        lookup: bool,
        hasher: Callable[[str], int] = hash,
    ) -> None:
        """A complete walk (``lookup``) or add from ``PyLruIndex``; unsampled calls only count."""
        n = len(hashes)
        keys = self._sampled(hashes, tag, hasher)
        if keys:
            self._reference(keys, n, lookup, n if lookup else 0)
        else:
            self._advance(n, n if lookup else 0)

    def added(self, hashes: Sequence[str], tag: int = 0, /) -> None:
        self._fed(hashes, _validate.index_batch(hashes, tag), False, str.__hash__)

    def walked(self, hashes: Sequence[str], stop: int, tag: int = 0, /) -> None:
        if not isinstance(stop, int):
            raise TypeError(f"stop must be an int, got {type(stop).__name__}")
        if stop < 0:
            raise ValueError("stop must be >= 0")
        tag = _validate.index_batch(hashes, tag)
        n = len(hashes)
        if not n:
            return
        stop = min(stop, n)
        keys = self._sampled(hashes[:stop], tag)
        last = self._sampled(hashes[stop : stop + 1], tag)
        lookups = stop + (stop < n)
        if keys or last:
            self._reference(keys, stop, True, lookups, last[0] if last else None)
        else:  # most calls: nothing sampled, only the counters move
            self._advance(stop, lookups)

    def removed(self, hashes: Sequence[str], tag: int = 0, /) -> None:
        tag = _validate.index_batch(hashes, tag)
        if not self._stack.times:
            return
        for key in self._sampled(hashes, tag):
            self._stack.remove(key)

    def clear(self) -> None:
        self._stack.clear()

    def cumulative(self, limits: Sequence[int], lookups: bool = False, /) -> list[float]:
        hist = (self._lookups if lookups else self._stream).hist
        prefix = [0.0, *accumulate(hist)]
        return [prefix[max(0, min(limit, len(hist)))] for limit in limits]

    def counts(self) -> dict[str, Any]:
        s, lk = self._stream, self._lookups
        return {
            "stream_sampled": s.sampled,
            "stream_cold": s.cold,
            "stream_references": s.references,
            "lookup_sampled": lk.sampled,
            "lookup_cold": lk.cold,
            "lookup_references": lk.references,
            "raw_references": self._raw[0],
            "raw_sampled": self._raw[1],
            "raw_lookups": self._raw[2],
            "tracked": len(self._stack.times),
            "lost": self._raw[3],
            "compactions": 0,
        }

    def __repr__(self) -> str:
        return f"<PySampler tracked={len(self._stack.times)} max_keys={self.max_keys}>"
