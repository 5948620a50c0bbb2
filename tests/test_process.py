"""``PROCESS.pid`` (the pid the sglang hooks key their registries by, read
without a system call) is this process's pid, in a forked child too."""

from __future__ import annotations

import os

from hicache_existence.integrations.sglang.process import PROCESS


def test_pid_is_this_process_and_follows_a_fork():
    """The cached pid equals os.getpid() here and, after fork, in the child."""
    assert PROCESS.pid == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        ok = PROCESS.pid == os.getpid() and PROCESS.pid != os.getppid()
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(child, 0)
    assert answer == b"1"
    assert PROCESS.pid == os.getpid()
