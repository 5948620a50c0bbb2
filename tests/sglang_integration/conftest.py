"""Fixtures of the real-sglang tests (the harness is ``hx_harness.py``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hx_harness import Scenarios, installed_entry_point, scenario_plan, write_shim


@pytest.fixture(scope="session")
def shim_root(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """A ``.dist-info`` declaring the entry point, only if the install lacks it."""
    if installed_entry_point() is not None:
        return None
    return write_shim(tmp_path_factory.mktemp("entry-point-shim"))


@pytest.fixture(scope="session")
def scenarios(shim_root: Path | None) -> Iterator[Scenarios]:
    s = Scenarios(shim_root)
    plan = scenario_plan(s)
    for key, fn in plan.items():  # start them all: the pool runs two at a time
        s.submit(key, fn)
    yield s
    s.close()
