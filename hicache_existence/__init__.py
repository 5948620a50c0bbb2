"""hicache-existence: an observable, verifiable, self-healing existence cache for
SGLang HiCache buffer mode.

The public API is re-exported here; importing it has no side effects (no logging
configuration, no metrics registration, no environment reads).
"""

from hicache_existence._version import __version__
from hicache_existence.cache import (
    HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
    PoolBeliefs,
    PoolExistenceBeliefs,
    StorageExistenceCache,
)
from hicache_existence.flat import FlatStorageExistenceCache
from hicache_existence.observers import BeliefObserver, MissMemory, Tee
from hicache_existence.policies import (
    ChainPagesPolicy,
    PoolBeliefPolicy,
    TrailingWindowPolicy,
    default_belief_policy,
)
from hicache_existence.stats import MISS_REASONS, CacheStats, PoolStats

__all__ = [
    "HICACHE_EXISTENCE_CACHE_MAX_ENTRIES",
    "MISS_REASONS",
    "BeliefObserver",
    "CacheStats",
    "ChainPagesPolicy",
    "FlatStorageExistenceCache",
    "MissMemory",
    "PoolBeliefPolicy",
    "PoolBeliefs",
    "PoolExistenceBeliefs",
    "PoolStats",
    "StorageExistenceCache",
    "Tee",
    "TrailingWindowPolicy",
    "__version__",
    "default_belief_policy",
]
