"""Shared test configuration.

With ``HICACHE_EXISTENCE_REQUIRE_ALL=1`` (set by ``tests/run-all.sh`` and so by CI)
a skipped test fails the run: a skipped test proves nothing, and every tier
(sglang, torch, redis, prometheus, multiprocess) must really run there.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import pytest

REQUIRE_ALL = os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, ``timeout``, a stopped job) unwinds the run like
    Ctrl-C, so fixtures' teardowns still stop what the tests started: sglang
    servers, Redis, Mooncake masters and Prometheus run in sessions of their own,
    which the signal does not reach, and would otherwise outlive the run."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
        # A forked child (a multiprocessing pool worker) must still die of SIGTERM at
        # once, wherever it is blocked: ``Pool.terminate`` relies on it.
        os.register_at_fork(after_in_child=_default_sigterm)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not REQUIRE_ALL:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    skipped = reporter.stats.get("skipped", [])
    if skipped and session.exitstatus == 0:
        reporter.write_line(
            f"HICACHE_EXISTENCE_REQUIRE_ALL=1: {len(skipped)} test(s) skipped; failing the run",
            red=True,
        )
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _logging_restored():
    """Undo what a test's ``cli.main()`` call configured: the CLI sets up the
    process's logging (root handlers, level, structlog), which would otherwise
    change how later tests' log records look (order-dependent failures)."""
    import logging

    root = logging.getLogger()
    package = logging.getLogger("hicache_existence")
    saved = (list(root.handlers), root.level, list(package.handlers), package.level)
    saved_propagate = package.propagate
    yield
    root.handlers[:], package.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    package.setLevel(saved[3])
    package.propagate = saved_propagate
    try:
        import structlog
    except ImportError:  # pragma: no cover - the bare environment
        return
    if structlog.is_configured():
        structlog.reset_defaults()
