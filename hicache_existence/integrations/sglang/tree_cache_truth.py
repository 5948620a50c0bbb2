"""The reconciler's ground truth, found on the running tree cache at first use.

The existence cache (and its reconciler) is built before ``init_hicache`` attaches
the storage backend (which may also come and go at run time), so the truth is
resolved lazily, on the reconciler's thread, from the tree the step hook saw: a
ledger-recording backend's ledger; else, with ``reconciler.redis_url``, the Redis
ledger of this rank's shard; else the backend's own ``batch_exists``.  Until a
backend exists every query fails with ``TruthUnavailable``: an error, never
evidence of absence.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from hicache_existence.config import ReconcilerSection, redact_url
from hicache_existence.reconcile.ground_truth import (
    GroundTruth,
    TruthUnavailable,
    absence_is_evidence,
    leased_objects,
)

logger = logging.getLogger("hicache_existence.integrations.sglang")


class TreeCacheGroundTruth:
    """A ``GroundTruth`` that delegates to the truth of the tree cache's backend."""

    def __init__(self, section: ReconcilerSection) -> None:
        self._section = section
        self._tree: weakref.ReferenceType[Any] | None = None
        self._lock = threading.Lock()
        self._backend: Any = None
        self._truth: GroundTruth | None = None
        self._logged = False
        #: Objects leased by the truths of backends attached before (the counter
        #: never goes back on a re-attach).
        self._leased_before = 0

    def bind(self, tree_cache: Any) -> None:
        """The tree cache whose storage backend holds the truth (scheduler thread)."""
        try:
            self._tree = weakref.ref(tree_cache)
        except TypeError:
            self._tree = lambda: tree_cache  # type: ignore[assignment]

    def resolve(self) -> GroundTruth:
        """The truth of the backend attached now (rebuilt when it changes)."""
        tree = self._tree() if self._tree is not None else None
        controller = getattr(tree, "cache_controller", None)
        backend = getattr(controller, "storage_backend", None)
        if backend is None:
            raise TruthUnavailable("no HiCache storage backend is attached yet")
        with self._lock:
            if backend is self._backend and self._truth is not None:
                return self._truth
            truth = self._build(backend, controller)
            self._leased_before += leased_objects(self._truth)
            self._backend, self._truth = backend, truth
            logger.info("hicache-existence: reconciler ground truth: %s", self.describe())
            return truth

    def leased_objects(self) -> int:
        """L3 objects this process's probes leased, over every backend attached."""
        with self._lock:
            return self._leased_before + leased_objects(self._truth)

    def _build(self, backend: Any, controller: Any) -> GroundTruth:
        ledger = getattr(backend, "ledger_ground_truth", None)
        if callable(ledger):
            truth = ledger()
            if truth is not None:
                return truth  # type: ignore[no-any-return]
        if self._section.redis_url:
            from hicache_existence.reconcile.ledgers import ledger_from_section
            from hicache_existence.reconcile.redis_truth import shard_from_storage_config

            config = getattr(controller, "storage_config", None) or getattr(
                backend, "storage_config", None
            )
            shard = shard_from_storage_config(config) if config is not None else "default"
            return ledger_from_section(self._section, shard)
        from hicache_existence.reconcile.mooncake_truth import (
            MooncakeGroundTruth,
            is_mooncake_backend,
        )
        from hicache_existence.reconcile.storage_adapters import BackendGroundTruth

        if is_mooncake_backend(backend):
            # Its batch_exists reads client errors (master down) as absence.
            return MooncakeGroundTruth(backend)
        return BackendGroundTruth(backend)

    def describe(self) -> str:
        truth = self._truth
        if truth is None:
            return "unresolved"
        if self._section.redis_url and type(truth).__name__ == "RedisLedger":
            return f"redis ledger at {redact_url(self._section.redis_url)}"
        return type(truth).__name__

    def _truth_or_raise(self) -> GroundTruth:
        try:
            return self.resolve()
        except TruthUnavailable:
            raise
        except Exception as exc:
            if not self._logged:
                self._logged = True
                logger.warning("hicache-existence: reconciler ground truth unavailable: %s", exc)
            raise TruthUnavailable(f"ground truth could not be built: {exc}") from None

    # -- GroundTruth -----------------------------------------------------------------
    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        return self._truth_or_raise().leading_present(pool, hashes)

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        return self._truth_or_raise().present(pool, hashes)

    def absence_is_evidence(self) -> bool:
        truth = self._truth
        return True if truth is None else absence_is_evidence(truth)
