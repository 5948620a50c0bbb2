"""A simulated HiCache buffer-mode prefill scheduler, one TP rank.

It drives an ``ExistenceRuntime`` through the calls SGLang's buffer-mode write
path makes, at the same points, so every metric, check and heal runs as in a
server:

* storage acks from the previous step: ``add`` + ``untrack_inflight``;
* per request, a prefetch hit query against L3 heals beliefs through the
  chain-pages policy (``invalidate_beyond`` beyond the hit, learn up to it);
* per radix node, write-through admission: ``covered`` (believed or in flight)
  avoids the write, otherwise ``track_inflight`` and an L3 write;
* a trailing-window pool (``swa``: the last page of each node) alongside ``kv``;
* ``runtime.step()`` once per step, the hook the SGLang plugin runs after
  ``check_hicache_events``.

L3 is a per-rank shard with a capacity and LRU eviction (``L3Shard``: the replay's
L3 model, ``replay.l3``), so beliefs go stale the way they do in production and
the reconciler has something to find.
Every rank runs the same deterministic stream, which keeps replicas identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_existence.core.policies import ChainPagesPolicy, TrailingWindowPolicy
from hicache_existence.reconcile.ground_truth import check_chain
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.pages import PageRequest
from hicache_existence.runtime import ExistenceRuntime

KV = "kv"
SWA = "swa"


class L3Shard(L3):
    """One rank's L3 shard: the simulators' one L3 model (``replay.l3``),
    bounded, and the rank's ground truth (the reconciler's worker reads it while
    the scheduler writes).  ``drop_every`` loses one page in that many writes,
    as an L3 node that fails or expires pages early would (stale positives)."""

    def __init__(self, capacity_pages: int, *, drop_every: int = 0, ledger: Any = None) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
        super().__init__(capacity_pages, drop_every=drop_every, ledger=ledger)

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        """``batch_exists`` semantics; reads refresh nothing (a probe, not a hit)."""
        name, seq = check_chain(pool, hashes)
        return self.leading(name, seq, read=False)

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        name, seq = check_chain(pool, hashes)
        with self._lock:
            held = self.pools.get(name)
            return [held is not None and page in held for page in seq]


@dataclass
class StepTotals:
    """What one rank did so far (for the progress line and the summary)."""

    steps: int = 0
    requests: int = 0
    pages: int = 0
    written: int = 0
    avoided: int = 0
    redundant: int = 0
    healed: int = 0


class SimulatedScheduler:
    """One rank's scheduler loop over a stream of page requests."""

    def __init__(
        self,
        runtime: ExistenceRuntime,
        shard: L3Shard,
        *,
        heal_every: int = 4,
        clear_swa_every: int = 0,
    ) -> None:
        self.runtime = runtime
        self.shard = shard
        self.heal_every = heal_every
        self.clear_swa_every = clear_swa_every
        self.totals = StepTotals()
        self._acks: list[tuple[str, tuple[str, ...]]] = []
        self._chain_policy = ChainPagesPolicy()
        self._window_policy = TrailingWindowPolicy()

    def step(self, requests: Iterable[PageRequest]) -> None:
        """One scheduler step: acks, prefetch heals, admissions, the hook."""
        cache = self.runtime.cache
        pools = cache.pool
        for pool, keys in self._acks:  # storage acks of last step's writes
            beliefs = pools(pool)
            beliefs.add(keys)
            beliefs.untrack_inflight(keys)
        self._acks = []
        totals = self.totals
        for request in requests:
            totals.requests += 1
            totals.pages += len(request.pages)
            self._prefetch(request)
            self._admit(request)
        totals.steps += 1
        if self.clear_swa_every and totals.steps % self.clear_swa_every == 0:
            pools(SWA).clear()
        self.runtime.step()

    def _prefetch(self, request: PageRequest) -> None:
        """A prefetch hit query: L3 says how much of the chain it holds."""
        if not self.heal_every or self.totals.requests % self.heal_every:
            return
        chain = request.pages
        hit = self.shard.leading_present(KV, chain)
        beliefs = self.runtime.cache.pool(KV)
        before = beliefs.stats().invalidations
        self._chain_policy.heal_from_query(beliefs, chain, (), hit, evidence=True)
        swa_keys = self._window(request)
        swa_hit = self.shard.leading_present(SWA, swa_keys)
        self._window_policy.heal_from_query(
            self.runtime.cache.pool(SWA),
            swa_keys,
            (),
            swa_hit,
            evidence=True,
        )
        self.totals.healed += beliefs.stats().invalidations - before

    @staticmethod
    def _window(request: PageRequest) -> tuple[str, ...]:
        return tuple(request.pages[end - 1] for end in request.node_ends)

    def _nodes(self, request: PageRequest) -> Iterator[tuple[str, ...]]:
        start = 0
        for end in request.node_ends:
            yield request.pages[start:end]
            start = end

    def _admit(self, request: PageRequest) -> None:
        """Write-through admission, node by node (parent first)."""
        runtime = self.runtime
        writes = runtime.writes
        totals = self.totals
        kv = runtime.cache.pool(KV)
        swa = runtime.cache.pool(SWA)
        for node in self._nodes(request):
            if kv.covered(node):
                writes.avoided(KV, len(node))
                totals.avoided += len(node)
            else:
                kv.track_inflight(node)
                already = self.shard.write(KV, node)
                writes.written(KV, len(node), already_stored=already)
                if already:  # the shard holds only this scheduler's writes: its own pages
                    writes.redundant_cause(KV, "recompute", already)
                totals.written += len(node)
                totals.redundant += already
                self._acks.append((KV, node))
            window = node[-1:]
            if swa.covered(window):
                writes.avoided(SWA, 1)
            else:
                swa.track_inflight(window)
                already = self.shard.write(SWA, window)
                writes.written(SWA, 1, already_stored=already)
                if already:
                    writes.redundant_cause(SWA, "recompute", already)
                self._acks.append((SWA, window))
