"""Accounting through upstream's own methods (sglang 0.5.23, stubbed state, no
server): paths a reviewer found miscounted, each pinned here by upstream's real
code (``_drop_queue_head``, ``_handle_prefetch_result``, ``_page_backup``), plus
the overlap with what SGLang does itself and the config flag's ``enabled``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections import deque
from types import SimpleNamespace as NS

import pytest

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.integrations.sglang import facts as _facts
from hicache_existence.integrations.sglang import flags, hooks
from hicache_existence.integrations.sglang import upstream_overlap as uo
from hicache_existence.integrations.sglang import write_hooks as wh
from hicache_existence.integrations.sglang import write_path as wp

pytest.importorskip("sglang")

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.buffer_mode.pipeline import BufferModePipeline
from sglang.srt.mem_cache.buffer_mode.storage_existence_cache import (
    default_belief_policy,
)
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

# -- a queued intent retired with nothing left to write ---------------------------

REAL_DROP = BufferModePipeline._drop_queue_head
HOOK = wh.hook("._drop_queue_head").bound(REAL_DROP)


class Pipe(BufferModePipeline):
    def __init__(self, cache):  # no upstream __init__: only what the flush reads
        cc = NS(
            mem_pool_host=NS(size=1 << 20), prefetch_tokens_occupied=0, start_writing=lambda: None
        )
        self._cache = NS(
            cache_controller=cc,
            storage_existence_cache=cache,
            page_size=4,
            enable_storage_metrics=False,
            storage_metrics_collector=None,
        )
        self.pending_write_queue = deque()
        self.write_staged_tokens_ = 0
        self.inflight_backup_pools = {}
        self._queued_span_refs = {}
        self.write_backlog_tokens_ = 0

    def _refresh_pending_backup_intents(self):
        return {i.snapshot.node_id: NS() for i in self.pending_write_queue}

    def _backup_parent_covered(self, state, node_id):
        return True

    def _launch_transfers(self, intent):
        return None  # upstream: "None when nothing is left to write"

    def _drop_queue_head(self, *a, **kw):  # what HookRegistry's AROUND installs
        return HOOK(REAL_DROP, self, *a, **kw)


def test_nothing_left_to_write_is_not_avoided():
    cache = StorageExistenceCache(64)
    feed = wp.WritePath(WriteAccounting(), cache)
    wp.attach(feed)
    try:
        p = Pipe(cache)
        keys = [f"{i:064x}" for i in range(3)]
        intent = NS(snapshot=NS(node_id=7, key=[0] * 12), pool=PoolName.SWA, keys=keys)
        p.pending_write_queue.append(intent)
        p.inflight_backup_pools[7] = {PoolName.SWA}
        p._queued_span_refs[(7, 12)] = 1
        p.flush_pending_writes()  # upstream's own flush
        assert not p.pending_write_queue  # retired with dropped=False
        assert cache.pool("swa").believed(keys) == []  # never covered
        swa = feed.writes.stats().get("swa")
        avoided = swa.avoided if swa is not None else 0
        assert avoided == 0, f"write_avoided_pages{{pool=swa}} = {avoided}, expected 0"
    finally:
        wp.detach()


# -- a prefetch upstream discards (hybrid all-or-nothing) -------------------------

PAGE = 4


class Req:
    def __init__(self, rid):
        self.rid = rid


AROUND = wh.hook("._handle_prefetch_result").bound(UnifiedRadixCache._handle_prefetch_result)
AFTER_QUERY = wh.hook("._invalidate_absent_from_hit_query").bound(
    UnifiedRadixCache._invalidate_absent_from_hit_query
)


class Tree(UnifiedRadixCache):
    page_size = PAGE  # upstream: properties over tree_core
    prefetch_threshold = 4 * PAGE
    host_memory_mode = "cache"

    def __init__(self, cache):  # only what the two upstream methods read
        self.storage_existence_cache = cache
        self.ongoing_prefetch = {}
        self.prefetch_loaded_tokens_by_reqid = {}
        self.prefetch_loaded_storage_start_by_reqid = {}
        self.finished = []

    def _belief_policy(self, pool, hit_policy):
        return default_belief_policy(hit_policy)

    def _finish_storage_prefetch(self, request, **kw):
        self.finished.append(kw)

    def _retire_ongoing_prefetch(self, request, *a):
        self.ongoing_prefetch.pop(request, None)


@pytest.mark.parametrize(
    ("swa_hits", "completed_pages"),
    [({}, 8), ({PoolName.SWA: 2}, 6)],
    ids=["an extra pool short", "kv short of the span"],
)
def test_discarded_prefetch_is_a_shortfall(swa_hits, completed_pages):
    cache = StorageExistenceCache(64)
    feed = wp.WritePath(WriteAccounting(), cache, cache_mode=True)
    wp.attach(feed)
    try:
        tree = Tree(cache)
        a = [f"a{i:063x}" for i in range(8)]
        # a rank-agreed hit query found all 8 pages (above the threshold)
        AFTER_QUERY(
            None, tree, NS(all_hash_values=a, storage_hit_count=8 * PAGE, deadline_expired=False)
        )
        req = Req("r1")
        swa = PoolTransfer(name=PoolName.SWA, keys=a[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        op = NS(
            handle=req,
            hash_value=a,
            completed_tokens=completed_pages * PAGE,
            pool_transfers=[swa],
            pool_storage_result=NS(extra_pool_hit_pages=swa_hits),
            sidecar_hash_values=None,
            deadline_expired=False,
            pool_transfers_done=False,
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
        assert tree.prefetch_loaded_tokens_by_reqid[req] == 0  # upstream: nothing usable
        assert tree.finished == [{"fulfilled_tokens": 0, "reason": "storage_transfer"}]
        # the request recomputes the 8 pages; their node is written again
        feed.causes.launched("node", a)
        causes = feed.causes.classify("node", a)
        assert causes == {"prefetch_shortfall": 8}, causes
    finally:
        wp.detach()


# -- a node write whose later batch fails ------------------------------------------

BACKUP_PAGE = 2
AROUND_BACKUP = wh.hook("HiCacheController._page_backup").bound(HiCacheController._page_backup)
AROUND_SET = wh.hook("HiCacheFile.set").bound(HiCacheFile.set)
AROUND_EXISTS = wh.hook("HiCacheFile.exists").bound(HiCacheFile.exists)


def test_redundant_only_among_acknowledged():
    n = STORAGE_BATCH_SIZE + 2
    pages = [f"{i:064x}" for i in range(n)]
    l3 = {pages[STORAGE_BATCH_SIZE]}  # held already; the page after it fails to write
    bad = pages[STORAGE_BATCH_SIZE + 1]

    def exists(backend, key):
        return key in l3

    def file_set(backend, key, value=None):  # HiCacheFile.set: exists first, then write
        if AROUND_EXISTS(exists, backend, key):
            return True
        if key == bad:
            return False
        l3.add(key)
        return True

    def page_set(hashes, host_indices, extra_info=None):  # _generic_page_set -> batch_set
        return all(AROUND_SET(file_set, None, h) for h in hashes)

    cache = StorageExistenceCache(1024)
    controller = NS(page_size=BACKUP_PAGE, page_set_func=page_set, backup_skip=False)
    pipeline = NS(
        _cache=NS(cache_controller=controller, storage_existence_cache=cache), ongoing_backup={}
    )
    feed = wp.WritePath(WriteAccounting(), cache)
    wp.attach(feed)
    try:
        intent = NS(snapshot=NS(hash_values=pages, node_id=1))
        feed.launched(pipeline, intent, {"kv": pages})
        op = NS(
            id=5,
            hash_value=pages,
            host_indices=list(range(n * BACKUP_PAGE)),
            prefix_keys=None,
            completed_tokens=0,
        )
        AROUND_BACKUP(HiCacheController._page_backup, controller, op)  # upstream's own
        assert op.completed_tokens == STORAGE_BATCH_SIZE * BACKUP_PAGE
        pipeline.ongoing_backup[5] = NS(intent=intent, keys_by_pool={"kv": pages})
        feed.acked(pipeline.ongoing_backup[5], feed.take_outcome(5))
        kv = feed.writes.stats()["kv"]
        assert (kv.acknowledged, kv.failed) == (STORAGE_BATCH_SIZE, 2)
        # none of the 128 acknowledged pages was held before
        assert kv.redundant == 0, f"redundant_written = {kv.redundant} (a failed page)"
    finally:
        wp.detach()


# -- what SGLang already does itself ------------------------------------------------


def test_no_events_of_ours_when_sglang_emits_them():
    config = Config()
    config = dataclasses.replace(
        config,
        enabled=True,
        events=dataclasses.replace(config.events, enabled=True),
        divergence=dataclasses.replace(config.divergence, enabled=False),
        metrics=dataclasses.replace(config.metrics, enabled=False),
    )
    facts = _facts.SchedulerFacts(
        host_memory_mode="buffer_only", storage_backend="mooncake", hierarchical_cache=True
    )
    overlap = uo.Overlap(external_events="sglang...UnifiedRadixCache._drain_backup")
    assert "EXTERNAL storage events" in overlap.describe()  # what the start-up line says
    entry = hooks.build_entry("current", None, facts, config, overlap)
    try:
        assert entry.runtime.events is None, "the package still emits its own storage events"
        assert entry.write_path.events is None
    finally:
        entry.close()


OWNER = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"


def consensus(fn):  # what sglang's rank_consensus does when its checker is on
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        return fn(*a, **kw)

    return wrapper


class TreeThatDedups:
    @consensus
    def write_backup_storage(self, node_id):
        if self.storage_existence_cache.pool("kv").covered([]):
            return None
        return node_id


def test_dedup_is_recognised_through_two_wrappers():
    ours = _wrap_fn(
        TreeThatDedups.write_backup_storage, lambda orig, *a, **k: orig(*a, **k), HookType.AROUND
    )  # this package's AROUND, as HookRegistry applies it

    def resolve(target):
        if target == OWNER:
            return TreeThatDedups
        if target == f"{OWNER}.write_backup_storage":
            return ours
        raise LookupError(target)

    assert uo.dedup_target(resolve) is not None


# -- the config flag's enabled ----------------------------------------------------


def test_enabled_in_the_config_flag_enables_the_schedulers(monkeypatch):
    # Restored at teardown: the flag sets the variable in this process, as it must.
    monkeypatch.setenv(flags.ENV_ENABLED, "0")
    monkeypatch.delenv(flags.ENV_ENABLED)
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    ns = parser.parse_args([flags.CONFIG_FLAG, '{"enabled": true}'])
    record = argparse.Namespace()  # stands for ServerArgs
    got = flags.around_from_cli_args(lambda cls, args: record, object, ns)
    # the configuration carried to the schedulers says enabled ...
    assert json.loads(flags.stored_values(got).config)["enabled"] is True
    # ... a scheduler process (spawned: inherits this environment) loads the plugin
    env = dict(os.environ)
    code = (
        "from hicache_existence.integrations.sglang import plugin;"
        "plugin.register(); s = plugin.status();"
        "print(s.get('enabled'), s.get('cache'))"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert out == "True True", f"scheduler plugin: enabled, cache hooks = {out}"


def test_the_config_flag_without_enabled_switches_nothing_on(monkeypatch):
    """Only ``"enabled": true`` (or the bare flag) switches the schedulers on."""
    monkeypatch.setenv(flags.ENV_ENABLED, "0")
    monkeypatch.delenv(flags.ENV_ENABLED)
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    for text in ('{"metrics": {"port": 0}}', '{"enabled": false}'):
        ns = parser.parse_args([flags.CONFIG_FLAG, text])
        flags.around_from_cli_args(lambda cls, args: argparse.Namespace(), object, ns)
        assert flags.ENV_ENABLED not in os.environ
