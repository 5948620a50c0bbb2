"""Buffer mode's write-path hooks: admission, D2H launch, storage ack.

Both API generations: the current one decides admissions in
``BufferModePipeline._write_intents``, the flat one (0.5.19-0.5.21) in
``enqueue_backup_intent`` through our flat cache's ``covers_all``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import (
    SKIP,
    Hooked,
    Params,
    bracketed,
    guard,
    read_then_account,
)
from hicache_existence.integrations.sglang.write_path import FEEDS, WritePath


# -- admission (current generation) ---------------------------------------------------------
def refresh_pending(p: Params) -> Hooked:
    return bracketed(
        lambda feed, pipeline, a, kw: feed.begin_refresh(),
        lambda feed, _: feed.end_refresh(),
        "around_refresh_pending",
        """AROUND ``_refresh_pending_backup_intents``: its split repairs re-examine
        admitted intents through ``_write_intents``; they are not new decisions.""",
    )


def backup_pool_keys(p: Params) -> Hooked:
    def after_backup_pool_keys(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_backup_pool_keys`` (only ``_write_intents`` calls it): the keys
        the next decision is about, outside a queue refresh (its repairs are not)."""
        feed = FEEDS.get(PROCESS.pid)
        if feed is not None and not feed.refreshing:
            feed.pool_keys = result
        return None

    return after_backup_pool_keys


def write_intents(p: Params) -> Hooked:
    def after_write_intents(intents: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_write_intents``: outside a queue refresh, an admission (once per
        node per insert walk, after upstream's dedupe); pools left out are avoided.
        (It needs only the result: an AFTER hook adds no call of upstream's own.)"""
        feed = FEEDS.get(PROCESS.pid)
        if feed is not None and feed.pool_keys is not None:
            try:
                feed.admission(pipeline, intents)
            except Exception as exc:  # accounting never raises into the scheduler
                feed.error(exc)
        return None

    return after_write_intents


def drop_queue_head(p: Params) -> Hooked:
    dropped_of = p["dropped"]

    def read(feed: WritePath, pipeline: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        drops = dropped_of(a, kw, True) is False
        queue = getattr(pipeline, "pending_write_queue", None) if drops else None
        return (queue[0].pool, queue[0].keys, pipeline._cache) if queue else None

    return read_then_account(
        "_cache",
        read,
        WritePath.retired,
        "around_drop_queue_head",
        """AROUND ``_drop_queue_head``: ``dropped=False`` retires a queued intent
        whose pool became covered before its launch (avoided at that decision).""",
    )


# -- admission (flat generation) --------------------------------------------------------------
def enqueue_backup_intent(p: Params) -> Hooked:
    node_of = p["node_id"]

    def enter(feed: WritePath, pipeline: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if not feed.owns_tree(getattr(pipeline, "_cache", None)):
            return SKIP
        return feed.begin_admission(node_of(a, kw))

    return bracketed(
        enter,
        lambda feed, _: feed.end_admission(),
        "around_enqueue_backup_intent",
        """AROUND ``enqueue_backup_intent`` (flat generation): one admission
        decision, counted at most once per node per insert walk.""",
    )


def flat_covers_all(p: Params) -> Hooked:
    pool_of, hashes_of = p["pool"], p["hashes"]

    def around_flat_covers_all(original: Hooked, cache: Any, *a: Any, **kw: Any) -> Any:
        """AROUND our flat cache's ``covers_all``: True inside an admission is avoided."""
        covered = original(cache, *a, **kw)
        if covered:
            feed = FEEDS.get(PROCESS.pid)
            if feed is not None and cache is feed.cache:
                guard(feed, lambda: feed.covered_in_admission(pool_of(a, kw), hashes_of(a, kw, ())))
        return covered

    return around_flat_covers_all


def tree_insert(p: Params) -> Hooked:
    return bracketed(
        lambda feed, tree, a, kw: feed.begin_walk() if feed.owns_tree(tree) else SKIP,
        lambda feed, outer: feed.end_walk(outer),
        "around_tree_insert",
        """AROUND ``UnifiedRadixCache.insert`` (flat): one insert walk, inside which
        a node's admission counts once.""",
    )


# -- launch and ack ---------------------------------------------------------------------------
def stage_backup_intent(p: Params) -> Hooked:
    intent_of, keys_of = p["intent"], p["keys_by_pool"]

    def after_stage_backup_intent(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_stage_backup_intent``: True is the D2H launch of the intent's
        pages (flat: the node's KV pages; it passes no ``keys_by_pool``)."""
        if result is not True:
            return None
        feed = FEEDS.get(PROCESS.pid)
        tree = getattr(pipeline, "_cache", None)
        if feed is None or getattr(tree, "storage_existence_cache", None) is not feed.cache:
            return None
        try:
            intent = intent_of(a, kw)
            keys = keys_of(a, kw)
            by_pool = keys if isinstance(keys, Mapping) else {"kv": intent.snapshot.hash_values}
            feed.launched(pipeline, intent, by_pool)
        except Exception as exc:  # accounting never raises into the scheduler
            feed.error(exc)
        return None

    return after_stage_backup_intent


def storage_write_ack(p: Params) -> Hooked:
    op_of = p["operation_id"]

    def read(feed: WritePath, pipeline: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        op_id = op_of(a, kw)
        entry = pipeline.ongoing_backup.get(op_id)
        outcome = feed.take_outcome(op_id)
        return None if entry is None else (entry, outcome)

    return read_then_account(
        "_cache",
        read,
        WritePath.acked,
        "around_storage_write_ack",
        """AROUND ``finish_storage_write_ack``: this rank's outcome of the write,
        read before upstream pops the pipeline's entry.""",
    )
