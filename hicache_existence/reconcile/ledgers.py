"""Opening the Redis ledger a URL names: standalone / Sentinel or Cluster (apart
from both ledger modules: ``redis_cluster`` builds on ``redis_truth``, and
``tests/test_layering.py`` fails on an import cycle).
"""

from __future__ import annotations

from hicache_existence.config import ReconcilerSection
from hicache_existence.reconcile.redis_cluster import RedisClusterLedger
from hicache_existence.reconcile.redis_truth import (
    LedgerSettings,
    RedisLedger,
    is_cluster_url,
    validate_redis_url,
)


def open_ledger(settings: LedgerSettings) -> RedisLedger:
    """The ledger ``settings.url`` names: ``RedisLedger`` for a standalone or
    Sentinel-managed server, ``RedisClusterLedger`` for a ``redis+cluster://`` URL."""
    if is_cluster_url(settings.url):
        return RedisClusterLedger(settings)
    return RedisLedger(settings)


def ledger_from_section(section: ReconcilerSection, shard: str = "default") -> RedisLedger:
    """A ledger configured by the ``reconciler`` section (``redis_url`` required)."""
    validate_redis_url(section.redis_url, "reconciler.redis_url")
    return open_ledger(LedgerSettings.from_section(section, shard))
