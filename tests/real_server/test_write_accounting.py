"""Write accounting inside a real SGLang server, against independent truth.

A real ``sglang.launch_server`` on CPU (``harness.py``) with buffer mode over the
file backend and ``--enable-hicache-existence``.  The counters are compared with
what the test can know without them: the page files the file backend created,
SGLang's own ``sglang:backuped_tokens_total`` (counted at the same storage ack),
and the pages the test itself already sent.  Prompts of 160 tokens stay below
SGLang's 256-token prefetch threshold, so nothing is loaded back from L3 and
every belief comes from an acknowledged write (the 320-token A+B and the failing
phase's prompt excepted, as their tests say).  Two servers: ``scripted`` (the
default cap) and ``capped`` (10 beliefs, over the file backend with writes made to
fail on demand, ``standins/hx_failing_storage.py``: SGLang's own log line and
backed-up count say which failed).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Server,
    ServerSpec,
    block_tokens_for,
    delta,
    family,
    launch_together,
    poll,
    sample_value,
    settle,
    side_by_side,
    trace_requests,
)

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
#: SGLang's own log line for a storage batch that failed (``HiCacheController._page_backup``).
FAILED_LINE = re.compile(r"Write page to storage: (\d+) pages failed")


def tokens(seed: int, pages: int) -> list[int]:
    """``pages`` full pages of deterministic token ids, distinct per seed."""
    return block_tokens_for(seed, PAGE * pages, salt="writes")


def reading(srv, quiet_s: float = 3.0) -> dict[str, float]:
    """Every counter of interest, plus the truth beside them, once SGLang's count,
    the L3 files and ours have all stopped changing."""
    srv.wait_writes_settled()
    return settle(lambda: _read(srv), quiet_s=quiet_s)


def _read(srv) -> dict[str, float]:
    """Every family must be on /metrics (a missing one fails, never reads 0)."""
    fams = srv.metrics()
    out = {name: family(fams, P + name).total("_total") for name in COUNTERS}
    misses = family(fams, P + "page_misses")
    for reason in REASONS:
        out[f"misses_{reason}"] = misses.total("_total", reason=reason)
    # SGLang creates its labelled series at the first backup: absent before it.
    backuped = sample_value(fams, "sglang:backuped_tokens_total", absent_ok=True)
    out["sglang_backuped_pages"] = backuped / PAGE
    prefetched = sample_value(fams, "sglang:prefetched_tokens_total", absent_ok=True)
    out["sglang_prefetched_pages"] = prefetched / PAGE
    out["files"] = float(len(srv.l3_pages()))
    return out


def one(srv, ids: list[int]) -> None:
    srv.generate(ids, max_new_tokens=1)


def run_scripted(srv: Server) -> dict[str, Any]:
    """Default cap: A; flush; A+B (one node spanning believed A and new B); flush;
    A+B again; then 40 requests of the Mooncake trace with a flush every 10."""
    a, b = tokens(1, 10), tokens(2, 10)
    r: dict[str, Any] = {"start": reading(srv)}
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
    return r


#: The failing phase: a prompt of this many new pages while L3 takes only
#: ``ALLOWED`` more page writes (SGLang writes in batches of 128 pages).
FAILING_PAGES, ALLOWED = 130, 128


def capped_spec(trigger: Path) -> ServerSpec:
    """A cap of 10 beliefs, over SGLang's file backend with writes that can be made
    to fail (``standins/hx_failing_storage.py``) once ``trigger`` exists."""
    return ServerSpec(
        config={"cache": {"max_entries": 10}},
        storage_backend="dynamic",
        storage_extra_config={
            "backend_name": "hx-failing-file",
            "module_path": "hx_failing_storage",
            "class_name": "FailingFileStorage",
            "fail_writes_file": str(trigger),
        },
    )


def run_capped(srv: Server, trigger: Path) -> dict[str, Any]:
    """A (10 pages); flush; C (10 other pages: A's beliefs are evicted, its files
    stay); flush; A again; then F (``FAILING_PAGES`` new pages) while L3 accepts
    only ``ALLOWED`` more page writes."""
    a, c, f = tokens(1, 10), tokens(3, 10), tokens(4, FAILING_PAGES)
    r: dict[str, Any] = {"start": reading(srv)}
    one(srv, a)
    r["a"] = reading(srv)
    srv.flush_cache()
    one(srv, c)
    r["c"] = reading(srv)
    srv.flush_cache()
    one(srv, a)
    r["a_replayed"] = reading(srv)
    log_at = len(srv.log.read_bytes())
    trigger.write_text(str(ALLOWED))
    one(srv, f)
    # the write is acknowledged (failed in part) after the request returns
    poll(
        lambda: (
            (x := _read(srv))["written_pages"] > r["a_replayed"]["written_pages"]
            and x["written_pages"] == x["write_acknowledged_pages"] + x["write_failed_pages"]
        )
    )
    r["failing"] = reading(srv)
    trigger.unlink()
    log = srv.log.read_bytes()[log_at:].decode(errors="replace")
    r["failing_log"] = {
        "sglang_failed_pages": float(sum(map(int, FAILED_LINE.findall(log)))),
        "refused_probes": float(log.count('"kind": "write_refused"')),
    }
    return r


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both workloads at once, on two servers started side by side (one start-up's
    wall time): ``scripted`` on the defaults, ``capped`` on the capped, failing L3.
    Each has its own L3 directory and sends its requests in order."""
    workdir = tmp_path_factory.mktemp("write-accounting")
    trigger = workdir / "fail-writes"
    with launch_together([ServerSpec(), capped_spec(trigger)], workdir) as (plain, capped):
        scripted, failing = side_by_side(
            lambda: run_scripted(plain), lambda: run_capped(capped, trigger)
        )
    return {"scripted": scripted, "capped": failing}


@pytest.fixture(scope="module")
def scripted(servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return servers["scripted"]


@pytest.fixture(scope="module")
def capped(servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return servers["capped"]


#: Distinct pages of the scripted workload (A, B and the 40 trace requests) and
#: its writes: A's 10 pages are written twice (the A+B node is written whole).
WORKLOAD_PAGES, WORKLOAD_WRITES = 534, 544


def test_written_pages_equal_the_files_the_backend_created(scripted) -> None:
    """Over the whole workload: written - redundant = new page files (every
    distinct page once), written = acknowledged (nothing failed) =
    sglang:backuped_tokens_total / page size, and bytes = pages x the 4096-byte
    page read from the server's host pool."""
    d = delta(scripted["trace"], scripted["start"])
    assert (d["written_pages"], d["files"]) == (WORKLOAD_WRITES, WORKLOAD_PAGES), d
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
    written and the request's node (20 pages) is avoided.  The 320-token prompt
    is prefetched from L3 (19 pages: SGLang computes at least its last token),
    and the fill commit is a second admission decision over the loaded pages:
    each decision counts once. SGLang waits for the prefetch before scheduling
    the request, so it is loaded unless it timed out (then nothing is loaded
    and only the node counts): the avoided pages follow SGLang's own count."""
    d = delta(scripted["a_b_again"], scripted["a_b"])
    assert d["sglang_prefetched_pages"] in (0, 19), d
    assert d["write_avoided_pages"] == 20 + d["sglang_prefetched_pages"], d
    assert d["written_pages"] == d["files"] == 0


def test_misses_by_reason_add_up(scripted) -> None:
    """Every page a lookup examined is a hit, an in-flight rescue or a miss, and
    the misses by reason sum to the misses."""
    d = delta(scripted["trace"], scripted["start"])
    by_reason = sum(d[f"misses_{r}"] for r in REASONS)
    # two lookups miss a new prompt's node (its insert and its finished
    # sequence's): A, A+B, and the 40 trace requests
    assert by_reason == d["page_misses"] == d["misses_cold"] == 2 * (1 + 1 + 40), d
    assert d["pages_checked"] == d["page_hits"] + d["page_rescues"] + d["page_misses"]


def test_evicted_beliefs_make_redundant_writes_classified_evicted(capped) -> None:
    """Cap 10: C evicts A's beliefs while L3 keeps A's files; replaying A writes
    10 pages that were all already stored (redundant = written, no new file, none
    believed), and the admission misses are classified evicted, none cold."""
    d = delta(capped["a_replayed"], capped["c"])
    assert d["written_pages"] == d["redundant_written_pages"] == 10
    assert d["files"] == 0
    assert d["redundant_believed_pages"] == 0
    # A's node is looked up twice (its insert and its finished sequence's)
    assert (d["misses_evicted"], d["misses_cold"], d["pages_checked"]) == (2, 0, 2), d
    first = delta(capped["c"], capped["a"])
    assert first["written_pages"] == first["files"] == 10
    assert first["redundant_written_pages"] == 0


def test_beliefs_added_at_acks_are_acknowledged_plus_failed(capped) -> None:
    """F (130 new pages) while L3 takes only 128 more page writes: SGLang stores
    128 (its own backed-up count, 128 new page files) and logs the last 2 as
    failed; written 130 = acknowledged 128 + failed 2, and the beliefs added at
    the ack are all 130 (SGLang adds every acked write's pages, failed or not)."""
    d = delta(capped["failing"], capped["a_replayed"])
    log = capped["failing_log"]
    assert log == {"sglang_failed_pages": 2, "refused_probes": 1}, log
    assert d["written_pages"] == FAILING_PAGES, d
    assert (d["write_acknowledged_pages"], d["write_failed_pages"]) == (128, 2), d
    assert d["sglang_backuped_pages"] == d["files"] == 128, d
    assert d["page_inserts"] + d["page_refreshes"] == 128 + 2, d
    assert d["page_inserts"] == FAILING_PAGES, d
    assert d["redundant_written_pages"] == 0, d
