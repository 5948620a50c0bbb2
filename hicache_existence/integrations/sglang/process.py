"""This process's id, read without a system call.

The write-path hooks (and the per-step hook until its first step binds the
tree) look their process's runtime up by pid on every call (a registry keyed
by pid keeps a forked child from stepping its parent's runtime).
``os.getpid()`` is a system call (~200 ns here), paid on every scheduler
event-loop iteration; ``PROCESS.pid`` is an attribute read, refreshed in a
forked child by ``os.register_at_fork`` (spawned children import the module
afresh).
"""

from __future__ import annotations

import os


class _Process:
    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    def refresh(self) -> None:
        self.pid = os.getpid()


#: This process (``PROCESS.pid``).
PROCESS = _Process()
os.register_at_fork(after_in_child=PROCESS.refresh)
