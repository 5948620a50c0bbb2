"""What both cache generations hold alike: their pools by name, and the settings a
pool takes from its cache (the cap, the observer, the advisor, the covered tally),
which reach every existing pool when they change.  One class, so that a setting
added for one generation is the other's too."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Generic, TypeVar

from hicache_existence.core import _validate
from hicache_existence.core.counting import CountingPool
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource, Tee
from hicache_existence.core.stats import CacheStats

#: ``pool name -> MissMemory | None``, called once per new pool (miss reasons).
MissMemoryFactory = Callable[[str], "MissMemory | None"]

P = TypeVar("P", bound=CountingPool)


class PoolRegistry(Generic[P]):
    """A cache's pools, in creation order, and what a new pool is given."""

    #: Whether every pool lives in one LRU under one cap (``core.protocol``).
    shared_lru: bool

    def __init__(
        self,
        max_entries: int,
        miss_memory: MissMemoryFactory | None,
        observer: BeliefObserver | None,
        advisor: SamplerSource | None,
    ) -> None:
        self._max_entries = _validate.count(max_entries, "max_entries", 1)
        self._pools: dict[str, P] = {}
        self._miss_memory = miss_memory
        self._observer = observer
        self._advisor = advisor
        self._tally = False

    def _listen(self) -> None:
        """Follow the observer if it is a ``Tee``: the last step of a cache's
        ``__init__``, after every check (a cache that failed one is never listened to)."""
        if isinstance(self._observer, Tee):
            self._observer.listen(self._observe)

    def tally_covered(self, on: bool) -> None:
        """Turn every pool's ``covered()`` tally on or off (``CountingPool``), new pools too."""
        self._tally = on = bool(on)
        for pool in list(self._pools.values()):
            pool.tally = on

    def _observe(self, observer: BeliefObserver | None) -> None:
        """What the cache and every pool notify from now on (a ``Tee``'s listener:
        ``None``, its one observer, or the ``Tee``)."""
        self._observer = observer
        for pool in list(self._pools.values()):
            pool._observer = observer

    @property
    def max_entries(self) -> int:
        """The cap: each new pool's (current generation), or the one every pool shares
        (flat: a lower one takes effect at the next add)."""
        return self._max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self._max_entries = _validate.count(value, "max_entries", 1)

    def pools(self) -> tuple[P, ...]:
        """Every pool created so far, in creation order."""
        return tuple(self._pools.values())

    def pool_names(self) -> tuple[str, ...]:
        """Names of the pools created so far, in creation order."""
        return tuple(self._pools)

    def settle(self) -> None:
        """Classify every pool's pending misses (miss reasons); scheduler thread."""
        for pool in list(self._pools.values()):
            pool.settle()

    def stats(self) -> CacheStats:
        """Immutable snapshot of every pool, O(pools), safe from any thread: the dict is
        copied in one C call (walking it could let GC, then the scheduler, in between)."""
        pools = {name: pool.stats() for name, pool in self._pools.copy().items()}
        return CacheStats(MappingProxyType(pools), self.shared_lru)
