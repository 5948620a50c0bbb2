"""Request boundaries for the trace recorder: a hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree after its
prefill (and again at its end, for what it generated): in buffer mode its walk
presents every node of the request's path to write admission, parent first, so
the lookups inside one insert are that request's page chain.  The hook brackets
each insert (``Recorder.begin_request`` / ``end_request``), tagging the lookups
in between, from which a replay rebuilds each chain.  A few Python frames per
request, on the scheduler thread: cheaper than ``match_prefix``, called several
times per request, whose page hashes cover only the matched part.

Only a server with a recorder pays for it: the hook is installed at the first
step on the tree that holds this process's cache (``install_on``, before its
first insert: the first step comes before the first batch), not registered on
the class, where every insert of every server would run it.  The recorder's
configuration may come from a server flag, read after the plugin registers its
hooks, so the plugin only resolves the target (a renamed ``insert`` is reported
there) and the runtime installs the hook once it knows.
"""

from __future__ import annotations

import functools
from typing import Any

from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import Hooked
from hicache_existence.integrations.sglang.write_path import FEEDS

TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"
_CLASS = TARGET.rsplit(".", 2)[1]


def around_insert(original: Hooked, *a: Any, **kw: Any) -> Any:
    """``tree.insert`` (``original``, bound) as one request boundary for the write
    path's recorder (none attached: upstream's call alone)."""
    feed = FEEDS.get(PROCESS.pid)
    recorder = feed.recorder if feed is not None else None
    if recorder is None:
        return original(*a, **kw)
    recorder.begin_request()
    try:
        return original(*a, **kw)
    finally:
        recorder.end_request()


def install_on(tree: Any) -> bool:
    """Bracket ``tree``'s inserts (an instance of the target's class or of a subclass:
    the class's own hooks, other plugins' included, still run inside), once; False
    when ``tree`` is no such tree."""
    if not any(c.__name__ == _CLASS for c in type(tree).__mro__):
        return False
    current = vars(tree).get("insert")
    if isinstance(current, functools.partial) and current.func is around_insert:
        return True
    # A C partial, not a closure: no frame of ours beside the hook's own.
    tree.insert = functools.partial(around_insert, tree.insert)
    return True
