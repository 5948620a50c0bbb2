"""Request boundaries for the trace recorder: a hook on the radix tree's insert.

``UnifiedRadixCache.insert`` is where a request's prompt enters the tree (after its
prefill, and at its end): its walk presents every node of the request's path to
write admission, parent first, so the lookups inside one insert are that request's
page chain.  Bracketing it (``Recorder.bracket``) costs about two calls per request,
less than ``match_prefix``, which is called several times per request and covers
only the matched part.

Only a server with a recorder pays for it: the runtime installs the hook at the
first step, on its own tree (``install_on``), not on the class; the plugin only
resolves the target (the recorder may be configured by a flag read later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache_existence.integrations.sglang.targets import TREE

if TYPE_CHECKING:
    from hicache_existence.accounting.recorder import Recorder

TARGET = f"{TREE}.insert"
_CLASS = TARGET.rsplit(".", 2)[1]


def install_on(tree: Any, recorder: Recorder) -> bool:
    """Make each insert into ``tree`` (an instance of the target's class or of a
    subclass) one request of ``recorder``, once; False when ``tree`` is no such
    tree.  It wraps ``tree.insert`` as bound now: class hooks registered later are
    not seen; sglang calls ``insert`` through the instance only (0.5.21, 0.5.23)."""
    if not any(c.__name__ == _CLASS for c in type(tree).__mro__):
        return False
    if hasattr(vars(tree).get("insert"), "hx_brackets"):
        return True
    tree.insert = recorder.bracket(tree.insert)
    return True
