"""Cache mode with ``cache_mode.dedup`` on under TP=2: two real scheduler
processes (gloo), each with its own replica of the existence cache and its own
slice of every page (file names end in ``_<rank>_2``), on 64-token pages.

Dedup decides at TP-lockstep points only (the node write runs at the rank-agreed
write-through ack; beliefs change at the rank-synchronised storage drain and at the
rank-agreed prefetch hit query), so both ranks must take the same decision for every
node: the same pages written and avoided, and replicas that the divergence checks
find identical throughout.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import Server, ServerSpec, block_tokens_for, conversation_requests, launch, settle

pytestmark = [pytest.mark.real_server, pytest.mark.torch]

P = "hicache_existence_"
#: SGLang's usual GPU page size: this is cache mode's 64-token module
#: (tests/real_server/test_server_tp.py is buffer mode's).
PAGE = 64
#: A's and B's pages: 192 tokens, below sglang's 256-token prefetch threshold, so a
#: flushed A is computed again (and its write avoided), not fetched from L3.
N = 3
WORKLOAD: dict[str, Any] = {
    "conversations": 4,
    "turns": 4,
    "system_tokens": 64,
    "user_tokens": (16, 96),
    "reply_tokens": (16, 64),
}


def per_rank(srv: Server, name: str) -> dict[str, float]:
    fams = srv.metrics()
    assert P + name in fams, f"{P + name} is not on /metrics"
    out: Counter[str] = Counter()
    for sample, labels, value in fams[P + name].samples:
        if sample.endswith("_total") or fams[P + name].type == "gauge":
            out[labels["tp_rank"]] += value
    return dict(out)


def test_both_ranks_take_the_same_dedup_decisions_and_stay_identical(tmp_path: Path) -> None:
    """TP=2, dedup on: a conversation workload, then A (N pages); flush; A+B
    (A computed again, below the prefetch threshold): each rank wrote and
    avoided exactly the same pages (its own slice of each), A's N avoided on
    both, the same number of beliefs; the divergence checks ran on both ranks
    and found none."""
    spec = ServerSpec(
        tp_size=2,
        page_size=PAGE,
        host_memory_mode="cache",
        max_total_tokens=4096,
        hicache_ratio=2.0,
        config={
            "cache_mode": {"dedup": True},
            "divergence": {"enabled": True, "interval_steps": 200},
        },
    )
    with launch(spec, tmp_path / "server") as srv:
        for turn in conversation_requests(**WORKLOAD):
            srv.generate(turn.input_ids, max_new_tokens=2)
        srv.wait_writes_settled()

        def figures() -> dict[str, dict[str, float]]:
            return {
                name: per_rank(srv, name)
                for name in ("written_pages", "write_avoided_pages", "redundant_written_pages")
            } | {"entries": per_rank(srv, "entries")}

        before = settle(figures, quiet_s=3.0)
        a = block_tokens_for(1, PAGE * N, salt="cache-mode-tp")
        b = block_tokens_for(2, PAGE * N, salt="cache-mode-tp")
        srv.generate(a, max_new_tokens=1)
        srv.wait_writes_settled()
        srv.flush_cache()
        srv.generate(a + b, max_new_tokens=1)
        srv.wait_writes_settled()
        got = settle(figures, quiet_s=3.0)
        for name, ranks in got.items():
            assert set(ranks) == {"0", "1"} and ranks["0"] == ranks["1"], (name, ranks)
        for rank in ("0", "1"):
            avoided = got["write_avoided_pages"][rank] - before["write_avoided_pages"][rank]
            written = got["written_pages"][rank] - before["written_pages"][rank]
            assert (avoided, written) == (N, 2 * N), (rank, before, got)
        assert got["redundant_written_pages"]["0"] == 0, got
        names = srv.l3_pages()
        slices = Counter(n.rsplit("_", 2)[-2] for n in names)
        assert slices["0"] == slices["1"] == got["written_pages"]["0"], slices

        deadline = time.monotonic() + 60
        while min((checks := per_rank(srv, "divergence_checks")).values(), default=0) < 2:
            assert time.monotonic() < deadline, checks
            time.sleep(0.5)
        assert set(checks) == {"0", "1"}
        assert per_rank(srv, "divergences") == {"0": 0.0, "1": 0.0}
