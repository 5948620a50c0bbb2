"""Cache mode's write-path hooks, and the prefetch dispositions both modes use.

``write_backup_storage`` brackets a node's L3 write, whose ``write_storage`` call
the cache-mode path counts (and, with ``cache_mode.dedup``, reduces).  The
hit-query drain and ``_handle_prefetch_result`` feed the causes of redundant
writes (and cache mode's heal).
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.write_hooks.binding import (
    Hooked,
    Params,
    read_then_account,
    replaced,
)
from hicache_existence.integrations.sglang.write_path import WritePath, current


def _write_backup_storage(p: Params) -> Hooked:
    node_of = p["node_id"]

    def around_write_backup_storage(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``UnifiedRadixCache.write_backup_storage(node_id)`` (cache mode): the
        L3 write of one backed-up node; its ``write_storage`` call is the one the
        cache-mode path counts (and, with ``cache_mode.dedup``, reduces).  Written
        without helper calls: it runs at every node write, on the scheduler thread."""
        feed = current()
        cache_mode = feed.cache_mode if feed is not None else None
        if (
            feed is None
            or cache_mode is None
            or getattr(tree, "storage_existence_cache", None) is not feed.cache
        ):
            return original(tree, *a, **kw)
        cache_mode.node, cache_mode.in_node = node_of(a, kw), True
        try:
            return original(tree, *a, **kw)
        finally:
            cache_mode.node, cache_mode.in_node = None, False

    return around_write_backup_storage


def _write_storage(p: Params) -> Hooked:
    host_of, tokens_of, hashes_of = p["host_indices"], p["token_ids"], p["hash_value"]
    prefix_of, extra_of = p["prefix_keys"], p["extra_pools"]
    changed = (host_of, tokens_of, hashes_of, prefix_of, extra_of)

    def around_write_storage(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``write_storage`` (both controllers) inside a cache-mode node write:
        look the pages up, leave the believed out with ``cache_mode.dedup``, count.
        The node write's first ``write_storage`` is ours; nothing nested is."""
        feed = current()
        cache_mode = feed.cache_mode if feed is not None else None
        if feed is None or cache_mode is None or not cache_mode.in_node:
            return original(controller, *a, **kw)
        node, cache_mode.node, cache_mode.in_node = cache_mode.node, None, False
        plan = None
        try:
            prefix_keys = prefix_of(a, kw)
            plan = feed.plan_cache_write(controller, hashes_of(a, kw), prefix_keys, extra_of(a, kw))
            if plan is not None and not plan.whole:
                plan, changes = feed.cache_write_changes(
                    plan, controller, host_of(a, kw), tokens_of(a, kw), prefix_keys
                )
                if changes:
                    a, kw = replaced(a, kw, changes, changed)
        except Exception as exc:
            feed.error(exc)
            plan = None
        if plan is None:  # could not plan: upstream's write as it was, uncounted
            return original(controller, *a, **kw)
        operation_id = original(controller, *a, **kw)
        try:
            cache_mode.launched(operation_id, plan, node)
        except Exception as exc:  # accounting never raises into the scheduler
            feed.error(exc)
        return operation_id

    return around_write_storage


def _hit_query(p: Params) -> Hooked:
    operation_of = p["operation"]

    def after_hit_query(result: Any, tree: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_invalidate_absent_from_hit_query(operation)`` (rank-agreed hit
        query drain): heal the beliefs in cache mode (upstream heals nothing there);
        in both modes, remember stored pages found too short to prefetch."""
        feed = current()
        if feed is not None and getattr(tree, "storage_existence_cache", None) is feed.cache:
            try:
                feed.hit_query(tree, operation_of(a, kw))
            except Exception as exc:  # accounting never raises into the scheduler
                feed.error(exc)
        return None

    return after_hit_query


def _prefetch_result(p: Params) -> Hooked:
    operation_of = p["operation"]

    def read(feed: WritePath, tree: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        operation = operation_of(a, kw)
        return tree, list(operation.hash_value or ()), int(operation.completed_tokens)

    return read_then_account(
        None,
        read,
        WritePath.prefetched,
        "around_prefetch_result",
        """AROUND ``_handle_prefetch_result(operation)`` (rank-synchronised): the
        pages a prefetch loaded from L3, and those it requested but did not load
        (read before upstream consumes the operation).""",
    )
