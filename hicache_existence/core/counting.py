"""The counting walk: one pool's lookups and their accounting, for both generations.

Both keep a pool's beliefs in an ``LruIndex`` under a tag (current: own index, tag 0;
seed: one shared index, a tag per pool).  ``CountingPool``, subclassed by both, bumps
each lookup counter in one place; subclasses do mutations and check chain arguments
before ``_walk`` (``contains`` checks its own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence

from hicache_existence.core import _validate, lru
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource
from hicache_existence.core.sampler import SamplerType
from hicache_existence.core.stats import PoolCounters, PoolStats


class CountingPool:
    """One pool's counters, miss memory and sampler, and its counted lookups."""

    __slots__ = (
        "name",
        "tag",
        "_entries",
        "_counters",
        "_memory",
        "_missed",
        "_observer",
        "_sampler",
        "_inflight",
        "tally",
        "covered_pages",
    )

    def __init__(
        self,
        name: str,
        entries: lru.LruIndexType,
        tag: int,
        memory: MissMemory | None,
        observer: BeliefObserver | None,
        advisor: SamplerSource | None,
    ) -> None:
        self.name = name
        #: This pool's tag in ``entries`` (0 for a pool with its own index).
        self.tag = tag
        self._entries = entries
        self._counters = PoolCounters()
        self._memory = memory
        self._missed: list[str] = []
        self._observer = observer
        #: This pool's own in-flight refcounts (D2H launch to storage ack).
        self._inflight: dict[str, int] = {}
        #: ``covered_pages``: the pages of every ``covered()`` answered True while
        #: ``tally`` is on (the cache's ``tally_covered``).  Buffer mode's write path
        #: turns it on where upstream's only other questions are its flush's (then
        #: off): the tally is then the admissions' avoided pages, with no hook on them.
        self.tally = False
        self.covered_pages = 0
        # The index feeds the sampler; the walk reports what it can't (misses, rescues, contains).
        self._sampler: SamplerType | None = None
        if advisor is not None:
            self._sampler = advisor.sampler(name, lru.sampler_class(entries))
            entries.attach(tag, self._sampler)

    def contains(self, page_hash: str) -> bool:
        """Whether one page is believed stored; a hit is LRU-touched."""
        _validate.page_hash(page_hash)
        c = self._counters
        c.queries += 1
        c.pages_checked += 1
        if self._entries.touch(page_hash, self.tag):
            c.page_hits += 1
            c.query_hits += 1
            stop = 1
        else:
            c.query_misses += 1
            self._count_miss(page_hash)
            stop = 0
        if self._sampler is not None:
            self._sampler.walked((page_hash,), stop, self.tag)
        if self._observer is not None:
            self._observer.touched(self.name, (page_hash,), stop)
        return stop == 1

    def _walk(self, seq: Sequence[str], cover: Container[str] | None) -> bool:
        """A chain walk (``seq`` checked by the caller, its pages by the index): every page
        believed (or in ``cover``)?  The believed prefix is touched in one C call."""
        n = len(seq)
        pos = self._entries.touch_prefix(seq, self.tag)  # validates seq before any change
        c = self._counters
        c.queries += 1
        if pos != n:
            return self._walk_rest(seq, pos, cover or None)
        c.query_hits += 1
        c.pages_checked += n
        c.page_hits += n
        if n and self._observer is not None:
            self._observer.touched(self.name, seq, n)
        return True

    def _walk_rest(self, seq: Sequence[str], pos: int, cover: Container[str] | None) -> bool:
        """Finish a walk from ``seq[pos]`` (first page not believed) on a miss or covered
        content: the index's ``cover_rest`` walks it (C when compiled, not a Python loop)."""
        c = self._counters
        stop, rescues = pos, 0
        if cover is not None:
            stop, rescues = self._entries.cover_rest(seq, pos, self.tag, cover)
            if stop == len(seq):
                c.query_hits += 1
                c.pages_checked += stop
                c.page_hits += stop - rescues
                c.rescues += rescues
                if self._sampler is not None:
                    self._sampler.walked(seq, stop, self.tag)
                if self._observer is not None:
                    self._observer.touched(self.name, seq, stop)
                return True
        c.query_misses += 1
        c.pages_checked += stop + 1
        c.page_hits += stop - rescues
        c.rescues += rescues
        self._count_miss(seq[stop])
        if self._sampler is not None:
            self._sampler.walked(seq, stop, self.tag)
        if self._observer is not None:
            self._observer.touched(self.name, seq, stop)
        return False

    def _count_miss(self, page_hash: str) -> None:
        self._counters.page_misses += 1
        if self._memory is not None:
            # Classified later in a batch (``settle``): a miss pays one append.
            self._missed.append(page_hash)

    def settle(self) -> None:
        """Classify the misses recorded since the last call.  Runs before the miss memory
        changes (each miss gets the reason it had) and from the per-step hook (exported
        reasons lag at most one step).  Scheduler thread only."""
        missed = self._missed
        if not missed or self._memory is None:
            return
        self._missed = []
        counts = self._counters.miss_reasons
        for reason, n in Counter(self._memory.classify(missed)).items():
            counts[reason] += n

    def _remember(self, keys: list[str], reason: int) -> None:
        """Record ``keys`` leaving for ``reason``, after classifying misses pending before."""
        memory = self._memory
        if memory is not None:
            if self._missed:
                self.settle()
            memory.remember(keys, reason)

    @property
    def max_entries(self) -> int:
        """The cap this pool counts against (each generation's pool says)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._entries)

    def inflight_refs(self) -> dict[str, int]:
        """A copy of the in-flight refcounts."""
        return dict(self._inflight)

    def stats(self) -> PoolStats:
        """An immutable snapshot of this pool's accounting, O(1)."""
        return self._counters.snapshot(self.name, len(self), self.max_entries, len(self._inflight))
