"""The flat generation (SGLang 0.5.19-0.5.21) in HiCache cache mode: a real 0.5.21
server's L3 writes counted, and ``cache_mode.dedup`` off against on.

Run by CI's sglang 0.5.21 leg (``tests/run-all.sh``), like ``test_server_flat.py``
(whose docstring says why the page size is 1 there).  Two servers side by side in
``--hicache-host-memory-mode cache`` over the file backend, one with dedup off and
one with it on.  The script: A (48 tokens); ``/flush_cache``; A+B (80 tokens).  The
flush empties device and host memory, and A+B is shorter than the 256-token
prefetch threshold, so nothing asks L3: A is computed again and its node, spanning A
and B, is written (dedup off) or written without A's believed pages (dedup on).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    WRITE_PAGES,
    Server,
    ServerSpec,
    block_tokens_for,
    cause_pages,
    delta,
    launch_together,
    our_totals,
    settle,
    sglang_total,
)

pytestmark = pytest.mark.real_server

P = "hicache_existence_"
COUNTERS = WRITE_PAGES
A_TOKENS, B_TOKENS = 48, 32


def read(srv: Server) -> dict[str, float]:
    fams = srv.metrics()
    out = our_totals(fams, COUNTERS)
    out.update({"cause_" + c: v for c, v in cause_pages(fams).items()})
    out["sglang_backuped_pages"] = sglang_total(fams, "sglang:backuped_tokens")  # a page a token
    out["files"] = float(len(srv.l3_pages()))
    return out


def reading(srv: Server) -> dict[str, float]:
    srv.wait_writes_settled()
    return settle(lambda: read(srv))


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, dict]]:
    """{dedup: {step: reading, "outputs": [...]}} for both servers."""
    specs = [
        ServerSpec(page_size=1, host_memory_mode="cache", config={"cache_mode": {"dedup": d}})
        for d in (False, True)
    ]
    a = block_tokens_for(1, A_TOKENS, salt="flat-cache-mode")
    b = block_tokens_for(2, B_TOKENS, salt="flat-cache-mode")
    workdir: Path = tmp_path_factory.mktemp("flat-cache-mode")
    out: dict[bool, dict] = {}
    with launch_together(specs, workdir) as servers:
        for dedup, srv in zip((False, True), servers):
            log = srv.log.read_text(errors="replace")
            assert "observing the flat-generation existence cache (host memory mode cache" in log
            r: dict = {"start": reading(srv), "outputs": []}
            r["outputs"].append(srv.generate(a, max_new_tokens=1))
            r["a"] = reading(srv)
            srv.flush_cache()
            r["outputs"].append(srv.generate(a + b, max_new_tokens=1))
            r["a_b"] = reading(srv)
            out[dedup] = r
        yield out


def test_counters_equal_sglangs_count_and_the_files(script) -> None:
    """Both servers, every step: written = acknowledged = SGLang's backed-up pages
    (one token per page), written - redundant = new page files, nothing failed."""
    for dedup, r in script.items():
        for before, after in (("start", "a"), ("a", "a_b")):
            d = delta(r[after], r[before])
            assert d["written_pages"] == d["write_acknowledged_pages"], (dedup, after, d)
            assert d["written_pages"] == d["sglang_backuped_pages"], (dedup, after, d)
            assert d["written_pages"] - d["redundant_written_pages"] == d["files"], (dedup, d)
            assert d["write_failed_pages"] == 0, (dedup, after, d)


def test_a_recomputed_prefix_is_left_out_with_dedup(script) -> None:
    """A: 49 pages (48 prompt tokens and the generated one) written by both.
    A+B after the flush: off writes the node's 81 pages, 48 of them (A's prompt)
    already in L3, believed, recomputed without a prefetch; on writes 33 and
    avoids those 48.  The same 33 new files and the same outputs on both."""
    off_a = delta(script[False]["a"], script[False]["start"])
    on_a = delta(script[True]["a"], script[True]["start"])
    assert off_a["written_pages"] == on_a["written_pages"] == off_a["files"] == 49
    off = delta(script[False]["a_b"], script[False]["a"])
    on = delta(script[True]["a_b"], script[True]["a"])
    assert (off["written_pages"], off["redundant_written_pages"]) == (81, 48), off
    assert off["redundant_believed_pages"] == off["cause_recompute"] == 48, off
    assert (on["written_pages"], on["write_avoided_pages"], on["redundant_written_pages"]) == (
        33,
        48,
        0,
    ), on
    assert off["files"] == on["files"] == 33
    assert script[False]["outputs"] == script[True]["outputs"]
