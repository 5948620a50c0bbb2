"""The vector the ranks MIN-reduce at every agreement (``3 + 2 * slots`` words:
the collective needs a fixed size); every rank acts on the element-wise MIN:

* ``done``: queries this rank finished contiguously from the oldest one;
* ``admit``: candidates this rank could admit (queue space, circuit state);
* ``elapsed_ms``: its clock (the MIN refills every rank's token bucket alike);
* ``leading[i]``: the i-th query's answer (-1 for an error, so one rank's
  error means nobody acts; ``UNDONE`` past ``done``, never agreed upon);
* ``trusted[i]``: 1 when that answer's absence is evidence, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

#: A slot beyond the finished queries (larger than any chain).
UNDONE = 1 << 62


class Vector(NamedTuple):
    done: int
    admit: int
    elapsed_ms: int
    leading: list[int]
    trusted: list[int]

    @classmethod
    def local(
        cls, verdicts: Sequence[tuple[int, int]], admit: int, elapsed_ms: int, slots: int
    ) -> Vector:
        """This rank's vector: ``verdicts`` (leading, trusted) of its first
        finished queries (at most ``slots``), the rest padded."""
        pad = slots - len(verdicts)
        leading = [v[0] for v in verdicts] + [UNDONE] * pad
        return cls(len(verdicts), admit, elapsed_ms, leading, [v[1] for v in verdicts] + [0] * pad)

    @classmethod
    def idle(cls, slots: int) -> Vector:
        """What a rank that cannot tell contributes: nothing done, nothing
        admitted, clock 0 (no refill)."""
        return cls.local((), 0, 0, slots)

    def words(self) -> list[int]:
        return [self.done, self.admit, self.elapsed_ms, *self.leading, *self.trusted]

    @classmethod
    def from_words(cls, words: Sequence[int], slots: int) -> Vector:
        if len(words) != 3 + 2 * slots:
            raise ValueError(f"agreed vector has {len(words)} words, not {3 + 2 * slots}")
        return cls(
            words[0], words[1], words[2], list(words[3 : 3 + slots]), list(words[3 + slots :])
        )
