"""Test-only probes in the server processes (not stand-ins: nothing fails without them).

Enabled by the harness with ``HX_PROBES=1``; each writes one ``HX-PROBE {json}`` line
to the process's stderr (the server log), which ``Server.probes()`` reads back.

``tree``
    After ``UnifiedRadixCache.__init__``: the class of the tree's
    ``storage_existence_cache``, so a test sees which implementation the real
    server built (ours with the flag, upstream's without).
"""

from __future__ import annotations

import json
import os
import sys
from types import ModuleType
from typing import Any

import hx_cpu_standins


def emit(kind: str, **fields: Any) -> None:
    rec = {"kind": kind, "pid": os.getpid(), **fields}
    sys.stderr.write("HX-PROBE " + json.dumps(rec, sort_keys=True) + "\n")
    sys.stderr.flush()


def _probe_tree(mod: ModuleType) -> None:
    cls = mod.UnifiedRadixCache
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        cache = getattr(self, "storage_existence_cache", None)
        kind = type(cache)
        emit("tree", cache_class=f"{kind.__module__}.{kind.__qualname__}")

    cls.__init__ = __init__


def install() -> None:
    hx_cpu_standins.on_import("sglang.srt.mem_cache.unified_radix_cache", _probe_tree)
