"""Which looked-up chains the reconciler verifies: the same ones on every rank.

A chain is picked after a random gap of lookups, uniform in [1, 2 / rate - 1],
drawn from a fixed-seed PRNG in integer arithmetic only: every replica sees the
same lookups and draws the same gaps on any platform, and random gaps, unlike
every k-th lookup, cannot alias with a periodic workload.  Fleet replay
(``replay.fleet``) picks with this very code.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence

#: Seed of the sampling PRNG: a constant, so every rank draws the same gaps.
SAMPLING_SEED = 0x68696361636865

#: A chain picked for verification: (pool, its first ``pages_per_query`` pages).
Chain = tuple[str, tuple[str, ...]]


class Sampler:
    """The gap sequence.  ``countdown`` is public so that the observer's hot
    path (not picked: one decrement) costs no call."""

    __slots__ = ("_rng", "_span", "countdown", "pages")

    def __init__(self, rate: float, pages_per_query: int) -> None:
        mean = 2.0 / rate if rate > 0 else 0.0  # inf for a subnormal rate
        self._span = (
            max(1, round(mean) - 1) if 0 < mean < sys.maxsize else (sys.maxsize if mean else 0)
        )
        self._rng = random.Random(SAMPLING_SEED)
        self.pages = pages_per_query
        self.countdown = self.gap()

    def gap(self) -> int:
        """Lookups until the next pick (never, at rate 0)."""
        span = self._span
        if span <= 0:
            return sys.maxsize
        return 1 + ((self._rng.getrandbits(32) * span) >> 32)

    def picked(self, pages: int) -> int:
        """Call when ``countdown`` reached 0 on a lookup of ``pages`` pages:
        draws the next gap and returns how many leading pages to verify."""
        self.countdown = self.gap()
        return min(pages, self.pages)


class Candidates:
    """Picked chains waiting for admission, at most ``cap``, and the chains
    (by pool and last page) queued or out, which are not picked twice."""

    __slots__ = ("_cap", "chains", "pending")

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self.chains: list[Chain] = []
        self.pending: set[tuple[str, str]] = set()

    def __iter__(self) -> Iterator[Chain]:
        return iter(self.chains)

    def __len__(self) -> int:
        return len(self.chains)

    def offer(self, pool: str, hashes: Sequence[str], n: int) -> bool | None:
        """Add ``hashes[:n]``: None when that chain is already pending, False
        when the list is full (dropped), True when added."""
        key = (pool, hashes[n - 1])
        if key in self.pending:
            return None
        if len(self.chains) >= self._cap:
            return False
        self.chains.append((pool, tuple(hashes[:n])))
        self.pending.add(key)
        return True

    def take(self) -> list[Chain]:
        """Every waiting chain (still pending until ``release``d)."""
        chains, self.chains = self.chains, []
        return chains

    def release(self, pool: str, chain: Sequence[str]) -> None:
        """The chain is no longer queued or out: it may be picked again."""
        self.pending.discard((pool, chain[-1]))

    def drop_pool(self, pool: str) -> None:
        """Forget ``pool``'s waiting chains (the pool was cleared)."""
        for chain in [c for p, c in self.chains if p == pool]:
            self.release(pool, chain)
        self.chains = [(p, chain) for p, chain in self.chains if p != pool]
