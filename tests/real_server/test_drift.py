"""Upstream drift in real SGLang servers: one changed upstream API per server.

The package patches SGLang's internals by name (``write_hooks.HOOKS``, the REPLACE of
the existence cache, ``conformance.py``). A release that renames a hooked method,
renames a parameter a hook reads, or adds a method to its existence cache that
its scheduler calls must never cost a request or a wrong figure. Each drift server
here is a real sglang 0.5.23 server with the package on and one such change made
inside its processes (``standins/hx_drift.py``, selected by ``HX_DRIFT`` in
``ServerSpec.env``; upstream's own callers keep working, so only the package's
view of the API changes):

``write_intents_renamed`` (buffer mode)
    ``BufferModePipeline._write_intents``, a required buffer-mode hook target, renamed.
``write_backup_storage_renamed`` (cache mode)
    ``UnifiedRadixCache.write_backup_storage``, cache mode's node write, renamed.
``write_storage_param_renamed`` (cache mode, and again on a buffer-mode server)
    ``HybridCacheController.write_storage``'s ``hash_value`` renamed (the controller
    every tree of 0.5.21-0.5.23 writes L3 through). On the buffer-mode server only
    cache mode's accounting stops: there the write counters must stay, and be exact.
``beliefs_method_added`` (buffer mode)
    ``PoolExistenceBeliefs.hx_future_sweep`` added and called by the scheduler on
    its tree's existence cache every event-loop iteration.

For each: the server starts and serves the workload with exactly the greedy
outputs of a server without the package (``existence=False``, same seed so the
same dummy weights; one such baseline serves every case), its log has no
traceback and exactly one package warning (a probe counts the package loggers'
records at WARNING and above), which names the changed target and what stops;
and each of our write counters is either absent from ``/metrics`` or equal to
the truth the test reads without it: SGLang's own
``sglang:backuped_tokens_total`` / page size (written, acknowledged), the page
files the file backend created (written - redundant; the backend skips a page
whose file exists), and no failed write. A mode whose write path lost a hook
has its write families absent, all of them; on the buffer-mode server whose
cache is still ours, the beliefs upstream's pipeline adds at its acks are still
exact (pages first believed = page files). The added method keeps upstream's
class: the scheduler's call answers, and none of our series exists.

Workload (per server, in order; small: the start-ups' wall time matters
more): prompt A (10 pages), flush, A+B (20 pages: a node spanning stored and new
pages, written again whole), flush, A+B again (320 tokens: at SGLang's prefetch
threshold, so it is loaded from L3), then 8 requests of the Mooncake trace
(shared prefixes). Two batches of three servers, each started side by side:
the baseline with two buffer-mode drift servers, then the two cache-mode ones and
the buffer-mode server whose change is cache mode's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    OURS,
    WRITE_PAGES,
    Server,
    ServerSpec,
    block_tokens_for,
    launch_together,
    settle,
    sglang_total,
    side_by_side,
    trace_requests,
)

pytestmark = [pytest.mark.real_server]

PAGE = 16
PIPELINE = "sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline"
TREE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
HYBRID = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
BELIEFS = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.PoolExistenceBeliefs"
UPSTREAM_CACHE = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"


@dataclass(frozen=True)
class Case:
    drift: str  # HX_DRIFT (standins/hx_drift.py)
    mode: str  # --hicache-host-memory-mode
    #: The target the warning must name, and what it must say stops.
    target: str
    stops: str
    #: Whether our cache replaces upstream's (False: the plugin stays out).
    ours: bool = True
    #: Whether this server's mode keeps its write accounting (the change is in the
    #: other mode's write path): its write families must be there, and exact.
    counts: bool = False


CASES: dict[str, Case] = {
    "write_intents_renamed": Case(
        "write_intents_renamed",
        "buffer_only",
        f"{PIPELINE}._write_intents",
        "buffer-mode write counters (buffer_only servers) are off",
    ),
    "write_backup_storage_renamed": Case(
        "write_backup_storage_renamed",
        "cache",
        f"{TREE}.write_backup_storage",
        "cache-mode write counters and dedup (cache-mode servers) are off",
    ),
    "write_storage_param_renamed": Case(
        "write_storage_param_renamed",
        "cache",
        f"{HYBRID}.write_storage",
        "cache-mode write counters and dedup (cache-mode servers) are off",
    ),
    # The same change on a buffer-mode server: only cache mode's accounting stops.
    "write_storage_param_renamed_on_buffer": Case(
        "write_storage_param_renamed",
        "buffer_only",
        f"{HYBRID}.write_storage",
        "cache-mode write counters and dedup (cache-mode servers) are off",
        counts=True,
    ),
    "beliefs_method_added": Case(
        "beliefs_method_added",
        "buffer_only",
        f"{BELIEFS.rsplit('.', 1)[1]}.hx_future_sweep",
        "upstream's StorageExistenceCache stays, the plugin stays inactive",
        ours=False,
    ),
}
BATCHES: tuple[tuple[str | None, ...], ...] = (
    (None, "write_intents_renamed", "beliefs_method_added"),
    (
        "write_backup_storage_renamed",
        "write_storage_param_renamed",
        "write_storage_param_renamed_on_buffer",
    ),
)


def spec(case: str | None) -> ServerSpec:
    if case is None:
        return ServerSpec(existence=False)
    return ServerSpec(host_memory_mode=CASES[case].mode, env={"HX_DRIFT": CASES[case].drift})


def workload() -> list[list[int]]:
    a = block_tokens_for(1, PAGE * 10, salt="drift")
    b = block_tokens_for(2, PAGE * 10, salt="drift")
    trace = [list(r.input_ids) for r in trace_requests(limit=8, block_tokens=32, max_blocks=6)]
    return [a, a + b, a + b, *trace]


#: Requests after which the device tree is flushed (A, then the first A+B).
FLUSH_AFTER = (0, 1)


@dataclass
class Run:
    outputs: list[list[int]]
    #: Our write counters (summed over pools); ``None``: the family is not on /metrics.
    counters: dict[str, float | None]
    ours_families: frozenset[str]
    #: ``hicache_existence_page_inserts_total`` (``None``: not on /metrics).
    page_inserts: float | None
    backuped_pages: float
    prefetched_pages: float
    files: int
    log: str
    srv: Server


def _reading(srv: Server) -> tuple[dict[str, float | None], float, int]:
    fams = srv.metrics()
    counters: dict[str, float | None] = {}
    for name in WRITE_PAGES:
        fam = fams.get(OURS + name)
        counters[name] = None if fam is None else fam.total("_total", absent_ok=True)
    return counters, sglang_total(fams, "sglang:backuped_tokens") / PAGE, len(srv.l3_pages())


def serve(srv: Server) -> Run:
    outputs = []
    for i, ids in enumerate(workload()):
        outputs.append(srv.generate(ids, max_new_tokens=4))
        if i in FLUSH_AFTER:
            srv.flush_cache()
    srv.wait_writes_settled(quiet_s=2.0)
    counters, backuped, files = settle(lambda: _reading(srv), quiet_s=3.0)
    fams = srv.metrics()
    inserts = fams.get(OURS + "page_inserts")
    return Run(
        outputs,
        counters,
        frozenset(n for n in fams if n.startswith(OURS)),
        None if inserts is None else inserts.total("_total"),
        backuped,
        sglang_total(fams, "sglang:prefetched_tokens") / PAGE,
        files,
        srv.log.read_text(errors="replace"),
        srv,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Run]:
    """Every server's run; ``None`` is the baseline without the package."""
    workdir: Path = tmp_path_factory.mktemp("drift")
    out: dict[str | None, Run] = {}
    for n, batch in enumerate(BATCHES):
        with launch_together([spec(c) for c in batch], workdir / str(n)) as servers:
            done = side_by_side(*(lambda s=s: serve(s) for s in servers))
        out.update(zip(batch, done))
    for case, run in out.items():
        c = run.counters
        print(
            f"\n{case}: backuped={run.backuped_pages:.0f} files={run.files} "
            f"prefetched={run.prefetched_pages:.0f} "
            + " ".join(f"{k}={'absent' if v is None else f'{v:.0f}'}" for k, v in c.items())
        )
    return out


def exact_or_absent(run: Run) -> dict[str, tuple[float, float]]:
    """Our write counters present on /metrics that differ from the truth: {name:
    (counter, truth)}. Truth: SGLang's backed-up pages (written, acknowledged), no
    failure, and written - files for the redundant pages."""
    truth = {
        "written_pages": run.backuped_pages,
        "write_acknowledged_pages": run.backuped_pages,
        "write_failed_pages": 0.0,
        "redundant_written_pages": run.backuped_pages - run.files,
    }
    return {
        name: (value, truth[name])
        for name, value in run.counters.items()
        if name in truth and value is not None and value != truth[name]
    }


CASE_IDS = list(CASES)


def test_baseline_wrote_and_loaded_l3(runs: dict[str | None, Run]) -> None:
    """The workload reaches L3 both ways on the server without the package (SGLang
    wrote pages and loaded A+B back), and that server has none of our series."""
    base = runs[None]
    assert base.backuped_pages > 0 and base.files > 0, base
    assert base.prefetched_pages > 0, base
    assert not base.ours_families, base.ours_families


@pytest.mark.parametrize("case", CASE_IDS)
def test_same_outputs_as_without_the_package(runs: dict[str | None, Run], case: str) -> None:
    """Every request served, with the baseline's greedy outputs; no traceback."""
    run = runs[case]
    assert run.outputs == runs[None].outputs
    assert "Traceback" not in run.log, run.srv.tail()
    assert run.backuped_pages > 0 and run.files > 0


@pytest.mark.parametrize("case", CASE_IDS)
def test_one_warning_names_the_target_and_what_stops(
    runs: dict[str | None, Run], case: str
) -> None:
    """Exactly one package warning in the whole server log; it names the changed
    target and what stops being counted (the drift was applied in the scheduler)."""
    run, want = runs[case], CASES[case]
    assert run.srv.probes("drift"), "the change was not applied"
    warned = [w["message"] for w in run.srv.probes("hx_warning")]
    assert len(warned) == 1, warned
    assert want.target in warned[0] and want.stops in warned[0], warned[0]
    printed = [
        line
        for line in run.log.splitlines()
        if warned[0] in line and not line.startswith("HX-PROBE")
    ]
    assert len(printed) == 1, printed  # what an operator reads, once
    print(f"\n{case}: {printed[0]}")


@pytest.mark.parametrize("case", CASE_IDS)
def test_counters_exact_or_absent(runs: dict[str | None, Run], case: str) -> None:
    """Each of our write counters is absent from /metrics or equals the truth: all
    absent where the server's mode lost its write path (or the plugin stayed out),
    all present and exact where the change is in the other mode's path."""
    run = runs[case]
    assert exact_or_absent(run) == {}, run.counters
    present = {name for name, value in run.counters.items() if value is not None}
    assert present == (set(WRITE_PAGES) if CASES[case].counts else set()), run.counters


@pytest.mark.parametrize("case", [c for c in CASE_IDS if CASES[c].mode == "buffer_only"])
def test_buffer_mode_beliefs_stay_exact(runs: dict[str | None, Run], case: str) -> None:
    """Buffer mode: upstream's pipeline adds a write's pages to the beliefs at its
    ack whatever the write hooks do, so where our cache is installed the pages
    first believed are the page files L3 holds; where it is not, none of our
    series exists."""
    run = runs[case]
    if CASES[case].ours:
        assert run.page_inserts == run.files, (run.page_inserts, run.files)
    else:
        assert run.page_inserts is None and not run.ours_families, run.ours_families


def test_added_method_answers_from_upstreams_cache(runs: dict[str | None, Run]) -> None:
    """The scheduler's every-iteration call reached upstream's own class (ours is
    not installed): no series of ours at all."""
    run = runs["beliefs_method_added"]
    calls = run.srv.probes("drift_call")
    assert calls, "the scheduler never called hx_future_sweep"
    assert calls[0]["cache_class"] == UPSTREAM_CACHE, calls
    assert calls[0]["answer"] == "upstream's sweep", calls
    assert not run.ours_families, run.ours_families
