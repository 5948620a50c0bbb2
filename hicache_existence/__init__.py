"""hicache-existence: an observable, verifiable, self-healing existence cache for
SGLang HiCache buffer mode.

The public API is re-exported here; importing it has no side effects (no logging
configuration, no metrics registration, no environment reads).  The cache core is
imported eagerly; the heavier features (runtime, exporters, checks, reconciler,
advisor) on first attribute access, so ``import hicache_existence`` stays light.
"""

import importlib
from typing import TYPE_CHECKING, Any

from hicache_existence._version import __version__
from hicache_existence.core.cache import (
    HICACHE_EXISTENCE_CACHE_MAX_ENTRIES,
    PoolBeliefs,
    PoolExistenceBeliefs,
    StorageExistenceCache,
)
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.observers import BeliefObserver, MissMemory, SamplerSource, Tee
from hicache_existence.core.policies import (
    ChainPagesPolicy,
    PoolBeliefPolicy,
    TrailingWindowPolicy,
    default_belief_policy,
)
from hicache_existence.core.stats import MISS_REASONS, CacheStats, PoolStats

#: Lazily imported public names -> their module.
_LAZY = {
    "AdvisorSnapshot": "hicache_existence.accounting.advisor",
    "CapacityAdvisor": "hicache_existence.accounting.advisor",
    "Config": "hicache_existence.config",
    "ConfigError": "hicache_existence.config",
    "DeploymentLabels": "hicache_existence.exporters.catalog",
    "DivergenceChecker": "hicache_existence.replicas.divergence",
    "ExistenceRuntime": "hicache_existence.runtime",
    "GhostFactory": "hicache_existence.accounting.ghosts",
    "Reconciler": "hicache_existence.reconcile.reconciler",
    "ReplicaDigest": "hicache_existence.replicas.digest",
    "SharedLruDigest": "hicache_existence.replicas.digest",
    "WriteAccounting": "hicache_existence.accounting.writes",
}

if TYPE_CHECKING:
    from hicache_existence.accounting.advisor import AdvisorSnapshot, CapacityAdvisor
    from hicache_existence.accounting.ghosts import GhostFactory
    from hicache_existence.accounting.writes import WriteAccounting
    from hicache_existence.config import Config, ConfigError
    from hicache_existence.exporters.catalog import DeploymentLabels
    from hicache_existence.reconcile.reconciler import Reconciler
    from hicache_existence.replicas.digest import ReplicaDigest, SharedLruDigest
    from hicache_existence.replicas.divergence import DivergenceChecker
    from hicache_existence.runtime import ExistenceRuntime


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_existence' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "HICACHE_EXISTENCE_CACHE_MAX_ENTRIES",
    "MISS_REASONS",
    "AdvisorSnapshot",
    "BeliefObserver",
    "CacheStats",
    "CapacityAdvisor",
    "ChainPagesPolicy",
    "Config",
    "ConfigError",
    "DeploymentLabels",
    "DivergenceChecker",
    "ExistenceRuntime",
    "GhostFactory",
    "Reconciler",
    "ReplicaDigest",
    "SharedLruDigest",
    "WriteAccounting",
    "FlatStorageExistenceCache",
    "MissMemory",
    "PoolBeliefPolicy",
    "PoolBeliefs",
    "PoolExistenceBeliefs",
    "PoolStats",
    "SamplerSource",
    "StorageExistenceCache",
    "Tee",
    "TrailingWindowPolicy",
    "__version__",
    "default_belief_policy",
]
