"""HiCache's default cache mode in real servers: L3 writes counted against
independent truth under each write policy, and ``cache_mode.dedup`` on against off.

For each write policy two servers start side by side (``--hicache-host-memory-mode
cache``, the file backend, ``--enable-hicache-existence``), one with
``cache_mode.dedup`` off and one with it on, each with its own L3 directory, and
serve the same multi-turn conversation workload (``harness.conversation_requests``:
12 conversations of 8 turns, interleaved turn by turn) with L2 pressure: a
4096-token device pool and a host pool twice its size hold less than the
conversations' ~9,800 distinct tokens, so prefixes leave host memory and come back
from L3 (``sglang:prefetched_tokens_total``), or are computed and written again.

The truth the counters are held to never reads them: SGLang's own
``sglang:backuped_tokens_total`` (counted at the same storage ack), the page files
the file backend created (``HiCacheFile.set`` skips a page that exists, so a file
is created once), and the greedy outputs.

Every server loads each prefetch whole (``harness.LOAD_WHOLE``), and still the two
servers of a pair need not take the same path: a write dedup leaves out acks at
once, a host copy is locked until its write acks, and the next request's hit query
sees only the files written by then.  So what one server must equal the other is
only what no timing moves (the greedy outputs, the set of pages L3 ends up
holding); every count is held to its own server's truth.

The ``write_through`` pair also runs the trace recorder at sampling rate 1 (every
page recorded), with a relative ``recorder.path``: its records are held to the same
truth (the write records' pages to the written pages, SGLang's backed-up pages and
the page files; the prefetch records' ``hit`` to SGLang's
``sglang:storage_prefetch_hit_tokens_total`` and ``sglang:prefetched_tokens_total``),
and its files must be where the relative path pointed when the server loaded its
configuration.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from doctor_cli import Run as DoctorRun
from doctor_cli import check_evidence, doctor, metrics_url
from harness import (
    LOAD_WHOLE,
    WRITE_PAGES,
    Server,
    ServerSpec,
    cause_pages,
    conversation_requests,
    family,
    launch_together,
    our_totals,
    settle,
    sglang_total,
    side_by_side,
)

pytestmark = [pytest.mark.real_server]

PAGE = 16
P = "hicache_existence_"
POLICIES = ("write_through", "write_back", "write_through_selective")
WORKLOAD: dict[str, Any] = {
    "conversations": 12,
    "turns": 8,
    "system_tokens": 64,
    "user_tokens": (16, 96),
    "reply_tokens": (16, 64),
}
COUNTERS = WRITE_PAGES
#: The policy whose servers also record a trace at rate 1 (it reads L3 back, so its
#: prefetch records carry hits).
RECORDED = "write_through"
#: Relative on purpose: made absolute when the server loads its configuration,
#: against its working directory (``Server.workdir``).
TRACE_DIR = "trace"


def spec(policy: str, dedup: bool) -> ServerSpec:
    config: dict[str, Any] = {"cache_mode": {"dedup": dedup}}
    if policy == RECORDED:
        config["recorder"] = {
            "enabled": True,
            "path": TRACE_DIR,
            "sample_rate": 1.0,
            "flush_interval_s": 0.25,
        }
    return ServerSpec(
        host_memory_mode="cache",
        write_policy=policy,
        max_total_tokens=4096,
        hicache_ratio=2.0,
        prefetch_policy=LOAD_WHOLE,
        config=config,
    )


@dataclass
class Run:
    """One server's figures once its writes settled."""

    counters: dict[str, float]
    causes: dict[str, float]
    mode: dict[str, str]
    backuped_pages: float
    prefetched_tokens: float
    files: frozenset[str]
    outputs: list[list[int]]
    doctor: DoctorRun | None = None
    #: Evidence figures of every warning-or-above finding compared to /metrics.
    evidence_compared: int = 0
    #: The recorder (``RECORDED`` only): SGLang's L3 hit tokens, our records
    #: series, the start-up line, and the records read once the server stopped.
    prefetch_hit_tokens: float = 0.0
    recorder_series: dict[str, dict[str, float]] | None = None
    recorder_line: str = ""
    workdir: Path | None = None
    trace: list[dict[str, Any]] | None = None


def reading(srv: Server) -> tuple[dict[str, float], dict[str, float], float, int]:
    fams = srv.metrics()
    counters, causes = our_totals(fams, COUNTERS), cause_pages(fams)
    backuped = sglang_total(fams, "sglang:backuped_tokens") / PAGE
    return counters, causes, backuped, len(srv.l3_pages())


def serve(srv: Server, outputs: list[list[int]]) -> None:
    for turn in conversation_requests(**WORKLOAD):
        outputs.append(srv.generate(turn.input_ids, max_new_tokens=2))


def settled(srv: Server, outputs: list[list[int]]) -> Run:
    srv.wait_writes_settled(quiet_s=2.0)
    counters, causes, backuped, _ = settle(lambda: reading(srv), quiet_s=3.0)
    fams = srv.metrics()
    ((_, mode, _),) = family(fams, P + "mode_info").samples
    prefetched = sglang_total(fams, "sglang:prefetched_tokens")
    run = Run(
        counters,
        causes,
        dict(mode),
        backuped,
        prefetched,
        frozenset(srv.l3_pages()),
        outputs,
    )
    # SGLang creates the series at its first counted hit, and it counts a hit only
    # while its request still waits (the recorder test): absent, none counted.
    run.prefetch_hit_tokens = srv.value("sglang:storage_prefetch_hit_tokens_total", absent_ok=True)
    if srv.spec.config and "recorder" in srv.spec.config:
        run.recorder_series = {
            name: {
                lab[key]: v for n, lab, v in family(fams, P + name).samples if n.endswith("_total")
            }
            for name, key in (("recorder_records", "kind"), ("recorder_dropped_records", "reason"))
        }
        lines = srv.log.read_text(errors="replace").splitlines()
        run.recorder_line = next((x for x in lines if "recording a trace" in x), "")
        run.workdir = srv.workdir
    return run


def read_trace_dir(directory: Path) -> list[dict[str, Any]]:
    """Every record of the recorder's files in ``directory``, headers first per file."""
    out: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            out += [json.loads(line) for line in f]
    return out


@pytest.fixture(scope="module", params=POLICIES)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Run, Run]]:
    """(policy, dedup off, dedup on): the same workload through two servers."""
    policy = request.param
    workdir: Path = tmp_path_factory.mktemp(f"cache-mode-{policy}")
    with launch_together([spec(policy, False), spec(policy, True)], workdir) as (off, on):
        outs: tuple[list[list[int]], list[list[int]]] = ([], [])
        side_by_side(lambda: serve(off, outs[0]), lambda: serve(on, outs[1]))
        assert len(outs[0]) == len(outs[1]) == WORKLOAD["conversations"] * WORKLOAD["turns"]
        runs = (settled(off, outs[0]), settled(on, outs[1]))
        for srv, run in zip((off, on), runs):
            # hicache-existence doctor as an operator runs it, on the settled server;
            # its evidence compared to the server's own series at once
            run.doctor = doctor(metrics_url(srv), "--interval", "1", "--json")
            run.evidence_compared = check_evidence_all(run.doctor, {metrics_url(srv): srv})
            assert "Traceback" not in srv.log.read_text(errors="replace"), srv.tail()
    for run in runs:  # the servers stopped: the recorder closed its last file
        if run.workdir is not None:
            run.trace = read_trace_dir(run.workdir / TRACE_DIR)
    print(f"\n{policy}: " + "; ".join(f"{k}={v}" for k, v in describe(*runs).items()))
    yield policy, *runs


def describe(off: Run, on: Run) -> dict[str, Any]:
    w_off, w_on = off.counters["written_pages"], on.counters["written_pages"]
    r_off, r_on = off.counters["redundant_written_pages"], on.counters["redundant_written_pages"]
    return {
        "written off/on": f"{w_off:.0f}/{w_on:.0f}",
        "redundant off/on": f"{r_off:.0f} ({r_off / max(w_off, 1):.1%})/{r_on:.0f}",
        "avoided on": f"{on.counters['write_avoided_pages']:.0f}",
        "files": len(off.files),
        "causes off": {k: int(v) for k, v in off.causes.items() if v},
        "prefetched tokens off/on": f"{off.prefetched_tokens:.0f}/{on.prefetched_tokens:.0f}",
    }


def test_counters_equal_sglangs_count_and_the_files_l3_created(pair) -> None:
    """Both servers: written = SGLang's backed-up pages = acknowledged (nothing
    failed); written - redundant = page files created; the causes add up to the
    redundant pages; mode_info names the mode, the policy and the dedup setting."""
    policy, off, on = pair
    for dedup, run in ((False, off), (True, on)):
        c = run.counters
        assert c["written_pages"] == run.backuped_pages == c["write_acknowledged_pages"], c
        assert c["write_failed_pages"] == 0, c
        assert c["written_pages"] - c["redundant_written_pages"] == len(run.files), c
        assert sum(run.causes.values()) == c["redundant_written_pages"], run.causes
        want = {"host_memory_mode": "cache", "write_policy": policy}
        want["cache_mode_dedup"] = "true" if dedup else "false"
        want["capacity_scope"] = "pool"  # sglang 0.5.23: a cap per pool
        assert {k: run.mode[k] for k in want} == want


def test_dedup_changes_no_output_and_no_page_in_l3(pair) -> None:
    """Dedup on and off: identical greedy outputs for every request and exactly
    the same pages in L3.  Under write_through some requests are served from L3 on
    both; write_back's host keeps what this workload comes back to, and selective
    writes too little to load back (how much each loads is timing: module
    docstring)."""
    policy, off, on = pair
    assert on.outputs == off.outputs
    assert on.files == off.files
    if policy == "write_through":
        assert off.prefetched_tokens > 0 and on.prefetched_tokens > 0


def test_dedup_removes_the_redundant_writes_it_was_told_about(pair) -> None:
    """With L2 pressure, cache mode without dedup writes pages L3 held; every one
    of them was believed stored (redundant_believed: what dedup would save).  With
    dedup on, believed pages are left out (avoided) and every page written is one
    L3 did not hold: written = the page files created, the same files as without
    dedup, redundant pages at most 0.5% of written (here none: one server, nothing
    forgotten by the cap).  Each server against its own truth: how many pages a
    server rewrites depends on its timing (module docstring)."""
    policy, off, on = pair
    c_off, c_on = off.counters, on.counters
    assert c_off["redundant_believed_pages"] == c_off["redundant_written_pages"]
    assert c_off["write_avoided_pages"] == 0
    assert c_on["redundant_written_pages"] <= 0.005 * c_on["written_pages"]
    assert c_on["redundant_written_pages"] == 0
    assert c_on["written_pages"] == len(on.files) == len(off.files)
    if policy != "write_through_selective":
        assert c_off["redundant_written_pages"] > 0, "the workload made no L2 pressure"
        assert c_on["write_avoided_pages"] > 0, "dedup left nothing out"


def test_causes_name_the_mechanism_of_each_write_policy(pair) -> None:
    """write_back rewrites the pages of nodes whose host copy was reclaimed while
    they lived on the device (the same node backed up twice); write_through
    rewrites recomputed prefixes (stored prefixes below the prefetch threshold,
    or recomputed with no prefetch asked)."""
    policy, off, _ = pair
    got = {k for k, v in off.causes.items() if v}
    if policy == "write_back":
        assert got == {"host_copy_reclaimed"}
    elif policy == "write_through":
        assert got and got <= {"below_prefetch_threshold", "recompute", "prefetch_shortfall"}
        assert "host_copy_reclaimed" not in got and "other_instance" not in got


def check_evidence_all(run: DoctorRun, servers: dict[str, Server]) -> int:
    assert run.code in (0, 1), run.out + run.err
    return sum(
        check_evidence(f, servers)
        for f in run.doc["findings"]
        if f["severity"] != "info" or f["id"] == "cache_mode_without_dedup"
    )


def test_doctor_names_cache_mode_without_dedup_where_it_rewrites(pair) -> None:
    """``hicache-existence doctor`` on both servers: the dedup-off server gets
    ``cache_mode_without_dedup`` (info, as its alert: a ticket) exactly where it rewrote more
    than the alert's share of its writes, with the pages dedup would have saved,
    and every evidence figure equal to the server's own series; the dedup-on
    server never gets it."""
    from hicache_existence.doctor.judgements import SETTINGS

    policy, off, on = pair
    assert off.doctor is not None and on.doctor is not None
    c = off.counters
    rewrites = (
        c["written_pages"] >= SETTINGS.min_written_pages
        and c["redundant_written_pages"] / c["written_pages"] > SETTINGS.cache_mode_redundant_ratio
    )
    found = off.doctor.findings("cache_mode_without_dedup")
    assert bool(found) == rewrites == (policy != "write_through_selective"), (policy, c)
    assert not on.doctor.findings("cache_mode_without_dedup"), on.doctor.out
    # The exit status from SGLang's own figures, not from the report: these servers
    # wrote nothing that failed, hold far fewer pages than the default cap and run no
    # reconciler or second rank, and cache mode's rewrites are a ticket (info), so
    # the one warning they can earn is L3 written and never read back (documented
    # rule: no prefetched token, no hit token, at least min_l3_tokens written), which
    # write_back's eviction-time writes earn on this workload.
    for run in (off, on):
        assert run.counters["write_failed_pages"] == 0, run.counters
        never_read = run.prefetched_tokens == 0 and run.prefetch_hit_tokens == 0
        warned = never_read and run.backuped_pages * PAGE >= SETTINGS.min_l3_tokens
        assert run.doctor is not None and run.doctor.code == (1 if warned else 0), run.doctor.out
    if found:
        (f,) = found
        assert f["severity"] == "info"
        assert f"dedup would have saved {c['redundant_believed_pages']:,.0f} pages" in f["summary"]
        assert any("cache_mode.dedup=true" in fix for fix in f["fix"]), f["fix"]
        assert off.evidence_compared >= 3, off.doctor.out


@pytest.mark.parametrize("pair", [RECORDED], indirect=True)  # the recorded pair only: no skip
def test_the_recorder_at_rate_1_records_every_write_and_every_l3_hit(pair) -> None:
    """Cache mode, every page recorded: the write records carry exactly the pages
    written (our counter, SGLang's backed-up pages) and, as a set, exactly the pages
    whose files L3 holds; the prefetch records' ``hit`` pages cover at least SGLang's
    own count of L3 hit tokens (it leaves out hits whose request already left), and
    every page a hit reports was written to this server's L3 before it.  The files
    are under the server's working directory, where the relative ``recorder.path``
    pointed, and the start-up line names that directory as an absolute path."""
    policy, off, on = pair
    assert policy == RECORDED
    for run in (off, on):
        assert run.trace is not None and run.workdir is not None
        trace_dir = run.workdir / TRACE_DIR
        assert f"to {trace_dir}/" in run.recorder_line, run.recorder_line
        headers = [r for r in run.trace if r.get("format") == "hicache-existence-trace"]
        assert headers and all(h["sample_rate"] == 1.0 for h in headers), headers
        assert {h["host_memory_mode"] for h in headers} == {"cache"}
        page = headers[0]["page_size"]
        assert page == PAGE
        records = [r for r in run.trace if "kind" in r]
        series = run.recorder_series or {}
        assert series["recorder_dropped_records"] == {"queue_full": 0.0, "write_error": 0.0}
        kinds = {k: sum(1 for r in records if r["kind"] == k) for k in series["recorder_records"]}
        assert kinds == series["recorder_records"]
        writes = [r for r in records if r["kind"] == "write"]
        written = [p for r in writes for p in r["pages"]]
        c = run.counters
        assert len(written) == c["written_pages"] == run.backuped_pages > 0
        assert set(written) == {name[:64] for name in run.files}
        prefetches = [r for r in records if r["kind"] == "prefetch"]
        assert all(0 <= r["hit"] <= len(r["pages"]) for r in prefetches)
        hit_pages = sum(r["hit"] for r in prefetches)
        # SGLang counts a rank-agreed hit only while its request still waits for the
        # prefetch (``_record_storage_prefetch_hit``; a request gone by the drain is
        # discarded uncounted: timing, and it may count none), the recorder every hit
        # query: at least as many, and some wherever SGLang loaded pages from L3.
        assert hit_pages * page >= run.prefetch_hit_tokens, (hit_pages, run.prefetch_hit_tokens)
        assert hit_pages > 0 < run.prefetched_tokens, (hit_pages, run.prefetched_tokens)
        seen: set[str] = set()
        for r in sorted(records, key=lambda r: r["timestamp"]):
            if r["kind"] == "write":
                seen.update(r["pages"])
            elif r["kind"] == "prefetch":
                assert set(r["pages"][: r["hit"]]) <= seen, r
