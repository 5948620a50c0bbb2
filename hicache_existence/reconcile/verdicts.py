"""What an agreed answer does to the beliefs, and the writes it must not undo.

An answer taken at time T proves nothing about a page whose write overlaps T
(docs/reconciler.md, "Writes racing a query"): one in flight when the verdict
applies, or added (the storage ack) since the query was admitted; either check
alone misses some of those writes.  If the first missing page was written since
the query, the invalidation is withheld; otherwise the pages beyond it are
dropped except those written since.  Every rank sees the same writes at the same
lockstep points, so every rank withholds the same verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from itertools import repeat

from hicache_existence.core.protocol import ExistenceCache

#: Pools whose keys are a trailing window of the chain (upstream TRAILING_PAGES):
#: a verdict only invalidates there, as upstream's ``TrailingWindowPolicy``.
TRAILING_POOLS = frozenset({"swa", "auxiliary_swa", "mamba", "draft_swa"})


def default_learns(pool: str) -> bool:
    """Whether verdicts may add presence to ``pool`` (all-pages pools only)."""
    return pool not in TRAILING_POOLS and not pool.endswith("_state")


def invalidation_span(
    chain: Sequence[str], leading: int, written: Callable[[str], bool]
) -> Sequence[str] | None:
    """The chain to pass to ``invalidate_beyond(..., leading)`` for an absence
    verdict, without the later pages ``written(page)`` since the answer; None
    (withhold) when ``chain[leading]``, where the answer stopped, was."""
    if written(chain[leading]):
        return None
    rest = chain[leading + 1 :]
    if not any(map(written, rest)):
        return chain
    return (*chain[: leading + 1], *(p for p in rest if not written(p)))


def _disjoint(pages: Container[str], tail: Sequence[str]) -> bool:
    """Whether ``pages`` certainly holds none of ``tail`` (in C for dicts and
    sets; other containers answer False and take the page-by-page check)."""
    if isinstance(pages, dict):
        return pages.keys().isdisjoint(tail)
    if isinstance(pages, (set, frozenset)):
        return pages.isdisjoint(tail)
    return False


class WritesSince:
    """The pages each pool added (storage acks) while one of its queries was
    out, with the add's ordinal: what was written since a query's admission."""

    #: Pages recorded per pool at most; past it the verdicts cannot tell.
    CAP = 1 << 18

    def __init__(self) -> None:
        # pool -> {page: ordinal of the add that last added it}, kept only
        # while a query of the pool is out (and until the next admission).
        self._recent: dict[str, dict[str, int]] = {}
        #: The pools recorded now (read-only to callers, one dict for good).
        self.recording: Container[str] = self._recent
        self._adds = 0
        self._out: dict[str, int] = {}

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        recent = self._recent.get(pool)
        if recent is not None and len(recent) < self.CAP:
            self._adds += 1
            recent.update(zip(hashes, repeat(self._adds)))

    def opened(self, pool: str) -> int:
        """A query of ``pool`` was admitted: record its adds from now; returns
        the add ordinal the query's answer predates."""
        self._out[pool] = self._out.get(pool, 0) + 1
        self._recent.setdefault(pool, {})
        return self._adds

    def closed(self, pool: str) -> None:
        """A query of ``pool`` was retired (its verdict still reads the adds)."""
        left = self._out.get(pool, 0) - 1
        if left > 0:
            self._out[pool] = left
        else:
            self._out.pop(pool, None)

    def prune(self) -> None:
        """Forget the adds of pools with nothing out."""
        for pool in [p for p in self._recent if p not in self._out]:
            del self._recent[pool]

    def span(
        self,
        pool: str,
        chain: Sequence[str],
        leading: int,
        since: int,
        inflight: Sequence[Container[str] | None],
    ) -> Sequence[str] | None:
        """``invalidation_span`` for a query admitted at add ordinal ``since``,
        given the pool's in-flight page sets; O(1) with nothing written."""
        recent = self._recent.get(pool)
        if recent is None:
            recent = {}
        elif len(recent) >= self.CAP:
            return None  # stopped recording: cannot tell, keep the beliefs
        sources = [s for s in inflight if s]
        if not recent and not sources:
            return chain
        tail = chain[leading:]
        if all(_disjoint(s, tail) for s in (recent, *sources)):
            return chain  # the common case, in C: nothing written touches the tail
        get = recent.get

        def written(page: str) -> bool:
            return get(page, -1) > since or any(page in s for s in sources)

        return invalidation_span(chain, leading, written)


@dataclass(frozen=True)
class Outcome:
    """What one verdict did: beliefs removed (a stale positive: at least one),
    whether its invalidation was withheld, pages learnt."""

    invalidated: int = 0
    withheld: bool = False
    learnt: int = 0


def apply_verdict(
    target: ExistenceCache,
    pool: str,
    chain: Sequence[str],
    leading: int,
    trusted: bool,
    doomed: Callable[[], Sequence[str] | None],
    learn: bool,
) -> Outcome:
    """Apply the agreed answer ``leading`` to ``pool``: a ``trusted`` absence
    runs ``invalidate_beyond(doomed(), leading)`` (withheld when None); with
    ``learn``, the leading pages the beliefs lack are added."""
    invalidated, withheld, learnt = 0, False, 0
    beliefs = target.pool(pool)
    if leading < len(chain) and trusted:
        span = doomed()
        if span is None:
            withheld = True
        else:
            before = beliefs.stats().invalidations
            beliefs.invalidate_beyond(span, leading)
            invalidated = beliefs.stats().invalidations - before
    if learn and leading > 0:
        head = chain[:leading]
        if len(beliefs.believed(head)) < len(head):
            before = beliefs.stats().inserts
            beliefs.add(head)
            learnt = beliefs.stats().inserts - before
    return Outcome(max(invalidated, 0), withheld, max(learnt, 0))
