"""The package in a real SGLang server: the flag, greedy correctness, a warm-L3 restart.

Three real servers share this module: ``enabled`` (``--enable-hicache-existence``),
``disabled`` (package installed, no flag) and, last, ``restarted`` (the flag, on the
L3 directory ``enabled`` left behind). Each serves the same stream of trace requests
twice, with a device-cache flush between the passes so the second pass loads its
prefixes back from L3.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Server, ServerSpec, TraceRequest, launch, trace_requests

pytestmark = pytest.mark.real_server

UPSTREAM_CLASS = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"
MAX_NEW = 4


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


def serve_twice(srv: Server) -> Served:
    reqs = stream()
    first = [srv.generate(r.input_ids, MAX_NEW) for r in reqs]
    srv.wait_writes_settled()
    files_first = srv.l3_pages()
    srv.flush_cache()
    before = srv.value("sglang:prefetched_tokens_total")
    second = [srv.generate(r.input_ids, MAX_NEW) for r in reqs]
    srv.wait_writes_settled()
    prefetched = srv.value("sglang:prefetched_tokens_total") - before
    return Served(srv, first, second, prefetched, files_first, srv.l3_pages())


@pytest.fixture(scope="module")
def enabled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launch(ServerSpec(existence=True), tmp_path_factory.mktemp("enabled")) as srv:
        yield serve_twice(srv)


@pytest.fixture(scope="module")
def disabled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launch(ServerSpec(existence=False), tmp_path_factory.mktemp("disabled")) as srv:
        yield serve_twice(srv)


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
    # The beliefs saw every page the server wrote (page files created by this server).
    assert sum(v for _, v in inserts) >= len(enabled.files_after_second) > 0


def test_without_flag_upstreams_class_no_series_same_outputs(
    enabled: Served, disabled: Served
) -> None:
    """Installed but not enabled: the tree builds upstream's class, /metrics has no
    hicache_existence series, and greedy outputs equal the enabled server's."""
    srv = disabled.server
    classes = {p["cache_class"] for p in srv.probes("tree")}
    assert classes == {UPSTREAM_CLASS}
    assert our_samples(srv) == []
    assert srv.value("sglang:backuped_tokens_total") > 0  # buffer mode did run
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


def test_restart_on_warm_l3_loads_prefixes_learns_beliefs_and_rewrites_nothing(
    enabled: Served, tmp_path: Path
) -> None:
    """After a restart on the same L3 directory, repeated prefixes are loaded from
    L3, the beliefs learn them from the fill, and no page file is written again."""
    l3 = enabled.server.l3_dir
    enabled.server.stop()
    before = {p.name: p.stat().st_mtime_ns for p in l3.iterdir()}
    with launch(ServerSpec(existence=True, l3_dir=l3), tmp_path) as srv:
        reqs = stream()
        outputs = [srv.generate(r.input_ids, MAX_NEW) for r in reqs]
        srv.wait_writes_settled()
        assert outputs == enabled.first
        assert srv.value("sglang:prefetched_tokens_total") > 0
        assert srv.value("hicache_existence_page_inserts_total") > 0
        assert srv.value("hicache_existence_page_hits_total") > 0
        after = {p.name: p.stat().st_mtime_ns for p in l3.iterdir()}
    assert after == before, "page files were created or rewritten after the restart"
