"""The SGLang integration: plugin, hooks, server flags and the fallback launcher.

The only code of the package that imports sglang (always lazily, inside a
function, guarded): importing this sub-package costs nothing and never imports
sglang or torch.

* ``plugin.register`` is the entry point of group ``sglang.srt.plugins``; it is
  inert unless enabled (``--enable-hicache-existence``,
  ``HICACHE_EXISTENCE_ENABLED=1`` or ``"enabled": true`` in the configuration).
* ``flags`` adds the two server flags to sglang's own parser.
* ``hooks`` replaces upstream's existence cache class and steps the runtime
  after every ``UnifiedRadixCache.check_hicache_events``.
* ``launcher`` is the route for an sglang whose parser cannot take the flags.

See docs/enable.md.
"""

from __future__ import annotations
