"""Shared helpers of the differential tests in this directory.

A plain module rather than a conftest: the tests import these names, and two
``conftest`` modules (tests/ and tests/upstream/) cannot both be imported by name.

The upstream classes come from the installed sglang wheel (the environment of
``tests/envs/ensure-env.sh``), never from a copy in this repository: a copy could
drift from what sglang ships and the differential test would then prove nothing.

``require_upstream()`` is called from inside each test (not from a fixture) so that a
missing wheel shows up as a *failed* test under ``HICACHE_EXISTENCE_REQUIRE_SGLANG=1``
(CI) and as a skip with the reason everywhere else.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIRE_SGLANG = os.environ.get("HICACHE_EXISTENCE_REQUIRE_SGLANG") == "1"


@dataclass(frozen=True)
class Upstream:
    """The upstream names the differential tests drive."""

    module: ModuleType
    StorageExistenceCache: Any
    PoolExistenceBeliefs: Any
    ChainPagesPolicy: Any
    TrailingWindowPolicy: Any
    default_belief_policy: Any
    PoolHitPolicy: Any
    PoolName: Any
    version: str


@functools.cache
def _load_upstream() -> Upstream | str:
    """Import sglang once per session; the failure reason is cached as a string."""
    try:
        import sglang
        from sglang.srt.mem_cache.buffer_mode import storage_existence_cache as sec
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName
    except Exception as exc:  # sglang's __init__ can fail with more than ImportError
        return (
            f"the sglang wheel is not importable ({type(exc).__name__}: {exc}); "
            "run the tests with the python printed by tests/envs/ensure-env.sh"
        )
    return Upstream(
        module=sec,
        StorageExistenceCache=sec.StorageExistenceCache,
        PoolExistenceBeliefs=sec.PoolExistenceBeliefs,
        ChainPagesPolicy=sec.ChainPagesPolicy,
        TrailingWindowPolicy=sec.TrailingWindowPolicy,
        default_belief_policy=sec.default_belief_policy,
        PoolHitPolicy=PoolHitPolicy,
        PoolName=PoolName,
        version=getattr(sglang, "__version__", "?"),
    )


def require_upstream() -> Upstream:
    """The upstream classes, or fail (CI) / skip (elsewhere) with the reason."""
    loaded = _load_upstream()
    if isinstance(loaded, str):
        if REQUIRE_SGLANG:
            pytest.fail(f"HICACHE_EXISTENCE_REQUIRE_SGLANG=1: {loaded}", pytrace=False)
        pytest.skip(loaded)
    return loaded


@functools.cache
def seed_baseline() -> ModuleType:
    """``benchmarks/seed_baseline.py`` loaded by path: ``benchmarks`` is not a
    package and need not be on ``sys.path``."""
    path = REPO / "benchmarks" / "seed_baseline.py"
    spec = importlib.util.spec_from_file_location("hicache_existence_seed_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
