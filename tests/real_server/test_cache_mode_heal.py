"""Cache mode with ``cache_mode.dedup`` on: page files deleted from L3 under a
running server are written again by the next request that needs them.

A skipped write rests on a belief; when L3 loses the page the belief must go, or
the page would be skipped forever.  Two ways heal it, one server each (started side
by side), both with the file backend:

* **the prefetch hit query** (no reconciler): a prompt at or above SGLang's
  256-token prefetch threshold asks L3 what it holds; its rank-agreed answer
  invalidates the beliefs beyond the hit, so the request's own write includes the
  deleted pages;
* **the reconciler** (on, with the file backend's own ``batch_exists`` as ground
  truth): a prompt below the threshold asks L3 nothing, so the first write after
  the deletion still skips the pages (they are believed); the dedup lookup is
  verified, the verdict invalidates the beliefs, and the next request writes them.

``/flush_cache`` empties device and host memory in between, so each request
computes its prompt again and its node is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Server,
    ServerSpec,
    block_tokens_for,
    delta,
    launch_together,
    our_totals,
    poll,
    settle,
    sglang_total,
)

pytestmark = [pytest.mark.real_server]

PAGE = 16
P = "hicache_existence_"
COUNTERS = (
    "written_pages",
    "write_avoided_pages",
    "redundant_written_pages",
    "reconciler_pages_invalidated",
    "reconciler_stale_positives",
)


def tokens(seed: int, pages: int) -> list[int]:
    return block_tokens_for(seed, PAGE * pages, salt="cache-mode-heal")


def spec(reconciler: bool) -> ServerSpec:
    config: dict[str, Any] = {"cache_mode": {"dedup": True}}
    if reconciler:
        config["reconciler"] = {
            "enabled": True,
            "sampling_rate": 1.0,
            "verifications_per_s": 1000.0,
            "timeout_ms": 1000.0,
            "learn": False,
        }
    return ServerSpec(host_memory_mode="cache", config=config)


def read(srv: Server) -> dict[str, float]:
    fams = srv.metrics()
    out: dict[str, float] = {}
    reconciling = "reconciler" in (srv.spec.config or {})
    names = [n for n in COUNTERS if reconciling or not n.startswith("reconciler_")]
    out = our_totals(fams, names)
    out["files"] = float(len(srv.l3_pages()))
    out["sglang_backuped_pages"] = sglang_total(fams, "sglang:backuped_tokens") / PAGE
    return out


def reading(srv: Server) -> dict[str, float]:
    srv.wait_writes_settled()
    return settle(lambda: read(srv))


def delete_files(srv: Server, keep: set[str]) -> int:
    """Delete the page files not in ``keep`` (the ones a step created)."""
    names = [n for n in srv.l3_pages() if n not in keep]
    for name in names:
        (srv.l3_dir / name).unlink()
    return len(names)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(query-healed, reconciler-healed): two dedup-on servers started together."""
    spec_q, spec_r = spec(reconciler=False), spec(reconciler=True)
    workdir: Path = tmp_path_factory.mktemp("cache-mode-heal")
    with launch_together([spec_q, spec_r], workdir) as (q, r):
        yield q, r


def test_a_hit_query_heals_and_the_next_request_rewrites_deleted_pages(servers) -> None:
    """A (24 pages, above the prefetch threshold) written; files deleted; A+B:
    its hit query finds nothing, the beliefs go, and its node writes all 32
    pages (A's 24 again): the files are back, nothing skipped, nothing redundant."""
    srv, _ = servers
    a, b = tokens(1, 24), tokens(2, 8)
    start, before = reading(srv), set(srv.l3_pages())
    srv.generate(a, max_new_tokens=1)
    after_a = reading(srv)
    d = delta(after_a, start)
    assert (d["written_pages"], d["files"], d["write_avoided_pages"]) == (24, 24, 0), d
    assert delete_files(srv, keep=before) == 24
    srv.flush_cache()
    deleted = reading(srv)
    srv.generate(a + b, max_new_tokens=1)
    d = delta(reading(srv), deleted)
    assert d["written_pages"] == d["sglang_backuped_pages"] == 32, d
    assert d["files"] == 32 and d["write_avoided_pages"] == 0, d
    assert d["redundant_written_pages"] == 0, d


def test_the_reconciler_heals_what_no_query_asks_about(servers) -> None:
    """S (8 pages, below the threshold) written; files deleted; S again: no query,
    the pages are believed, their write is skipped (8 avoided, no file); the
    reconciler verifies that lookup, finds the pages absent and invalidates them
    (8, from one stale positive); S once more writes the 8 pages: the files are
    back."""
    _, srv = servers
    s = tokens(3, 8)
    start, before = reading(srv), set(srv.l3_pages())
    srv.generate(s, max_new_tokens=1)
    after_s = reading(srv)
    d = delta(after_s, start)
    assert (d["written_pages"], d["files"]) == (8, 8), d
    assert delete_files(srv, keep=before) == 8
    srv.flush_cache()
    srv.generate(s, max_new_tokens=1)
    invalidated = poll(
        lambda: (
            read(srv)["reconciler_pages_invalidated"] - after_s["reconciler_pages_invalidated"] >= 8
        ),
        timeout_s=60,
    )
    assert invalidated, read(srv)
    skipped = reading(srv)
    d = delta(skipped, after_s)
    assert (d["written_pages"], d["write_avoided_pages"], d["files"]) == (0, 8, -8), d
    assert d["reconciler_pages_invalidated"] == 8 and d["reconciler_stale_positives"] == 1, d
    srv.flush_cache()
    srv.generate(s, max_new_tokens=1)
    d = delta(reading(srv), skipped)
    assert (d["written_pages"], d["files"], d["write_avoided_pages"]) == (8, 8, 0), d
    assert d["redundant_written_pages"] == 0, d
