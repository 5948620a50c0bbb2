"""The ground-truth interface, its errors, and an in-memory implementation.

``leading_present`` has the semantics of SGLang's ``HiCacheStorage.batch_exists``.
An answer that could not be obtained raises a ``GroundTruthError``, never read as
evidence of absence; ``absence_is_evidence()`` lets a truth say that right now a
short answer proves nothing (a ledger that lost its history).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from hicache_existence.core import _validate, lru


class GroundTruthError(Exception):
    """Ground truth could not answer; ``kind`` is a bounded metric label."""

    kind = "error"


class TruthUnavailable(GroundTruthError):
    """The store could not be reached (refused, reset, DNS, TLS)."""

    kind = "connection"


class TruthTimeout(GroundTruthError):
    """The store did not answer within its socket timeout."""

    kind = "timeout"


class GarbageAnswer(GroundTruthError):
    """The store answered something that is not a valid reply."""

    kind = "garbage"


class LedgerEmpty(GroundTruthError):
    """The ledger holds no epoch: it was never written or lost its data, so an
    absent key says nothing about L3."""

    kind = "ledger_empty"


class LedgerBehind(GroundTruthError):
    """The ledger's writer had not written, within the wait allowed, the records
    offered before the question: an answer now could miss pages already stored."""

    kind = "ledger_behind"


class UnsupportedPool(GroundTruthError):
    """This ground truth cannot answer for the pool."""

    kind = "unsupported"


class ServerError(GroundTruthError):
    """The store answered with an error (script error, busy, loading, auth)."""

    kind = "server"


@runtime_checkable
class GroundTruth(Protocol):
    """What is really in L3, per pool."""

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        """How many leading pages of ``hashes`` are present (``batch_exists``)."""

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        """Presence of every page of ``hashes``."""


def absence_is_evidence(truth: object) -> bool:
    """Whether a short answer from ``truth`` proves absence right now (truths
    that do not say are trusted)."""
    probe = getattr(truth, "absence_is_evidence", None)
    return probe is None or bool(probe())


def leased_objects(truth: object) -> int:
    """L3 objects ``truth``'s answers leased on the store (``leased_objects()``:
    Mooncake's read leases); 0 for a truth that leases nothing or cannot say."""
    try:
        return int(truth.leased_objects())  # type: ignore[attr-defined]
    except Exception:
        return 0


def check_chain(pool: str, hashes: Iterable[str]) -> tuple[str, Sequence[str]]:
    """Validate a query's arguments (naming them) before any I/O."""
    name = _validate.pool_name(pool, "pool")
    return name, lru.page_hashes(hashes, "hashes")


class InMemoryGroundTruth:
    """A thread-safe set of stored pages per pool: ground truth for the demo and
    the tests, and a ledger with the same writer API as the Redis one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, set[str]] = {}

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        name, seq = check_chain(pool, hashes)
        with self._lock:  # stops at the first absent page
            stored = self._pages.get(name, set())
            return next((i for i, h in enumerate(seq) if h not in stored), len(seq))

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        name, seq = check_chain(pool, hashes)
        with self._lock:
            stored = self._pages.get(name, set())
            return [h in stored for h in seq]

    def record_stored(self, pool: str, hashes: Iterable[str]) -> int:
        """Pages were written to L3."""
        name, seq = check_chain(pool, hashes)
        with self._lock:
            self._pages.setdefault(name, set()).update(seq)
        return len(seq)

    def record_removed(self, pool: str, hashes: Iterable[str]) -> int:
        """Pages left L3 (evicted, deleted, lost)."""
        name, seq = check_chain(pool, hashes)
        with self._lock:
            self._pages.setdefault(name, set()).difference_update(seq)
        return len(seq)

    def clear(self) -> None:
        """L3 was emptied."""
        with self._lock:
            self._pages.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._pages.values())
