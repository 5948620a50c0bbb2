"""Mooncake as L3 in HiCache cache mode, ``cache_mode.dedup`` off and on.

Two real ``mooncake_master`` processes, one per server (so each master's counts are
one server's writes), two servers started side by side in ``--hicache-host-memory-mode
cache`` over SGLang's own ``--hicache-storage-backend mooncake``.  The script: A (10
pages, below SGLang's 256-token prefetch threshold); ``/flush_cache``; A+B (20
pages: its hit query finds A's 10 pages, fewer than the threshold, so A is computed
and its node, spanning A and B, is written).  Truth: the master's own object counts
(two objects per page for the tiny MHA Llama), objects put, and SGLang's backed-up
count.  Mooncake answers a put of a stored object with success, so only the
existence query (``batch_is_exist``, which the hooks read) sees the redundancy.
Both servers wait for each prefetch, its hit query included (``harness.LOAD_WHOLE``):
under SGLang's default a request scheduled before its hit query answers is recomputed
with no answer to classify, so A's rewrite is a ``recompute``, not
``below_prefetch_threshold`` (a full run's failure).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    LOAD_WHOLE,
    REPO,
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

sys.path.insert(0, str(REPO / "tests"))
from mooncake_master import MooncakeMaster, need_mooncake

pytestmark = [pytest.mark.real_server]

PAGE = 16
OBJECTS_PER_PAGE = 2
P = "hicache_existence_"
OURS = WRITE_PAGES


def tokens(seed: int, pages: int) -> list[int]:
    return block_tokens_for(seed, PAGE * pages, salt="cache-mode-mooncake")


def read(srv: Server, master: MooncakeMaster) -> dict[str, float]:
    fams = srv.metrics()
    out = our_totals(fams, OURS)
    out.update({"cause_" + c: v for c, v in cause_pages(fams).items()})
    out["sglang_backuped_pages"] = sglang_total(fams, "sglang:backuped_tokens") / PAGE
    mm = master.metrics()
    out["mc_objects"] = mm["master_key_count"]
    out["mc_put_objects"] = mm["master_batch_put_start_items_total"]
    return out


@pytest.fixture(scope="module")
def readings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, dict[str, dict]]]:
    """{dedup: {step: reading}} for the script, on both servers."""
    need_mooncake()
    workdir: Path = tmp_path_factory.mktemp("cache-mode-mooncake")
    masters: list[MooncakeMaster] = []
    try:
        for i in range(2):
            (workdir / f"master-{i}").mkdir()
            masters.append(MooncakeMaster(workdir / f"master-{i}").start())
        specs = [
            ServerSpec(
                host_memory_mode="cache",
                storage_backend="mooncake",
                storage_extra_config=m.extra_config(),
                config={"cache_mode": {"dedup": dedup}},
                prefetch_policy=LOAD_WHOLE,
            )
            for m, dedup in zip(masters, (False, True))
        ]
        out: dict[bool, dict[str, dict]] = {False: {}, True: {}}
        with launch_together(specs, workdir / "servers") as servers:
            pairs = list(zip((False, True), servers, masters))
            a, b = tokens(1, 10), tokens(2, 10)
            for dedup, srv, m in pairs:
                out[dedup]["start"] = settle(lambda s=srv, mm=m: read(s, mm))
                out[dedup]["out_a"] = {"ids": srv.generate(a, max_new_tokens=1)}
                out[dedup]["a"] = settle(lambda s=srv, mm=m: read(s, mm))
                srv.flush_cache()
                out[dedup]["out_ab"] = {"ids": srv.generate(a + b, max_new_tokens=1)}
                out[dedup]["a_b"] = settle(lambda s=srv, mm=m: read(s, mm))
        yield out
    finally:
        for m in masters:
            m.close()


def test_first_writes_are_new_mooncake_objects(readings) -> None:
    """A, dedup off and on: 10 pages written and acknowledged, counted by SGLang,
    20 new objects on the master, each put once; nothing redundant or avoided."""
    for dedup in (False, True):
        d = delta(readings[dedup]["a"], readings[dedup]["start"])
        assert d["written_pages"] == d["write_acknowledged_pages"] == 10, (dedup, d)
        assert d["sglang_backuped_pages"] == 10, (dedup, d)
        assert d["mc_objects"] == d["mc_put_objects"] == 20, (dedup, d)
        assert d["redundant_written_pages"] == d["write_avoided_pages"] == 0, (dedup, d)


def test_a_recomputed_prefix_is_written_again_unless_dedup_is_on(readings) -> None:
    """A+B after a flush.  Dedup off: the node's 20 pages are written (SGLang
    counts 20), Mooncake already held A's 10 (redundant, believed, below the
    prefetch threshold) and stores B's: 20 new objects, 20 put.  Dedup on: A's
    believed pages are left out, 10 written, 10 avoided; the same 20 objects
    stored and put; nothing redundant.  The outputs are the same."""
    off = delta(readings[False]["a_b"], readings[False]["a"])
    on = delta(readings[True]["a_b"], readings[True]["a"])
    assert off["written_pages"] == off["sglang_backuped_pages"] == 20, off
    assert off["redundant_written_pages"] == off["redundant_believed_pages"] == 10, off
    assert off["cause_below_prefetch_threshold"] == 10, off
    assert on["written_pages"] == on["sglang_backuped_pages"] == 10, on
    assert on["write_avoided_pages"] == 10 and on["redundant_written_pages"] == 0, on
    for d in (off, on):
        assert d["mc_objects"] == d["mc_put_objects"] == 20, d
    for step in ("out_a", "out_ab"):
        assert readings[False][step] == readings[True][step]
