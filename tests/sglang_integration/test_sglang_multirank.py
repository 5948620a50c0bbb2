"""Two scheduler-like processes over real gloo: each builds a real
``UnifiedRadixCache`` with a two-rank TP group, so the real
``check_hicache_events`` all-reduces across them; our AFTER hook builds the
dedicated replica group on the first step (an all-gather over the world, then
``new_group`` for every replica set) and the divergence checks compare the two
caches, catching a page added on one rank only."""

from __future__ import annotations

import pytest
from hx_harness import Scenarios

pytestmark = [pytest.mark.sglang, pytest.mark.torch, pytest.mark.multiprocess]


def _ranks(scenarios: Scenarios) -> list[dict]:
    return [outcome.value() for outcome in scenarios.get("multirank")]


def test_replica_group_spans_the_tp_group(scenarios: Scenarios) -> None:
    """Both ranks are observed, labelled with their TP rank, and find each other
    as one replica set."""
    r0, r1 = _ranks(scenarios)
    assert r0["observed"] and r1["observed"]
    assert (r0["tp_rank_label"], r1["tp_rank_label"]) == (0, 1)
    assert r0["members"] == r1["members"] == [0, 1]


def test_divergence_is_detected_on_both_ranks(scenarios: Scenarios) -> None:
    """Checks every second step over 8 steps; a page added on rank 1 before step
    5 is found at steps 6 and 8, by both ranks, naming rank 1 and pool kv."""
    r0, r1 = _ranks(scenarios)
    for r in (r0, r1):
        assert r["steps"] == 8
        assert r["checks"] == 4
        assert r["divergences"] == 2
        assert r["active"] is True
        detected = [w for w in r["warnings"] if "divergence.detected" in w]
        assert len(detected) == 2
        assert "diverged_ranks=[1]" in detected[0] and 'diverged_pools=["kv"]' in detected[0]
