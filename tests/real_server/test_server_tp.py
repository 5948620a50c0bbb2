"""Tensor parallelism in a real server on CPU: two scheduler processes over gloo.

sglang 0.5.23's CPU engine runs ``--tp-size 2`` here once the TP group skips
pynccl (the ``tp_gloo`` stand-in) and each rank is bound to a core
(``SGLANG_CPU_OMP_THREADS_BIND``, set by the harness).

Pages are 64 tokens here, SGLang's usual GPU setting (the buffer-mode module of
the 64-token shape; tests/real_server/test_cache_mode_tp.py is cache mode's).
One server for the module, started the way docs/enable.md's environment route
says: ``python -m sglang.launch_server`` with no flag of ours, the package
enabled and configured by ``HICACHE_EXISTENCE_*`` variables only, and without
``--enable-metrics``, so each scheduler serves its own ``/metrics`` on
``metrics.port + index`` (index = tp_rank here). The tests run in file order: the
replica divergence is injected last.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    Family,
    Server,
    ServerSpec,
    family,
    free_ports,
    launch,
    proc_view,
    sample_value,
    scrape,
    trace_requests,
)

pytestmark = [pytest.mark.real_server, pytest.mark.torch]

P = "hicache_existence_"
TP = 2
#: SGLang's usual GPU page size (64 tokens); the other modules use 16.
PAGE = 64
#: One rank's share of a page of the tiny Llama: 2 layers x (K, V) x 1 of its
#: 2 KV heads x 16 dims x 2 bytes (bf16) x 64 tokens.
RANK_PAGE_BYTES = 2 * 2 * 1 * 16 * 2 * PAGE
WRITES = ("written", "redundant_written", "write_acknowledged", "write_failed")
OUR_FLAGS = ("--enable-hicache-existence", "--hicache-existence-config")


@dataclass
class TPServer:
    server: Server
    port: int
    trigger: Path

    def rank_metrics(self, rank: int) -> dict[str, Family]:
        """Rank ``rank``'s own /metrics (standalone, on ``metrics.port + rank``)."""
        return scrape(f"http://127.0.0.1:{self.port + rank}/metrics")


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPServer]:
    workdir = tmp_path_factory.mktemp("tp")
    trigger = workdir / "diverge"
    port = free_ports(TP)
    spec = ServerSpec(
        tp_size=TP,
        page_size=PAGE,
        existence=False,  # no --enable-hicache-existence: the environment enables it
        metrics=False,  # no --enable-metrics: each scheduler serves its own /metrics
        env={
            "HICACHE_EXISTENCE_ENABLED": "1",
            "HICACHE_EXISTENCE_METRICS__PORT": str(port),
            "HICACHE_EXISTENCE_DIVERGENCE__ENABLED": "1",
            "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "200",
            # No exact audits (the default folds one every 100 checks, which an idle
            # server reaches in seconds): the injected divergence must be found by
            # the operation digests alone. Audits: test_divergence_inprocess/gloo.
            "HICACHE_EXISTENCE_DIVERGENCE__AUDIT_EVERY_CHECKS": "0",
            "HX_PROBE_DIVERGE_FILE": str(trigger),
        },
    )
    with launch(spec, workdir / "server") as srv:
        for r in trace_requests(limit=4, max_blocks=8):
            srv.generate(r.input_ids, 4)
        srv.wait_writes_settled()
        yield TPServer(srv, port, trigger)


def rank_writes(t: TPServer, rank: int) -> dict[str, float]:
    fams = t.rank_metrics(rank)
    out = {}
    for w in WRITES:
        out[w + "_pages"] = family(fams, f"{P}{w}_pages").total("_total", tp_rank=str(rank))
        out[w + "_bytes"] = family(fams, f"{P}{w}_bytes").total("_total", tp_rank=str(rank))
    return out


def test_environment_route_enables_every_rank_with_metrics_on_port_plus_index(
    tp: TPServer,
) -> None:
    """Started with only HICACHE_EXISTENCE_ENABLED=1 (no flag on sglang's command
    line), both schedulers build our cache, and each serves its own series, and
    only its own, on metrics.port + its index."""
    srv = tp.server
    assert srv.proc is not None
    argv, env = proc_view(srv.proc.pid)
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv
    assert not [a for a in argv if a.startswith(OUR_FLAGS)], argv
    assert env.get("HICACHE_EXISTENCE_ENABLED") == "1"
    classes = [p["cache_class"] for p in srv.probes("tree")]
    assert len(classes) == TP and all(c.startswith("hicache_existence.") for c in classes)
    for rank in range(TP):
        fams = tp.rank_metrics(rank)
        ranks = {lab.get("tp_rank") for _, lab, _ in family(fams, P + "page_inserts").samples}
        assert ranks == {str(rank)}, (rank, ranks)
        assert sample_value(fams, P + "page_inserts_total", tp_rank=str(rank)) > 0


def test_each_rank_counts_its_own_share_of_every_page_in_bytes(tp: TPServer) -> None:
    """Under TP=2 each rank writes its own KV slice (files ``*_<rank>_2.bin``, half
    a page each): per rank, written - redundant pages = that rank's new files, and
    every byte counter is pages x the rank's page share, which is the size of each
    of its files; nothing failed."""
    files = tp.server.l3_pages()
    per_rank = [
        {n: size for n, size in files.items() if n.endswith(f"_{rank}_{TP}.bin")}
        for rank in range(TP)
    ]
    assert sum(map(len, per_rank)) == len(files)
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for rank, mine in enumerate(per_rank):
        assert set(mine.values()) == {RANK_PAGE_BYTES}, (rank, set(mine.values()))
        w = rank_writes(tp, rank)
        assert w["written_pages"] - w["redundant_written_pages"] == len(mine), (rank, w)
        assert w["write_acknowledged_pages"] == w["written_pages"], (rank, w)
        assert w["write_failed_pages"] == 0, (rank, w)
        for name in WRITES:
            assert w[name + "_bytes"] == w[name + "_pages"] * RANK_PAGE_BYTES, (rank, name, w)


def test_tp2_divergence_checks_run_between_real_ranks_and_report_an_injected_one(
    tp: TPServer,
) -> None:
    """TP=2: both ranks run divergence checks with no divergence while serving;
    one belief of rank 1 replaced by a made-up one (the same pool size on both
    ranks) is reported at the next check."""
    srv = tp.server

    def per_rank(name: str) -> dict[int, float]:
        return {
            rank: sample_value(tp.rank_metrics(rank), P + name, tp_rank=str(rank))
            for rank in range(TP)
        }

    deadline = time.monotonic() + 60
    while min((checks := per_rank("divergence_checks_total")).values()) < 2:
        assert time.monotonic() < deadline, checks
        time.sleep(0.5)
    assert per_rank("divergences_total") == {0: 0.0, 1: 0.0}

    tmp = tp.trigger.with_suffix(".tmp")
    tmp.write_text("1")
    os.replace(tmp, tp.trigger)
    deadline = time.monotonic() + 60
    while not any(per_rank("divergences_total").values()):
        assert time.monotonic() < deadline, srv.tail()
        time.sleep(0.5)
    injected = srv.probes("diverge")
    assert [p["tp_rank"] for p in injected] == [1]
    # A page replaced, not added: the pools' sizes agree, so the digests found it.
    (probe,) = injected
    assert len(probe["replaced"]) == 1 and probe["sizes"][0] == probe["sizes"][1] > 0, probe
