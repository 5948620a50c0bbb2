"""Tensor parallelism in a real server on CPU: two scheduler processes over gloo.

sglang 0.5.23's CPU engine runs ``--tp-size 2`` here once the TP group skips
pynccl (the ``tp_gloo`` stand-in) and each rank is bound to a core
(``SGLANG_CPU_OMP_THREADS_BIND``, set by the harness).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from harness import ServerSpec, launch, trace_requests

pytestmark = [pytest.mark.real_server, pytest.mark.torch]


def test_tp2_divergence_checks_run_between_real_ranks_and_report_an_injected_one(
    tmp_path: Path,
) -> None:
    """TP=2: both ranks run divergence checks with no divergence while serving;
    one made-up belief injected in rank 1 is reported at the next check."""
    trigger = tmp_path / "diverge"
    spec = ServerSpec(
        tp_size=2,
        config={"divergence": {"enabled": True, "interval_steps": 200}},
        env={"HX_PROBE_DIVERGE_FILE": str(trigger)},
    )
    with launch(spec, tmp_path / "server") as srv:
        for r in trace_requests(limit=4, max_blocks=8):
            srv.generate(r.input_ids, 4)
        srv.wait_writes_settled()
        # Each rank writes its own KV slice: file names end in _<rank>_2.
        names = srv.l3_pages()
        assert any(n.endswith("_0_2.bin") for n in names)
        assert any(n.endswith("_1_2.bin") for n in names)

        def checks() -> dict[str, float]:
            return {
                lab["tp_rank"]: v
                for lab, v in srv.samples("hicache_existence_divergence_checks_total")
            }

        deadline = time.monotonic() + 60
        while not (len(c := checks()) == 2 and min(c.values()) >= 2):
            assert time.monotonic() < deadline, c
            time.sleep(0.5)
        assert srv.value("hicache_existence_divergences_total") == 0

        tmp = trigger.with_suffix(".tmp")
        tmp.write_text("1")
        os.replace(tmp, trigger)
        deadline = time.monotonic() + 60
        while srv.value("hicache_existence_divergences_total") == 0:
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.5)
        injected = srv.probes("diverge")
        assert [p["tp_rank"] for p in injected] == [1]
        detected = {
            lab["tp_rank"] for lab, v in srv.samples("hicache_existence_divergences_total") if v > 0
        }
        assert detected, "no rank reported the divergence"
