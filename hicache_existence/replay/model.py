"""A model of HiCache buffer mode's write path, driving the real cache classes.

Per request: due storage acks land, the device prefix cache matches, a long enough
miss queries L3 and heals the beliefs (``ChainPagesPolicy``), the insert walk admits
nodes write-through, and the device cache takes the pages.  docs/replay.md ("The
buffer-mode write-path model") has the sglang 0.5.23 sources and every assumption.
The cache is ``StorageExistenceCache`` itself (cap per pool), so LRU, eviction,
in-flight refcounts, healing and counters are the shipped code's; L3 is
``replay.l3``.  ``simulate`` drives instances of it (one for ``run_model``, N for
``replay.fleet``); the demo's scheduler drives ``PoolRun`` directly.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import Any

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.cache import PoolBeliefs, StorageExistenceCache
from hicache_existence.core.policies import ChainPagesPolicy, PoolBeliefPolicy
from hicache_existence.core.protocol import PoolView
from hicache_existence.replay.l3 import L3, exhaust, leading
from hicache_existence.replay.pages import PageRequest, PageTrace, counted

_HEAL = ChainPagesPolicy()


@dataclass(frozen=True)
class ModelConfig:
    """The deployment the write path is modelled for."""

    #: Device (GPU) prefix-cache capacity in pages; 0 means no device cache.
    device_pages: int = 16384
    #: L3 capacity in pages; 0 means unbounded (L3 never drops a page).
    l3_pages: int = 0
    #: Launch-to-storage-ack latency; acks drain before the first request at or after it.
    ack_latency_ms: float = 0.0
    #: Shortest device miss, in tokens, that issues a prefetch hit query (sglang default 256).
    prefetch_threshold_tokens: int = 256
    #: Heal beliefs from prefetch hit queries (``ChainPagesPolicy``), as sglang does.
    heal: bool = True


@dataclass
class ModelResult:
    """What one run at one cap produced (pages unless named otherwise)."""

    cap: int
    requests: int = 0
    page_references: int = 0
    #: Admission pages found believed / pages the cache examined (its own counters).
    belief_hit_ratio: float = 1.0
    writes_issued: int = 0
    #: Written pages that L3 already held when the write landed.
    redundant_writes: int = 0
    #: Pages of nodes skipped because ``covered()`` said so.
    writes_avoided: int = 0
    #: Skipped pages that L3 did not hold and no write was bringing (stale beliefs).
    stale_skips: int = 0
    #: Pages of nodes dropped because their parent was not covered.
    dropped_writes: int = 0
    #: Entries the cap evicted (the cache's ``evictions``).
    evictions: int = 0
    #: Beliefs removed by prefetch healing (``invalidations``).
    heal_invalidations: int = 0
    device_hit_pages: int = 0
    l3_hit_pages: int = 0
    l3_evictions: int = 0
    #: Most entries held at once, over all pools.
    peak_entries: int = 0
    #: ``peak_entries`` times the measured bytes per entry (hash strings excluded).
    memory_bytes: int = 0
    elapsed_s: float = 0.0
    #: The cache's own counters at the end, summed over pools.
    cache_stats: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def bytes_per_entry() -> float:
    """Memory one belief costs in ``PoolBeliefs`` (the hash string is shared with the
    radix tree in sglang, so it is not counted), measured with ``tracemalloc``."""
    keys = [f"{i:064x}" for i in range(1 << 16)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = PoolBeliefs(len(keys), "kv")
        pool.add(keys)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del pool
    return (after - before) / len(keys)


class _Device:
    """The device prefix cache: prefix match, leaf-first LRU eviction."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[str, None] = OrderedDict()

    def match(self, pages: Sequence[str]) -> int:
        """Pages of the longest cached prefix (touched; ``insert`` re-orders them)."""
        return leading(self.pages, pages) if self.capacity else 0

    def insert(self, pages: Sequence[str]) -> None:
        if not self.capacity:
            return
        held = self.pages
        backwards = pages[::-1]
        held.update(zip(backwards, repeat(None)))
        exhaust(map(held.move_to_end, backwards))
        excess = len(held) - self.capacity
        if excess > 0:
            exhaust(map(held.popitem, repeat(False, excess)))


#: A write waiting for its storage ack: (due time in ms, pool state, pages).
Ack = tuple[float, "PoolRun", Sequence[str]]


class PoolRun:
    """One pool's model state around its beliefs (a ``PoolView``), counting into
    ``result``.  ``writes`` (the runtime's ``WriteAccounting``, the demo's) hears
    every write, avoided write and redundant page, as the write path's hooks tell
    it in a server."""

    def __init__(
        self,
        beliefs: PoolView,
        config: ModelConfig,
        page_size: int,
        l3: L3,
        pool: str,
        result: ModelResult,
        writing: dict[str, int] | None = None,
        *,
        policy: PoolBeliefPolicy = _HEAL,
        writes: WriteAccounting | None = None,
        owner: Any = None,
    ) -> None:
        self.beliefs = beliefs
        self.config = config
        self.page_size = page_size
        self.device = _Device(config.device_pages)
        #: L3 (shared by the instances of a fleet, see ``replay.fleet``) and this pool's part.
        self.l3 = l3
        self.pool = pool
        self.result = result
        self.held = l3.held(pool)
        #: Pages with a write launched and not yet landed (ground truth, refcounted;
        #: shared by a fleet's instances like L3).
        self.writing: dict[str, int] = writing if writing is not None else {}
        #: Nodes (by last page) with a write not yet acked: they vouch for children.
        self.pending_nodes: dict[str, int] = {}
        self.policy = policy
        self.writes = writes
        #: The ``Instance`` it serves (None: the demo drives it directly).
        self.owner = owner

    def land(self, keys: Sequence[str]) -> None:
        """The storage ack: L3 holds the pages, the beliefs learn them."""
        redundant = self.l3.write(self.pool, keys)
        self.result.redundant_writes += redundant
        if redundant and self.writes is not None:
            # L3 holds only this model's writes: a page again is one recomputed.
            self.writes.redundant(self.pool, redundant)
            self.writes.redundant_cause(self.pool, "recompute", redundant)
        self.beliefs.add(keys)
        self.beliefs.untrack_inflight(keys)
        writing = self.writing
        for page in keys:
            left = writing[page] - 1
            if left:
                writing[page] = left
            else:
                del writing[page]
        last = keys[-1]
        left = self.pending_nodes[last] - 1
        if left:
            self.pending_nodes[last] = left
        else:
            del self.pending_nodes[last]

    def request(self, req: PageRequest, acks: deque[Ack]) -> None:
        pages = req.pages
        config = self.config
        result = self.result
        result.requests += 1
        result.page_references += len(pages)
        matched = self.device.match(pages)
        result.device_hit_pages += matched
        rest = pages[matched:]
        if rest and len(rest) * self.page_size >= config.prefetch_threshold_tokens:
            hit = self.l3.leading(self.pool, rest)
            if config.heal:
                self.policy.heal_from_query(self.beliefs, rest, rest, hit, evidence=True)
            result.l3_hit_pages += hit
        self._insert_walk(req, acks)
        self.device.insert(pages)

    def _insert_walk(self, req: PageRequest, acks: deque[Ack]) -> None:
        pages = req.pages
        result = self.result
        beliefs = self.beliefs
        bounded_store = bool(self.config.l3_pages)
        held = self.held
        writing = self.writing
        pending = self.pending_nodes
        writes = self.writes
        due = req.timestamp_ms + self.config.ack_latency_ms
        start = 0
        parent_last: str | None = None
        for end in req.node_ends:
            keys = pages[start:end]
            start = end
            if not keys:
                continue
            if beliefs.covered(keys):
                result.writes_avoided += len(keys)
                if writes is not None:
                    writes.avoided(self.pool, len(keys))
                if bounded_store:
                    result.stale_skips += sum(1 for p in keys if p not in held and p not in writing)
            elif parent_last is None or parent_last in pending or beliefs.contains(parent_last):
                beliefs.track_inflight(keys)
                for page in keys:
                    writing[page] = writing.get(page, 0) + 1
                last = keys[-1]
                pending[last] = pending.get(last, 0) + 1
                result.writes_issued += len(keys)
                if writes is not None:
                    writes.written(self.pool, len(keys))
                acks.append((due, self, keys))
            else:
                result.dropped_writes += len(keys)
            parent_last = keys[-1]


class Instance:
    """One prefill instance: its cache, each pool's ``PoolRun`` (made at its first
    request) and its figures.  A fleet's instances share L3 and ``writing``."""

    def __init__(
        self,
        cache: StorageExistenceCache,
        cap: int,
        config: ModelConfig,
        page_size: int,
        l3: L3,
        writing: dict[str, dict[str, int]] | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.page_size = page_size
        self.l3 = l3
        #: Per pool, the pages being written (see ``PoolRun.writing``).
        self.writing = {} if writing is None else writing
        self.runs: dict[str, PoolRun] = {}
        self.result = ModelResult(cap=cap)

    def request(self, req: PageRequest, acks: deque[Ack]) -> None:
        pool = req.pool
        run = self.runs.get(pool)
        if run is None:
            run = self.runs[pool] = PoolRun(
                self.cache.pool(pool),
                self.config,
                self.page_size,
                self.l3,
                pool,
                self.result,
                self.writing.setdefault(pool, {}),
                owner=self,
            )
        run.request(req, acks)

    def landed(self, keys: Sequence[str]) -> None:
        """One of this instance's writes landed (fleet mode counts its ledger records)."""


def land_due(acks: deque[Ack], until: float = math.inf) -> list[Ack]:
    """Land the acks due by ``until`` (all by default), in order; returns them."""
    landed = []
    while acks and acks[0][0] <= until:
        ack = acks.popleft()
        ack[1].land(ack[2])
        landed.append(ack)
    return landed


def simulate(
    trace: PageTrace,
    instances: Sequence[Instance],
    progress: Callable[[int, int], None] | None = None,
    *,
    pick: Callable[[PageRequest, int], int] = lambda _req, _number: 0,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> int:
    """Replay ``trace`` through ``instances``: ``pick(request, its 0-based number)``
    is the one serving it; ``before`` runs before each request, after the acks due
    by then landed, ``after`` after it.  Every write lands by the end.  Returns the
    most entries an instance was seen holding."""
    acks: deque[Ack] = deque()

    def land(until: float = math.inf) -> int:
        """Land the acks due by ``until``; the largest entry count of an instance
        that landed something (0: none did)."""
        landed = set()
        for _, run, keys in land_due(acks, until):
            run.owner.landed(keys)
            landed.add(run.owner)
        return max((len(i.cache) for i in landed), default=0)

    peak = 0
    for number, req in enumerate(counted(trace.requests, progress)):
        # Acks only add; the request's heal may then remove: look before it.
        peak = max(peak, land(req.timestamp_ms))
        if before is not None:
            before()
        inst = instances[pick(req, number)]
        inst.request(req, acks)
        peak = max(peak, len(inst.cache))
        if after is not None:
            after()
    return max(peak, land())


#: The cache counters a replay reports (``ModelResult.cache_stats``).
CACHE_STATS: tuple[str, ...] = (
    "queries",
    "pages_checked",
    "page_hits",
    "rescues",
    "page_misses",
    "adds",
    "inserts",
    "refreshes",
    "evictions",
    "invalidations",
    "inflight_tracked",
    "inflight_released",
)
#: The model's own counters, summed over a fleet's instances.
_SUMMED = (
    "requests",
    "page_references",
    "writes_issued",
    "redundant_writes",
    "writes_avoided",
    "stale_skips",
    "dropped_writes",
    "device_hit_pages",
    "l3_hit_pages",
)


def run_model(
    trace: PageTrace,
    cap: int,
    config: ModelConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    cache: StorageExistenceCache | None = None,
    step_hook: Callable[[], object] | None = None,
) -> ModelResult:
    """Replay ``trace`` through the write-path model with ``cap`` entries per pool.

    ``cache`` replaces the fresh ``StorageExistenceCache(cap)`` (e.g. one with an
    observer); ``step_hook`` runs after every request, where sglang's per-step
    hook would (e.g. an advisor's ``drain``)."""
    config = config or ModelConfig()
    started = time.perf_counter()
    l3 = L3(config.l3_pages)
    cache = StorageExistenceCache(cap) if cache is None else cache
    inst = Instance(cache, cap, config, trace.page_size, l3)
    result = total([inst], l3, simulate(trace, [inst], progress, after=step_hook))
    result.elapsed_s = time.perf_counter() - started
    return result


def total(
    instances: Sequence[Instance], l3: L3, peak: int, verdict_invalidations: int = 0
) -> ModelResult:
    """The run's figures: the model's and the caches' counters summed over
    ``instances``, L3's evictions and the peak memory (``peak_entries``: the
    largest instance's, now or at ``peak``).  Invalidations by ledger verdicts
    are not prefetch healing (fleet mode counts them apart)."""
    peak = max(peak, *(len(i.cache) for i in instances))
    result = ModelResult(cap=instances[0].result.cap)
    for name in _SUMMED:
        setattr(result, name, sum(getattr(i.result, name) for i in instances))
    totals = [i.cache.stats().total for i in instances]
    stats = result.cache_stats = {n: sum(getattr(t, n) for t in totals) for n in CACHE_STATS}
    checked = stats["pages_checked"]
    result.belief_hit_ratio = stats["page_hits"] / checked if checked else 1.0
    result.evictions = stats["evictions"]
    result.heal_invalidations = stats["invalidations"] - verdict_invalidations
    result.l3_evictions = l3.evictions
    result.peak_entries = peak
    result.memory_bytes = int(peak * bytes_per_entry())
    return result
