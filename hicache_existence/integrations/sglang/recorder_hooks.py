"""Request boundaries for the trace recorder: one AROUND hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree after its
prefill (and again at its end, for what it generated): in buffer mode its walk
presents every node of the request's path to write admission, parent first, so
the lookups inside one insert are that request's page chain.  The hook brackets
each insert (``Recorder.begin_request`` / ``end_request``), tagging the lookups
in between, from which a replay rebuilds each chain.  A few Python frames per
request, on the scheduler thread: cheaper than ``match_prefix``, called several
times per request, whose page hashes cover only the matched part.  Without a
recorder the hook calls upstream and returns.
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.write_hooks.binding import SKIP, bracketed
from hicache_existence.integrations.sglang.write_path import WritePath

TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"


def _begin(feed: WritePath, tree: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    recorder = feed.recorder
    if recorder is None or not feed.owns_tree(tree):
        return SKIP
    recorder.begin_request()
    return recorder


around_insert = bracketed(
    _begin,
    lambda feed, recorder: recorder.end_request(),
    "around_insert",
    """AROUND ``UnifiedRadixCache.insert``: one request boundary for the recorder.""",
)
