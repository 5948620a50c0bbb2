"""The trace recorder inside a real SGLang server, and the replay of what it recorded.

A real CPU ``sglang.launch_server`` (buffer mode, file backend, 16-token pages) with
``--enable-hicache-existence``, the recorder on at ``RATE`` and the capacity advisor
at sampling rate 1 (its curve is then exact: the yardstick), a small cap so that the
multi-turn workload's curve rises over 0.25x .. 8x of it.  After the workload the
recorder's files are replayed with ``hicache-existence replay`` and its recorded-stream
curves are compared with the advisor's ``hicache_existence_advisor_estimated_hit_ratio``
(and lookup) series at every multiplier: within 0.02 at the recorded rate.  The
recorder's own series (records by kind, no drops) and the trace's header (instance,
rate, page size) are checked against the server too, and its write records against
L3 itself: at rate 0.5 the pages recorded as written are, as a set, exactly the
page files of the L3 directory whose hash the sampling rule (docs/replay.md: the
hash's first 32 bits below rate x 2^32, computed here from that rule) selects.
(Exact counts at rate 1, and the prefetch records' hits against SGLang's own
count, are checked in cache mode: ``test_cache_mode.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Server, ServerSpec, conversation_requests, launch, settle

pytestmark = pytest.mark.real_server

P = "hicache_existence_"
REPO = Path(__file__).resolve().parents[2]
#: The recorder's sampling rate, and the cap the advisor's multipliers apply to.
RATE = 0.5
CAP = 512
MULTIPLIERS = ("0.25", "0.5", "1", "2", "4", "8")


def _advisor(srv: Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("advisor_estimated_hit_ratio", "advisor_estimated_lookup_hit_ratio"):
        out[name] = {
            lab["cap_multiplier"]: v for lab, v in srv.samples(P + name) if lab["pool"] == "kv"
        }
    out["capacity"] = {lab["pool"]: v for lab, v in srv.samples(P + "capacity_entries")}
    out["records"] = {lab["kind"]: v for lab, v in srv.samples(P + "recorder_records_total")}
    out["dropped"] = {
        lab["reason"]: v for lab, v in srv.samples(P + "recorder_dropped_records_total")
    }
    out["written"] = srv.value(P + "written_pages_total")
    out["failed"] = srv.value(P + "write_failed_pages_total")
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("recorder")
    trace_dir = root / "trace"
    config = {
        "cache": {"max_entries": CAP},
        "advisor": {"sampling_rate": 1.0},
        "recorder": {
            "enabled": True,
            "path": str(trace_dir),
            "sample_rate": RATE,
            "flush_interval_s": 0.25,
        },
        "metrics": {"flush_interval_s": 0.25},
    }
    turns = conversation_requests(conversations=20, turns=8)
    with launch(ServerSpec(config=config, max_total_tokens=16384), root / "server") as srv:
        for turn in turns:
            srv.generate(turn.input_ids, 2)
        srv.wait_writes_settled()
        seen = settle(lambda: _advisor(srv), quiet_s=2.0)
        port = srv.port
        l3 = sorted(srv.l3_pages())
        srv.stop()
        log = srv.log.read_text(errors="replace")
    yield {"advisor": seen, "trace": trace_dir, "root": root, "port": port, "turns": len(turns),
           "l3": l3, "log": log}  # fmt: skip


def _replay(trace: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "hicache_existence", "replay", str(trace), "--quiet", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        timeout=300,
    )


def test_the_recorder_wrote_a_trace_without_drops(recorded: dict[str, Any]) -> None:
    """The server's recorder series count records of every traffic kind and no drops,
    and its files name the instance (host:port and ranks), the rate and the page size."""
    seen = recorded["advisor"]
    assert seen["capacity"]["kv"] == CAP  # the cap the multipliers apply to
    assert seen["dropped"] == {"queue_full": 0.0, "write_error": 0.0}
    for kind in ("lookup", "add", "write", "request"):
        assert seen["records"][kind] > 0, kind
    files = sorted(recorded["trace"].glob("*.jsonl.gz"))
    assert files
    import gzip

    with gzip.open(files[0], "rt") as f:
        header = json.loads(f.readline())
    assert header["version"] == 2
    assert header["sample_rate"] == RATE
    assert header["page_size"] == 16
    assert header["instance"].endswith(f":{recorded['port']}-dp0-tp0-pp0")
    assert header["host_memory_mode"] == "buffer_only"


def _records(trace: Path) -> list[dict[str, Any]]:
    import gzip

    out: list[dict[str, Any]] = []
    for path in sorted(trace.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            out += [r for r in map(json.loads, f) if "kind" in r]
    return out


def test_write_records_are_the_sampled_pages_l3_holds(recorded: dict[str, Any]) -> None:
    """Every page file L3 holds whose hash the sampling rule selects was recorded
    as written, and nothing else was; every page a prefetch record reports as an
    L3 hit was recorded as written before it; the start-up line names the
    directory the files are in."""
    seen = recorded["advisor"]
    assert seen["failed"] == 0 and seen["written"] > 0
    records = _records(recorded["trace"])
    written = [p for r in records if r["kind"] == "write" for p in r["pages"]]
    assert sum(1 for r in records if r["kind"] == "write") == seen["records"]["write"]
    sampled = {
        name[:64] for name in recorded["l3"] if int(name[:8], 16) < RATE * 2**32
    }  # the documented rule, not the package's code
    assert sampled and set(written) == sampled
    assert 0 < len(written) < seen["written"]  # a sample, of every write
    recorded_written: set[str] = set()
    for r in sorted(records, key=lambda r: r["timestamp"]):
        if r["kind"] == "write":
            recorded_written.update(r["pages"])
        elif r["kind"] == "prefetch":
            assert 0 <= r["hit"] <= len(r["pages"]), r
            assert set(r["pages"][: r["hit"]]) <= recorded_written, r
    assert f"recording a trace (sample rate {RATE:g}) to {recorded['trace']}/" in recorded["log"]


def test_replayed_curve_agrees_with_the_advisor(recorded: dict[str, Any]) -> None:
    """``replay`` of the recorded trace gives, at every multiplier of the cap, the
    stream and lookup hit ratios the live advisor (sampling everything) exported,
    within 0.02 at the recorder's sampling rate."""
    root: Path = recorded["root"]
    caps = ",".join(str(int(CAP * float(m))) for m in MULTIPLIERS)
    done = _replay(recorded["trace"], root, "--model", "belief-only", "--caps", caps,
                   "--json", str(root / "replay.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((root / "replay.json").read_text())
    (curve,) = [c for c in report["recorded"]["curves"] if c["pool"] == "kv"]
    seen = recorded["advisor"]
    rows = []
    for m, stream, lookup in zip(MULTIPLIERS, curve["stream_hit_ratio"], curve["lookup_hit_ratio"]):
        adv_s = seen["advisor_estimated_hit_ratio"][m]
        adv_l = seen["advisor_estimated_lookup_hit_ratio"][m]
        rows.append((m, stream, adv_s, lookup, adv_l))
    print("\nmultiplier  replay stream  advisor stream  replay lookup  advisor lookup")
    for m, s, a, lk, al in rows:
        print(f"{m:>10} {s:14.4f} {a:15.4f} {lk:14.4f} {al:15.4f}")
    print(f"recorded references: {curve['recorded_references']:,}, events: {curve['events']}")
    for m, s, a, lk, al in rows:
        assert abs(s - a) <= 0.02, (m, s, a)
        assert abs(lk - al) <= 0.02, (m, lk, al)
    # The curve is not flat: the comparison covers a rising part.
    assert rows[-1][2] - rows[0][2] > 0.05


def test_replay_runs_the_model_and_the_fleet_on_the_recorded_requests(
    recorded: dict[str, Any],
) -> None:
    """The recorded trace's requests (one per insert walk) feed the buffer-mode model
    and the fleet mode: both exit 0 and count every request."""
    root: Path = recorded["root"]
    done = _replay(recorded["trace"], root, "--caps", "256,1K", "--no-plot", "--jobs", "1",
                   "--json", str(root / "model.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((root / "model.json").read_text())
    # Every prompt is inserted once its prefill ran (and again at its end).
    assert report["sweep"]["trace"]["requests"] >= recorded["turns"]
    done = _replay(recorded["trace"], root, "--fleet", "1,2", "--router", "round-robin",
                   "--learn-rate", "0", "--json", str(root / "fleet.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    fleet = json.loads((root / "fleet.json").read_text())
    assert fleet


def test_a_recorded_file_cut_in_a_flush_reads_up_to_the_flush_before(
    recorded: dict[str, Any],
) -> None:
    """A recorder file the server wrote, cut in the middle of its last compressed
    member (a kill mid-flush, or a file still being written): replay reads every
    complete flush before the cut (docs/replay.md), says what it left out in one
    warning line naming the file, and exits 0."""
    from hicache_existence.replay.trace import read_trace

    root: Path = recorded["root"]
    (first,) = sorted(recorded["trace"].glob("*.jsonl.gz"))[:1]
    cut = root / "cut.jsonl.gz"
    data = first.read_bytes()
    cut.write_bytes(data[: len(data) - 7])
    whole, kept = read_trace(first).events, read_trace(cut).events
    assert 0 < len(kept) < len(whole)
    assert [(e.kind, e.pages) for e in kept] == [(e.kind, e.pages) for e in whole[: len(kept)]]
    done = _replay(cut, root, "--model", "belief-only")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"warning: {cut}: the compressed file ends early" in done.stderr
