"""The cache core's extension points, as protocols (docs/design.md, "Extension points").

Memories and observers get whole batches, once per *operation*, and only when
installed (else one ``is not None`` test): features that are off cost nothing.
A ``SamplerSource``'s sampler is fed by the LRU index: unlike an observer it costs the
hot path no Python call (``core.sampler``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from hicache_existence.core.sampler import SamplerType


@runtime_checkable
class MissMemory(Protocol):
    """Bounded memory of pages that left a pool's belief set, and why."""

    def remember(self, keys: Sequence[str], reason: int) -> None:
        """``keys`` left for ``reason`` (a ``stats.MISS_REASONS`` index other than ``COLD``)."""

    def reason(self, key: str) -> int:
        """Classify a miss on ``key``: the ``stats.MISS_REASONS`` index."""

    def classify(self, keys: Sequence[str]) -> Iterable[int]:
        """``reason`` per key of a batch of misses; run before the memory next changes (the
        answer the miss would have got) or at the step boundary."""


@runtime_checkable
class BeliefObserver(Protocol):
    """Receives every state-changing (or LRU-touching) operation of a cache."""

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        """``add`` completed (its evictions included)."""

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        """A lookup of a non-empty ``hashes`` walked ``hashes[:stop]``, touching believed pages;
        ``stop < len(hashes)``: it missed at ``hashes[stop]`` (``0``: nothing touched)."""

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        """``invalidate_beyond(hashes, keep_pages)`` completed."""

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        """``track_inflight`` (``delta=+1``) or ``untrack_inflight`` (``-1``)."""

    def cleared(self, pool: str, inflight_only: bool) -> None:
        """``clear`` (or ``clear_inflight`` when ``inflight_only``)."""


@runtime_checkable
class SamplerSource(Protocol):
    """Gives each pool the sampler its index should feed (the capacity advisor)."""

    def sampler(self, pool: str, factory: Callable[..., SamplerType] | None = None) -> SamplerType:
        """``pool``'s sampler, made with ``factory`` (what the index takes) if new."""


class Tee:
    """Fans one cache's operation stream out to several observers, in order.  A cache
    given a ``Tee`` listens to it and holds what it should call: ``None`` with no
    observer, the one observer itself (one call, not a Python loop in front of it: a
    recorder's compiled tap, a TP=2 rank's digest), else the ``Tee``.  Attaching one
    later (the reconciler, a recorder) reaches every pool at once."""

    __slots__ = ("_observers", "_listeners")

    def __init__(self, *observers: BeliefObserver) -> None:
        self._observers: tuple[BeliefObserver, ...] = tuple(observers)
        self._listeners: list[Callable[[BeliefObserver | None], None]] = []

    @property
    def observers(self) -> tuple[BeliefObserver, ...]:
        """The observers, in notification order (assignable: listeners are told)."""
        return self._observers

    @observers.setter
    def observers(self, value: Iterable[BeliefObserver]) -> None:
        self._observers = tuple(value)
        live = self._live()
        for listen in self._listeners:
            listen(live)

    def _live(self) -> BeliefObserver | None:
        observers = self._observers
        if len(observers) == 1:
            return observers[0]
        return self if observers else None

    def listen(self, listener: Callable[[BeliefObserver | None], None]) -> None:
        """Call ``listener`` now and whenever observers change with what a cache
        should call: ``None`` (no observer), the one observer, or the ``Tee``."""
        self._listeners.append(listener)
        listener(self._live())

    def append(self, observer: BeliefObserver) -> None:
        """Add an observer that needs the cache to exist first (the reconciler):
        build the ``Tee``, then the cache, then append.  Scheduler thread only."""
        self.observers = (*self._observers, observer)

    def discard(self, observer: BeliefObserver) -> None:
        """Stop notifying ``observer`` (absent: nothing).  Scheduler thread only."""
        self.observers = tuple(o for o in self._observers if o is not observer)

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        for o in self._observers:
            o.added(pool, hashes)

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        for o in self._observers:
            o.touched(pool, hashes, stop)

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        for o in self._observers:
            o.invalidated(pool, hashes, keep_pages)

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        for o in self._observers:
            o.inflight(pool, hashes, delta)

    def cleared(self, pool: str, inflight_only: bool) -> None:
        for o in self._observers:
            o.cleared(pool, inflight_only)
