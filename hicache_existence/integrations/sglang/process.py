"""This process's id, read without a system call.

The write-path hooks (and the step hook until its first step binds the tree)
look their runtime up by pid on every call, so a forked child never steps its
parent's.  ``os.getpid()`` is a system call (~200 ns here) per event-loop
iteration; ``PROCESS.pid`` is an attribute, refreshed in a forked child by
``os.register_at_fork`` (spawned children import the module afresh).
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
