"""Test-only CPU stand-in: the ``torch_native`` attention backend reads a
sliding-window layer's keys and values at their SWA pool slots.

``swa_attention``
    ``layers.attention.torch_native_backend.TorchNativeAttnBackend``
    (``forward_extend`` / ``forward_decode``), the backend sglang 0.5.23 picks on a
    CPU without AMX.  With a hybrid SWA model (``SWAKVPool``: the sliding layers
    keep their KV in a smaller pool of their own) the backend *writes* a sliding
    layer's new tokens at the slots translated from full-pool to SWA-pool
    indices (``KVWriteLoc(cache_loc, swa_out_cache_loc)``), but *reads* them back
    through ``req_to_token`` untranslated: full-pool indices into the SWA pool's
    buffer (``torch_native_backend.py``, ``_run_sdpa_forward_extend`` and
    ``_run_sdpa_forward_decode``: ``k_cache[req_to_token[req, :seq_len]]``).
    Without the stand-in the first request whose full-pool slots run past the
    SWA pool's size kills the scheduler ("IndexError: index 1648 is out of bounds
    for dimension 0 with size 1648", seen with a 2048-token full pool and the
    default ``--swa-full-tokens-ratio 0.8``), and every earlier sliding layer read
    another token's KV.  The stand-in hands the two methods, for sliding layers
    only (``SWAKVPool.layers_mapping``), a ``req_to_token`` whose rows come out
    translated (``SWAKVPool.translate_loc_from_full_to_swa``), which is what
    sglang's GPU backends do (``triton_backend.py``).  Tokens that left the window
    map to slot 0 (their slot was freed) and are masked out by the backend's
    sliding-window mask, as on GPU.

Registered on the post-import hook of ``hx_cpu_standins`` (``HX_CPU_STANDINS_OFF=
swa_attention`` turns it off); a no-op for models without an SWA pool.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import hx_cpu_standins

NAME = "swa_attention"
MODULE = "sglang.srt.layers.attention.torch_native_backend"


class _TranslatedRows:
    """``req_to_token`` whose indexed rows come out as SWA pool slots."""

    def __init__(self, req_to_token: Any, pool: Any) -> None:
        self._rows = req_to_token
        self._pool = pool

    def __getitem__(self, index: Any) -> Any:
        return self._pool.translate_loc_from_full_to_swa(self._rows[index])


class _ReqToTokenView:
    """The backend's ``req_to_token_pool`` with ``req_to_token`` translated."""

    def __init__(self, pool: Any, kv_pool: Any) -> None:
        self._pool = pool
        self.req_to_token = _TranslatedRows(pool.req_to_token, kv_pool)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _sliding(backend: Any, layer: Any) -> bool:
    if not getattr(backend, "use_sliding_window_kv_pool", False):
        return False
    mapping = getattr(backend.token_to_kv_pool, "layers_mapping", None) or {}
    return bool(mapping.get(layer.layer_id, (None, False))[1])


def _translating(original: Any) -> Any:
    def method(self: Any, q: Any, k: Any, v: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        if not _sliding(self, layer):
            return original(self, q, k, v, layer, *args, **kwargs)
        pool = self.req_to_token_pool
        self.req_to_token_pool = _ReqToTokenView(pool, self.token_to_kv_pool)
        try:
            return original(self, q, k, v, layer, *args, **kwargs)
        finally:
            self.req_to_token_pool = pool

    method.__name__ = original.__name__
    method.__qualname__ = original.__qualname__
    return method


def _patch(mod: ModuleType) -> None:
    if hx_cpu_standins._off(NAME):
        return
    cls = mod.TorchNativeAttnBackend
    for name in ("forward_extend", "forward_decode"):
        setattr(cls, name, _translating(vars(cls)[name]))
    hx_cpu_standins.APPLIED.append(NAME)


def install() -> None:
    hx_cpu_standins.on_import(MODULE, _patch)
