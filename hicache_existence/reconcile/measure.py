"""Side-by-side round-trip costs of the ledger's read methods against a real Redis.

``leading_present`` must cost one round trip per chain: a Lua script that walks
the chain server-side and stops at the first absent page, or one pipeline (GET
epoch + MGET of every key) cut client-side.  Both are measured interleaved call
by call (load on a shared machine hits them alike), as medians of wall time and
of the calling thread's CPU time (what the worker holds the GIL for); also the
write path's throughput.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_existence.reconcile.redis_truth import LedgerSettings, RedisLedger

CASES = ("all_present", "absent_first", "absent_half")


@dataclass(frozen=True)
class Row:
    pages: int
    case: str
    method: str
    median_us: float
    p90_us: float
    cpu_median_us: float


def page_chain(tag: str, n: int) -> list[str]:
    """``n`` deterministic page hashes (SGLang's form: 64 hex digits)."""
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def query_chains(full: list[str]) -> dict[str, list[str]]:
    """The chain each case of ``CASES`` queries, given ``full`` (all recorded)."""
    n = len(full)
    return {
        "all_present": full,
        "absent_first": ["absent-" + full[0], *full[1:]],
        "absent_half": [*full[: n // 2], "absent-half", *full[n // 2 + 1 :]],
    }


def measure_reads(
    url: str,
    sizes: Sequence[int] = (64, 256, 1024),
    reps: int = 50,
    namespace: str = "hicache-measure",
) -> list[Row]:
    """Lua vs pipeline ``leading_present`` per chain size and absence position."""
    ledgers = {
        m: RedisLedger(LedgerSettings(url, namespace=namespace, shard="m", method=m))
        for m in ("lua", "pipeline")
    }
    rows: list[Row] = []
    try:
        writer = ledgers["lua"]
        for n in sizes:
            full = page_chain(f"n{n}", n)
            writer.record_stored("kv", full)
            for case, c in query_chains(full).items():
                answers = {m: led.leading_present("kv", c) for m, led in ledgers.items()}
                if len(set(answers.values())) != 1:
                    raise AssertionError(f"methods disagree on {case}/{n}: {answers}")
                wall: dict[str, list[float]] = {m: [] for m in ledgers}
                cpu: dict[str, list[float]] = {m: [] for m in ledgers}
                for _ in range(reps):
                    for m, led in ledgers.items():
                        c0 = time.thread_time()
                        t0 = time.perf_counter()
                        led.leading_present("kv", c)
                        wall[m].append(time.perf_counter() - t0)
                        cpu[m].append(time.thread_time() - c0)
                for m in ledgers:
                    w = sorted(wall[m])
                    p90 = w[int(0.9 * (len(w) - 1))]
                    us = (statistics.median(w), p90, statistics.median(cpu[m]))
                    rows.append(Row(n, case, m, *(x * 1e6 for x in us)))
        writer.clear_shard()
    finally:
        for led in ledgers.values():
            led.close()
    return rows


def measure_writes(
    url: str, pages: int = 4096, ttl_s: float = 0.0, namespace: str = "hicache-measure"
) -> float:
    """Pages per second recorded by ``record_stored`` (pipelined batches)."""
    settings = LedgerSettings(url, namespace=namespace, shard="w", ttl_s=ttl_s)
    with contextlib.closing(RedisLedger(settings)) as led:
        c = page_chain(f"w{ttl_s}", pages)
        t0 = time.perf_counter()
        led.record_stored("kv", c)
        rate = pages / (time.perf_counter() - t0)
        led.clear_shard()
        return rate


def measure_memory(
    url: str,
    pages: int = 100_000,
    ttl_s: float = 0.0,
    shard: str = "llama-70b_3_8",
    namespace: str = "hicache-measure",
) -> float:
    """Redis ``used_memory`` bytes per ledger page entry (records ``pages`` pages
    in one shard, reads INFO before and after, then removes them)."""
    settings = LedgerSettings(url, namespace=namespace, shard=shard, ttl_s=ttl_s)
    with contextlib.closing(RedisLedger(settings)) as led:
        before = int(led._client.info("memory")["used_memory"])
        led.record_stored("kv", page_chain(f"m{ttl_s}", pages))
        after = int(led._client.info("memory")["used_memory"])
        led.clear_shard()
        return (after - before) / pages


def wait_ready(url: str, timeout_s: float) -> bool:
    """Whether the Redis at ``url`` answers PING within ``timeout_s``."""
    settings = LedgerSettings(url, socket_timeout_s=0.5, connect_timeout_s=0.5)
    with contextlib.closing(RedisLedger(settings)) as led:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if led.ping():
                return True
            time.sleep(0.02)
        return False


def format_rows(rows: Sequence[Row]) -> str:
    """A table: one line per (pages, case), Lua and pipeline side by side."""
    by = {(r.pages, r.case, r.method): r for r in rows}
    lines = [
        f"{'pages':>5} {'case':14} {'lua us':>9} {'pipeline us':>12} {'ratio':>6} "
        f"{'lua cpu us':>11} {'pipe cpu us':>12}",
    ]
    for pages, case in sorted({(r.pages, r.case) for r in rows}):
        lua, pipe = by[(pages, case, "lua")], by[(pages, case, "pipeline")]
        lines.append(
            f"{pages:>5} {case:14} {lua.median_us:9.0f} {pipe.median_us:12.0f} "
            f"{pipe.median_us / lua.median_us:6.2f} {lua.cpu_median_us:11.0f} "
            f"{pipe.cpu_median_us:12.0f}"
        )
    return "\n".join(lines)
