"""Write accounting inside a real SGLang server, against independent truth.

A real ``sglang.launch_server`` on CPU (``harness.py``) with buffer mode over the
file backend and ``--enable-hicache-existence``.  The counters are compared with
what the test can know without them: the page files the file backend created,
SGLang's own ``sglang:backuped_tokens_total`` (counted at the same storage ack),
and the pages the test itself already sent.  Prompts of 160 tokens stay below
SGLang's 256-token prefetch threshold, so nothing is loaded back from L3 and
every belief comes from an acknowledged write.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import ServerSpec, block_tokens_for, delta, launch, settle, trace_requests

PAGE = 16
P = "hicache_existence_"
COUNTERS = (
    "written_pages",
    "written_bytes",
    "write_avoided_pages",
    "redundant_written_pages",
    "redundant_believed_pages",
    "write_acknowledged_pages",
    "write_acknowledged_bytes",
    "write_failed_pages",
    "page_inserts",
    "page_refreshes",
    "pages_checked",
    "page_hits",
    "page_rescues",
    "page_misses",
)
REASONS = ("cold", "evicted", "invalidated", "cleared", "unclassified")


def tokens(seed: int, pages: int) -> list[int]:
    """``pages`` full pages of deterministic token ids, distinct per seed."""
    return block_tokens_for(seed, PAGE * pages, salt="writes")


def reading(srv, quiet_s: float = 3.0) -> dict[str, float]:
    """Every counter of interest, plus the truth beside them, once SGLang's count,
    the L3 files and ours have all stopped changing."""
    srv.wait_writes_settled()
    return settle(lambda: _read(srv), quiet_s=quiet_s)


def _read(srv) -> dict[str, float]:
    fams = srv.metrics()
    out = {name: fams[P + name].total("_total") if P + name in fams else 0.0 for name in COUNTERS}
    misses = fams.get(P + "page_misses")
    for reason in REASONS:
        out[f"misses_{reason}"] = misses.total("_total", reason=reason) if misses else 0.0
    backuped = fams.get("sglang:backuped_tokens")
    out["sglang_backuped_pages"] = backuped.total("_total") / PAGE if backuped else 0.0
    out["files"] = float(len(srv.l3_pages()))
    return out


def one(srv, ids: list[int]) -> None:
    srv.generate(ids, max_new_tokens=1)


@pytest.fixture(scope="module")
def scripted() -> Iterator[dict[str, dict[str, float]]]:
    """Default cap: A; flush; A+B (one node spanning believed A and new B); flush;
    A+B again; then 40 requests of the Mooncake trace with a flush every 10."""
    a, b = tokens(1, 10), tokens(2, 10)
    with launch(ServerSpec()) as srv:
        r: dict[str, dict[str, float]] = {"start": reading(srv)}
        one(srv, a)
        r["a"] = reading(srv)
        srv.flush_cache()
        one(srv, a + b)
        r["a_b"] = reading(srv)
        srv.flush_cache()
        one(srv, a + b)
        r["a_b_again"] = reading(srv)
        for i, req in enumerate(trace_requests(limit=40, block_tokens=32, max_blocks=12)):
            if i and i % 10 == 0:
                srv.flush_cache()
            one(srv, list(req.input_ids))
        r["trace"] = reading(srv)
        yield r


@pytest.fixture(scope="module")
def capped() -> Iterator[dict[str, dict[str, float]]]:
    """A cap of 10 beliefs: A (10 pages); flush; C (10 other pages: A's beliefs are
    evicted, its files stay); flush; A again."""
    a, c = tokens(1, 10), tokens(3, 10)
    with launch(ServerSpec(config={"cache": {"max_entries": 10}})) as srv:
        r: dict[str, dict[str, float]] = {"start": reading(srv)}
        one(srv, a)
        r["a"] = reading(srv)
        srv.flush_cache()
        one(srv, c)
        r["c"] = reading(srv)
        srv.flush_cache()
        one(srv, a)
        r["a_replayed"] = reading(srv)
        yield r


def test_written_pages_equal_the_files_the_backend_created(scripted) -> None:
    """Over the whole workload: written - redundant = new page files, written =
    acknowledged (nothing failed) = sglang:backuped_tokens_total / page size, and
    bytes = pages x the 4096-byte page read from the server's host pool."""
    d = delta(scripted["trace"], scripted["start"])
    assert d["written_pages"] > 100
    assert d["written_pages"] - d["redundant_written_pages"] == d["files"]
    assert d["write_acknowledged_pages"] == d["written_pages"]
    assert d["write_failed_pages"] == 0
    assert d["write_acknowledged_pages"] == d["sglang_backuped_pages"]
    page_bytes = 256 * PAGE  # tiny Llama: 2 layers x (K, V) x 2 KV heads x 16 dims x bf16
    assert d["written_bytes"] == d["written_pages"] * page_bytes
    assert d["write_acknowledged_bytes"] == d["write_acknowledged_pages"] * page_bytes


def test_first_prompt_writes_its_pages_and_beliefs_follow_the_acks(scripted) -> None:
    """Prompt A (10 pages): 10 written, 10 files, 10 acknowledged; the beliefs
    added at the acks are the acknowledged pages."""
    d = delta(scripted["a"], scripted["start"])
    assert (d["written_pages"], d["files"], d["write_acknowledged_pages"]) == (10, 10, 10)
    assert d["page_inserts"] + d["page_refreshes"] == d["write_acknowledged_pages"]
    assert d["write_avoided_pages"] == d["redundant_written_pages"] == 0


def test_node_spanning_believed_pages_is_written_whole(scripted) -> None:
    """A+B after a flush (design notes §8): one 20-page node, not covered, written
    whole: 20 written, 10 new files, 10 redundant, all 10 believed at launch."""
    d = delta(scripted["a_b"], scripted["a"])
    assert d["written_pages"] == 20 and d["files"] == 10
    assert d["redundant_written_pages"] == d["redundant_believed_pages"] == 10
    assert d["write_acknowledged_pages"] == 20
    # New beliefs are the new pages (A's were refreshed: at the ack, and by the
    # 320-token prompt's L3 hit query, which re-adds the pages L3 reported)
    assert d["page_inserts"] == d["files"] == 10


def test_believed_node_is_avoided_exactly(scripted) -> None:
    """A+B again after a flush: the test wrote those 20 pages already; nothing is
    written and the request's node (20 pages) is avoided.  When the prefetch from
    L3 lands before the request is inserted, its fill commit is a second admission
    decision over the loaded pages (up to 20 more avoided, seen on 3.12: 39); each
    decision counts once."""
    d = delta(scripted["a_b_again"], scripted["a_b"])
    assert 20 <= d["write_avoided_pages"] <= 40, d
    assert d["written_pages"] == d["files"] == 0


def test_misses_by_reason_add_up(scripted) -> None:
    """Every page a lookup examined is a hit, an in-flight rescue or a miss, and
    the misses by reason sum to the misses."""
    d = delta(scripted["trace"], scripted["start"])
    by_reason = sum(d[f"misses_{r}"] for r in REASONS)
    assert by_reason == d["page_misses"] > 0
    assert d["pages_checked"] == d["page_hits"] + d["page_rescues"] + d["page_misses"]


def test_evicted_beliefs_make_redundant_writes_classified_evicted(capped) -> None:
    """Cap 10: C evicts A's beliefs while L3 keeps A's files; replaying A writes
    10 pages that were all already stored (redundant = written, no new file, none
    believed), and the admission misses are classified evicted, none cold."""
    d = delta(capped["a_replayed"], capped["c"])
    assert d["written_pages"] == d["redundant_written_pages"] == 10
    assert d["files"] == 0
    assert d["redundant_believed_pages"] == 0
    assert d["misses_evicted"] >= 1 and d["misses_cold"] == 0
    first = delta(capped["c"], capped["a"])
    assert first["written_pages"] == first["files"] == 10
    assert first["redundant_written_pages"] == 0
