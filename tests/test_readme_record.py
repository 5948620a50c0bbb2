"""README's performance sentence states what its record holds
(``benchmarks/results/foundation.json``): re-recording the benchmark without
updating the README, or the reverse, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RECORD = json.loads((ROOT / "benchmarks" / "results" / "foundation.json").read_text())


def _speedups() -> dict[str, float]:
    return {c["scenario"]: c["speedup"] for c in RECORD["comparisons"]}


def _claim(pattern: str) -> tuple[str, ...]:
    text = " ".join(README.split())
    m = re.search(pattern, text)
    assert m, f"README no longer says {pattern!r}: update it and this test together"
    return m.groups()


def test_lookup_speedups_are_the_recorded_range() -> None:
    """README's "chain lookups A-Bx faster": the lowest and highest recorded lookup speed-up
    of either generation against its baseline (seed or upstream), to one decimal."""
    lookups = [
        v
        for k, v in _speedups().items()
        if not k.startswith("accounting.") and "add_steady" not in k
    ]
    low, high = _claim(r"chain lookups ([\d.]+)-([\d.]+)x faster than upstream's and the seed's")
    assert (low, high) == (f"{min(lookups):.1f}", f"{max(lookups):.1f}")


def test_add_speedups_and_memory_are_the_recorded_ones() -> None:
    """Steady-state adds against upstream and the seed, and memory per entry, are
    the record's figures (speed-ups to one decimal, memory ratios to two)."""
    s = _speedups()
    current, flat = _claim(
        r"steady-state adds ([\d.]+)x faster than upstream's and ([\d.]+)x than the seed's"
    )
    assert (current, flat) == (f"{s['current.add_steady']:.1f}", f"{s['flat.add_steady']:.1f}")
    memory = RECORD["memory"]
    upstream, seed = _claim(r"([\d.]+)x upstream's memory per entry and ([\d.]+)x the seed's")
    assert (upstream, seed) == (
        f"{memory['current.memory_per_entry']['ratio']:.2f}",
        f"{memory['flat.memory_per_entry']['ratio']:.2f}",
    )
