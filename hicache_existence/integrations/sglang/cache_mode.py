"""HiCache cache mode's L3 writes: counted, and deduplicated on request (docs/enable.md §3a,
where the dedup rules and why a skipped write is safe are explained).

``UnifiedRadixCache.write_backup_storage(node_id)`` hands a backed-up node's host
pages to ``cache_controller.write_storage``; upstream consults no existence cache
there.  ``CacheModeWrites`` sits on that path (``write_hooks``):

* **launch**: inside ``write_backup_storage`` (TP-lockstep: the rank-agreed
  write-through ack) the pages are looked up (one ``covered`` query per pool),
  and with ``cache_mode.dedup`` the believed ones left out by the ``WritePlan``
  rule; with upstream's own dedup (``upstream_overlap``) the launch only counts;
* **ack**: the per-step ``reap`` sees operations leave ``tree.ongoing_backup`` in
  launch order (one backup thread, FIFO queues) and counts this rank's outcome.
  The written pages become beliefs unconditionally, as in upstream's buffer mode,
  so every rank adds the same pages whatever its backend answered.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

from hicache_existence.accounting.causes import CauseTracker
from hicache_existence.accounting.recorder import Recorder
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.policies import ChainPagesPolicy, default_belief_policy
from hicache_existence.core.protocol import ExistenceCache, PoolView

KV = "kv"
_CHAIN = ChainPagesPolicy()
_NOTHING: frozenset[str] = frozenset()


def pool_name(pool: object) -> str:
    """``PoolName.KV`` -> ``"kv"`` (str enums), plain strings unchanged."""
    return str.__str__(pool) if isinstance(pool, str) else str(pool)


def account_ack(
    writes: WriteAccounting,
    causes: CauseTracker,
    pool: str,
    keys: Sequence[str],
    outcome: Any,
    node: Any,
    noted: Collection[str],
    held: Collection[str],
) -> None:
    """This rank's outcome of one pool's written ``keys`` at their storage ack (both
    modes), and the causes of the redundant ones, classified before the ack adds
    them to the beliefs (``noted``: believed at launch; ``held``: decided the write)."""
    stored = outcome.stored[pool]
    # Every pool's stored pages are the leading ones (KV: upstream stops at the
    # first failed batch; extra pools: ``count_pool_hits`` counts the leading run of
    # successes): a page past the first failure that L3 held is failed, not redundant.
    acked = keys[:stored]
    existed = outcome.existed.get(pool, set()).intersection(acked)
    already = min(len(existed), stored)
    believed = min(len(existed.intersection(noted)), already)
    writes.acked(pool, stored, outcome.failed.get(pool, 0), already, believed)
    if already:
        redundant = [k for k in acked if k in existed][:already]
        for cause, n in causes.classify(node, redundant, noted, held, pool).items():
            writes.redundant_cause(pool, cause, n)


class WritePlan(NamedTuple):
    """What one cache-mode node write sends to L3, and what it leaves out (a named
    tuple: built per node write without an ``__init__`` frame, ``_plan``)."""

    #: Indices (into the node's KV pages) written, in order; ``None``: every page (the
    #: common case, tested without a length or a list built per node write).
    keep: list[int] | None
    pages: list[str]
    #: KV pages believed stored at launch (redundant_believed at the ack): ``pages``
    #: itself when every page is (no set built per node write).
    believed: Collection[str]
    #: Extra pools' keys (hybrid models), written whole or not at all.
    extra: Mapping[str, list[str]]
    extra_written: bool
    #: Extra pools' keys believed stored at launch (their redundant_believed).
    extra_believed: Mapping[str, set[str]]

    @property
    def written_pages(self) -> list[str]:
        if self.keep is None:
            return self.pages
        return [self.pages[i] for i in self.keep]

    @property
    def whole(self) -> bool:
        return self.keep is None and self.extra_written


#: A ``WritePlan`` from its six fields, all in C (no generated ``__new__`` frame).
_plan: Callable[[tuple[Any, ...]], WritePlan] = functools.partial(tuple.__new__, WritePlan)

#: No extra pools (a plain model's node write): one shared, read-only empty mapping
#: rather than two dicts built per node write.
_NO_EXTRA: Mapping[str, Any] = types.MappingProxyType({})


#: A launched cache-mode operation, until its ack: its node, its KV pages written
#: and those believed at launch, its extra pools' keys written and, per extra pool,
#: those believed at launch.  A tuple: one is built at every node write.
_Launch = tuple[Any, list[str], Collection[str], Mapping[str, list[str]], Mapping[str, set[str]]]


class CacheModeWrites:
    """The cache-mode write path of one scheduler process (module docstring)."""

    def __init__(
        self,
        writes: WriteAccounting,
        cache: ExistenceCache,
        *,
        dedup: bool,
        causes: CauseTracker,
        size_pool: Callable[[str], None],
        upstream_dedup: bool = False,
    ) -> None:
        self.writes = writes
        self.cache = cache
        #: sglang deduplicates these writes itself (``upstream_overlap``): ours never
        #: does, and the launch reads the beliefs without a counted lookup.
        self.upstream_dedup = upstream_dedup
        self.dedup = dedup and not upstream_dedup
        self.causes = causes
        self._size_pool = size_pool
        self._sized: set[str] = set()
        #: The KV pool's live write counters (``WriteAccounting.live``), once sized
        #: (``_sized`` holds the extra pools sized so far).
        self._kv_writes: Any = None
        #: The node whose ``write_backup_storage`` is running, and whether one is
        #: (the hooks set them: the node write's first ``write_storage`` takes them).
        self.node: Any = None
        self.in_node = False
        #: Launched operations, in launch order (= ack order).
        self._pending: dict[int, _Launch] = {}
        #: The KV pool's beliefs, once looked up (a pool object is never replaced).
        self._kv: PoolView | None = None
        self.recorder: Recorder | None = None

    # -- the node write --------------------------------------------------------------
    def plan(self, hash_value: Any, extra_pools: Any, *, prefix_keyed: bool) -> WritePlan:
        """Look a node write's pages up and decide what is written, from
        ``write_storage``'s own arguments (no argument-conversion frame); a plain
        model's node write (no extra pool, our own dedup) takes the first branches only."""
        # str page hashes (the cache checks them), as a list the plan may keep
        pages: list[str] = list(hash_value or ())
        kv = self._kv
        if kv is None:
            kv = self._kv = self.cache.pool(KV)
        if extra_pools or self.upstream_dedup:
            return self._plan_with(pages, extra_pools, kv, prefix_keyed)
        if not pages:
            return _plan((None, pages, pages, _NO_EXTRA, True, _NO_EXTRA))
        if kv.covered(pages):  # every page believed (or in flight): nothing to write
            return _plan(([] if self.dedup else None, pages, pages, _NO_EXTRA, True, _NO_EXTRA))
        believed = set(kv.believed(pages))
        keep = None
        if self.dedup and believed:
            if prefix_keyed:  # only a believed prefix (the prefix context advances past it)
                first = next((i for i, p in enumerate(pages) if p not in believed), len(pages))
                keep = list(range(first, len(pages))) if first else None
            else:
                keep = [i for i, p in enumerate(pages) if p not in believed]
        return _plan((keep, pages, believed, _NO_EXTRA, True, _NO_EXTRA))

    def _plan_with(
        self, pages: list[str], extra_pools: Any, kv: PoolView, prefix_keyed: bool
    ) -> WritePlan:
        """``plan`` with extra pools riding along (written whole or not at all) or
        with sglang's own dedup (``upstream_dedup``: count, never leave out)."""
        extra: Mapping[str, list[str]] = (
            {pool_name(t.name): list(t.keys) for t in extra_pools if getattr(t, "keys", None)}
            if extra_pools
            else _NO_EXTRA
        )
        if not extra and not self.upstream_dedup:  # no extra pool has keys: a plain write
            return self.plan(pages, None, prefix_keyed=prefix_keyed)
        pool = self.cache.pool
        # A read (no touch, no count), for the extra pools' redundant_believed at the ack.
        extra_believed: Mapping[str, set[str]] = (
            {p: set(pool(p).believed(keys)) for p, keys in extra.items() if keys}
            if extra
            else _NO_EXTRA
        )
        if self.upstream_dedup:
            # sglang looked these pages up in this cache already (counted there) and
            # left out what it skips: count what it sends, classify without a lookup.
            believed: Collection[str] = set(kv.believed(pages)) if pages else set()
            return _plan((None, pages, believed, extra, True, extra_believed))
        covered = kv.covered(pages) if pages else True
        believed = pages if covered else set(kv.believed(pages))
        # counted lookups of the extra pools (up to the first not covered), dedup on or
        # off alike (the same counters)
        extra_covered = all(pool(p).covered(keys) for p, keys in extra.items() if keys)
        if self.dedup and covered and extra_covered:
            return _plan(([], pages, believed, extra, False, extra_believed))
        return _plan((None, pages, believed, extra, True, extra_believed))

    def launched(self, operation_id: int, plan: WritePlan, node: Any) -> None:
        """The operation carrying ``plan``'s pages was queued for the backup thread.
        Every node write runs this on the scheduler thread: the KV pool's common case
        is inline (no property, helper or empty-pool calls)."""
        pages, keep = plan.pages, plan.keep
        written = pages if keep is None else [pages[i] for i in keep]
        counters = self._kv_writes
        if counters is None:  # the KV pool's first write: size it, once
            self._size_pool(KV)
            counters = self._kv_writes = self.writes.live(KV)
        counters.written += len(written)
        if keep is not None:
            counters.avoided += len(pages) - len(keep)
        if self.recorder is not None:
            self.recorder.written(KV, written)
        extra = plan.extra
        if extra:
            for name, keys in extra.items():
                if name not in self._sized:
                    self._sized.add(name)
                    self._size_pool(name)
                self.writes.written(name, len(keys) if plan.extra_written else 0)
                if keys and not plan.extra_written:
                    self.writes.avoided(name, len(keys))
            if not plan.extra_written:
                extra = _NO_EXTRA
        if written:
            kv = self._kv
            if kv is None:
                kv = self._kv = self.cache.pool(KV)
            kv.track_inflight(written)
            self.causes.launched(node, written)  # nothing written takes nothing
        believed = plan.believed
        if keep is not None and believed:  # believed is a subset of the node's pages
            believed = written if believed is pages else set(believed).intersection(written)
        if not extra:
            self._pending[int(operation_id)] = (node, written, believed, _NO_EXTRA, _NO_EXTRA)
            return
        for name, keys in extra.items():
            self.cache.pool(name).track_inflight(keys)
        self._pending[int(operation_id)] = (
            node,
            written,
            believed,
            extra,
            {p: plan.extra_believed.get(p, set()).intersection(k) for p, k in extra.items()},
        )

    # -- the ack ---------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Operations launched and not yet acknowledged."""
        return len(self._pending)

    @property
    def pending_operations(self) -> Mapping[int, object]:
        """The pending operations themselves (a live, read-only view: the per-step
        hook tests it for emptiness without a call)."""
        return self._pending

    def reap(self, ongoing: Any, outcomes: MutableMapping[int, Any]) -> None:
        """Per step: account the operations the storage drain acknowledged (gone
        from ``ongoing``, upstream's ``ongoing_backup``), oldest first, each with
        this rank's outcome popped from ``outcomes`` (the write path's, by operation id)."""
        pending = self._pending
        while pending:
            op_id = next(iter(pending))
            if op_id in ongoing:
                break
            self._acked(pending.pop(op_id), outcomes.pop(op_id, None))

    def _acked(self, launch: _Launch, outcome: Any) -> None:
        node, pages, believed, extra, extra_believed = launch
        if outcome is not None:  # None: this rank wrote nothing (non-writer rank, backup_skip)
            stored = outcome.stored
            # The beliefs decided the write only with dedup on (its node rules).
            dedup = self.dedup
            if KV in stored:
                held = believed if dedup else _NOTHING
                account_ack(self.writes, self.causes, KV, pages, outcome, node, believed, held)
            for pool, keys in extra.items():
                if pool in stored:
                    noted = extra_believed.get(pool, _NOTHING)
                    held = noted if dedup else _NOTHING
                    account_ack(self.writes, self.causes, pool, keys, outcome, node, noted, held)
        # Believed whatever this rank's backend answered: all ranks add the same.
        if pages:
            kv = self._kv
            if kv is None:
                kv = self._kv = self.cache.pool(KV)
            kv.add(pages)
            kv.untrack_inflight(pages)
        for pool, keys in extra.items():
            if keys:
                beliefs = self.cache.pool(pool)
                beliefs.add(keys)
                beliefs.untrack_inflight(keys)
        self.causes.stored(node, pages)

    # -- prefetch hit queries ----------------------------------------------------------------
    def heal(self, operation: Any, chain: list[str], page_size: int) -> None:
        """A rank-agreed prefetch hit query's verdict heals the beliefs (upstream
        heals only in buffer mode): nothing is believed beyond the agreed boundary;
        with the KV pool's own verdict, up to it is learnt.  A query cut by its
        deadline is no verdict (its hit may be a MIN over skipped lookups)."""
        if getattr(operation, "deadline_expired", False) or page_size <= 0:
            return
        hit_tokens = int(getattr(operation, "storage_hit_count", 0) or 0)
        folded = hit_tokens // page_size
        verdicts = getattr(operation, "query_pool_hit_pages", None)
        if isinstance(verdicts, dict):
            own = {pool_name(p): int(v) for p, v in verdicts.items()}
            if KV not in own:
                return  # no rank-agreed KV verdict (e.g. assumed stored): unchanged
        else:  # a controller without per-pool verdicts: the folded, agreed count
            own = {KV: folded}
        _CHAIN.heal_from_query(self.cache.pool(KV), chain, chain, own[KV], evidence=True)
        for transfer in getattr(operation, "pool_transfers", None) or ():
            name = pool_name(transfer.name)
            policy = default_belief_policy(getattr(transfer, "hit_policy", None))
            hit, evidence = (own[name], True) if name in own else (folded, False)
            keys = list(transfer.keys or ())
            policy.heal_from_query(self.cache.pool(name), chain, keys, hit, evidence=evidence)
