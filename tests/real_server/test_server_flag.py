"""The package in a real SGLang server: the flag, greedy correctness, a warm-L3 restart.

Three real servers share this module: ``enabled`` (``--enable-hicache-existence``),
``disabled`` (package installed, no flag) and, last, ``restarted`` (the flag, on the
L3 directory ``enabled`` left behind, started through ``hicache-existence launch``).
``enabled`` and ``disabled`` serve the same stream of trace requests twice, with a
device-cache flush between the passes so the second pass loads its prefixes back
from L3; ``restarted`` serves it once.

SGLang's file backend answers a write of a page it already holds with success and
leaves the file alone, so page files and their mtimes cannot show a rewrite: the
counters are held to SGLang's own ``sglang:backuped_tokens_total`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    LOAD_WHOLE,
    Server,
    ServerSpec,
    TraceRequest,
    delta,
    family,
    launch,
    launch_together,
    proc_view,
    sample_value,
    settle,
    side_by_side,
    trace_requests,
)

pytestmark = pytest.mark.real_server

UPSTREAM_CLASS = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"
MAX_NEW = 4
PAGE = 16
P = "hicache_existence_"
OURS = (
    "written_pages",
    "redundant_written_pages",
    "redundant_believed_pages",
    "write_avoided_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "page_inserts",
    "page_refreshes",
    "invalidations",
    "page_hits",
)


def counters(srv: Server, ours: bool = True) -> dict[str, float]:
    """SGLang's backed-up and prefetched pages and, with ``ours``, our counters
    (each family must be on /metrics: a missing one fails, never reads 0)."""
    fams = srv.metrics()
    out = {
        # SGLang creates these labelled series at the first backup / prefetch.
        "sglang_backuped_pages": sample_value(fams, "sglang:backuped_tokens_total", absent_ok=True)
        / PAGE,
        "sglang_prefetched_pages": sample_value(
            fams, "sglang:prefetched_tokens_total", absent_ok=True
        )
        / PAGE,
    }
    if ours:
        out.update({c: family(fams, P + c).total("_total") for c in OURS})
    return out


def stream() -> list[TraceRequest]:
    """The requests among the trace's first 140 that share their first block with
    another (11, in pairs and triples, as in the trace), 8-12 blocks of 32 tokens:
    every one reaches sglang's 256-token L3 prefetch threshold."""
    return trace_requests(limit=40, max_blocks=12, min_blocks=8, shared_only=True, window=140)


@dataclass
class Served:
    server: Server
    first: list[list[int]]
    second: list[list[int]]
    prefetched_tokens: float
    files_after_first: dict[str, int]
    files_after_second: dict[str, int]
    #: counters at start, after the first pass and after the second
    readings: dict[str, dict[str, float]]


def settled(srv: Server, ours: bool) -> dict[str, float]:
    srv.wait_writes_settled()
    return settle(lambda: counters(srv, ours))


def serve_twice(srv: Server, ours: bool) -> Served:
    reqs = stream()
    r = {"start": settled(srv, ours)}
    first = [srv.generate(r.input_ids, MAX_NEW) for r in reqs]
    r["first"] = settled(srv, ours)
    files_first = srv.l3_pages()
    srv.flush_cache()
    second = [srv.generate(r.input_ids, MAX_NEW) for r in reqs]
    r["second"] = settled(srv, ours)
    prefetched = PAGE * (
        r["second"]["sglang_prefetched_pages"] - r["first"]["sglang_prefetched_pages"]
    )
    return Served(srv, first, second, prefetched, files_first, srv.l3_pages(), r)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """The server with the flag and the one without, started side by side (one
    start-up's wall time), each serving the stream twice on its own L3."""
    workdir = tmp_path_factory.mktemp("flag")
    # Every prefetch loaded whole: the servers are compared on their prefetched pages,
    # and the restart below with a known count (best_effort cut its loads under a full
    # test run's load: 69 of 115).
    specs = [
        ServerSpec(existence=True, prefetch_policy=LOAD_WHOLE),
        ServerSpec(existence=False, prefetch_policy=LOAD_WHOLE),
    ]
    with launch_together(specs, workdir) as (on, off):
        with_flag, without = side_by_side(
            lambda: serve_twice(on, ours=True), lambda: serve_twice(off, ours=False)
        )
        yield with_flag, without


@pytest.fixture(scope="module")
def enabled(pair: tuple[Served, Served]) -> Served:
    return pair[0]


@pytest.fixture(scope="module")
def disabled(pair: tuple[Served, Served]) -> Served:
    return pair[1]


def our_samples(srv: Server) -> list[tuple[str, dict[str, str], float]]:
    return [s for fam in srv.metrics().values() for s in fam.samples if s[0].startswith("hicache_")]


def test_flag_puts_our_series_on_sglangs_metrics_with_the_servers_labels(enabled: Served) -> None:
    """With the flag the tree builds our class and SGLang's /metrics carries our
    series, labelled with the running server's model, engine type, rank and backend."""
    srv = enabled.server
    classes = {p["cache_class"] for p in srv.probes("tree")}
    assert classes and all(c.startswith("hicache_existence.") for c in classes), classes
    inserts = srv.samples("hicache_existence_page_inserts_total")
    assert inserts, "no hicache_existence_page_inserts_total on /metrics"
    labels = inserts[0][0]
    assert labels["model_name"] == "tiny-llama"
    assert labels["engine_type"] == "unified"
    assert labels["tp_rank"] == "0"
    assert labels["storage_backend"] == "file"
    assert labels["pool"] == "kv"


def test_both_passes_count_every_write_sglang_made_and_every_page_file(enabled: Served) -> None:
    """Both passes of the enabled server: written = acknowledged = SGLang's own
    backed-up pages, written - redundant = the page files created, nothing failed,
    and each page file's page was inserted into the beliefs exactly once."""
    d = delta(enabled.readings["second"], enabled.readings["start"])
    files = len(enabled.files_after_second)
    print(f"\nenabled, both passes: {d}, files {files}")
    assert d["written_pages"] == d["write_acknowledged_pages"] == d["sglang_backuped_pages"], d
    assert d["write_failed_pages"] == 0, d
    assert d["written_pages"] - d["redundant_written_pages"] == files > 0, d
    assert d["page_inserts"] == files, d


def test_without_flag_upstreams_class_no_series_same_outputs(
    enabled: Served, disabled: Served
) -> None:
    """Installed but not enabled: the tree builds upstream's class, /metrics has no
    hicache_existence series, and upstream's class makes the same decisions as
    ours: SGLang backs up and prefetches the same pages in both passes, and
    greedy outputs equal the enabled server's."""
    srv = disabled.server
    classes = {p["cache_class"] for p in srv.probes("tree")}
    assert classes == {UPSTREAM_CLASS}
    assert our_samples(srv) == []
    ours, theirs = (delta(s.readings["second"], s.readings["start"]) for s in (enabled, disabled))
    for key in ("sglang_backuped_pages", "sglang_prefetched_pages"):
        assert theirs[key] == ours[key] > 0, (key, theirs, ours)
    assert disabled.first == enabled.first


def test_greedy_outputs_equal_with_and_without_the_package_including_from_l3(
    enabled: Served, disabled: Served
) -> None:
    """Both passes (the second served from L3 after a device flush) give the same
    greedy tokens with and without the package, and equal each other."""
    for s in (enabled, disabled):
        assert s.prefetched_tokens > 0, "the second pass loaded nothing from L3"
        assert s.second == s.first
    assert enabled.second == disabled.second
    # L3 holds the real KV bytes (the D2H stand-in is a faithful copy): no page is all zeros.
    l3 = enabled.server.l3_dir
    assert all(any((l3 / name).read_bytes()) for name in sorted(enabled.files_after_second)[:20])
    # Same model, same pages: the L3 files are byte-for-byte the same set of names.
    assert set(enabled.files_after_second) == set(disabled.files_after_second)


def test_restart_through_the_launcher_on_warm_l3_loads_prefixes_and_rewrites_one_page_each(
    enabled: Served, tmp_path: Path
) -> None:
    """Restarted through ``hicache-existence launch -- <sglang args>`` on the same
    L3 directory: the launcher hands sglang its arguments without our flag and
    enables the package through the environment (our class in the tree). Each
    distinct prompt is loaded from L3 but for its last page (SGLang computes at
    least one token), which is written again: SGLang backs up exactly those
    pages, the backend already holds each (redundant, none believed: nothing
    taught the fresh beliefs about it), no page file appears; the beliefs learn
    the loaded pages at the fill and the rewritten ones at the ack, each once,
    and nothing is invalidated."""
    prompts = {r.input_ids for r in stream()}
    loaded = sum(len(ids) // PAGE - 1 for ids in prompts)
    l3 = enabled.server.l3_dir
    enabled.server.stop()
    before = set(enabled.server.l3_pages())
    with launch(
        ServerSpec(existence=True, l3_dir=l3, prefetch_policy=LOAD_WHOLE), tmp_path, launcher=True
    ) as srv:
        assert srv.proc is not None
        argv, env = proc_view(srv.proc.pid)  # exec: sglang runs in the launcher's process
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv
        assert "--enable-hicache-existence" not in argv, argv
        assert env.get("HICACHE_EXISTENCE_ENABLED") == "1"
        classes = {p["cache_class"] for p in srv.probes("tree")}
        assert classes and all(c.startswith("hicache_existence.") for c in classes), classes
        start = settled(srv, ours=True)
        outputs = [srv.generate(r.input_ids, MAX_NEW) for r in stream()]
        d = delta(settled(srv, ours=True), start)
        assert outputs == enabled.first
        files = set(srv.l3_pages())
    assert files == before
    assert d["sglang_prefetched_pages"] == loaded, d
    assert d["written_pages"] == d["sglang_backuped_pages"] == len(prompts), d
    assert d["write_acknowledged_pages"] == d["redundant_written_pages"] == len(prompts), d
    assert d["redundant_believed_pages"] == d["write_failed_pages"] == 0, d
    assert d["page_inserts"] == loaded + len(prompts), d
    assert d["invalidations"] == 0, d
