"""The ledger-recording storage backend inside the real sglang wheel: loaded by
``StorageBackendFactory`` as ``--hicache-storage-backend dynamic`` would, wrapping
the real ``HiCacheFile`` backend on disk, recording into a real redis-server; and
a test where L3 (the file backend) drops pages and the reconciler finds them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.redis]

sys.path.insert(0, os.path.dirname(__file__))

from reconcile_helpers import chain, sglang_storage_config, step_until_idle, wired  # noqa: E402
from reconcile_redis_server import RedisServer  # noqa: E402


def _require_sglang() -> Any:
    try:
        from sglang.srt.mem_cache import hicache_storage
    except ImportError as exc:
        message = f"the sglang wheel is not importable ({exc}); see tests/envs"
        if (
            os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1"
            or os.environ.get("HICACHE_EXISTENCE_REQUIRE_SGLANG") == "1"
        ):
            pytest.fail(message)
        pytest.skip(message)
    return hicache_storage


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    workdir = tmp_path / "redis"
    workdir.mkdir()
    s = RedisServer(workdir).start()
    yield s
    s.close()


def _wrapper(hs: Any, l3_dir: Path, url: str) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {
        "backend_name": "hicache-existence-ledger",
        "module_path": "hicache_existence.reconcile.storage_adapters",
        "class_name": "LedgerRecordingStorage",
        "inner_backend": "file",
        "file_storage_path": str(l3_dir),
        "ledger_redis_url": url,
        "ledger_namespace": "sgl",
    }
    return StorageBackendFactory.create_backend(
        "dynamic", sglang_storage_config(extra, page_first=False, model="org/model"), None
    )


def _page(value: int) -> Any:
    import torch

    return torch.full((64,), value, dtype=torch.float16)


def test_dynamic_backend_is_a_hicache_storage_recording_writes(
    server: RedisServer, tmp_path: Path
) -> None:
    """The factory loads the wrapper as a real HiCacheStorage subclass around
    HiCacheFile; writes land on disk and in the ledger (shard derived like the file
    backend's key suffix)."""
    hs = _require_sglang()
    from hicache_existence.reconcile import storage_adapters

    cls = storage_adapters.LedgerRecordingStorage
    assert issubclass(cls, hs.HiCacheStorage)
    w = _wrapper(hs, tmp_path / "l3", server.url)
    assert isinstance(w, cls) and isinstance(w.inner_backend, hs.HiCacheFile)
    keys = chain("sgl", 6)
    assert w.batch_set(keys, [_page(i) for i in range(6)]) is True
    assert w.flush_ledger(5)
    assert w.batch_exists(keys) == 6 and len(list((tmp_path / "l3").glob("*.bin"))) == 6
    ledger = w.ledger_ground_truth()
    assert ledger.ledger.settings.shard == "org-model_0_1"
    assert ledger.leading_present("kv", keys) == 6
    assert w.get(keys[0], _page(0)) is not None
    w.close()


def test_other_instance_learns_and_dropped_pages_are_found(
    server: RedisServer, tmp_path: Path
) -> None:
    """Instance B stores through the wrapper; instance A's reconciler learns B's
    pages from the ledger.  Then L3 drops pages (files deleted, as its evictor
    does): ground truth from the real backend finds every stale positive."""
    hs = _require_sglang()
    from hicache_existence.reconcile.storage_adapters import BackendGroundTruth

    l3 = tmp_path / "l3"
    b = _wrapper(hs, l3, server.url)
    chains = [chain(("inst", i), 8) for i in range(6)]
    for c in chains:
        assert b.batch_set(c, [_page(j) for j in range(8)])
    assert b.flush_ledger(5)
    # A believes only the first page of each chain: it learns the rest.
    cache, rec = wired(b.ledger_ground_truth())
    kv = cache.pool("kv")
    for c in chains:
        kv.add(c[:1])
        kv.contains_all(c)
    step_until_idle(rec)
    assert rec.snapshot().pages_learnt == {"kv": 6 * 7}
    rec.close()
    # L3 drops one page of chains 0, 2 and 4.
    inner = b.inner_backend
    for i in (0, 2, 4):
        Path(l3, f"{inner._get_suffixed_key(chains[i][3])}.bin").unlink()
    cache2, rec2 = wired(BackendGroundTruth(b))
    kv2 = cache2.pool("kv")
    for c in chains:
        kv2.add(c)
    for c in chains:
        kv2.contains_all(c)
    step_until_idle(rec2)
    snap = rec2.snapshot()
    assert snap.stale_positives == {"kv": 3} and snap.pages_invalidated == {"kv": 3 * 5}
    # The wrapper's batch_exists saw the absences and taught the ledger too.
    assert b.flush_ledger(5)
    for i in (0, 2, 4):
        assert b.ledger_ground_truth().leading_present("kv", chains[i]) == 3
    rec2.close()
    b.close()
