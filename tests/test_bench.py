"""The benchmark machinery: the accounting-free baseline and the CLI's record.

Timings are never asserted here (benchmarks report ratios; they are not timed
unit tests); these tests only keep the benchmark honest and runnable.
"""

from __future__ import annotations

import json
import subprocess
import sys

from hicache_existence_bench import noacct
from hicache_existence_bench.seed import SeedStorageExistenceCache


def test_stripped_classes_keep_the_data_path_and_drop_only_accounting():
    """The no-accounting copies behave exactly like the shipped classes (same LRU
    order) while every counter stays at zero, and statements were removed."""
    import hicache_existence as he

    assert noacct.removed_statement_count() > 20
    classes = noacct.stripped_classes()
    ours = he.StorageExistenceCache(3).pool("kv")
    bare = classes["StorageExistenceCache"](3).pool("kv")
    for pool in (ours, bare):
        pool.add(["a", "b", "c", "d"])
        pool.contains_all(["b", "x"])
        pool.invalidate_beyond(["c", "d"], 1)
    assert ours.lru_keys() == bare.lru_keys()
    assert ours.stats().page_hits == 1 and bare.stats().page_hits == 0
    flat = he.FlatStorageExistenceCache(3)
    bare_flat = classes["FlatStorageExistenceCache"](3)
    for cache in (flat, bare_flat):
        cache.add("kv", ["a", "b"])
        cache.add("swa", ["a", "c"])
    assert flat.lru_keys() == bare_flat.lru_keys()
    assert bare_flat.stats().total.inserts == 0


def test_seed_baseline_matches_the_flat_generation_on_a_mixed_stream():
    """The benchmark's seed baseline and our flat cache agree on state."""
    import hicache_existence as he

    seed, ours = SeedStorageExistenceCache(4), he.FlatStorageExistenceCache(4)
    ops = [
        ("add", "kv", list("abc")),
        ("add", "swa", list("ab")),
        ("all", "kv", list("ab")),
        ("inv", "kv", list("abc"), 1),
        ("add", "kv", list("de")),
    ]
    for op in ops:
        for cache in (seed, ours):
            if op[0] == "add":
                cache.add(op[1], op[2])
            elif op[0] == "all":
                cache.contains_all(op[1], op[2])
            else:
                cache.invalidate_beyond(op[1], op[2], op[3])
    assert list(seed._entries) == list(ours.lru_keys())


def test_bench_cli_quick_json_record_has_every_target():
    """`hicache-existence bench --quick --json` runs and reports every foundation
    target with its verdict (upstream marked unmeasured when sglang is absent)."""
    out = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    record = json.loads(out.stdout)
    names = {t["target"] for t in record["targets"]}
    assert {"flat.kv.contains_all", "flat.add_steady", "current.add_steady"} <= names
    assert all(isinstance(t["met"], bool) for t in record["targets"])
    assert record["memory"]["flat.memory_per_entry"]["ratio"] < 1.0


def test_bench_wired_foundation_runs_with_export_and_concurrent_scrapes():
    """`bench --wired`: our caches carry miss-reason memories, a feeder flushed
    every round and a scrape thread; the record says so and the scrapes ran."""
    out = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "bench", "--quick", "--wired", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    record = json.loads(out.stdout)
    assert record["config"]["wired"] is True
    assert record["wired"]["scrape_errors"] == 0
    assert record["index_backend"] in {"c", "python"}
    assert {t["target"] for t in record["targets"]} >= {"flat.add_steady", "current.add_steady"}


def test_advisor_bench_measures_the_attached_advisor_and_reports_targets():
    """A tiny run of the advisor suite: both sides timed, the advisor really attached
    (its samplers saw the step mix), and the verdicts carry the issue's targets."""
    from hicache_existence.replay.pages import PageTrace
    from hicache_existence.replay.synthetic import LongContextSpec, long_context_requests
    from hicache_existence_bench import advisor as bench

    requests = tuple(long_context_requests(LongContextSpec(requests=60, documents=20)))
    trace = PageTrace("synthetic", "page", 64, requests)
    cfg = bench.AdvisorBenchConfig(
        chain_sizes=(8,),
        rounds=1,
        queries_per_round=4,
        mix_rounds=1,
        current_cap=4096,
        accuracy_caps=(1024, 4096),
        accuracy_salts=0,
    )
    result = bench.run_advisor_bench(cfg, trace=trace)
    assert [c.scenario for c in result.per_operation] == ["advisor.attached.contains_all[8]"]
    mix = result.step_mix
    assert mix["operations"] > 0 and mix["sampled_references"] > 0
    assert mix["cache_us_per_step"] > 0 and mix["advisor_us_per_step"] > 0
    targets = {v["target"]: v for v in result.verdicts}
    assert targets["advisor.hot_path[step_mix]"]["bound"] == "<= 0.05"
    assert targets["advisor.accuracy[max_abs_error]"]["measured"]
    text = bench.format_advisor_bench(result)
    assert "with the advisor attached" in text
    json.dumps(result.as_dict())  # the record the CLI writes


def test_ab_trees_compares_two_trees_with_an_identical_copy_as_control(tmp_path):
    """``benchmarks/ab_trees.py`` imports each tree afresh in one process and reports
    every operation for the change (A/B) and for its control (A/A); a directory with
    no package is refused by name before anything runs."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = str(repo / "benchmarks" / "ab_trees.py")
    args = ["--quick", "--processes", "1", "--rounds", "1", "--reps", "1"]
    out = subprocess.run(
        [sys.executable, script, str(repo), str(repo), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines() if "[hot]" in line or "add_steady" in line]
    assert [r[0] for r in rows] == [
        "flat.second_pool.contains_all[hot]",
        "flat.second_pool.covers_all[hot]",
        "current.contains_all[hot]",
        "current.covered[hot]",
        "current.covered_inflight[hot]",
        "current.add_steady",
    ]
    assert all(len(r) == 5 and float(r[1]) > 0 and float(r[3]) > 0 for r in rows), out
    bad = subprocess.run(
        [sys.executable, script, str(tmp_path), str(repo), *args], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no hicache_existence package there" in bad.stderr
