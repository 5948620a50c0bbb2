"""Sidecar pools and dropped prefetches against upstream's real methods (sglang 0.5.23):
what upstream counts as stored, retired and loaded is what the package counts."""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from types import SimpleNamespace as NS

import torch
from sglang.srt.mem_cache.buffer_mode.pipeline import BufferModePipeline
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    StorageOperation,
)
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.observers import Tee
from hicache_existence.events import emitter as em
from hicache_existence.events.wire import Removed
from hicache_existence.integrations.sglang import hooks
from hicache_existence.integrations.sglang import write_hooks as wh
from hicache_existence.integrations.sglang import write_path as wp

# A hybrid pool write (real HybridCacheController._page_backup + real HiCacheFile.batch_set_v2):
# upstream counts a pool's stored pages as the LEADING run of successes (count_pool_hits);
# a page after the first failure that L3 already held must not be counted redundant.


AROUND_BACKUP = wh.hook("HybridCacheController._page_backup").bound(
    HybridCacheController._page_backup
)
AROUND_SET = wh.hook("HiCacheFile.set").bound(HiCacheFile.set)
AROUND_EXISTS = wh.hook("HiCacheFile.exists").bound(HiCacheFile.exists)
REAL_SET, REAL_EXISTS = HiCacheFile.set, HiCacheFile.exists


def test_sidecar_redundant_only_among_leading_stored(tmp_path, monkeypatch):
    pages = [f"{i:064x}" for i in range(3)]
    held = f"{pages[2]}.swa"  # L3 holds the third SWA page already
    bad = f"{pages[1]}.swa"  # the second SWA page fails to write (disk full)
    (tmp_path / f"{held}.bin").write_bytes(b"x")

    class Evictor:
        def reserve(self, suffixed, n, key=None):
            return key != bad

        def touch(self, *a):
            pass

        def commit(self, *a):
            pass

        def abort(self, *a):
            pass

    backend = object.__new__(HiCacheFile)  # the real class, no config
    backend.file_path = str(tmp_path)
    backend.config_suffix = backend.tp_config_suffix = ""
    backend.metadata_cache = None
    backend._evictor = Evictor()
    backend.registered_pools = {
        PoolName.SWA: NS(page_size=2, get_data_page=lambda off, flat=True: torch.zeros(4))
    }
    # what HookRegistry's AROUND installs on the class
    monkeypatch.setattr(
        HiCacheFile, "set", lambda self, *a, **kw: AROUND_SET(REAL_SET, self, *a, **kw)
    )
    monkeypatch.setattr(
        HiCacheFile, "exists", lambda self, *a, **kw: AROUND_EXISTS(REAL_EXISTS, self, *a, **kw)
    )

    controller = object.__new__(HybridCacheController)
    controller.mem_pool_host = NS(layout_lease=contextlib.nullcontext)
    controller.storage_config = NS(is_storage_writer=True)
    controller.storage_backend = backend
    controller.page_size = 2
    controller.page_set_func = lambda *a: True

    cache = StorageExistenceCache(1024)
    feed = wp.WritePath(WriteAccounting(), cache)
    feed.controller = controller
    wp.attach(feed)
    try:
        intent = NS(snapshot=NS(hash_values=pages, node_id=1), pool=PoolName.SWA)
        pipeline = NS(_cache=NS(cache_controller=controller, storage_existence_cache=cache))
        feed.launched(pipeline, intent, {PoolName.SWA: pages})
        swa = PoolTransfer(
            name=PoolName.SWA,
            host_indices=torch.arange(6),
            keys=list(pages),
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        op = StorageOperation(
            torch.arange(0), [], hash_value=[], prefix_keys=None, pool_transfers=[swa]
        )
        AROUND_BACKUP(HybridCacheController._page_backup, controller, op)  # upstream's own
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.SWA: 1}  # leading run
        feed.acked(NS(intent=intent, keys_by_pool={PoolName.SWA: pages}), feed.take_outcome(op.id))
        s = feed.writes.stats()["swa"]
        assert (s.acknowledged, s.failed) == (1, 2)
        # the only acknowledged page (pages[0]) was newly written: nothing redundant
        assert s.redundant == 0, (
            f"redundant_written{{pool=swa}} = {s.redundant} (a page past the failure)"
        )
    finally:
        wp.detach()


# Buffer mode, a tree with a KV-derived sidecar (DSA indexer): the same decision, "KV and
# its riding indexer are covered, nothing to write", counts the indexer's pages avoided at
# admission (real _write_intents) but not when a queued KV intent is retired at launch for
# that reason (real flush_pending_writes -> _drop_queue_head(dropped=False)).


REAL_DROP = BufferModePipeline._drop_queue_head
DROP = wh.hook("._drop_queue_head").bound(REAL_DROP)
KEYS = [f"{i:064x}" for i in range(3)]


class Pipe(BufferModePipeline):
    def __init__(self, cache):  # only what upstream's flush / _write_intents read
        cc = NS(
            mem_pool_host=NS(size=1 << 20), prefetch_tokens_occupied=0, start_writing=lambda: None
        )
        self._cache = NS(
            cache_controller=cc,
            storage_existence_cache=cache,
            page_size=4,
            enable_storage_metrics=False,
            storage_metrics_collector=None,
            sidecar_pool_specs=[NS(pool_name=PoolName.INDEXER, indices_from_pool=PoolName.KV)],
        )
        self.pending_write_queue = deque()
        self.write_staged_tokens_ = 0
        self.inflight_backup_pools = {}
        self._queued_span_refs = {}
        self.write_backlog_tokens_ = 0

    def _backup_pool_keys(self, snapshot):
        return {PoolName.KV: list(KEYS), PoolName.INDEXER: list(KEYS)}

    def _refresh_pending_backup_intents(self):
        return {i.snapshot.node_id: NS() for i in self.pending_write_queue}

    def _backup_parent_covered(self, state, node_id):
        return True

    def _launch_transfers(self, intent):  # upstream: KV rows, keys per written pool (riders too)
        return [1, 2], {PoolName.KV: list(KEYS), PoolName.INDEXER: list(KEYS)}, []

    def _drop_queue_head(self, *a, **kw):
        return DROP(REAL_DROP, self, *a, **kw)


def avoided(feed, pool):
    s = feed.writes.stats().get(pool)
    return s.avoided if s is not None else 0


def test_retirement_counts_riders_like_admission():
    cache = StorageExistenceCache(64)
    cache.pool("kv").add(KEYS)
    cache.pool("indexer").add(KEYS)
    feed = wp.WritePath(WriteAccounting(), cache)
    wp.attach(feed)
    try:
        p = Pipe(cache)
        wh.install_on(p, "current")  # the per-instance admission hooks, as the plugin does
        assert p._write_intents(NS(node_id=7)) == []  # upstream's admission: all covered
        admission = (avoided(feed, "kv"), avoided(feed, "indexer"))
        assert admission == (3, 3)

        feed2 = wp.WritePath(WriteAccounting(), cache)
        wp.attach(feed2)
        p.pending_write_queue.append(
            NS(snapshot=NS(node_id=7, key=[0] * 12), pool=PoolName.KV, keys=list(KEYS))
        )
        p.inflight_backup_pools[7] = {PoolName.KV}
        p._queued_span_refs[(7, 12)] = 1
        p.flush_pending_writes()  # upstream's own flush: retired, nothing written
        assert not p.pending_write_queue
        retirement = (avoided(feed2, "kv"), avoided(feed2, "indexer"))
        assert retirement == admission, (
            f"retirement avoided (kv, indexer) = {retirement}, admission = {admission}"
        )
    finally:
        wp.detach()


# Cache mode: a prefetch whose host insert upstream drops (write-through refill under an
# un-backed-up node, UnifiedTreeCore.insert_host -> host_insert_dropped) delivers nothing:
# upstream's real _handle_prefetch_result sets loaded=0 and finishes with reason="dropped".
# The pages are recomputed and rewritten; their cause must be prefetch_shortfall.


PAGE = 4
AROUND = wh.hook("._handle_prefetch_result").bound(UnifiedRadixCache._handle_prefetch_result)
AFTER_QUERY = wh.hook("._invalidate_absent_from_hit_query").bound(
    UnifiedRadixCache._invalidate_absent_from_hit_query
)


class Req:
    rid = "r1"


class Tree(UnifiedRadixCache):
    page_size = PAGE
    prefetch_threshold = 4 * PAGE
    host_memory_mode = "cache"
    enable_storage_metrics = False
    storage_metrics_collector = None
    buffer_pipeline = None

    def __init__(self, cache):  # only what upstream's method reads
        self.storage_existence_cache = cache
        self.ongoing_prefetch = {}
        self.prefetch_loaded_tokens_by_reqid = {}
        self.prefetch_loaded_storage_start_by_reqid = {}
        self.finished = []
        self.tree_core = NS(
            insert_host=lambda *a: NS(host_insert_dropped=True, prefix_len=0, cache_actions=[])
        )
        self.cache_controller = NS(
            append_host_mem_release=lambda **kw: None, prefetch_tokens_occupied=8 * PAGE
        )

    def _apply_cache_actions(self, actions):
        pass

    def _resolve_storage_prefetch_tokens(self, *a, **kw):
        pass

    def _finish_storage_prefetch(self, request, **kw):
        self.finished.append(kw)

    def dec_host_lock_ref(self, *a):
        pass


def test_dropped_host_insert_is_a_shortfall():
    cache = StorageExistenceCache(64)
    feed = wp.WritePath(WriteAccounting(), cache, cache_mode=True)
    wp.attach(feed)
    try:
        tree = Tree(cache)
        a = [f"a{i:063x}" for i in range(8)]
        AFTER_QUERY(
            None, tree, NS(all_hash_values=a, storage_hit_count=8 * PAGE, deadline_expired=False)
        )
        req = Req()
        op = NS(
            handle=req,
            hash_value=a,
            completed_tokens=8 * PAGE,
            pool_transfers=None,
            pool_storage_result=NS(extra_pool_hit_pages={}),
            sidecar_hash_values=None,
            deadline_expired=False,
            storage_start=0,
        )
        tree.ongoing_prefetch[req] = (
            0,
            list(range(8 * PAGE)),
            list(range(8 * PAGE)),
            None,
            None,
            {},
        )
        AROUND(UnifiedRadixCache._handle_prefetch_result, tree, op)  # upstream's own
        assert tree.prefetch_loaded_tokens_by_reqid[req] == 0  # upstream: nothing loaded
        assert tree.finished == [{"fulfilled_tokens": 0, "reason": "dropped"}]
        feed.causes.launched("node", a)  # recomputed, written again
        causes = feed.causes.classify("node", a)
        assert causes == {"prefetch_shortfall": 8}, causes
    finally:
        wp.detach()


# (c) Hybrid models on Mooncake: extra pools (mamba, swa, ...) are written by
# MooncakeStore.batch_set_v2, which asks _batch_exist and puts only the missing
# objects (upstream's own _batch_io_v2 below), but the package records existence
# answers only inside batch_set_v1: redundant_written_pages{pool="mamba"} stays 0
# although the store held every page (docs/metrics.md: Mooncake's redundant writes
# come from its existence query; written - redundant = objects stored).
MOONCAKE_HELD = set()
AROUND_EXIST = wh.hook("MooncakeStore._batch_exist").bound(MooncakeStore._batch_exist)


def _exist(self, key_strs):  # the master's answer: 1 = stored
    return [1 if k in MOONCAKE_HELD else 0 for k in key_strs]


class V2Store(MooncakeStore):
    def __init__(self):  # only what _batch_io_v2 reads
        self.registered_pools = {PoolName.MAMBA: NS(page_size=1)}
        self.config_prefix = None

    def _get_hybrid_page_component_keys(self, keys, transfer):
        return [f"{k}_mamba" for k in keys], 1

    def _can_use_group_semantics(self):
        return False

    def batch_set_v2(self, *a, **kw):  # what HookRegistry installs, when a hook exists
        around = wh.hook("MooncakeStore.batch_set_v2").bound(MooncakeStore.batch_set_v2)
        return around(MooncakeStore.batch_set_v2, self, *a, **kw)

    def _batch_exist(self, key_strs):
        return AROUND_EXIST(_exist, self, key_strs)

    def _put_batch_zero_copy_impl(self, keys, ptrs, sizes, *a, **kw):
        MOONCAKE_HELD.update(keys)
        return [0] * len(keys)


def test_mamba_pages_mooncake_held_are_redundant():
    import torch

    cache = StorageExistenceCache(64)
    feed = wp.WritePath(WriteAccounting(), cache)
    wp.attach(feed)
    try:
        keys = [f"{i:064x}" for i in range(3)]
        MOONCAKE_HELD.update(f"{k}_mamba" for k in keys)  # Mooncake holds all three already
        controller = NS(page_size=4, backup_skip=True, should_backup=lambda t: True)
        feed.controller = controller
        answers = feed.begin_backup(controller)
        assert answers is not None
        transfer = PoolTransfer(
            name=PoolName.MAMBA,
            keys=keys,
            host_indices=torch.arange(3),
            hit_policy=PoolHitPolicy.ALL_PAGES,
        )
        results = V2Store().batch_set_v2([transfer])  # upstream's own v2 write
        assert results[PoolName.MAMBA] == [True, True, True]
        op = NS(
            id=9,
            hash_value=[],
            completed_tokens=0,
            pool_transfers=[transfer],
            pool_storage_result=NS(extra_pool_hit_pages={PoolName.MAMBA: 3}),
        )
        feed.end_backup(controller, op, answers)
        intent = NS(snapshot=NS(node_id=1, hash_values=[]))
        feed.acked(NS(intent=intent, keys_by_pool={PoolName.MAMBA: keys}), feed.take_outcome(9))
        mamba = feed.writes.stats()["mamba"]
        assert mamba.acknowledged == 3
        assert mamba.redundant == 3, f"redundant_written_pages{{pool=mamba}} = {mamba.redundant}"
    finally:
        wp.detach()


# (e) /clear_hicache_storage_backend: upstream's UnifiedRadixCache.clear_storage_backend
# empties L3 and then clears the existence cache ("L3 is empty now", its only call of
# clear()).  The package's storage-tier KV events treat clear() as "says nothing
# about L3": the blocks it published as stored in L3 stay published, no BlockRemoved
# (nor anything else) reaches subscribers (e.g. a KV-aware router), which keep
# routing to an L3 copy that no longer exists.


class Captured:
    def __init__(self):
        self.batches = []

    def send(self, ts, events):
        self.batches.append(list(events))

    def close(self):
        pass


class ClearingTree(UnifiedRadixCache):
    def __init__(self, cache):  # only what clear_storage_backend reads
        self.storage_existence_cache = cache
        self._storage_attachment = NS(clear=lambda: True)  # the backend emptied L3

    def clear_storage_backend(self):  # what HookRegistry installs (an AFTER, if any)
        result = UnifiedRadixCache.clear_storage_backend(self)  # upstream's own
        after = getattr(hooks, "after_clear_storage_backend", None)
        if after is not None:
            after(result, self)
        return result


def test_clearing_l3_unpublishes_its_blocks():
    sink = Captured()
    events = em.KvEvents(lambda: sink, medium="DISK")
    assert events.start()
    cache = StorageExistenceCache(64, observer=Tee(events))
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(3)]
    blocks, parent = [], None
    for i, p in enumerate(hashes):
        blocks.append((p, parent, list(range(i * 4, (i + 1) * 4))))
        parent = p
    events.stored(blocks)  # an acknowledged write, published as stored in L3
    cache.pool("kv").add(hashes)
    tree = ClearingTree(cache)
    feed = wp.WritePath(WriteAccounting(), cache)
    feed.events = events  # as ProcessEntry wires it
    wp.attach(feed)
    try:
        assert tree.clear_storage_backend() is True
    finally:
        wp.detach()
    assert events.flush()
    events.close()
    removed = [h for b in sink.batches for e in b if isinstance(e, Removed) for h in e.block_hashes]
    print("published blocks after the clear:", events.snapshot().blocks, "removed:", removed)
    assert events.snapshot().blocks == 0 and len(removed) == 3
