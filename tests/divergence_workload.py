"""A cheap synthetic scheduler step for the divergence tests (in-process and gloo).

Each replica owns a real ``StorageExistenceCache`` observed by a ``ReplicaDigest``
and applies the same operations as SGLang's lockstep drain would (admission
reads, D2H launches, storage acks, prefetch heals, in-flight resets) on chained
SHA-256 page hashes, with small caps so evictions happen all the time.  The
operations are drawn from a seeded RNG only (never from query results), so every
rank applies the same stream and an injected fault stays the only difference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hicache_existence.accounting.ghosts import GhostFactory
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.replicas.digest import ReplicaDigest
from hicache_existence_bench import workload

CHAINS = [workload.chain(i, 16, "div") for i in range(48)]

#: Injectable faults: each one changes one operation on the faulty rank only.
FAULTS = ("extra_add", "touch_order", "missed_invalidate", "missed_untrack")


class Replica:
    """One rank's cache, digest and workload state."""

    def __init__(self, seed: int = 7, cap: int = 96) -> None:
        self.digest = ReplicaDigest()
        # The real miss-reason memory, large enough that reasons are exact here.
        self.cache = StorageExistenceCache(
            cap,
            observer=self.digest,
            miss_memory=GhostFactory(cap, memory_fraction=1.0, debug_events_per_s=0),
        )
        self.rng = random.Random(seed)
        self.pending: list[list[str]] = []
        self.probe_round = 0

    def step(self) -> None:
        """One synthetic scheduler step (RNG-driven, identical on every rank)."""
        rng = self.rng
        kv = self.cache.pool("kv")
        swa = self.cache.pool("swa")
        chain = CHAINS[rng.randrange(len(CHAINS))]
        n = rng.randint(1, len(chain))
        roll = rng.random()
        launch = rng.random() < 0.6
        kv.covered(chain[:n])  # admission read (touches believed pages)
        if launch:
            kv.track_inflight(chain[:n])  # D2H launched
            self.pending.append(chain[:n])
        if self.pending and roll < 0.7:  # storage ack drained
            seg = self.pending.pop(0)
            kv.add(seg)
            kv.untrack_inflight(seg)
            swa.add(seg[-2:])
        if roll > 0.9:  # prefetch shortfall heal
            kv.invalidate_beyond(chain, rng.randrange(len(chain)))
        if roll < 0.002:  # write pipeline reset
            kv.clear_inflight()
            self.pending.clear()
        swa.contains_all(chain[-2:])
        self.cache.settle()  # the per-step hook classifies the step's misses

    def inject(self, fault: str, faulty: bool) -> None:
        """A scripted step every rank runs; the ``faulty`` rank deviates by ``fault``."""
        self.probe_round += 1
        tag = f"probe-{self.probe_round}"
        kv = self.cache.pool("kv")
        chain = CHAINS[self.probe_round % len(CHAINS)]
        if fault == "extra_add":
            if faulty:
                kv.add(workload.chain(10_000 + self.probe_round, 2, tag))
        elif fault == "touch_order":
            # Cap 2: the touch order decides which page the next add evicts.
            probe = self.cache.pool("probe")
            probe.max_entries = 2
            a, b, c = workload.chain(20_000 + self.probe_round, 3, tag)
            probe.add([a, b])
            first, second = (b, a) if faulty else (a, b)
            probe.contains(first)
            probe.contains(second)
            probe.add([c])
        elif fault == "missed_invalidate":
            kv.add(chain)
            if not faulty:
                kv.invalidate_beyond(chain, 4)
        elif fault == "missed_untrack":
            kv.track_inflight(chain[:3])
            if not faulty:
                kv.untrack_inflight(chain[:3])
        else:
            raise ValueError(f"unknown fault {fault!r}")


def run_steps(
    replica: Replica,
    steps: int,
    on_step: Callable[[int], None],
    inject_at: int | None = None,
    fault: str | None = None,
    faulty: bool = False,
) -> None:
    """Run ``steps`` steps, calling ``on_step(step)`` after each (the lockstep point)."""
    for step in range(1, steps + 1):
        replica.step()
        if inject_at is not None and step == inject_at and fault is not None:
            replica.inject(fault, faulty)
        on_step(step)
