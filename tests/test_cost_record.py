"""benchmarks/README.md's cost figures state what their record holds
(``benchmarks/results/cost.json``, issue 31): re-recording the cost benchmarks
without updating the README, or the reverse, fails here.  Not a timed test: the
figures are read, never measured."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8").split())
RECORD = json.loads((ROOT / "benchmarks" / "results" / "cost.json").read_text())


def _claim(pattern: str) -> tuple[str, ...]:
    m = re.search(pattern, README)
    assert m, f"benchmarks/README.md no longer says {pattern!r}: update it and this test together"
    return m.groups()


def test_the_record_names_its_commit_and_commands() -> None:
    """Every recorded run carries the command that made it; the record, its commit."""
    assert re.fullmatch(r"[0-9a-f]{40}", RECORD["commit"])
    for part in ("buffer", "cache", "step_hook"):
        assert RECORD[part]["command"].startswith("python benchmarks/"), part
    (commit,) = _claim(r"Recorded at commit `([0-9a-f]{7,40})`")
    assert RECORD["commit"].startswith(commit)


def test_buffer_mode_share_and_hook_are_the_recorded_ones() -> None:
    s = RECORD["buffer"]["summary"]
    share, top, hook = _claim(
        r"buffer mode \(`real_server_cost.py`\): the package's share of busy time ([\d.]+)% "
        r"\(median; at most ([\d.]+)%\), the per-step hook ([\d.]+) µs per polling iteration"
    )
    assert f"{share}%" == s["package_share_of_busy_median"]
    assert f"{top}%" == s["package_share_of_busy_max"]
    assert hook == f"{s['hook_us_per_poll_iteration_median']:.2f}"
    rounds, requests = _claim(r"buffer mode: (\d+) rounds of (\d+) requests")
    assert (int(rounds), int(requests)) == (s["rounds"], s["requests_per_round"])


def test_cache_mode_shares_are_the_recorded_ones() -> None:
    c = RECORD["cache"]
    for pressure in ("low", "high"):
        off, on = _claim(
            rf"{pressure} pressure, dedup off / on: ([\d.]+)% / ([\d.]+)% of busy time"
        )
        assert f"{off}%" == c[pressure]["off"]["package_share_of_busy_median"], pressure
        assert f"{on}%" == c[pressure]["on"]["package_share_of_busy_median"], pressure


def test_step_hook_is_the_recorded_one() -> None:
    (own,) = _claim(r"`step_hook.py`: (-?\d+) ns of our own per call")
    assert int(own) == round(RECORD["step_hook"]["own_ns_per_call"])


def test_ab_trees_rows_are_the_recorded_ones() -> None:
    """The before/after table of the foundation's hot paths (``ab_trees.py``)."""
    a = RECORD["ab_trees"]
    for op, v in a["A/B"].items():
        w = a["A/A"][op]
        row = (
            f"| `{op}` | {v['gmean']:.3f} [{v['min']:.3f}-{v['max']:.3f}] | "
            f"{w['gmean']:.3f} [{w['min']:.3f}-{w['max']:.3f}] |"
        )
        assert row in README, row


def test_events_share_is_the_recorded_one() -> None:
    """Storage-tier KV events' cost (issue 30 item 5): the difference of two servers' shares."""
    e = RECORD["events"]["summary"]
    feature, off, on = _claim(
        r"the feature's share of busy time ([\d.]+)% \(the difference of the two servers' "
        r"medians, ([\d.]+)% off and ([\d.]+)% on"
    )
    assert f"{feature}%" == e["feature_share_of_busy"]
    assert f"{off}%" == e["events_off"]["package_share_of_busy_median"]
    assert f"{on}%" == e["events_on"]["package_share_of_busy_median"]


def _buffer_pairs(x: dict[str, Any], tried: str, lead: str) -> list[dict[str, Any]]:
    """An experiment's two buffer runs and main's, whose shares (and in-situ shares) the
    README states after ``lead`` as "A and B of busy time against main's C and D (...)";
    returns the four summaries, the experiment's first."""
    shares = _claim(
        re.escape(lead) + r"([\d.]+)% and ([\d.]+)% of busy time against main's ([\d.]+)% and "
        r"([\d.]+)% \(([\d.]+)% and ([\d.]+)% against ([\d.]+)% and ([\d.]+)% in situ\)"
    )
    runs = [x[t][k]["summary"] for t in (tried, "main") for k in ("buffer", "buffer_repeat")]
    assert [f"{v}%" for v in shares[:4]] == [r["package_share_of_busy_median"] for r in runs]
    assert [f"{v}%" for v in shares[4:]] == [
        r["package_share_of_busy_insitu_timer_median"] for r in runs
    ]
    return runs


def _cache_pairs(
    x: dict[str, Any], tried: str, lead: str, run: str = "cache", against: str = "main"
) -> None:
    """An experiment's cache-mode shares and ``against``'s (``run``: which of their cache
    runs), which the README states after ``lead`` as "A / B (low pressure, dedup off / on)
    and C / D (high) against ..."."""
    cache = _claim(
        re.escape(lead) + r"([\d.]+)% / ([\d.]+)% \(low pressure, dedup off / on\) and "
        r"([\d.]+)% / ([\d.]+)% \(high\) against ([\d.]+)% / ([\d.]+)% and ([\d.]+)% / ([\d.]+)%"
    )
    recorded = [
        x[t][run][p][m]["package_share_of_busy_median"]
        for t in (tried, against)
        for p in ("low", "high")
        for m in ("off", "on")
    ]
    assert [f"{v}%" for v in cache] == recorded


def test_the_rejected_compiled_hooks_are_the_recorded_ones() -> None:
    """The experiment that did not land (compiled hooks and walk) against main then."""
    x = RECORD["compiled_hooks"]
    runs = _buffer_pairs(x, "compiled", "in buffer mode ")
    covered = _claim(r"`covered` ([\d.]+) and ([\d.]+) ms a round against ([\d.]+) and ([\d.]+);")
    by_fn = [r["package_ms_by_function_per_round"]["PoolBeliefs.covered"]["busy_ms"] for r in runs]
    assert [float(v) for v in covered] == by_fn
    _cache_pairs(x, "compiled", "in cache mode ")
    assert x["main"]["commit"] in README


#: Buffer mode's two per-admission hooks, which the prototype did not register.
HOOKS = ("_write_intents", "_backup_pool_keys")


def test_the_admission_prototype_is_the_recorded_one() -> None:
    """The measurement of buffer mode without its admission hooks (the prototype)."""
    x = RECORD["admission_without_hooks"]
    runs = _buffer_pairs(x, "prototype", "alternating on the quiet machine: ")
    ms = _claim(
        r"the package's time ([\d.]+) and ([\d.]+) ms a round against ([\d.]+) and ([\d.]+), "
        r"of which the two hooks were ([\d.]+) and ([\d.]+) ms"
    )
    assert [float(v) for v in ms[:4]] == [r["package_busy_ms_median"] for r in runs]
    hooks = [
        round(sum(r["package_ms_by_function_per_round"][f"hook:{h}"]["busy_ms"] for h in HOOKS), 3)
        for r in runs[2:]
    ]
    assert [float(v) for v in ms[4:]] == hooks
    for r in runs[:2]:  # the prototype registered neither hook
        assert not any(f"hook:{h}" in r["package_ms_by_function_per_round"] for h in HOOKS)
    assert x["main"]["commit"] in README and x["prototype"]["on"] == x["main"]["commit"]


def test_the_admission_tally_is_the_recorded_one() -> None:
    """Buffer mode counting admissions by the cache's tally, against its parent."""
    x = RECORD["admission_tally"]
    lead = f"its parent `{x['main']['commit']}` with the commands above, alternating on the "
    runs = _buffer_pairs(x, "tallied", lead + "quiet machine: ")
    ms = _claim(
        r"the package's time ([\d.]+) and ([\d.]+) ms a round against ([\d.]+) and ([\d.]+);"
    )
    assert [float(v) for v in ms] == [r["package_busy_ms_median"] for r in runs]
    hook = _claim(
        r"the per-step hook ([\d.]+) and ([\d.]+) µs per polling iteration against ([\d.]+) and "
        r"([\d.]+) \(([\d.]+) and ([\d.]+) in situ against ([\d.]+) and ([\d.]+)\)"
    )
    assert [float(v) for v in hook[:4]] == [
        round(r["hook_us_per_poll_iteration_median"], 2) for r in runs
    ]
    assert [float(v) for v in hook[4:]] == [
        round(r["hook_us_per_poll_iteration_insitu_median"], 2) for r in runs
    ]
    net = _claim(r"the package adds ([\d.]+)% and ([\d.]+)% against ([\d.]+)% and ([\d.]+)%\)")
    assert [f"{v}%" for v in net] == [
        r["package_share_of_busy_net_of_replaced_cache_median"] for r in runs
    ]
    _cache_pairs(x, "tallied", "did not move: ")
    for r in runs[:2]:  # neither admission hook ran where the tally counts
        assert not any(f"hook:{h}" in r["package_ms_by_function_per_round"] for h in HOOKS)
    for r in runs[2:]:
        assert all(f"hook:{h}" in r["package_ms_by_function_per_round"] for h in HOOKS)
    assert f"Built in `{x['tallied']['commit']}`" in README


def test_the_lighter_paths_are_the_recorded_ones() -> None:
    """The prefetch chain in one store and cache mode's lighter node write, against
    their parent: both modes, two runs of each tree."""
    x = RECORD["lighter_paths"]
    lead = f"its parent `{x['main']['commit']}` with the commands above, alternating on the "
    runs = _buffer_pairs(x, "lighter", lead + "quiet machine: ")
    ms = _claim(
        r"the package's time ([\d.]+) and ([\d.]+) ms a round against ([\d.]+) and ([\d.]+), "
        r"the prefetch result hook ([\d.]+) and ([\d.]+) against ([\d.]+) and ([\d.]+);"
    )
    assert [float(v) for v in ms[:4]] == [r["package_busy_ms_median"] for r in runs]
    prefetch = [
        r["package_ms_by_function_per_round"]["hook:_handle_prefetch_result"]["busy_ms"]
        for r in runs
    ]
    assert [float(v) for v in ms[4:]] == prefetch
    _cache_pairs(x, "lighter", "the first pair: ")
    _cache_pairs(x, "lighter", "the second pair: ", run="cache_repeat")
    node = _claim(
        r"the node write hook \(`hook:write_storage`, low pressure, first pair\) (\d+\.\d+) / "
        r"(\d+\.\d+) ms a round against (\d+\.\d+) / (\d+\.\d+)"
    )
    assert [float(v) for v in node] == [
        x[t]["cache"]["low"][m]["package_ms_by_function_per_round"]["hook:write_storage"]["busy_ms"]
        for t in ("lighter", "main")
        for m in ("off", "on")
    ]
    assert f"Built in `{x['lighter']['commit']}`" in README


def test_the_node_write_trim_and_the_unwrapped_cache_are_the_recorded_ones() -> None:
    """Cache mode's lighter node write and ack against their parent, and the same code
    measured with and without the probe wrapping the cache's methods."""
    x = RECORD["node_write_trim"]
    assert f"against its parent `{x['main']['commit']}`" in README
    assert f"so `{x['trimmed']['commit']}` runs less of it" in README
    _cache_pairs(x, "trimmed", "trimmed, first runs: ")
    _cache_pairs(x, "trimmed", "trimmed, second runs: ", run="cache_repeat")
    runs = [x[t][r] for t in ("trimmed", "main") for r in ("cache", "cache_repeat")]
    insitu = [
        float(run[p][m]["package_share_of_busy_insitu_timer_median"].rstrip("%"))
        for run in runs
        for p in ("low", "high")
        for m in ("off", "on")
    ]
    lo, hi, main_lo, main_hi = _claim(
        r"\(([\d.]+)% to ([\d.]+)% in situ against ([\d.]+)% to ([\d.]+)%\)\. The node write"
    )
    assert (float(lo), float(hi)) == (min(insitu[:8]), max(insitu[:8]))
    assert (float(main_lo), float(main_hi)) == (min(insitu[8:]), max(insitu[8:]))
    node = _claim(
        r"\(([\d.]+) to ([\d.]+) ms a round in the first runs against ([\d.]+) to ([\d.]+)\)"
    )
    by_tree = [
        [
            x[t]["cache"][p][m]["package_ms_by_function_per_round"]["hook:write_storage"]["busy_ms"]
            for p in ("low", "high")
            for m in ("off", "on")
        ]
        for t in ("trimmed", "main")
    ]
    assert [float(v) for v in node] == [f(ms) for ms in by_tree for f in (min, max)]
    gross = [
        float(run[p][m]["package_share_of_busy_median"].rstrip("%"))
        for run in runs[:2]
        for p in ("low", "high")
        for m in ("off", "on")
    ]
    met, low, high = _claim(r"gross, (\d) of its 8 medians do \(([\d.]+)-([\d.]+)%\)")
    assert (int(met), float(low), float(high)) == (
        sum(g <= 0.3 for g in gross),
        min(gross),
        max(gross),
    )
    a = x["apparatus"]
    _cache_pairs(a, "unwrapped", "without the wrappers, first runs: ", against="wrapped")
    _cache_pairs(
        a, "unwrapped", "without them, second runs: ", run="cache_repeat", against="wrapped"
    )
