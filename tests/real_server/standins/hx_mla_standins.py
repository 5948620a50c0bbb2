"""Test-only CPU stand-ins for serving a DeepSeek-style MLA model on sglang's CPU engine.

Separate from ``hx_cpu_standins`` (which the Llama servers need) and applied by the
same post-import hook (``hx_cpu_standins.on_import``), from this directory's
``sitecustomize``. Each stand-in says what fails without it (checked on sglang 0.5.23
with ``tests/real_server/test_shape_mla.py``'s tiny ``DeepseekV2ForCausalLM`` by
launching the real server with ``HX_CPU_STANDINS_OFF=<name>``, which turns that one
off). Every one is a no-op for a server that serves no MLA model.

``mla_torch_native``
    The DeepSeek attention picks its forward method from a per-backend handler
    (``models/deepseek_common/attention_backend_handler.py``). ``torch_native``
    (the CPU engine's backend on a CPU without AMX) has no handler and gets the
    ``triton`` one, which sends a prefill with no cached prefix to the MHA path
    (``forward_mha.py:forward_normal_core``): per-head K and V expanded from the
    latent. ``torch_native_backend.forward_extend`` ignores the K and V it is
    handed and reads both from the KV pool, which for MLA holds the latent rows
    (``kv_lora_rank + qk_rope_head_dim`` wide), so the first prefill (the
    start-up warm-up) kills the scheduler in ``torch_native_backend.py:160``
    (``scaled_dot_product_attention``: "Expected size for first two dimensions of
    batch2 tensor to be: [4, 32] but got: [4, 48]"). The stand-in registers a
    ``torch_native`` handler that always answers upstream's absorbed MLA method
    (``_dispatch_mla_subtype``: what the ``triton`` handler itself answers for
    decode, for a prefill with a cached prefix, and for every batch under
    deterministic inference). Weight absorption is an exact rewrite of the same
    attention, and it is the path whose cache reads match what the backend reads.
``mla_d2h_copy``
    ``pool_host.mla.transfer_kv_all_layer_direct_lf_pf`` (device layer-first ->
    host ``page_first_direct``, every layer) and
    ``pool_host.mla.transfer_kv_per_layer_direct_pf_lf`` (host -> device, one
    layer): sgl_kernel's CUDA ``kvcacheio`` ops, which ``mla.py`` imports only on
    CUDA/ROCm/XPU, so on CPU the first backup dies with ``NameError``. MLA keeps
    one latent buffer per layer (``[tokens, 1, dim]`` on the device; the host pool
    one ``[pages, layers, page_size, 1, dim]`` tensor), so these are the
    one-buffer forms of ``hx_cpu_standins``' K/V copies (same index semantics:
    token indices on both sides, host pages of ``page_size`` tokens): the file
    backend writes the real latent bytes to L3.
``mla_dummy_page``
    ``hx_cpu_standins``' ``dummy_page`` stand-in (an unpinned zero page for the L3
    read path; pinning needs a CUDA driver) applied to the MLA host pool's
    ``get_dummy_flat_data_page`` too (``dummy_page`` in ``HX_CPU_STANDINS_OFF`` turns
    it off here as well).

One probe (not a stand-in: it changes nothing), on with ``HX_PROBE_L3_SETS=1``:

``l3_set``
    Every ``HiCacheFile.batch_set`` call, as an ``HX-PROBE`` line: the calling
    backend's ``tp_rank``, the pages handed to it, and how many of their files it
    created (absent before the call, present after: checked on the file system,
    without the backend's own ``exists``). MLA page files carry no rank in their
    names, so this is how a test tells which rank wrote L3.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import hx_cpu_standins

APPLIED: list[str] = []


def _off(name: str) -> bool:
    return hx_cpu_standins._off(name)


def _patch_attention_handler(mod: ModuleType) -> None:
    if _off("mla_torch_native"):
        return
    registry = mod.AttentionBackendRegistry
    dispatch = mod._dispatch_mla_subtype

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return dispatch(attn, forward_batch)

    registry.register("torch_native", handle_attention_torch_native)
    APPLIED.append("mla_torch_native")


def _rows(indices: Any) -> Any:
    import torch

    return indices.to(dtype=torch.int64)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Device (one ``[tokens, 1, dim]`` latent tensor per layer) to host
    (``[pages, layers, page_size, 1, dim]``)."""
    (dst,) = dst_ptrs
    src = _rows(src_indices)
    dst_rows = _rows(dst_indices)
    page, offset = dst_rows // page_size, dst_rows % page_size
    for layer, layer_buf in enumerate(src_ptrs):
        dst[page, layer, offset] = layer_buf[src].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    layer_id: int,
    page_size: int,
) -> None:
    """Host ``page_first_direct`` latent rows of one layer back to the device tensor."""
    (src,) = src_ptrs
    (dst,) = dst_ptrs
    src_rows = _rows(src_indices)
    page, offset = src_rows // page_size, src_rows % page_size
    dst[_rows(dst_indices)] = src[page, layer_id, offset].to(dst.device)


def _patch_host_mla(mod: ModuleType) -> None:
    if not _off("mla_d2h_copy"):
        for fn in (transfer_kv_all_layer_direct_lf_pf, transfer_kv_per_layer_direct_pf_lf):
            if not hasattr(mod, fn.__name__):
                setattr(mod, fn.__name__, fn)
        APPLIED.append("mla_d2h_copy")
    if not _off("mla_dummy_page"):
        hx_cpu_standins._patch_dummy_page(mod)
        APPLIED.append("mla_dummy_page")


def _probe_l3_sets(mod: ModuleType) -> None:
    import hx_probes

    cls = mod.HiCacheFile
    init, batch_set = cls.__init__, cls.batch_set

    def __init__(self: Any, storage_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, storage_config, *args, **kwargs)
        self._hx_tp_rank = int(storage_config.tp_rank)

    def probed_batch_set(self: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        paths = [os.path.join(self.file_path, f"{self._get_suffixed_key(k)}.bin") for k in keys]
        absent = [p for p in paths if not os.path.exists(p)]
        ok = batch_set(self, keys, *args, **kwargs)
        created = sum(os.path.exists(p) for p in absent)
        hx_probes.emit(
            "l3_set", tp_rank=self._hx_tp_rank, pages=len(paths), created=created, ok=bool(ok)
        )
        return ok

    cls.__init__ = __init__
    cls.batch_set = probed_batch_set


def install() -> None:
    if os.environ.get("HX_PROBE_L3_SETS") == "1":
        hx_cpu_standins.on_import("sglang.srt.mem_cache.hicache_storage", _probe_l3_sets)
    hx_cpu_standins.on_import(
        "sglang.srt.models.deepseek_common.attention_backend_handler", _patch_attention_handler
    )
    hx_cpu_standins.on_import("sglang.srt.mem_cache.pool_host.mla", _patch_host_mla)
