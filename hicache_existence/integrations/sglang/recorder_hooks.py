"""Request boundaries for the trace recorder: one AROUND hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree after its
prefill (and again at its end, for what it generated): in buffer mode its walk
presents every node of the request's path to write admission, parent first, so
the lookups inside one insert are that request's page chain.  The hook brackets
each insert (``Recorder.begin_request`` / ``end_request``), tagging the lookups
in between, from which a replay rebuilds each chain.  A few Python frames per
request, on the scheduler thread: cheaper than ``match_prefix``, called several
times per request, whose page hashes cover only the matched part.

The hook is registered whenever the package is enabled (the recorder's
configuration may come from a server flag read after registration), so most
servers run it without a recorder: that path is one frame, a dict lookup and an
attribute read before upstream's call, written inline.
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import Hooked
from hicache_existence.integrations.sglang.write_path import FEEDS

TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"


def around_insert(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``UnifiedRadixCache.insert``: one request boundary for the recorder."""
    feed = FEEDS.get(PROCESS.pid)
    if feed is None:
        return original(tree, *a, **kw)
    recorder = feed.recorder
    if recorder is None or getattr(tree, "storage_existence_cache", None) is not feed.cache:
        return original(tree, *a, **kw)
    recorder.begin_request()
    try:
        return original(tree, *a, **kw)
    finally:
        recorder.end_request()
