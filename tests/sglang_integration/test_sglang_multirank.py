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


def test_ranks_that_disagree_on_divergence_enabled_are_caught_at_start_up(
    scenarios: Scenarios,
) -> None:
    """Checks on for rank 0 and off for rank 1: both ranks still build the replica
    group and meet in the start-up handshake, which reports the mismatch on both
    and stops checking on both (no stall in group creation, no rank checking
    alone); only the rank with checks on exports divergence series, with
    ``active`` at 0 and one mismatch, which the checks-stopped alert reads."""
    r0, r1 = (outcome.value() for outcome in scenarios.get("multirank_mixed"))
    for r in (r0, r1):
        assert r["members"] == [0, 1] and r["steps"] == 8
        assert (r["active"], r["checks"], r["config_mismatches"], r["failures"]) == (
            False,
            0,
            1,
            0,
        )
        mismatch = [w for w in r["warnings"] if "divergence.config_mismatch" in w]
        assert len(mismatch) == 1 and '"enabled": {"min": 0, "max": 1' in mismatch[0]
        assert not [w for w in r["warnings"] if "could not build the replica groups" in w]
    series = r0["divergence_series"]
    assert series["hicache_existence_divergence_active"] == [0.0]
    assert series["hicache_existence_divergence_config_mismatches"] == [1.0]
    assert r1["divergence_series"] == {}


def test_a_rank_without_the_package_stops_the_checks_visibly(scenarios: Scenarios) -> None:
    """Rank 1 runs upstream's cache (package off): rank 0 cannot build the replica
    group (its peer never comes to new_group; one wait of divergence.timeout_s),
    so its checker records one failed handshake and stops, with ``active`` 0 and
    the failure exported, instead of comparing the rank with itself."""
    r0, r1 = (outcome.value() for outcome in scenarios.get("multirank_half"))
    assert r1["observed"] is False and r1["divergence_series"] == {}
    assert r0["observed"] is True and r0["members"] == [0] and r0["steps"] == 8
    assert (r0["active"], r0["checks"], r0["failures"], r0["config_mismatches"]) == (
        False,
        0,
        1,
        0,
    )
    assert any("could not build the replica groups" in w for w in r0["warnings"])
    failed = [w for w in r0["warnings"] if "divergence.check_failed" in w]
    assert len(failed) == 1 and "stage=handshake" in failed[0]
    series = r0["divergence_series"]
    assert series["hicache_existence_divergence_active"] == [0.0]
    assert series["hicache_existence_divergence_check_failures"] == [0.0, 1.0]
