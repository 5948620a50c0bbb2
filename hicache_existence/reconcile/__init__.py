"""Ground truth for the existence cache's beliefs, and the reconciler that heals them.

Beliefs go stale when L3 drops pages (writes get skipped that should happen) and
stay blind to pages another prefill instance stored (writes happen that need not).
This package checks sampled beliefs against ground truth off the scheduler thread
and applies agreed verdicts at lockstep points.

Importing it costs nothing: redis, torch and sglang are imported lazily by the
modules that need them (``redis_truth``, ``agreement``, ``storage_adapters``).
"""

from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    GroundTruth,
    GroundTruthError,
    InMemoryGroundTruth,
    LedgerEmpty,
    ServerError,
    TruthTimeout,
    TruthUnavailable,
    UnsupportedPool,
)

__all__ = [
    "GarbageAnswer",
    "GroundTruth",
    "GroundTruthError",
    "InMemoryGroundTruth",
    "LedgerEmpty",
    "ServerError",
    "TruthTimeout",
    "TruthUnavailable",
    "UnsupportedPool",
]
