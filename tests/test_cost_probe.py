"""The cost probe's hook timer (``tests/real_server/standins/hx_probes.py``), which
the cost benchmarks' figures rest on: an AROUND hook counts its own frames, not
upstream's call inside it, and the package's methods upstream calls in between
count as the top-level calls they are without the hook.  CPU time is measured, so
the test spins rather than sleeps, and compares with wide margins."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_server" / "standins"))
import hx_probes  # test-only code beside the real-server stand-ins


def _spin(ms: float) -> None:
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


@pytest.fixture
def cost() -> Any:
    c = hx_probes._COST
    saved = (c.main, c.ns, c.calls, c.depth, dict(c.by_name), c.timer_ns)
    c.main, c.ns, c.calls, c.depth, c.timer_ns = threading.get_ident(), 0, 0, 0, 0.0
    yield c
    c.main, c.ns, c.calls, c.depth, by_name, c.timer_ns = saved
    c.by_name.clear()
    c.by_name.update(by_name)
    c.touched.clear()


def test_an_around_hook_counts_its_own_time_not_upstreams(cost: Any) -> None:
    """2 ms of the hook's own work around 20 ms of upstream's: about 2 ms counted
    (fails if the pause is dropped: 22 ms), and the package method upstream calls
    (4 ms, timed as the probe times the cache's methods) counts once, top-level."""
    method = hx_probes._timed(lambda: _spin(4), "")

    def upstream(x: int) -> int:
        _spin(16)
        method()
        return x + 1

    def hook(original: Any, x: int) -> int:
        _spin(1)
        out = original(x)
        _spin(1)
        return int(out)

    timed = hx_probes._hook_timed(hook, "AROUND", "probe_test_around")
    assert timed(upstream, 1) == 2
    slot = cost.by_name["hook:probe_test_around"]
    assert slot[1] == 1
    assert 1.5e6 < slot[0] < 6e6, slot[0]
    assert cost.calls == 2  # the hook and the method inside upstream, each top-level
    assert 5e6 < cost.ns < 12e6, cost.ns
    assert cost.depth == 0


def test_an_after_hook_counts_whole_and_other_threads_not_at_all(cost: Any) -> None:
    timed = hx_probes._hook_timed(lambda result, x: _spin(3), "AFTER", "probe_test_after")
    timed(None, 1)
    slot = cost.by_name["hook:probe_test_after"]
    assert slot[1] == 1 and 2.5e6 < slot[0] < 9e6
    worker = threading.Thread(target=timed, args=(None, 1))
    worker.start()
    worker.join()
    assert slot[1] == 1  # not the scheduler thread: not counted
