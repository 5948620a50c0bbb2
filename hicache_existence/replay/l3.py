"""L3 as every simulator models it: the pages each pool holds, LRU-bounded.

One model for the replay (``replay.model``), fleet mode (one L3 shared by the
instances) and the demo (one rank's shard, also its reconciler's ground truth:
``leading_present`` and ``present``).  A pool keeps every page written or, bounded,
the ``capacity`` most recently written (or read, when a read says so): that is
what makes beliefs stale.  ``drop_every`` loses one recent page in that many
writes, as a failing or early-expiring L3 node would; a ``ledger``
(``record_stored`` / ``record_removed``, e.g. Redis) hears every change, as from
the wrapping storage backend.

Thread-safe: the demo's reconciler worker reads while its scheduler writes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

#: Drains an iterator in C.
_sink: deque[object] = deque(maxlen=0)
exhaust: Callable[[Iterable[object]], None] = _sink.extend


def leading(held: OrderedDict[str, None], pages: Sequence[str]) -> int:
    """How many leading ``pages`` are in ``held``, moving them to most recent (in C)."""
    try:
        exhaust(map(held.move_to_end, pages))
    except KeyError as miss:
        # Any earlier occurrence of the missing page would have raised there.
        return pages.index(miss.args[0])
    return len(pages)


class L3:
    """Per pool, the pages stored (``capacity`` of them at most; 0: unbounded)."""

    def __init__(self, capacity: int = 0, *, drop_every: int = 0, ledger: Any = None) -> None:
        self.capacity = capacity
        self.drop_every = drop_every
        self.ledger = ledger
        self.pools: defaultdict[str, OrderedDict[str, None]] = defaultdict(OrderedDict)
        #: Pages the capacity pushed out, and pages ``drop_every`` lost.
        self.evictions = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._writes = 0
        self._recent: deque[str] = deque(maxlen=64)

    def held(self, pool: str) -> OrderedDict[str, None]:
        """``pool``'s pages, oldest first (read it on the writing thread only)."""
        return self.pools[pool]

    def __len__(self) -> int:
        return sum(map(len, self.pools.values()))

    def write(self, pool: str, pages: Sequence[str]) -> int:
        """Store ``pages``; returns how many were already held (redundant)."""
        with self._lock:
            held = self.held(pool)
            before = len(held)
            if self.drop_every:
                removed = self._write_dropping(held, pages)
            else:
                held.update(zip(pages, repeat(None)))
                removed = []
            redundant = len(pages) - (len(held) - before) - len(removed)
            if self.capacity:
                if redundant and not self.drop_every:
                    exhaust(map(held.move_to_end, pages))
                excess = len(held) - self.capacity
                if excess > 0:
                    self.evictions += excess
                    if self.ledger is None:
                        exhaust(map(held.popitem, repeat(False, excess)))
                    else:
                        removed += [held.popitem(False)[0] for _ in range(excess)]
        if self.ledger is not None:
            self.ledger.record_stored(pool, pages)
            if removed:
                self.ledger.record_removed(pool, removed)
        return redundant

    def _write_dropping(self, held: OrderedDict[str, None], pages: Sequence[str]) -> list[str]:
        """Page by page: every ``drop_every``-th write loses the oldest of the
        last 64 pages written (the beliefs still say it is stored)."""
        dropped: list[str] = []
        recent = self._recent
        for page in pages:
            if page in held:
                held.move_to_end(page)
            else:
                held[page] = None
            self._writes += 1
            recent.append(page)
            if self._writes % self.drop_every == 0 and recent[0] in held:
                del held[recent[0]]
                dropped.append(recent[0])
        self.dropped += len(dropped)
        return dropped

    def leading(self, pool: str, pages: Sequence[str], *, read: bool = True) -> int:
        """``batch_exists``: how many leading pages are stored.  ``read``: they
        are loaded too, which refreshes them in the LRU; else a probe."""
        with self._lock:
            held = self.held(pool)
            if read:
                return leading(held, pages)
            return next((i for i, page in enumerate(pages) if page not in held), len(pages))

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        """The ground truth's ``batch_exists``: a probe, which refreshes nothing."""
        return self.leading(pool, hashes, read=False)

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        with self._lock:
            held = self.pools.get(pool, ())
            return [page in held for page in hashes]
