"""A test-only L3 whose writes fail on demand (not a stand-in: nothing needs it).

``FailingFileStorage`` is SGLang's own file backend (``HiCacheFile``, unchanged
apart from ``set``), loaded with ``--hicache-storage-backend dynamic``::

    {"backend_name": "hx-failing-file", "module_path": "hx_failing_storage",
     "class_name": "FailingFileStorage", "fail_writes_file": "/path/to/trigger"}

While the trigger file exists it holds a number N: the next N page writes (calls
of ``set``) go through, every later one is refused until the file is removed:
``set`` returns False without touching the disk, as the file backend itself does
when its evictor refuses a page. SGLang's ``batch_set`` stops at the first refused
page and its ``_page_backup`` counts the whole batch (up to 128 pages) as not
stored, so a write launched with more pages than N left stores the first N and
fails the rest of their batch. Each refused page writes one
``HX-PROBE {"kind": "write_refused"}`` line (``hx_probes.emit``) to the log.
"""

from __future__ import annotations

from typing import Any

from hx_probes import emit
from sglang.srt.mem_cache.hicache_storage import HiCacheFile


class FailingFileStorage(HiCacheFile):
    """``HiCacheFile`` whose ``set`` fails while ``fail_writes_file`` says so."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)
        extra = storage_config.extra_config or {}
        self._trigger = str(extra["fail_writes_file"])
        self._passed = 0

    def _allowance(self) -> int | None:
        """Writes allowed while the trigger exists (None: no trigger)."""
        try:
            with open(self._trigger) as f:
                return int(f.read().strip() or 0)
        except FileNotFoundError:
            return None

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        allowed = self._allowance()
        if allowed is None:
            self._passed = 0
        elif self._passed >= allowed:
            emit("write_refused", key=key, passed=self._passed)
            return False
        else:
            self._passed += 1
        return bool(super().set(key, value, target_location, target_sizes))
