"""Write accounting fed by sglang's real buffer-mode write path, on CPU.

The real ``UnifiedRadixCache`` + ``BufferModePipeline`` + cache controller +
file backend (``hx_scenarios.BufferModeServer``); the counters are compared
with what the backend really did (its page files).  Each phase inserts a
prefix after evicting the device tree, as a new request would.
"""

from __future__ import annotations

import pytest
from hx_harness import Scenarios, installed_generation

pytestmark = [pytest.mark.sglang]


def _kv(r: dict, phase: str) -> dict:
    return r["phases"][phase]["writes"]


def test_first_write_counts_pages_bytes_and_acks(scenarios: Scenarios) -> None:
    """8 new pages: 8 written = 8 acknowledged = 8 page files; bytes use the
    page size read from the host pool's layout; nothing avoided or redundant."""
    r = scenarios.get("buffer_writes").value()
    assert r["errors"] == 0 and r["warnings"] == []
    w = _kv(r, "a")
    assert r["phases"]["a"]["files"] == 8
    assert (w["written"], w["acknowledged"], w["failed"]) == (8, 8, 0)
    assert (w["avoided"], w["redundant"]) == (0, 0)
    assert r["page_bytes"] == r["host_page_bytes"] > 0
    assert w["written_bytes"] == 8 * r["page_bytes"]


def test_believed_prefix_is_avoided_once_per_admission(scenarios: Scenarios) -> None:
    """Re-inserting the stored prefix: its 8 pages are avoided once (not again
    when the pending queue is re-examined), nothing is written, no new file."""
    r = scenarios.get("buffer_writes").value()
    before, after = _kv(r, "a"), _kv(r, "a_again")
    assert after["avoided"] - before["avoided"] == 8
    assert after["written"] == before["written"]
    assert r["phases"]["a_again"]["files"] == 8


def test_node_spanning_believed_pages_is_a_redundant_write(scenarios: Scenarios) -> None:
    """A+B after a device flush is one new node: covered() is false for it, so
    all 16 pages are written although A's 8 were believed (design notes §8);
    the file backend found those 8 files: redundant = redundant_believed = 8,
    and new files = written - redundant."""
    r = scenarios.get("buffer_writes").value()
    before, after = _kv(r, "a_again"), _kv(r, "a_b")
    written = after["written"] - before["written"]
    redundant = after["redundant"] - before["redundant"]
    new_files = r["phases"]["a_b"]["files"] - r["phases"]["a_again"]["files"]
    assert (written, redundant, after["redundant_believed"]) == (16, 8, 8)
    assert new_files == written - redundant == 8
    assert after["acknowledged"] == after["written"] == 24
    (line,) = r["written_samples"]
    assert line.endswith(" 24.0")
    (line,) = r["written_bytes_samples"]
    assert line.endswith(f" {24.0 * r['page_bytes']}")


def test_evicted_beliefs_cause_redundant_writes_classified_evicted(scenarios: Scenarios) -> None:
    """Cap 8: C's pages evict A's beliefs while the file backend keeps A's
    files; replaying A writes 8 pages that all were already stored (redundant 8,
    none of them believed), no new file, and the admission miss is `evicted`."""
    r = scenarios.get("buffer_writes_capped").value()
    assert r["errors"] == 0 and r["warnings"] == []
    before, after = r["phases"]["c"], r["phases"]["a_replayed"]
    written = after["writes"]["written"] - before["writes"]["written"]
    redundant = after["writes"]["redundant"] - before["writes"]["redundant"]
    assert written == redundant == 8
    assert after["writes"]["redundant_believed"] == 0
    assert after["files"] == before["files"] == 16
    assert after["misses"]["evicted"] > before["misses"]["evicted"]
    assert after["misses"]["cold"] == before["misses"]["cold"]


def test_the_admission_hooks_count_what_the_tally_counts(scenarios: Scenarios) -> None:
    """A tree with sidecar pools counts admissions by the two hooks installed on its
    pipeline (that instance only), any other by the cache's covered() tally (0.5.22+):
    over the same phases of the real pipeline, every counter is the same either way."""
    tallied = scenarios.get("buffer_writes").value()
    hooked = scenarios.get("buffer_writes_hooked").value()
    if installed_generation() == "current":
        assert (tallied["tallied"], tallied["on_pipeline"]) == (True, [])
        assert (hooked["tallied"], hooked["on_pipeline"]) == (False, ["_write_intents"])
    else:  # 0.5.19-0.5.21 decide in covers_all, hooked on the class: neither applies
        assert tallied["tallied"] is hooked["tallied"] is False
        assert tallied["on_pipeline"] == hooked["on_pipeline"] == []
    assert hooked["errors"] == 0 and hooked["warnings"] == []
    for name in ("a", "a_again", "a_b"):
        assert hooked["phases"][name] == tallied["phases"][name], name
    assert _kv(hooked, "a_again")["avoided"] == 8
    assert not any(h.endswith(("._write_intents", "._backup_pool_keys")) for h in hooked["hooks"])
