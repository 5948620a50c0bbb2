"""A simulated HiCache buffer-mode prefill scheduler, one TP rank.

It drives an ``ExistenceRuntime`` through the replay's write-path model
(``replay.model`` over ``replay.l3``), so the cache sees the calls SGLang's
buffer-mode write path makes, beside a trailing-window pool (``swa``: each node's
last page) cleared every ``clear_swa_every`` steps; the runtime's
``WriteAccounting`` hears every write and ``runtime.step()`` runs once per step,
where the SGLang plugin's hook runs.  L3 is a per-rank lossy LRU shard, so beliefs
go stale as in production and the reconciler (reading the shard as its ground
truth) has something to find.  Every rank runs the same deterministic stream,
which keeps replicas identical.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hicache_existence.core.policies import TrailingWindowPolicy
from hicache_existence.replay.l3 import L3
from hicache_existence.replay.model import Ack, ModelConfig, ModelResult, PoolRun, land_due
from hicache_existence.replay.pages import DEFAULT_PAGE_SIZE, PageRequest
from hicache_existence.runtime import ExistenceRuntime

KV = "kv"
SWA = "swa"
#: The demo's deployment: no device cache, and a prefetch hit query (which heals
#: beliefs) only for prompts of at least 32K tokens, so the beliefs of shorter
#: ones go stale as the small, lossy shard drops pages, for the reconciler to find.
PREFETCH_THRESHOLD_TOKENS = 32768


class SimulatedScheduler:
    """One rank's scheduler loop over a stream of page requests, a step a batch.

    ``model``'s ``ack_latency_ms`` is counted in steps here (the default 1: a
    write lands at the next step, after ``check_hicache_events``)."""

    def __init__(
        self,
        runtime: ExistenceRuntime,
        shard: L3,
        *,
        clear_swa_every: int = 0,
        model: ModelConfig | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.runtime = runtime
        self.shard = shard
        self.clear_swa_every = clear_swa_every
        config = model or ModelConfig(
            device_pages=0,
            l3_pages=shard.capacity,
            ack_latency_ms=1,
            prefetch_threshold_tokens=PREFETCH_THRESHOLD_TOKENS,
        )
        cache, writes = runtime.cache, runtime.writes
        #: The kv pool's figures (the progress line and the summary); swa's apart.
        self.totals = ModelResult(cap=cache.max_entries)
        self._kv = PoolRun(cache.pool(KV), config, page_size, shard, KV, self.totals, writes=writes)
        swa, policy = ModelResult(cap=cache.max_entries), TrailingWindowPolicy()
        self._swa = PoolRun(
            cache.pool(SWA), config, page_size, shard, SWA, swa, policy=policy, writes=writes
        )
        self._acks: deque[Ack] = deque()
        self.steps = 0

    def step(self, requests: Iterable[PageRequest]) -> None:
        """One scheduler step: last step's acks, then each request's prefetch and
        admission in both pools, then the plugin's hook."""
        self.steps = now = self.steps + 1
        acks = self._acks
        land_due(acks, now)
        for request in requests:
            ends = request.node_ends
            self._kv.request(PageRequest(now, KV, request.pages, ends), acks)
            window = tuple(request.pages[end - 1] for end in ends)
            swa = PageRequest(now, SWA, window, tuple(range(1, len(window) + 1)))
            self._swa.request(swa, acks)
        if self.clear_swa_every and now % self.clear_swa_every == 0:
            self.runtime.cache.pool(SWA).clear()
        self.runtime.step()
