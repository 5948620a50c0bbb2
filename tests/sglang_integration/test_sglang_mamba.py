"""A hybrid Mamba model's HiCache L3 writes, counted per pool, through sglang's own
classes in process (``hx_mamba.py`` builds them: ``MambaComponent`` in a
``UnifiedRadixCache``, ``HybridReqToTokenPool``/``MambaPool``, ``MambaPoolHost``,
``HybridCacheController``, the file backend): cache mode with ``cache_mode.dedup``
off and on, and buffer mode.

A Mamba hybrid does not run as a real server on sglang's CPU engine (``docs/enable.md``
§9); these tests are where its write path is proven.  Workload: ``A`` (8 pages of 4
tokens: ``kv`` pages A0..A7, and one ``mamba`` page, the node's state keyed by its
last page A7); a flush (device and host memory emptied, L3 and beliefs kept); ``A4``
(A's first 4 pages, a new node: its ``kv`` pages A0..A3 are believed stored, its
``mamba`` page, keyed by A3, is not); a flush; ``A4`` again (now all believed).

Truth, never read from the package: the keys the file backend's ``set`` was called
with, per pool (``<hash>`` or ``<hash>.mamba``), and the page files per pool.
"""

from __future__ import annotations

from typing import Any

import pytest
from hx_harness import Scenarios, installed_generation

pytestmark = [pytest.mark.sglang]

POOLS = ("kv", "mamba")
COUNTERS = ("written", "acknowledged", "failed", "avoided", "redundant", "redundant_believed")
BOTH = pytest.mark.parametrize("key", ["mamba_writes", "mamba_writes_dedup"])
#: Whether the installed sglang runs a Mamba tree in buffer mode: 0.5.22 and later;
#: 0.5.21's ``init_hicache`` refuses one ("buffer_only supports only FULL/SWA unified
#: trees"), which ``test_buffer_mode_admits_each_pool_on_its_own`` checks there.
BUFFER_MAMBA = installed_generation() == "current"
#: Cache mode with dedup off and on, and buffer mode (``buffer_only``) where it runs.
ALL = pytest.mark.parametrize(
    "key", ["mamba_writes", "mamba_writes_dedup"] + ["mamba_writes_buffer"] * BUFFER_MAMBA
)


def _delta(r: dict[str, Any], before: str | None, after: str) -> dict[str, dict[str, int]]:
    """Counter changes per pool over one phase (``before`` None: from zero)."""
    out: dict[str, dict[str, int]] = {}
    for pool in POOLS:
        now = r["phases"][after]["writes"].get(pool, {})
        was = r["phases"][before]["writes"].get(pool, {}) if before else {}
        out[pool] = {c: int(now.get(c, 0)) - int(was.get(c, 0)) for c in COUNTERS}
    return out


def _files(r: dict[str, Any], phase: str, pool: str) -> int:
    return int(r["phases"][phase]["files"].get(pool, 0))


def _sets(r: dict[str, Any], phase: str, pool: str) -> list[str]:
    return list(r["phases"][phase]["sets"].get(pool, []))


PHASES = [(None, "a"), ("a", "a4"), ("a4", "a4_again")]


@ALL
def test_sglang_s_own_hybrid_mamba_classes_write_l3(scenarios: Scenarios, key: str) -> None:
    """The tree, host pools and controller are sglang's Mamba-hybrid ones, our
    cache is the tree's, nothing failed or warned; the Mamba page file holds the
    node's device state byte for byte (the stand-in copy is faithful)."""
    r = scenarios.get(key).value()
    assert r["controller"] == "HybridCacheController"
    assert r["host_pools"] == ["kv:MHATokenToKVPoolHost", "mamba:MambaPoolHost"]
    assert r["components"] == ["FULL", "MAMBA"]
    assert r["observed"] and r["dedup"] == (key == "mamba_writes_dedup")
    assert r["errors"] == 0 and r["warnings"] == []
    assert "pool_host.mamba.transfer_kv_all_layer_direct_lf_pf" in r["shims"]
    assert r["mamba_file_equals_device_state"] and r["mamba_state_bytes"] > 0
    assert all(r["phases"][p]["drained"] for _, p in PHASES)


@ALL
def test_every_phase_counts_each_pool_against_the_backend(scenarios: Scenarios, key: str) -> None:
    """Per pool and phase: written = the keys the backend was asked to store,
    acknowledged = written (nothing failed), written - redundant = the page
    files that pool gained; the Mamba pool is counted under its own label, the
    scraped ``kv`` series is the kv pages alone (never folded together), and each
    pool's redundant pages are classified (causes) in that pool."""
    r = scenarios.get(key).value()
    for before, after in PHASES:
        d = _delta(r, before, after)
        for pool in POOLS:
            new_files = _files(r, after, pool) - (_files(r, before, pool) if before else 0)
            assert d[pool]["written"] == len(_sets(r, after, pool)), (after, pool)
            assert d[pool]["acknowledged"] == d[pool]["written"], (after, pool)
            assert d[pool]["failed"] == 0
            assert d[pool]["written"] - d[pool]["redundant"] == new_files, (after, pool)
    last = r["phases"]["a4_again"]["writes"]
    assert r["written_samples"] == {p: float(last[p]["written"]) for p in POOLS}
    for pool in POOLS:  # every redundant page of each pool has its cause, in its pool
        assert sum(last[pool]["causes"].values()) == last[pool]["redundant"], pool


@ALL
def test_first_write_kv_pages_and_the_trailing_mamba_page(scenarios: Scenarios, key: str) -> None:
    """A: 8 kv pages and one mamba page keyed by the node's last page, each a new
    file; after the ack exactly those are believed, per pool; the mamba pool's
    bytes are its own page size (the page file's)."""
    r = scenarios.get(key).value()
    kv, mamba = r["keys"]["kv"], r["keys"]["mamba"]
    assert len(kv) == 8 and mamba == [kv[-1]]
    d = _delta(r, None, "a")
    assert (d["kv"]["written"], d["kv"]["redundant"]) == (8, 0)
    assert (d["mamba"]["written"], d["mamba"]["redundant"]) == (1, 0)
    assert r["phases"]["a"]["files"] == {"kv": 8, "mamba": 1}
    assert r["phases"]["a"]["believed_kv"] == kv
    assert r["phases"]["a"]["believed_mamba"] == [kv[-1]]
    # Bytes per pool: a mamba page is one host slot of MambaPoolHost (every Mamba
    # layer's conv and SSM state), the size of its page file, not a kv page.
    mamba_w, kv_w = r["phases"]["a"]["writes"]["mamba"], r["phases"]["a"]["writes"]["kv"]
    assert mamba_w["page_size_bytes"] == r["mamba_state_bytes"] != kv_w["page_size_bytes"]
    assert mamba_w["written_bytes"] == mamba_w["page_size_bytes"]


@BOTH
def test_a_node_whose_kv_is_believed_and_mamba_not_is_written_whole(
    scenarios: Scenarios, key: str
) -> None:
    """A4 after a flush: its 4 kv pages are believed, its mamba page (A3) is not.
    With dedup off and on alike the node goes to L3 whole: the 4 kv pages again
    (redundant, all believed at launch) and the new mamba page A3, whose file
    appears; after the ack A3 is believed in the mamba pool too."""
    r = scenarios.get(key).value()
    kv = r["keys"]["kv"]
    assert _sets(r, "a4", "kv") == kv[:4]
    assert _sets(r, "a4", "mamba") == [kv[3]]
    d = _delta(r, "a", "a4")
    assert d["kv"] == {
        "written": 4,
        "acknowledged": 4,
        "failed": 0,
        "avoided": 0,
        "redundant": 4,
        "redundant_believed": 4,
    }
    assert (d["mamba"]["written"], d["mamba"]["redundant"], d["mamba"]["avoided"]) == (1, 0, 0)
    assert r["phases"]["a4"]["files"] == {"kv": 8, "mamba": 2}
    assert r["phases"]["a4"]["believed_mamba"] == [kv[3], kv[7]]


@BOTH
def test_a_node_with_every_pool_believed(scenarios: Scenarios, key: str) -> None:
    """A4 again: every page of the node, kv and mamba, is believed.  Dedup off
    writes it again (4 kv + 1 mamba, all redundant and believed, no new file);
    dedup on leaves the whole node out (the backend is asked for nothing; 4 kv
    and 1 mamba avoided) and upstream's operation still drains."""
    r = scenarios.get(key).value()
    d = _delta(r, "a4", "a4_again")
    assert r["phases"]["a4_again"]["files"] == {"kv": 8, "mamba": 2}
    if key == "mamba_writes":
        assert (d["kv"]["written"], d["kv"]["redundant"], d["kv"]["redundant_believed"]) == (
            4,
            4,
            4,
        )
        assert (d["mamba"]["written"], d["mamba"]["redundant"]) == (1, 1)
        assert d["mamba"]["redundant_believed"] == 1
        assert d["kv"]["avoided"] == d["mamba"]["avoided"] == 0
    else:
        assert r["phases"]["a4_again"]["sets"] == {}
        assert (d["kv"]["written"], d["kv"]["avoided"]) == (0, 4)
        assert (d["mamba"]["written"], d["mamba"]["avoided"]) == (0, 1)
        assert r["phases"]["a4_again"]["drained"]


def test_dedup_avoids_exactly_what_dedup_off_rewrites_believed(scenarios: Scenarios) -> None:
    """Side by side, per pool: what dedup on avoided is what dedup off wrote
    again although it was believed; where a pool is not believed (A4's mamba
    page) both write the same."""
    off, on = scenarios.get("mamba_writes").value(), scenarios.get("mamba_writes_dedup").value()
    assert off["keys"] == on["keys"]
    for before, after in PHASES:
        d_off, d_on = _delta(off, before, after), _delta(on, before, after)
        for pool in POOLS:
            skipped = d_off[pool]["written"] - d_on[pool]["written"]
            assert d_on[pool]["avoided"] == skipped, (after, pool)
            if skipped:
                assert skipped == d_off[pool]["redundant_believed"], (after, pool)


def test_buffer_mode_admits_each_pool_on_its_own(scenarios: Scenarios) -> None:
    """Buffer mode (upstream's admission, pool by pool, through this cache): A4's
    believed kv pages are not written (4 avoided), its mamba page A3 is (a new
    file, then believed); A4 again: nothing is handed to the backend, 4 kv and 1
    mamba page avoided."""
    r = scenarios.get("mamba_writes_buffer").value()
    if not BUFFER_MAMBA:  # sglang 0.5.21: upstream refuses the tree, nothing to count
        assert "buffer_only supports only" in r["refused"] and "MAMBA" in r["refused"]
        return
    kv = r["keys"]["kv"]
    d = _delta(r, "a", "a4")
    assert _sets(r, "a4", "kv") == [] and _sets(r, "a4", "mamba") == [kv[3]]
    assert (d["kv"]["written"], d["kv"]["avoided"]) == (0, 4)
    assert (d["mamba"]["written"], d["mamba"]["avoided"], d["mamba"]["redundant"]) == (1, 0, 0)
    assert r["phases"]["a4"]["believed_mamba"] == [kv[3], kv[7]]
    d = _delta(r, "a4", "a4_again")
    assert r["phases"]["a4_again"]["sets"] == {}
    assert (d["kv"]["written"], d["kv"]["avoided"]) == (0, 4)
    assert (d["mamba"]["written"], d["mamba"]["avoided"]) == (0, 1)
    assert r["phases"]["a4_again"]["files"] == {"kv": 8, "mamba": 2}
