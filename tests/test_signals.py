"""The test run's SIGTERM handling (tests/conftest.py): the pytest process unwinds
on SIGTERM so fixtures stop the servers they started, while a forked child (a
multiprocessing pool worker) keeps the default action, so ``Pool.terminate``
still kills it wherever it is blocked."""

from __future__ import annotations

import os
import signal
import threading


def test_pytest_unwinds_and_a_forked_child_dies_of_sigterm() -> None:
    """In the pytest process SIGTERM raises KeyboardInterrupt; a forked child has
    the default action, and SIGTERM kills it while it blocks on a lock."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its disposition, then block until killed
        try:
            ok = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            os.write(write, b"1" if ok else b"0")
            if not ok:
                os._exit(3)
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # blocks until a signal ends the process
        finally:
            os._exit(3)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    os.close(read)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
