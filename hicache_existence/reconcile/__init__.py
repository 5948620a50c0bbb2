"""Ground truth for the existence cache's beliefs, and the reconciler that heals them
(docs/reconciler.md).  Importing it costs nothing: redis, torch and sglang are
imported lazily by the modules that need them.
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
