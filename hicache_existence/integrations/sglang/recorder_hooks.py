"""Request boundaries for the trace recorder: a hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree after its
prefill (and again at its end, for what it generated): in buffer mode its walk
presents every node of the request's path to write admission, parent first, so
the lookups inside one insert are that request's page chain.  The tree's insert
is bracketed (``Recorder.bracket``: ``begin_request`` / ``end_request``'s work in
one C call, or one frame without a compiler), tagging the lookups in between,
from which a replay rebuilds each chain.  About two per request, on the scheduler
thread: cheaper than ``match_prefix``, called several times per request, whose
page hashes cover only the matched part.

Only a server with a recorder pays for it: the hook is installed at the first
step on the tree that holds this process's cache (``install_on``, before its
first insert: the first step comes before the first batch), not registered on
the class, where every insert of every server would run it.  The recorder's
configuration may come from a server flag, read after the plugin registers its
hooks, so the plugin only resolves the target (a renamed ``insert`` is reported
there) and the runtime installs the hook once it knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_existence.accounting.recorder import Recorder

TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"
_CLASS = TARGET.rsplit(".", 2)[1]


def install_on(tree: Any, recorder: Recorder) -> bool:
    """Make each insert into ``tree`` (an instance of the target's class or of a
    subclass) one request of ``recorder`` (``Recorder.bracket``), once; False when
    ``tree`` is no such tree.  The bracket wraps ``tree.insert`` as bound now: hooks
    on the class registered by then (other plugins' included) run inside it, later
    ones are not seen; an outer insert is one request however often it calls its
    class's (a subclass's ``super().insert``); sglang calls ``insert`` through the
    instance only (0.5.21, 0.5.23)."""
    if not any(c.__name__ == _CLASS for c in type(tree).__mro__):
        return False
    if hasattr(vars(tree).get("insert"), "hx_brackets"):
        return True
    tree.insert = recorder.bracket(tree.insert)
    return True
