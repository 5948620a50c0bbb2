"""The exact belief-only hit-ratio curve of a trace, for every cap, in one pass.

A reference hits at cap ``C`` iff its *stack distance* (distinct pages referenced
after its previous reference and before its request began) is below ``C``
(Mattson et al., 1970; docs/replay.md, "Belief-only mode").  Distances come from a
Fenwick tree over positions counting superseded ("dead") ones: a reference last
seen at ``a`` has distance ``distinct_so_far - (a + 1 - dead[0..a])``.  A run of
pages last referenced at consecutive positions (a reused prefix) has distances
``d, d-1, ...``: one tree query and one range update per run.  A request's
distances are all taken before its updates: the batch's "as the request arrives".
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

from hicache_existence.replay.pages import PageRequest, PageTrace, counted


@dataclass(frozen=True, eq=False)
class BeliefCurve:
    """One pool's exact belief-only curve: hits, misses and evictions at any cap."""

    pool: str
    references: int
    #: First references: misses at every cap.
    cold: int
    #: Distinct pages referenced.
    distinct: int
    #: ``hits_below[c]``: references with stack distance below ``c``, for ``c`` in ``0..distinct``.
    hits_below: Sequence[int]
    #: Repeats of a page earlier in the same request: hits at every cap.
    repeats: int = 0

    def hits(self, cap: int) -> int:
        """References already believed when their request arrives, at ``cap`` entries."""
        return self.repeats + self.hits_below[min(cap, self.distinct)]

    def hit_ratio(self, cap: int) -> float:
        """``hits / references`` (1.0 for an empty stream, like ``PoolStats``)."""
        return self.hits(cap) / self.references if self.references else 1.0

    def misses(self, cap: int) -> int:
        """References not believed: the pages ``add`` inserts (each one L3 write)."""
        return self.references - self.hits(cap)

    def evictions(self, cap: int) -> int:
        """Entries the cap removed over the whole stream."""
        return self.misses(cap) - min(cap, self.distinct)

    def entries(self, cap: int) -> int:
        """Entries held at the end (and at the peak: belief-only never removes otherwise)."""
        return min(cap, self.distinct)


class _Pool:
    """The one-pass state of one pool's reference stream."""

    __slots__ = ("name", "last", "pos", "size", "b1", "b2", "diff", "cold", "repeats")

    def __init__(self, name: str, references: int) -> None:
        self.name = name
        self.last: dict[str, int] = {}
        self.pos = 0
        self.size = references + 2
        # Range-update / prefix-sum Fenwick pair over 1-based positions: dead counts.
        self.b1 = [0] * (self.size + 1)
        self.b2 = [0] * (self.size + 1)
        # Difference array over stack distances (distance d at index d).
        self.diff = [0] * (references + 2)
        self.cold = 0
        self.repeats = 0

    def _dead_through(self, pos: int) -> int:
        """Dead positions in ``[0, pos]``."""
        i = pos + 1
        s1 = s2 = 0
        b1 = self.b1
        b2 = self.b2
        n = i
        while i > 0:
            s1 += b1[i]
            s2 += b2[i]
            i &= i - 1
        return s1 * n - s2

    def _kill(self, start: int, count: int) -> None:
        """Mark positions ``[start, start + count)`` dead (they were all live)."""
        size = self.size
        b1 = self.b1
        b2 = self.b2
        left = start + 1
        right = start + count  # inclusive, 1-based
        i = left
        w = left - 1
        while i <= size:
            b1[i] += 1
            b2[i] += w
            i += i & -i
        i = right + 1
        while i <= size:
            b1[i] -= 1
            b2[i] -= right
            i += i & -i

    def request(self, pages: Sequence[str]) -> None:
        n = len(pages)
        if not n:
            return
        start = self.pos
        last = self.last
        prevs: list[int | None] = list(map(last.get, pages))
        repeat_kills: list[int] = []
        if len(set(pages)) != n:
            # A repeat within the request is a hit at every cap (-1); the earlier
            # occurrence it supersedes dies.
            seen: dict[str, int] = {}
            for index, page in enumerate(pages):
                earlier = seen.get(page)
                if earlier is not None:
                    prevs[index] = -1
                    repeat_kills.append(start + earlier)
                seen[page] = index
        # Split into runs of consecutive previous positions: (first, length).
        runs: list[tuple[int, int]] = []
        first = end = -2  # the run being built, positions first..end-1 (-2: none)
        for prev in prevs:
            if prev == end:
                end += 1
                continue
            if first >= 0:
                runs.append((first, end - first))
            first, end = (-2, -2) if prev is None or prev < 0 else (prev, prev + 1)
        if first >= 0:
            runs.append((first, end - first))
        self.cold += prevs.count(None)
        self.repeats += prevs.count(-1)
        distinct = len(last)
        diff = self.diff
        for first, count in runs:
            d0 = distinct - (first + 1 - self._dead_through(first))
            diff[d0 - count + 1] += 1
            diff[d0 + 1] -= 1
        for first, count in runs:
            self._kill(first, count)
        for pos in repeat_kills:
            self._kill(pos, 1)
        last.update(zip(pages, range(start, start + n)))
        self.pos = start + n

    def curve(self) -> BeliefCurve:
        distinct = len(self.last)
        counts = accumulate(self.diff[:distinct])
        hits_below = array("q", chain((0,), accumulate(counts)))
        return BeliefCurve(self.name, self.pos, self.cold, distinct, hits_below, self.repeats)


def belief_only_curves(
    requests: PageTrace | Iterable[PageRequest],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, BeliefCurve]:
    """The exact belief-only curve of every pool (each pool is its own LRU)."""
    reqs = requests.requests if isinstance(requests, PageTrace) else tuple(requests)
    sizes: dict[str, int] = {}
    for r in reqs:
        sizes[r.pool] = sizes.get(r.pool, 0) + len(r.pages)
    pools = {name: _Pool(name, size) for name, size in sizes.items()}
    for r in counted(reqs, progress):
        pools[r.pool].request(r.pages)
    return {name: pool.curve() for name, pool in pools.items()}
