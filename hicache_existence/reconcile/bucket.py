"""The verification budget: a token bucket refilled from the agreed clock.

It counts thousandths of a token in integers and is refilled only from the
MIN-agreed elapsed milliseconds, so it is bit-identical on every rank and every
rank admits the same candidates.  Burst: one second's worth (one token at least).
"""

from __future__ import annotations


class TokenBucket:
    __slots__ = ("_burst", "_last_ms", "_rate", "_rem", "milli")

    def __init__(self, per_s: float) -> None:
        self._rate = round(float(per_s) * 1000)
        self._burst = max(1000, self._rate)
        #: Thousandths of a token available.
        self.milli = self._burst
        self._last_ms: int | None = None
        self._rem = 0  # millionths of a token credited but not yet a thousandth

    def refill(self, elapsed_ms: int) -> None:
        """Credit the time since the last refill (the first call only sets the origin)."""
        if self._last_ms is None:
            self._last_ms = elapsed_ms
            return
        if elapsed_ms > self._last_ms:
            gained, self._rem = divmod((elapsed_ms - self._last_ms) * self._rate + self._rem, 1000)
            self.milli = min(self._burst, self.milli + gained)
            self._last_ms = elapsed_ms

    def tokens(self) -> int:
        """Whole tokens available."""
        return self.milli // 1000

    def spend(self) -> None:
        self.milli -= 1000
