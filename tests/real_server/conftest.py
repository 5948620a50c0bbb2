"""Fixtures of the real-server tests (the harness is ``harness.py``).

The real-server tier needs what a real ``sglang.launch_server`` process needs: sglang
0.5.23 with the "full" + "server" pins of ``tests/envs/sglang-requirements.txt``.
Where that does not import, the tests are skipped with the reason, which
``HICACHE_EXISTENCE_REQUIRE_ALL=1`` (CI) turns into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

MISSING = [
    name
    for name in ("sglang", "torch", "uvloop", "fastapi", "xgrammar", "prometheus_client")
    if importlib.util.find_spec(name) is None
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not MISSING:
        return
    skip = pytest.mark.skip(
        reason=f"a real sglang server needs {', '.join(MISSING)} (tests/envs, full flavour)"
    )
    for item in items:
        if "real_server" in str(item.fspath):
            item.add_marker(skip)
