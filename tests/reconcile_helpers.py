"""Shared helpers of the reconciler tests: chains, faulty truths, wiring, stepping."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.observers import Tee
from hicache_existence.reconcile.ground_truth import GroundTruthError, TruthUnavailable
from hicache_existence.reconcile.reconciler import Reconciler


def chain(tag: object, n: int) -> list[str]:
    """``n`` chained SHA-256 page hashes (like SGLang's)."""
    out: list[str] = []
    prev = str(tag).encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).hexdigest().encode()
        out.append(prev.decode())
    return out


def wired(
    truth: Any, *, cap: int = 100_000, extra_observers: Sequence[Any] = (), **kwargs: Any
) -> tuple[StorageExistenceCache, Reconciler]:
    """A cache whose observer Tee includes a reconciler over ``truth``."""
    tee = Tee()
    cache = StorageExistenceCache(cap, observer=tee)
    kwargs.setdefault("sampling_rate", 1.0)
    kwargs.setdefault("agree_interval_steps", 1)
    kwargs.setdefault("verifications_per_s", 10_000.0)
    rec = Reconciler(cache, truth, **kwargs)
    tee.observers = (*extra_observers, rec)
    return cache, rec


def step_until_idle(rec: Reconciler, max_steps: int = 2000, pause_s: float = 0.001) -> int:
    """Call ``apply`` (as the scheduler would, once per step) until nothing is
    queued or out; returns the steps taken."""
    for i in range(max_steps):
        rec.apply(i)
        if rec.idle():
            return i + 1
        time.sleep(pause_s)
    raise AssertionError(f"reconciler not idle after {max_steps} steps: {rec.snapshot()}")


class FaultyTruth:
    """Wraps a truth; ``mode`` switches between ok / raise / slow / garbage."""

    def __init__(self, inner: Any, mode: str = "ok", delay_s: float = 0.0) -> None:
        self.inner = inner
        self.mode = mode
        self.delay_s = delay_s
        self.calls = 0
        self.release = threading.Event()

    def leading_present(self, pool: str, hashes: Sequence[str]) -> Any:
        self.calls += 1
        if self.mode == "raise":
            raise TruthUnavailable("down")
        if self.mode == "internal":
            raise RuntimeError("bug")
        if self.mode == "slow":
            time.sleep(self.delay_s)
        if self.mode == "block":
            self.release.wait(10)
        if self.mode == "garbage":
            return "seven"
        if self.mode == "too_big":
            return len(hashes) + 5
        return self.inner.leading_present(pool, hashes)

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        return list(self.inner.present(pool, hashes))


class TrustToggle:
    """A truth whose ``absence_is_evidence`` can be switched off."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trusted = True

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        return int(self.inner.leading_present(pool, hashes))

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        return list(self.inner.present(pool, hashes))

    def absence_is_evidence(self) -> bool:
        return self.trusted


__all__ = [
    "FaultyTruth",
    "GroundTruthError",
    "TrustToggle",
    "chain",
    "step_until_idle",
    "wired",
]


def sglang_storage_config(extra: dict[str, Any], *, page_first: bool, model: str) -> Any:
    """SGLang's own ``HiCacheStorageConfig`` for one rank of TP 1, MHA."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        enable_storage_metrics=False,
        is_mla_model=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )
