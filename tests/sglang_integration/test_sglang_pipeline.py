"""Our cache inside sglang's real HiCache buffer-mode pipeline, on CPU (and the
reconciler healing it against the real file backend).

``UnifiedRadixCache.init_hicache`` with ``--hicache-host-memory-mode
buffer_only`` and the real file storage backend; only three CUDA-only calls are
CPU no-ops (see ``hx_scenarios._cpu_buffer_mode_shims``).  An insert writes
through to L3, ``check_hicache_events`` drains the storage acks into our cache
(``track_inflight`` / ``add`` / ``untrack_inflight`` from upstream's code), and
re-inserting the same prefix is admitted by ``covered`` without a new write.
"""

from __future__ import annotations

import pytest
from hx_harness import Scenarios, installed_generation

pytestmark = [pytest.mark.sglang]

#: The seed generation's API (sglang <= 0.5.21) has no in-flight refs: its pipeline keeps
#: the pages it is writing itself, so our in-flight counters stay 0 there and writes show
#: in the L3 files only.
CURRENT = installed_generation() == "current"


def test_write_through_acks_feed_our_cache(scenarios: Scenarios) -> None:
    """Eight pages written to the file backend become eight beliefs in our
    cache, via in-flight refs taken at launch and released at the ack (current
    generation; the seed's pipeline adds at the ack without them)."""
    r = scenarios.get("buffer_pipeline").value()
    assert r["pipeline"] == "BufferModePipeline"
    assert r["observed"] is True
    assert r["warnings"] == []
    kv = r["after_write"]["pools"]["kv"]
    assert r["l3_files"][0] == 8
    inflight = 8 if CURRENT else 0
    assert kv["inflight_tracked"] == inflight and kv["inflight_released"] == inflight
    assert kv["adds"] >= 1 and kv["inserts"] == 8 and kv["entries"] == 8


def test_reinsert_is_admitted_by_beliefs_without_a_write(scenarios: Scenarios) -> None:
    """After eviction, the same prefix is covered by the beliefs: a query hit,
    no new in-flight write and no new L3 file."""
    r = scenarios.get("buffer_pipeline").value()
    before, after = r["after_write"]["pools"]["kv"], r["after_reinsert"]["pools"]["kv"]
    assert after["query_hits"] == before["query_hits"] + 1
    assert after["inflight_tracked"] == before["inflight_tracked"]
    assert r["l3_files"] == [8, 8]
    (line,) = r["page_hits_samples"]
    assert line.endswith(" 8.0") and 'storage_backend="file"' in line


def test_steps_follow_the_pipelines_pumping(scenarios: Scenarios) -> None:
    """Every check_hicache_events call of both drains was one runtime step."""
    first, second, total = scenarios.get("buffer_pipeline").value()["steps"]
    assert first >= 1 and second >= 1
    assert total == first + second


def test_reconciler_heals_stale_positives_from_real_l3_eviction(scenarios: Scenarios) -> None:
    """The capped file backend evicts a prefix the beliefs still hold; the
    re-insert skips its write (upstream's behaviour with a stale positive); the
    reconciler, asking the backend's own batch_exists, invalidates the stale
    beliefs at a step, and the next insert writes the prefix to L3 again."""
    r = scenarios.get("buffer_reconcile").value()
    assert r["truth"] == "BackendGroundTruth"
    assert r["warnings"] == []
    assert r["believed_a"] == r["chain_pages"] == 8
    assert r["in_l3_a"] < 8  # L3 really lost pages the beliefs hold
    if CURRENT:  # the write decisions, seen through our in-flight refs
        assert r["skipped_write"] is True
    assert r["stale_positives"]["kv"] >= 1 and r["pages_invalidated"]["kv"] >= 1
    assert r["believed_after_heal"] < 8
    if CURRENT:
        assert r["rewritten_pages"] >= 8 - r["believed_after_heal"]
    assert r["in_l3_a_after"] == 8  # the lost pages were written again


def test_reconciler_sees_the_pages_the_real_pipeline_is_writing(scenarios: Scenarios) -> None:
    """Between D2H launch and storage ack, every page the real pipeline writes is
    in flight for the reconciler (so no verdict acts past it): the cache's refs
    in the current generation, the seed pipeline's own set (the ``extra_cover``
    it passes to ``covers_all``) in the seed generation; none once the acks drained."""
    r = scenarios.get("buffer_inflight").value()
    assert r["reconciler"] is True and r["warnings"] == []
    assert r["reads_pipeline_set"] is (not CURRENT)
    assert len(r["written"]) == 8
    assert r["seen_in_flight"] == r["written"]
    assert r["after_ack"] == []
