"""A demo workload behind a live ``/metrics`` endpoint: every exported counter moves.

    python integrations/prometheus/demo.py --port 9464

Point ``prometheus.yml`` (beside this file) at it, import the dashboard into
Grafana and every cache panel fills within a minute.  ``tests/test_prometheus_e2e.py``
runs the same workload under a real Prometheus and checks that every dashboard
query and every rule expression returns data.

``Demo.step`` is the one workload driver: one call is one scheduler step that
moves every cache and write counter, including every miss reason.  Metrics of
features wired later (TP divergence, reconciler, capacity advisor) are added
there and in ``Demo.__init__`` (collectors go on ``self.registry``).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from hicache_existence import StorageExistenceCache
from hicache_existence.bench.workload import chain
from hicache_existence.catalog import DeploymentLabels
from hicache_existence.exporters.prometheus import MetricsServer, serve
from hicache_existence.exporters.samples import Sampler
from hicache_existence.ghosts import FingerprintGhosts, GhostFactory
from hicache_existence.writes import WriteAccounting

#: Pools: ``kv`` churns, ``swa`` is cleared every step, ``draft`` has no
#: miss-reason memory (its misses are ``unclassified``).
POOLS = ("kv", "swa", "draft")
UNCLASSIFIED_POOL = "draft"
CAP = 256
CHAIN = 48
PAGE_BYTES = 4096
LABELS = DeploymentLabels(
    model_name="demo-model", engine_type="prefill", storage_backend="demo-backend"
)


class Demo:
    """A cache, its write accounting and a registry serving them."""

    def __init__(self, cap: int = CAP) -> None:
        self.ghosts = GhostFactory(cap, memory_fraction=1.0)
        self.cache = StorageExistenceCache(cap, miss_memory=self._memory)
        self.writes = WriteAccounting(page_size_bytes=PAGE_BYTES)
        self.sampler = Sampler(
            self.cache, writes=self.writes, ghosts=self.ghosts, initial_pools=POOLS
        )
        self.registry = CollectorRegistry()
        self.steps = 0
        self._inflight: list[str] = []

    def _memory(self, pool: str) -> FingerprintGhosts | None:
        return None if pool == UNCLASSIFIED_POOL else self.ghosts(pool)

    def step(self) -> None:
        """One scheduler step: lookups that hit, miss for every reason and are
        rescued; adds that insert, refresh and evict; a heal; a clear; writes."""
        n = self.steps
        self.steps += 1
        kv, swa, draft = (self.cache.pool(p) for p in POOLS)
        kv.untrack_inflight(self._inflight)  # last step's storage acks
        a, b = chain(n, CHAIN, "demo-a"), chain(n, CHAIN, "demo-b")
        kv.add(a)
        kv.add(b)  # at cap after a few steps: every add evicts
        kv.contains_all(chain(n - 4, CHAIN, "demo-a"))  # evicted (cold in the first steps)
        kv.contains(chain(n, 1, "demo-cold")[0])  # cold
        kv.contains_all(b)  # hits
        keep = CHAIN - 8
        kv.invalidate_beyond(b, keep)  # a heal
        kv.contains_all(b)  # hits, then an invalidated miss
        self._inflight = b[keep:]
        kv.track_inflight(self._inflight)
        kv.covered(b)  # hits and rescues
        kv.add(b[:keep])  # refreshes
        s = chain(n, 8, "demo-s")
        swa.add(s)
        swa.contains_all(s)
        swa.track_inflight(s[:2])
        swa.clear_inflight()
        swa.clear()
        swa.contains(s[0])  # cleared
        swa.add(s)
        d = chain(n, 8, "demo-d")
        draft.add(d)
        draft.contains_all(d)
        draft.contains(chain(n, 1, "demo-draft-cold")[0])  # unclassified
        for pool in POOLS:
            self.writes.written(pool, 8, already_stored=1 + n % 2)
            self.writes.avoided(pool, 6)
        self.cache.settle()  # the per-step hook classifies this step's misses

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        """Serve ``/metrics`` for this demo (port 0 picks a free port)."""
        return serve(self.sampler, LABELS, host=host, port=port, registry=self.registry)

    def run(self, stop: threading.Event, steps_per_s: float = 10.0) -> None:
        """Step until ``stop`` is set (the scheduler thread of the demo)."""
        period = 1.0 / steps_per_s
        while not stop.is_set():
            self.step()
            stop.wait(period)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=9464, help="port of /metrics")
    parser.add_argument("--steps-per-s", type=float, default=10.0, help="workload steps/s")
    args = parser.parse_args(argv)
    if not args.steps_per_s > 0:
        parser.error(f"--steps-per-s must be > 0, got {args.steps_per_s}")
    demo = Demo()
    stop = threading.Event()
    with demo.serve(args.host, args.port) as server:
        print(f"serving {server.url}; Ctrl-C stops", flush=True)
        worker = threading.Thread(target=demo.run, args=(stop, args.steps_per_s), daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            worker.join(timeout=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
