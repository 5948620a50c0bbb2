"""Ground truth from a Mooncake store, reading its raw existence codes.

SGLang's ``MooncakeStore.batch_exists`` counts the leading pages whose objects
the store client reports with code 1 and takes every other code for absent.
The client answers ``batch_is_exist`` with a negative code per key when it
cannot reach the master (0.3.13.post1: -900 for every key while
``mooncake_master`` is down, after up to ~9 s of reconnect attempts), so there
an outage reads as "no page is stored".  This adapter asks the store client
itself and raises ``TruthUnavailable`` on any code but 0 (absent) or 1 (present).

Keys derive from the backend's own attributes as SGLang names a KV page's
objects: ``<prefix>_<page hash>_<suffix>_k`` (and ``_v`` for MHA).  The master
leases every object ``batch_is_exist`` finds (docs/reconciler.md, "Probes lease
what they find"); ``lease_counts()`` counts those leases.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from hicache_existence.reconcile.ground_truth import (
    GarbageAnswer,
    TruthUnavailable,
    UnsupportedPool,
    check_chain,
)

KV = "kv"


def is_mooncake_backend(backend: Any) -> bool:
    """Whether ``backend`` looks like SGLang's ``MooncakeStore`` (a store client
    with ``batch_is_exist`` and the key-layout attributes)."""
    client = getattr(backend, "store", None)
    return (
        callable(getattr(client, "batch_is_exist", None))
        and callable(getattr(backend, "_tag_keys", None))
        and hasattr(backend, "mha_suffix")
    )


class MooncakeGroundTruth:
    """``leading_present`` / ``present`` of KV pages in a Mooncake store; errors
    of the store client raise instead of reading as absent."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._leasing_queries = 0
        self._leased_objects = 0

    def lease_counts(self) -> dict[str, int]:
        """Answers that leased something (any thread): ``queries`` that found an
        object, ``objects`` found (each leased for ``default_kv_lease_ttl``)."""
        with self._lock:
            return {"queries": self._leasing_queries, "objects": self._leased_objects}

    def leased_objects(self) -> int:
        """``lease_counts()["objects"]``: what the reconciler exports
        (``hicache_existence_reconciler_objects_leased_total``)."""
        return self.lease_counts()["objects"]

    def _objects(self, hashes: Sequence[str]) -> tuple[list[str], int]:
        """The store keys of ``hashes`` in page order and how many each page has."""
        b = self._backend
        tagged = b._tag_keys(list(hashes))
        if getattr(b, "is_mla_backend", False):
            return [f"{key}_{b.mla_suffix}_k" for key in tagged], 1
        suffixes = b.mha_suffix if getattr(b, "should_split_heads", False) else [b.mha_suffix]
        keys = [f"{key}_{suffix}_{kv}" for key in tagged for suffix in suffixes for kv in "kv"]
        return keys, 2 * len(suffixes)

    def _codes(self, pool: str, hashes: Sequence[str]) -> tuple[list[int], int]:
        name, seq = check_chain(pool, hashes)
        if name != KV:
            raise UnsupportedPool(f"Mooncake ground truth answers the kv pool only, not {name!r}")
        if not seq:
            return [], 1
        keys, per_page = self._objects(seq)
        try:
            codes = self._backend.store.batch_is_exist(keys)
        except Exception as exc:
            raise TruthUnavailable(f"batch_is_exist raised {type(exc).__name__}: {exc}") from None
        if not isinstance(codes, list | tuple) or len(codes) != len(keys):
            raise GarbageAnswer(
                f"batch_is_exist answered {type(codes).__name__} for {len(keys)} keys"
            )
        bad = [c for c in codes if c not in (0, 1) or isinstance(c, bool)]
        if bad:
            raise TruthUnavailable(f"Mooncake store client error code {bad[0]!r}")
        found = sum(1 for c in codes if c == 1)
        if found:
            with self._lock:
                self._leasing_queries += 1
                self._leased_objects += found
        return list(codes), per_page

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        codes, per_page = self._codes(pool, hashes)
        first_absent = next((i for i, c in enumerate(codes) if c != 1), len(codes))
        return first_absent // per_page

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        codes, per_page = self._codes(pool, hashes)
        return [
            all(c == 1 for c in codes[i : i + per_page]) for i in range(0, len(codes), per_page)
        ]
