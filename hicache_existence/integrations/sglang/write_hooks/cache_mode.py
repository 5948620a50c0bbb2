"""Cache mode's write-path hooks, and the prefetch dispositions both modes use.

``write_backup_storage`` brackets a node's L3 write, whose ``write_storage`` call
the cache-mode path counts (and, with ``cache_mode.dedup``, reduces).  The
hit-query drain and ``_handle_prefetch_result`` feed the causes of redundant
writes (and cache mode's heal).
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.write_hooks.binding import (
    SKIP,
    Hooked,
    Params,
    bracketed,
    guard,
    read_then_account,
    replaced,
)
from hicache_existence.integrations.sglang.write_path import WritePath, current


def _write_backup_storage(p: Params) -> Hooked:
    node_of = p["node_id"]

    def enter(feed: WritePath, tree: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        cache_mode = feed.cache_mode
        if cache_mode is None or not feed.owns_tree(tree):
            return SKIP
        cache_mode.begin_node(node_of(a, kw))
        return cache_mode

    return bracketed(
        enter,
        lambda feed, cache_mode: cache_mode.end_node(),
        "around_write_backup_storage",
        """AROUND ``UnifiedRadixCache.write_backup_storage(node_id)`` (cache mode): the
        L3 write of one backed-up node; its ``write_storage`` call is the one the
        cache-mode path counts (and, with ``cache_mode.dedup``, reduces).""",
    )


def _write_storage(p: Params) -> Hooked:
    host_of, tokens_of, hashes_of = p["host_indices"], p["token_ids"], p["hash_value"]
    prefix_of, extra_of = p["prefix_keys"], p["extra_pools"]

    def around_write_storage(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``write_storage`` (both controllers) inside a cache-mode node write:
        look the pages up, leave the believed out with ``cache_mode.dedup``, count."""
        feed = current()
        cache_mode = feed.cache_mode if feed is not None else None
        if feed is None or cache_mode is None or not cache_mode.in_node:
            return original(controller, *a, **kw)
        node = cache_mode.claim()  # one write per node write; nothing nested is ours
        call = None
        try:
            call = feed.plan_cache_write(
                controller,
                host_of(a, kw),
                tokens_of(a, kw),
                hashes_of(a, kw),
                prefix_of(a, kw),
                extra_of(a, kw),
            )
        except Exception as exc:
            feed.error(exc)
        if call is None:  # could not plan: upstream's write, uncounted
            return original(controller, *a, **kw)
        plan, changes = call
        if changes:
            a, kw = replaced(a, kw, changes, (host_of, tokens_of, hashes_of, prefix_of, extra_of))
        operation_id = original(controller, *a, **kw)
        guard(feed, lambda: cache_mode.launched(operation_id, plan, node))
        return operation_id

    return around_write_storage


def _hit_query(p: Params) -> Hooked:
    operation_of = p["operation"]

    def after_hit_query(result: Any, tree: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_invalidate_absent_from_hit_query(operation)`` (rank-agreed hit
        query drain): heal the beliefs in cache mode (upstream heals nothing there);
        in both modes, remember stored pages found too short to prefetch."""
        feed = current()
        if feed is not None and feed.owns_tree(tree):
            guard(feed, lambda: feed.hit_query(tree, operation_of(a, kw)))
        return None

    return after_hit_query


def _prefetch_result(p: Params) -> Hooked:
    operation_of = p["operation"]

    def read(feed: WritePath, tree: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        operation = operation_of(a, kw)
        return list(operation.hash_value or ()), int(operation.completed_tokens)

    return read_then_account(
        WritePath.owns_tree,
        read,
        lambda feed, tree, seen: feed.prefetched(tree, *seen),
        "around_prefetch_result",
        """AROUND ``_handle_prefetch_result(operation)`` (rank-synchronised): the
        pages a prefetch loaded from L3, and those it requested but did not load
        (read before upstream consumes the operation).""",
    )
