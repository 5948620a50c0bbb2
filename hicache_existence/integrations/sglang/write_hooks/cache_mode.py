"""Cache mode's write-path hooks, and the prefetch dispositions both modes use.

``write_backup_storage`` brackets a node's L3 write, whose ``write_storage`` call
the cache-mode path counts (and, with ``cache_mode.dedup``, reduces).  The
hit-query drain and ``_handle_prefetch_result`` feed the causes of redundant
writes (and cache mode's heal).
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import (
    Hooked,
    Param,
    Params,
)
from hicache_existence.integrations.sglang.write_path import FEEDS


def write_backup_storage(p: Params) -> Hooked:
    node_at = p["node_id"].index

    def around_write_backup_storage(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``UnifiedRadixCache.write_backup_storage(node_id)`` (cache mode): the
        L3 write of one node, whose ``write_storage`` call the cache-mode path counts
        (and reduces with ``cache_mode.dedup``).  No helper calls: it runs at every
        node write, on the scheduler thread."""
        feed = FEEDS.get(PROCESS.pid)
        cache_mode = feed.cache_mode if feed is not None else None
        if (
            feed is None
            or cache_mode is None
            or getattr(tree, "storage_existence_cache", None) is not feed.cache
        ):
            return original(tree, *a, **kw)
        cache_mode.node = a[node_at] if 0 <= node_at < len(a) else kw.get("node_id")
        cache_mode.in_node = True
        try:
            return original(tree, *a, **kw)
        finally:
            cache_mode.node, cache_mode.in_node = None, False

    return around_write_backup_storage


def write_storage(p: Params) -> Hooked:
    # Where a deduplicated write's changed arguments go (the parameters the target has).
    places = tuple((q.name, q.index) for q in p.values() if q.index != Param.ABSENT)
    # Read inline below (by position, else by their name): a parameter read through
    # its ``Param`` is a frame per node write.
    host_at, tokens_at = p["host_indices"].index, p["token_ids"].index
    hashes_at, prefix_at, extra_at = (
        p[n].index for n in ("hash_value", "prefix_keys", "extra_pools")
    )

    def around_write_storage(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``write_storage`` (both controllers) inside a cache-mode node write:
        look the pages up, leave the believed out with ``cache_mode.dedup``, count.
        The node write's first ``write_storage`` is ours; nothing nested is."""
        feed = FEEDS.get(PROCESS.pid)
        cache_mode = feed.cache_mode if feed is not None else None
        if feed is None or cache_mode is None or not cache_mode.in_node:
            return original(controller, *a, **kw)
        node, cache_mode.node, cache_mode.in_node = cache_mode.node, None, False
        plan = None
        try:
            n = len(a)
            prefix_keys = a[prefix_at] if 0 <= prefix_at < n else kw.get("prefix_keys")
            if feed.controller is None:
                feed.controller = controller
            plan = cache_mode.plan(
                a[hashes_at] if 0 <= hashes_at < n else kw.get("hash_value"),
                a[extra_at] if 0 <= extra_at < n else kw.get("extra_pools"),
                prefix_keyed=prefix_keys is not None,
            )
            if plan.keep is not None or not plan.extra_written:  # ``not plan.whole``
                plan, changes = feed.cache_write_changes(
                    plan,
                    controller,
                    a[host_at] if 0 <= host_at < n else kw.get("host_indices"),
                    a[tokens_at] if 0 <= tokens_at < n else kw.get("token_ids"),
                    prefix_keys,
                )
                if changes:  # replaced where they sit (inline: no frame per node write)
                    args, kwargs = list(a), dict(kw)
                    for name, i in places:
                        if name in changes:
                            if 0 <= i < n:
                                args[i] = changes[name]
                            else:
                                kwargs[name] = changes[name]
                    a, kw = tuple(args), kwargs
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


def hit_query(p: Params) -> Hooked:
    operation_of = p["operation"]

    def after_hit_query(result: Any, tree: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_invalidate_absent_from_hit_query(operation)`` (rank-agreed hit
        query drain): heal the beliefs in cache mode (upstream heals nothing there);
        in both modes, remember stored pages found too short to prefetch."""
        feed = FEEDS.get(PROCESS.pid)
        if feed is not None and getattr(tree, "storage_existence_cache", None) is feed.cache:
            try:
                feed.hit_query(tree, operation_of(a, kw))
            except Exception as exc:  # accounting never raises into the scheduler
                feed.error(exc)
        return None

    return after_hit_query


def prefetch_result(p: Params) -> Hooked:
    operation_at, operation_key = p["operation"].index, p["operation"].name  # read inline

    def around_prefetch_result(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_handle_prefetch_result(operation)`` (rank-synchronised): the
        pages a prefetch loaded from L3, and those it requested but did not load
        (read before upstream consumes the operation, recorded after it).  Written
        without helper calls: it runs at every finished prefetch."""
        feed = FEEDS.get(PROCESS.pid)
        if feed is None or getattr(tree, "storage_existence_cache", None) is not feed.cache:
            return original(tree, *a, **kw)
        try:
            operation: Any = (
                a[operation_at] if 0 <= operation_at < len(a) else kw.get(operation_key)
            )
            requested = list(operation.hash_value or ())
            page = int(tree.page_size)
            loaded = int(operation.completed_tokens) // page
            if loaded and _discarded(operation, len(requested) * page):
                loaded = 0  # upstream's all-or-nothing check drops the whole prefetch
        except Exception as exc:  # accounting never raises into the scheduler
            feed.error(exc)
            return original(tree, *a, **kw)
        result = original(tree, *a, **kw)
        try:
            if loaded:
                # Upstream's own verdict, which it sets on every path: a host insert
                # it dropped (cache mode: a refill under a node not backed up) or a
                # fetch it could not stage (buffer mode) delivered nothing.
                got = getattr(tree, "prefetch_loaded_tokens_by_reqid", None) or {}
                if got.get(getattr(operation, "handle", None)) == 0:
                    loaded = 0
            feed.causes.prefetched(requested, loaded)
        except Exception as exc:
            feed.error(exc)
        return result

    return around_prefetch_result


def _discarded(operation: Any, expected_tokens: int) -> bool:
    """Whether upstream's ``_check_hybrid_prefetch_result`` discards this prefetch
    (an extra pool, not KV-derived, short of its keys, or KV short of the span):
    nothing of it is delivered, whatever ``completed_tokens`` says."""
    pools = [
        t
        for t in getattr(operation, "pool_transfers", None) or ()
        if getattr(t, "indices_from_pool", None) != "kv"
    ]
    if not pools:
        return False
    result = getattr(operation, "pool_storage_result", None)
    hits = getattr(result, "extra_pool_hit_pages", None) or {}
    return int(operation.completed_tokens) != expected_tokens or not all(
        t.keys is not None and hits.get(t.name, 0) == len(t.keys) for t in pools
    )
