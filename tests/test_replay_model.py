"""The buffer-mode write-path model against an independent brute-force simulation
of the documented model (docs/replay.md): plain lists and loops, its own LRUs,
no cache classes.  Every counter must agree on random small traces and
deployments.  Also: the sweep (serial and over processes), the report files,
and the CLI end to end."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_replay_trace import mooncake, mooncake_trace, write_lines

from hicache_existence.cli import main
from hicache_existence.replay import report
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.model import ModelConfig, run_model
from hicache_existence.replay.pages import PageRequest, PageTrace, chunk_ends
from hicache_existence.replay.sweep import parse_caps, sweep

# ---------------------------------------------------------------------------
# the brute-force reference


class RefBeliefs:
    """One pool's beliefs per the API contract: LRU list (oldest first) + in-flight refs."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lru: list[str] = []
        self.refs: dict[str, int] = {}
        self.pages_checked = 0
        self.page_hits = 0
        self.evictions = 0
        self.invalidations = 0

    def _touch(self, h: str) -> None:
        self.lru.remove(h)
        self.lru.append(h)

    def add(self, hashes: list[str]) -> None:
        for h in hashes:
            if h in self.lru:
                self.lru.remove(h)
            self.lru.append(h)
        while len(self.lru) > self.cap:
            self.lru.pop(0)
            self.evictions += 1

    def covered(self, hashes: list[str]) -> bool:
        for h in hashes:
            self.pages_checked += 1
            if h in self.lru:
                self._touch(h)
                self.page_hits += 1
            elif self.refs.get(h, 0) > 0:
                pass  # a rescue: covered by an in-flight write
            else:
                return False
        return True

    def contains(self, h: str) -> bool:
        self.pages_checked += 1
        if h in self.lru:
            self._touch(h)
            self.page_hits += 1
            return True
        return False

    def track(self, hashes: list[str]) -> None:
        for h in hashes:
            self.refs[h] = self.refs.get(h, 0) + 1

    def untrack(self, hashes: list[str]) -> None:
        for h in hashes:
            if h in self.refs:
                self.refs[h] -= 1
                if self.refs[h] == 0:
                    del self.refs[h]

    def invalidate_beyond(self, hashes: list[str], keep: int) -> None:
        for h in hashes[keep:]:
            if h in self.lru:
                self.lru.remove(h)
                self.invalidations += 1


class RefLRU:
    """A plain LRU list of pages, oldest first; capacity 0 means unbounded."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.items: list[str] = []
        self.evictions = 0

    def touch(self, h: str) -> None:
        if h in self.items:
            self.items.remove(h)
        self.items.append(h)

    def evict(self) -> None:
        while self.cap and len(self.items) > self.cap:
            self.items.pop(0)
            self.evictions += 1


@dataclass
class RefPool:
    """One pool's full reference state."""

    beliefs: RefBeliefs
    device: RefLRU
    store: RefLRU
    writing: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)


def reference_model(
    requests: list[PageRequest], cap: int, cfg: ModelConfig, page_size: int
) -> dict[str, float]:
    """The documented write-path model, simulated the slow, obvious way."""
    pools: dict[str, RefPool] = {}
    acks: list[tuple[float, str, list[str]]] = []
    out = dict.fromkeys(
        (
            "writes_issued",
            "redundant_writes",
            "writes_avoided",
            "stale_skips",
            "dropped_writes",
            "device_hit_pages",
            "l3_hit_pages",
        ),
        0,
    )
    peak = 0

    def land(pool_name: str, keys: list[str]) -> None:
        p = pools[pool_name]
        for h in keys:
            if h in p.store.items:
                out["redundant_writes"] += 1
            p.store.touch(h)
        p.store.evict()
        p.beliefs.add(keys)
        p.beliefs.untrack(keys)
        for h in keys:
            p.writing[h] -= 1
            if not p.writing[h]:
                del p.writing[h]
        p.pending[keys[-1]] -= 1
        if not p.pending[keys[-1]]:
            del p.pending[keys[-1]]

    def entries() -> int:
        return sum(len(p.beliefs.lru) for p in pools.values())

    for req in requests:
        landed = False
        while acks and acks[0][0] <= req.timestamp_ms:
            _, name, keys = acks.pop(0)
            land(name, keys)
            landed = True
        if landed:
            peak = max(peak, entries())
        if req.pool not in pools:
            pools[req.pool] = RefPool(
                RefBeliefs(cap), RefLRU(cfg.device_pages), RefLRU(cfg.l3_pages)
            )
        p = pools[req.pool]
        pages = list(req.pages)
        matched = 0
        if cfg.device_pages:
            for h in pages:
                if h not in p.device.items:
                    break
                matched += 1
        out["device_hit_pages"] += matched
        rest = pages[matched:]
        if rest and len(rest) * page_size >= cfg.prefetch_threshold_tokens:
            hit = 0
            for h in rest:
                if h not in p.store.items:
                    break
                hit += 1
            for h in rest[:hit]:
                p.store.touch(h)  # the load reads them
            if cfg.heal:
                p.beliefs.invalidate_beyond(rest, hit)
                p.beliefs.add(rest[:hit])
            out["l3_hit_pages"] += hit
        start = 0
        parent_last = None
        for end in req.node_ends:
            keys = pages[start:end]
            start = end
            if not keys:
                continue
            if p.beliefs.covered(keys):
                out["writes_avoided"] += len(keys)
                if cfg.l3_pages:
                    out["stale_skips"] += sum(
                        1 for h in keys if h not in p.store.items and h not in p.writing
                    )
            elif parent_last is None or parent_last in p.pending or p.beliefs.contains(parent_last):
                p.beliefs.track(keys)
                for h in keys:
                    p.writing[h] = p.writing.get(h, 0) + 1
                p.pending[keys[-1]] = p.pending.get(keys[-1], 0) + 1
                out["writes_issued"] += len(keys)
                acks.append((req.timestamp_ms + cfg.ack_latency_ms, req.pool, keys))
            else:
                out["dropped_writes"] += len(keys)
            parent_last = keys[-1]
        if cfg.device_pages:
            for h in reversed(pages):
                p.device.touch(h)
            p.device.evict()
        peak = max(peak, entries())
    while acks:
        _, name, keys = acks.pop(0)
        land(name, keys)
    peak = max(peak, entries())
    checked = sum(p.beliefs.pages_checked for p in pools.values())
    hits = sum(p.beliefs.page_hits for p in pools.values())
    out["belief_hit_ratio"] = hits / checked if checked else 1.0
    out["evictions"] = sum(p.beliefs.evictions for p in pools.values())
    out["heal_invalidations"] = sum(p.beliefs.invalidations for p in pools.values())
    out["l3_evictions"] = sum(p.store.evictions for p in pools.values())
    out["peak_entries"] = peak
    return out


# ---------------------------------------------------------------------------
# random traces


def random_trace(
    rng: random.Random, requests: int = 60, pools: tuple[str, ...] = ("kv",)
) -> PageTrace:
    """Chains over a small set of prefixes, with divergence, repeats and bursts."""
    out = []
    t = 0.0
    for _ in range(requests):
        t += rng.choice([0.0, 0.0, 1.0, 5.0, 20.0])
        root = rng.randrange(5)
        length = rng.randint(0, 20)
        branch = rng.randrange(3)
        split = rng.randint(0, length)
        pages = [f"r{root}-{i}" for i in range(split)]
        pages += [f"r{root}-b{branch}-{i}" for i in range(split, length)]
        node_pages = rng.choice([1, 3, 4])
        out.append(
            PageRequest(t, rng.choice(pools), tuple(pages), chunk_ends(len(pages), node_pages))
        )
    return PageTrace("random", "pages", 64, tuple(out))


CONFIGS = [
    ModelConfig(),
    ModelConfig(device_pages=0),
    ModelConfig(device_pages=6, l3_pages=25, ack_latency_ms=3.0),
    ModelConfig(device_pages=10, l3_pages=12, ack_latency_ms=0.0, prefetch_threshold_tokens=0),
    ModelConfig(device_pages=4, l3_pages=30, ack_latency_ms=10.0, heal=False),
    ModelConfig(device_pages=30, l3_pages=0, ack_latency_ms=1.0, prefetch_threshold_tokens=512),
]

FIELDS = (
    "writes_issued",
    "redundant_writes",
    "writes_avoided",
    "stale_skips",
    "dropped_writes",
    "device_hit_pages",
    "l3_hit_pages",
    "evictions",
    "heal_invalidations",
    "l3_evictions",
    "peak_entries",
)


@pytest.mark.parametrize("config_index", range(len(CONFIGS)))
@pytest.mark.parametrize("seed", range(8))
def test_model_matches_brute_force(config_index: int, seed: int) -> None:
    """Every counter of run_model equals the brute-force simulation (random trace, caps 1..40)."""
    rng = random.Random(seed * 100 + config_index)
    cfg = CONFIGS[config_index]
    trace = random_trace(rng, pools=("kv", "swa") if seed % 2 else ("kv",))
    for cap in (1, 3, 8, 40):
        got = run_model(trace, cap, cfg)
        want = reference_model(list(trace.requests), cap, cfg, trace.page_size)
        for name in FIELDS:
            assert getattr(got, name) == want[name], (name, cap)
        assert got.belief_hit_ratio == pytest.approx(want["belief_hit_ratio"], abs=1e-12)
        assert got.page_references == sum(len(r.pages) for r in trace.requests)


def test_model_invariants_on_the_mooncake_trace() -> None:
    """Mooncake, unbounded L3: every distinct page is written once plus redundant rewrites, and
    nothing is stale; a bounded L3 creates stale beliefs that healing invalidates."""
    from hicache_existence.replay.pages import expand
    from hicache_existence.replay.trace import read_trace

    pages = expand(read_trace(mooncake_trace()))
    requests = PageTrace(pages.source, pages.format, pages.page_size, pages.requests[:1500])
    big = run_model(requests, 1 << 21)
    assert big.redundant_writes == 0
    assert big.stale_skips == 0
    assert big.writes_issued + big.writes_avoided == big.page_references
    small = run_model(requests, 4096, ModelConfig(device_pages=65536))
    assert small.redundant_writes > 0
    assert small.writes_issued == big.writes_issued + small.redundant_writes
    bounded = run_model(requests, 1 << 21, ModelConfig(l3_pages=20000, ack_latency_ms=50))
    assert bounded.l3_evictions > 0
    assert bounded.heal_invalidations > 0


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--caps", "0"), ("--device-pages", "-1"), ("--ack-latency-ms", "nan"), ("--jobs", "0")],
)
def test_model_rejects_bad_arguments(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad caps and configurations are refused at the edge (the CLI, exit 2) with
    the argument named; the model behind it trusts its typed callers."""
    with pytest.raises(SystemExit) as info:
        main(["replay", "trace.jsonl", flag, value, "--quiet"])
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# sweep, report, CLI


def test_parse_caps() -> None:
    """Cap lists and doubling ranges parse; nonsense is refused with the text quoted."""
    assert parse_caps("16K..128K") == (16384, 32768, 65536, 131072)
    assert parse_caps("1M, 64k,1M,100") == (100, 65536, 1 << 20)
    for bad in ("", "12X", "0", "2M..1M", "-5"):
        with pytest.raises(ValueError):
            parse_caps(bad)


@pytest.mark.multiprocess
def test_sweep_over_processes_equals_serial() -> None:
    """The model sweep gives identical rows whether run serially or over two processes."""
    trace = random_trace(random.Random(3), 80)
    caps = (2, 5, 13, 40)
    serial = sweep(trace, caps, jobs=1)
    parallel = sweep(trace, caps, jobs=2)
    strip = ("elapsed_s",)
    assert [
        {k: v for k, v in r.as_dict().items() if k not in strip} for r in serial.model_rows
    ] == [{k: v for k, v in r.as_dict().items() if k not in strip} for r in parallel.model_rows]
    assert [r.cap for r in serial.model_rows] == list(caps)


def test_report_json_table_and_plot(tmp_path: Path) -> None:
    """The JSON has every cap and field, the table marks the current cap, the PNG is written."""
    trace = random_trace(random.Random(4), 50)
    result = sweep(trace, (4, 8, 16), current_cap=8, jobs=1)
    table = report.format_table(result)
    assert "<- current cap" in table
    assert table.count("<- current cap") == 2  # belief-only and model tables
    report.write_json(result, tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == report.JSON_SCHEMA
    rows = doc["belief_only"]["kv"]["rows"]
    assert [r["cap"] for r in rows] == [4, 8, 16]
    assert {
        "belief_hit_ratio",
        "writes_issued",
        "redundant_writes",
        "writes_avoided",
        "stale_skips",
        "evictions",
        "memory_bytes",
    } <= set(rows[0])
    assert [r["cap"] for r in doc["buffer_model"]] == [4, 8, 16]
    require_matplotlib()
    assert report.write_plot(result, tmp_path / "r.png") is None
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_without_matplotlib_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib no PNG is written and the message says how to get one."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    trace = random_trace(random.Random(5), 10)
    result = sweep(trace, (4,), model="belief-only")
    message = report.write_plot(result, tmp_path / "r.png")
    assert message == report.NO_MATPLOTLIB
    assert "hicache-existence[plot]" in message
    assert not (tmp_path / "r.png").exists()


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """replay prints both tables and writes JSON and PNG into --out."""
    lines = [mooncake(i, 1024 if i % 2 else 600, 1, [i % 3, 10 + i % 4]) for i in range(30)]
    path = write_lines(tmp_path / "t.jsonl", lines)
    out = tmp_path / "out"
    code = main(
        [
            "replay",
            str(path),
            "--out",
            str(out),
            "--caps",
            "4,16,64",
            "--current-cap",
            "16",
            "--jobs",
            "1",
            "--quiet",
            "--device-pages",
            "8",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "belief-only, pool kv" in printed
    assert "buffer-mode write path (device 8 pages" in printed
    doc = json.loads((out / "replay.json").read_text())
    assert doc["caps"] == [4, 16, 64]
    assert doc["current_cap"] == 16
    assert (out / "replay.png").is_file() == _has_matplotlib()


def require_matplotlib() -> None:
    """Skip without matplotlib (fail under HICACHE_EXISTENCE_REQUIRE_ALL=1)."""
    if _has_matplotlib():
        return
    message = "matplotlib (the plot extra) is not installed"
    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_on_the_mooncake_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Done-when of issue #8: replay on the Mooncake trace prints the sweep and writes the plot."""
    code = main(
        [
            "replay",
            str(mooncake_trace()),
            "--out",
            str(tmp_path),
            "--caps",
            "16K,512K,2M",
            "--jobs",
            "2",
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "958,200 page references" in printed
    assert "512K" in printed and "<- current cap" in printed
    doc = json.loads((tmp_path / "replay.json").read_text())
    rows = {r["cap"]: r for r in doc["belief_only"]["kv"]["rows"]}
    assert rows[2 << 20]["belief_hit_ratio"] == pytest.approx(1 - 335388 / 958200)
    assert (tmp_path / "replay.png").is_file() or not _has_matplotlib()


def test_cli_on_a_page_trace_with_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A page-format trace with two pools: a curve and rows per pool, its declared page size."""
    rng = random.Random(9)
    lines = [json.dumps({"format": "hicache-existence-trace", "version": 1, "page_size": 16})]
    for i in range(40):
        pages = [f"{rng.randrange(30):064x}" for _ in range(rng.randint(1, 12))]
        lines.append(json.dumps({"timestamp": i, "pages": pages, "pool": "kv" if i % 2 else "swa"}))
    path = write_lines(tmp_path / "p.jsonl", lines)
    code = main(
        [
            "replay",
            str(path),
            "--out",
            str(tmp_path / "o"),
            "--caps",
            "4,8",
            "--current-cap",
            "8",
            "--jobs",
            "1",
            "--quiet",
            "--no-plot",
        ]
    )
    assert code == 0
    assert "page size 16 tokens" in capsys.readouterr().out
    doc = json.loads((tmp_path / "o" / "replay.json").read_text())
    assert set(doc["belief_only"]) == {"kv", "swa"}
    assert doc["trace"]["page_size"] == 16
    assert not (tmp_path / "o" / "replay.png").exists()


def test_l3_model_drops_evicts_and_tells_the_ledger() -> None:
    """The simulators' one L3 (``replay.l3``): every ``drop_every``-th write loses
    the oldest of the last 64 pages written, a redundant write refreshes, the
    capacity evicts the least recent, a read refreshes and a probe does not, and
    the ledger hears every page stored and removed."""
    log: list[tuple[str, str, tuple[str, ...]]] = []

    class Ledger:
        def record_stored(self, pool: str, pages: Sequence[str]) -> None:
            log.append(("stored", pool, tuple(pages)))

        def record_removed(self, pool: str, pages: Sequence[str]) -> None:
            log.append(("removed", pool, tuple(pages)))

    l3 = L3(3, drop_every=2, ledger=Ledger())
    assert l3.write("kv", ["a", "b", "c"]) == 0  # write 2 drops "a"
    assert l3.write("kv", ["b", "d", "e"]) == 1  # "b" again; "c" evicted
    assert (list(l3.held("kv")), l3.dropped, l3.evictions) == (["b", "d", "e"], 1, 1)
    assert log == [
        ("stored", "kv", ("a", "b", "c")),
        ("removed", "kv", ("a",)),
        ("stored", "kv", ("b", "d", "e")),
        ("removed", "kv", ("c",)),
    ]
    assert l3.leading("kv", ["b", "d", "x"], read=False) == 2
    assert list(l3.held("kv")) == ["b", "d", "e"]
    assert l3.leading("kv", ["b", "d", "x"]) == 2
    assert list(l3.held("kv")) == ["e", "b", "d"]
    unbounded = L3()
    assert unbounded.write("kv", ["a", "a", "b"]) == 1 and len(unbounded) == 2
