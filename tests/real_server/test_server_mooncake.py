"""Mooncake as L3 under a real server: counters against Mooncake's own answers,
and the master killed and restarted under the running server.

One server for the module: SGLang's own ``--hicache-storage-backend mooncake``
(buffer mode, ``--enable-hicache-existence``) over TCP on loopback to a real
``mooncake_master`` the test starts (``tests/mooncake_master.py``).  The
reconciler runs on the backend's ground truth (no Redis: the integration picks
``MooncakeGroundTruth``, the store client's raw existence codes), with learning
off so that a verification never re-adds an evicted belief between two steps of
the script.  The truth the counters are held to is the master's own metrics
(objects it holds, objects clients started to put) and SGLang's
``sglang:backuped_tokens_total``; none of them reads our counters.

The tiny Llama is MHA without split heads: SGLang stores a page as two Mooncake
objects (``<model>_<page hash>_<rank>_k`` and ``..._v``).  Prompts stay below
SGLang's 256-token prefetch threshold, so no prefetch query (which would wait on
a dead master and heal beliefs on its own) takes part.  The tests run in file
order on the same server.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness import (
    REPO,
    Server,
    ServerSpec,
    block_tokens_for,
    delta,
    family,
    launch,
    poll,
    sample_value,
    settle,
)

sys.path.insert(0, str(REPO / "tests"))
from mooncake_master import MooncakeMaster, need_mooncake

pytestmark = [pytest.mark.real_server]

PAGE = 16
#: Mooncake objects per page for the tiny Llama (MHA, heads not split): k and v.
OBJECTS_PER_PAGE = 2
#: Beliefs the cache may hold: small enough that one 2-page prompt evicts a belief.
CAP = 10
P = "hicache_existence_"
OURS = (
    "written_pages",
    "redundant_written_pages",
    "redundant_believed_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "write_avoided_pages",
    "reconciler_stale_positives",
    "reconciler_pages_invalidated",
    "reconciler_errors",
)
REASONS = ("cold", "evicted", "invalidated", "cleared")


def config() -> dict[str, Any]:
    return {
        "cache": {"max_entries": CAP},
        "miss_reasons": {"enabled": True},
        "reconciler": {
            "enabled": True,
            "sampling_rate": 1.0,
            "verifications_per_s": 1000.0,
            # A loaded 2-core machine: only a dead master times out.
            "timeout_ms": 1000.0,
            "learn": False,
            "breaker_failures": 3,
            "breaker_backoff_s": 0.5,
            "breaker_backoff_max_s": 1.0,
        },
    }


def tokens(seed: int, pages: int) -> list[int]:
    """``pages`` full pages of deterministic token ids, distinct per seed."""
    return block_tokens_for(seed, PAGE * pages, salt="mooncake-l3")


@dataclass
class Stack:
    master: MooncakeMaster
    server: Server
    readings: dict[str, dict[str, float]] = field(default_factory=dict)


def read(stack: Stack) -> dict[str, float]:
    """Our counters, SGLang's backed-up pages and the master's object counts."""
    srv = stack.server
    fams = srv.metrics()
    # Every family must be on /metrics: a missing one fails, never reads 0.
    out = {n: family(fams, P + n).total("_total") for n in OURS}
    misses = family(fams, P + "page_misses")
    for reason in REASONS:
        out[f"misses_{reason}"] = misses.total("_total", reason=reason)
    queries = family(fams, P + "reconciler_queries")
    for result in ("present", "absent", "error", "timeout"):
        out[f"queries_{result}"] = queries.total("_total", result=result)
    # SGLang creates its labelled series at the first backup: absent before it.
    backuped = sample_value(fams, "sglang:backuped_tokens_total", absent_ok=True)
    out["sglang_backuped_pages"] = backuped / PAGE
    if stack.master.proc is not None and stack.master.proc.poll() is None:
        mm = stack.master.metrics()  # each exported from the start (a missing one fails)
        out["mc_objects"] = mm["master_key_count"]
        out["mc_put_objects"] = mm["master_batch_put_start_items_total"]
        # Puts of objects already stored: the client reports them as successes.
        out["mc_put_existing"] = mm["master_batch_put_start_failed_items_total"]
    return out


def settled(stack: Stack) -> dict[str, float]:
    """A reading once everything has stopped moving."""
    return settle(lambda: read(stack))


def srv_log(srv: Server, since: int) -> str:
    """The server's log from byte ``since`` on."""
    return srv.log.read_bytes()[since:].decode(errors="replace")


def healthy(srv: Server) -> bool:
    with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
        return r.status == 200


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_mooncake()
    workdir = tmp_path_factory.mktemp("mooncake")
    master = MooncakeMaster(workdir).start()
    try:
        spec = ServerSpec(
            config=config(),
            storage_backend="mooncake",
            storage_extra_config=master.extra_config(),
        )
        with launch(spec, workdir / "server") as srv:
            st = Stack(master, srv)
            st.readings["start"] = settled(st)
            yield st
    finally:
        master.close()


Readings = dict[str, dict[str, float]]


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> Readings:
    """A (10 pages); flush; C (2 pages: at cap 10 its beliefs evict A's oldest
    two while Mooncake keeps every object); flush; A again."""
    srv, r = stack.server, stack.readings
    for name, ids in (("a", tokens(1, 10)), ("c", tokens(2, 2)), ("a_again", tokens(1, 10))):
        srv.flush_cache()
        srv.generate(ids, max_new_tokens=1)
        r[name] = settled(stack)
    return r


def test_first_writes_are_the_objects_mooncake_newly_holds(scripted: Readings) -> None:
    """A and C: every written page is acknowledged, counted by SGLang too, and
    is two new objects on the master, each put once; nothing redundant."""
    for before, after, pages in (("start", "a", 10), ("a", "c", 2)):
        d = delta(scripted[after], scripted[before])
        assert d["written_pages"] == d["write_acknowledged_pages"] == pages, (after, d)
        assert d["sglang_backuped_pages"] == pages, (after, d)
        assert d["mc_objects"] == d["mc_put_objects"] == OBJECTS_PER_PAGE * pages, (after, d)
        assert d["mc_put_existing"] == 0, (after, d)
        assert d["redundant_written_pages"] == d["write_failed_pages"] == 0, (after, d)


def test_evicted_beliefs_make_redundant_writes_mooncake_already_held(scripted: Readings) -> None:
    """A again after C evicted two of its beliefs: the node is written whole
    (10 pages, SGLang counts 10 backed up) but Mooncake is sent no object and
    holds no new one, so all 10 are redundant, 8 of them still believed at the
    launch; the admission miss is classified evicted, not cold."""
    d = delta(scripted["a_again"], scripted["c"])
    assert d["written_pages"] == d["sglang_backuped_pages"] == 10, d
    assert d["mc_objects"] == d["mc_put_objects"] == d["mc_put_existing"] == 0, d
    assert d["redundant_written_pages"] == 10, d
    assert d["redundant_believed_pages"] == 8, d
    # A's node is looked up twice (its insert and its finished sequence's)
    assert (d["misses_evicted"], d["misses_cold"]) == (2, 0), d


def test_written_minus_redundant_is_what_mooncake_stored(scripted: Readings) -> None:
    """Over the whole script: written - redundant pages = objects the master
    holds / 2 = objects clients put / 2 (the warm-up object excluded)."""
    d = delta(scripted["a_again"], scripted["start"])
    stored = d["written_pages"] - d["redundant_written_pages"]
    assert stored * OBJECTS_PER_PAGE == d["mc_objects"] == d["mc_put_objects"] == 24, d
    print(
        f"\nmooncake L3: written {d['written_pages']:.0f}, redundant "
        f"{d['redundant_written_pages']:.0f} ({d['redundant_believed_pages']:.0f} believed), "
        f"master objects +{d['mc_objects']:.0f}, objects put {d['mc_put_objects']:.0f}, "
        f"sglang backed-up pages {d['sglang_backuped_pages']:.0f}"
    )


def test_master_killed_and_restarted_under_the_server(stack: Stack) -> None:
    """SIGKILL the master while requests flow: every request completes with the
    same greedy output, the server stays healthy, the reconciler sees errors and
    invalidates nothing; restarted empty, the beliefs about the lost pages (and
    about the pages whose write failed during the outage) are found stale and
    dropped, and the next requests rewrite exactly those pages."""
    srv, master = stack.server, stack.master
    p, q, r = tokens(5, 6), tokens(6, 2), tokens(7, 2)
    srv.flush_cache()
    out_p, out_q = srv.generate(p, 4), srv.generate(q, 4)
    before = settled(stack)
    log_at = len(srv.log.read_bytes())

    master.kill()
    t_down = time.monotonic()
    srv.flush_cache()
    assert srv.generate(p, 4) == out_p  # believed stored: served, write avoided
    assert srv.generate(q, 4) == out_q
    out_r = srv.generate(r, 4)  # new pages: their write fails while the master is down
    assert healthy(srv)
    down = poll(
        lambda: (
            (now := read(stack))["queries_error"] + now["queries_timeout"]
            > before["queries_error"] + before["queries_timeout"]
            and now["write_failed_pages"] > before["write_failed_pages"]
            and now
        ),
        timeout_s=90,
    )
    assert down, read(stack)
    down_s = time.monotonic() - t_down
    dd = delta(down, before)
    # Errors are never evidence: no answer reads as absence, nothing is invalidated.
    assert dd["reconciler_pages_invalidated"] == dd["queries_absent"] == 0, dd
    # P (6 pages) and Q (2) believed stored: one admission decision each
    assert dd["write_avoided_pages"] == 8 and dd["written_pages"] == 2, dd
    # R's write failed, as SGLang itself says (and counts nothing backed up).
    assert dd["write_failed_pages"] == 2 and dd["sglang_backuped_pages"] == 0, dd
    assert "Write page to storage: 2 pages failed" in srv_log(srv, log_at)
    assert healthy(srv)

    master.start()  # empty: every object is gone
    assert poll(lambda: master.metrics().get("master_active_clients", 0) >= 1, timeout_s=30)
    restart = settled(stack)
    assert restart["mc_objects"] == 0, restart

    def healed() -> dict[str, float] | None:
        srv.flush_cache()
        for ids, want in ((p, out_p), (q, out_q), (r, out_r)):
            assert srv.generate(ids, 4) == want
        now = read(stack)
        gone = now["reconciler_pages_invalidated"] - restart["reconciler_pages_invalidated"]
        return now if gone >= 10 else None

    assert poll(healed, timeout_s=60, every_s=1.0), read(stack)
    srv.flush_cache()
    for ids in (p, q, r):
        srv.generate(ids, 4)
    after = settled(stack)
    d = delta(after, restart)
    # one verdict per lost prompt (P, Q, R): the first drops all its beliefs
    assert d["reconciler_pages_invalidated"] == 10 and d["reconciler_stale_positives"] == 3, d
    # Each lost page rewritten once: 10 pages, 20 new objects, all acknowledged.
    assert d["written_pages"] == d["write_acknowledged_pages"] == 10, d
    assert d["redundant_written_pages"] == d["write_failed_pages"] == 0, d
    assert after["mc_objects"] == d["mc_put_objects"] == OBJECTS_PER_PAGE * 10, d
    assert after["mc_put_existing"] == 0, after
    assert healthy(srv)
    srv.check_alive()
    log = srv_log(srv, log_at)
    tracebacks = re.split(r"(?=Traceback \(most recent call last\))", log)[1:]
    ours = [t for t in tracebacks if "hicache_existence" in t]
    assert not ours, ours[0][:3000]
    assert "write accounting skipped" not in log and "reconciler: internal error" not in log
    print(
        f"\nmooncake master down {down_s:.1f} s: reconciler errors "
        f"{dd['reconciler_errors']:.0f}, timeouts {dd['queries_timeout']:.0f}, "
        f"{dd['write_avoided_pages']:.0f} pages avoided, {dd['write_failed_pages']:.0f} failed; "
        f"after the restart invalidated "
        f"{d['reconciler_pages_invalidated']:.0f} pages in "
        f"{d['reconciler_stale_positives']:.0f} stale positives, rewritten {d['written_pages']:.0f}"
    )
