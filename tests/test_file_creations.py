"""The real-server tests' L3 rename watcher (``tests/real_server/harness.py``,
``FileCreations``), whose counts the fleet tests compare with the package's written
and redundant pages: two renames onto one page file, queued unread, are two."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_server"))
from harness import FileCreations  # test-only code of the real-server tests

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")


def _rename_onto(directory: Path, name: str, tag: str) -> None:
    """What SGLang's file backend does: write a temporary file, rename it into place."""
    tmp = directory / f".{tag}.tmp"
    tmp.write_bytes(tag.encode())
    os.replace(tmp, directory / name)


def test_back_to_back_renames_onto_one_page_count_twice(tmp_path: Path) -> None:
    """Two instances racing on one page rename it twice with nothing in between.
    Held unread (the watcher's lock), inotify would merge two identical
    ``IN_MOVED_TO`` events into one; the watcher counts both, and other pages once."""
    watcher = FileCreations(tmp_path)
    try:
        with watcher._lock:  # the watcher's thread cannot read while these queue
            _rename_onto(tmp_path, "a.bin", "x")
            _rename_onto(tmp_path, "a.bin", "y")
            _rename_onto(tmp_path, "b.bin", "z")
            (tmp_path / "ignored.txt").write_text("not a page")
    finally:
        counts = watcher.close()
    assert dict(counts) == {"a.bin": 2, "b.bin": 1}
