"""Request boundaries for the trace recorder: one AROUND hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree once its
prefill has run (and again at its end, for what it generated): in buffer mode its
insert walk presents every node of the request's path to write admission, parent
first, so the lookups made inside one insert are that request's page chain.  The
hook numbers each insert (``Recorder.begin_request``) and closes it
(``end_request``), which tags the lookups in between; a replay rebuilds each
request's chain from them.  One Python frame per insert, on the scheduler thread,
a few per request: cheaper than a hook on ``match_prefix``, which the scheduler
calls several times per request while it schedules, and its page hashes exist
only for the matched part.  Without a recorder the hook calls upstream and returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hicache_existence.integrations.sglang.write_path import current

logger = logging.getLogger("hicache_existence.integrations.sglang")

TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"


def around_insert(original: Callable[..., Any], tree: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``UnifiedRadixCache.insert``: one request boundary for the recorder."""
    feed = current()
    recorder = feed.recorder if feed is not None else None
    if recorder is None or feed is None or not feed.owns_tree(tree):
        return original(tree, *a, **kw)
    recorder.begin_request()
    try:
        return original(tree, *a, **kw)
    finally:
        recorder.end_request()


def register(registry: Any, hook_type: Any, resolve: Callable[[str], object]) -> list[str]:
    """Register the insert hook if the installed sglang has the target."""
    try:
        resolve(TARGET)
    except Exception as exc:
        logger.info("hicache-existence: no request boundaries for the recorder (%s)", exc)
        return []
    registry.register(TARGET, around_insert, hook_type.AROUND)
    return [TARGET]
