"""The ledger on Redis Cluster against a standalone Redis, side by side.

Starts its own servers on free loopback ports (a 3-primary + 3-replica cluster
and one standalone redis-server; needs ``redis-server`` and ``redis-cli``) and
measures, interleaved call by call so the shared machine's load hits every way
alike (medians):

1. **the chain query, both key designs** on the cluster:
   * ``hashtag-lua``: the shipped design, every key of a (shard, pool) under one
     hash tag, one Lua call that stops at the first absent page;
   * ``hashtag-lua-keys``: the same with every page key declared in KEYS (the
     strict reading of the scripting rules);
   * ``slots-exists``: keys spread over every slot (the standalone schema), one
     cluster pipeline of GET epoch + EXISTS per key, grouped per node by redis-py,
     the count cut client-side;
   * ``slots-mget``: the same keys through ``mget_nonatomic`` (one MGET per slot);
2. **recording and verification throughput per page**, the shipped cluster
   ledger against the shipped standalone ledger.

    python benchmarks/ledger_cluster.py [--reps 30] [--json benchmarks/results/ledger_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reconcile_redis_server import RedisServer
from redis_cluster_server import RedisCluster

from hicache_existence.reconcile.ledgers import open_ledger
from hicache_existence.reconcile.measure import CASES, page_chain, query_chains
from hicache_existence.reconcile.redis_truth import LUA_LEADING_PRESENT, LedgerSettings

SIZES = (64, 256, 1024)
#: The scripting rules' strict form: every key declared, the epoch first.
LUA_DECLARED = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {false, 0} end
local n = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then break end
  n = n + 1
end
return {epoch, n}
"""


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def interleaved(ways: dict[str, Callable[[], int]], reps: int) -> dict[str, float]:
    """Median wall time (µs) of each way, called in turn ``reps`` times (the
    order rotates every round, so no way always follows the same one)."""
    wall: dict[str, list[float]] = {w: [] for w in ways}
    names = list(ways)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = ways[name]
            t0 = time.perf_counter()
            call()
            wall[name].append(time.perf_counter() - t0)
    return {w: median_us(s) for w, s in wall.items()}


def chain_query(cluster_url: str, reps: int) -> list[dict[str, Any]]:
    """The four ways to answer "how many leading pages are present" on a cluster."""
    led = open_ledger(LedgerSettings(cluster_url, namespace="bench", shard="q"))
    client = led._lazy.get()  # type: ignore[attr-defined]
    declared = client.register_script(LUA_DECLARED)
    spread_script = client.register_script(LUA_LEADING_PRESENT)  # only to check answers
    del spread_script
    rows: list[dict[str, Any]] = []
    epoch_key = "bench:epoch"
    client.set(epoch_key, "e 0")
    for n in SIZES:
        full = page_chain(f"n{n}", n)
        led.record_stored("kv", full)
        spread_prefix = f"bench:q:kv{n}:"
        for h in full:  # the standalone schema: keys spread over every slot
            client.set(spread_prefix + h, b"1")
        chains = query_chains(full)
        for case in CASES:
            c = chains[case]
            tagged = [led.prefix("kv") + h for h in c]
            spread = [spread_prefix + h for h in c]

            def hashtag_lua(c: list[str] = c) -> int:
                return led.leading_present("kv", c)

            def hashtag_keys(tagged: list[str] = tagged) -> int:
                _, count = declared(keys=[led.epoch_key("kv"), *tagged])
                return int(count)

            def slots_exists(spread: list[str] = spread) -> int:
                pipe = client.pipeline(transaction=False)
                pipe.get(epoch_key)
                for key in spread:
                    pipe.exists(key)
                flags = pipe.execute()[1:]
                return next((i for i, v in enumerate(flags) if not v), len(flags))

            def slots_mget(spread: list[str] = spread) -> int:
                client.get(epoch_key)
                flags = client.mget_nonatomic(spread)
                return next((i for i, v in enumerate(flags) if v is None), len(flags))

            ways = {
                "hashtag-lua": hashtag_lua,
                "hashtag-lua-keys": hashtag_keys,
                "slots-exists": slots_exists,
                "slots-mget": slots_mget,
            }
            answers = {w: f() for w, f in ways.items()}
            if len(set(answers.values())) != 1:
                raise AssertionError(f"ways disagree on {case}/{n}: {answers}")
            for way, us in interleaved(ways, reps).items():
                rows.append({"pages": n, "case": case, "way": way, "median_us": round(us, 1)})
    led.clear_shard()
    led.close()
    return rows


def throughput(standalone_url: str, cluster_url: str, reps: int) -> list[dict[str, Any]]:
    """Pages per second recorded and verified, standalone vs cluster (shipped ledgers)."""
    rows: list[dict[str, Any]] = []
    for ttl in (0.0, 3600.0):
        ledgers = {
            "standalone": open_ledger(
                LedgerSettings(standalone_url, namespace="tp", shard="w", ttl_s=ttl)
            ),
            "cluster": open_ledger(
                LedgerSettings(cluster_url, namespace="tp", shard="w", ttl_s=ttl)
            ),
        }
        pages = 4096
        rec: dict[str, list[float]] = {k: [] for k in ledgers}
        ver: dict[str, list[float]] = {k: [] for k in ledgers}
        names = list(ledgers)
        for r in range(max(4, reps // 2)):
            c = page_chain(f"t{ttl}:{r}", pages)
            order = names if r % 2 else names[::-1]  # neither always goes first
            for name in order:
                led = ledgers[name]
                t0 = time.perf_counter()
                led.record_stored("kv", c)
                rec[name].append(time.perf_counter() - t0)
            for name in order:
                led = ledgers[name]
                t0 = time.perf_counter()
                for start in range(0, pages, 1024):
                    assert led.leading_present("kv", c[start : start + 1024]) == 1024
                ver[name].append(time.perf_counter() - t0)
        for name, led in ledgers.items():
            rows.append(
                {
                    "ledger": name,
                    "ttl_s": ttl,
                    "record_pages_per_s": round(pages / statistics.median(rec[name])),
                    "verify_pages_per_s": round(pages / statistics.median(ver[name])),
                }
            )
            led.clear_shard()
            led.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hicache-ledger-bench-") as tmp:
        cluster = RedisCluster(Path(tmp) / "cluster")
        standalone = RedisServer(Path(tmp))
        try:
            cluster.start()
            standalone.start()
            queries = chain_query(cluster.url, args.reps)
            rates = throughput(standalone.url, cluster.url, args.reps)
        finally:
            cluster.close()
            standalone.close()
    by = {(r["pages"], r["case"], r["way"]): r["median_us"] for r in queries}
    ways = ("hashtag-lua", "hashtag-lua-keys", "slots-exists", "slots-mget")
    print("chain query on a 3+3 cluster, median µs (ratio to hashtag-lua)")
    print(f"{'pages':>5} {'case':13}" + "".join(f"{w:>22}" for w in ways))
    for n in SIZES:
        for case in CASES:
            base = by[(n, case, "hashtag-lua")]
            cells = "".join(
                f"{by[(n, case, w)]:>14.0f} ({by[(n, case, w)] / base:4.1f}x)" for w in ways
            )
            print(f"{n:>5} {case:13}{cells}")
    print("\nthroughput per page, shipped ledgers (4096-page records, 1024-page chains)")
    print(f"{'ledger':>10} {'ttl_s':>6} {'record pages/s':>15} {'verify pages/s':>15}")
    for r in rates:
        print(
            f"{r['ledger']:>10} {r['ttl_s']:>6.0f} {r['record_pages_per_s']:>15,} "
            f"{r['verify_pages_per_s']:>15,}"
        )
    for ttl in (0.0, 3600.0):
        s = next(r for r in rates if r["ledger"] == "standalone" and r["ttl_s"] == ttl)
        c = next(r for r in rates if r["ledger"] == "cluster" and r["ttl_s"] == ttl)
        print(
            f"cluster / standalone, ttl {ttl:.0f}: record "
            f"{c['record_pages_per_s'] / s['record_pages_per_s']:.2f}x, verify "
            f"{c['verify_pages_per_s'] / s['verify_pages_per_s']:.2f}x"
        )
    if args.json is not None:
        record = {
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "reps": args.reps,
            "chain_query": queries,
            "throughput": rates,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
