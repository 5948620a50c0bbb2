"""Test-only CPU stand-in for the one CUDA-only call a hybrid Mamba tree's HiCache
write path makes in process (``hx_mamba.py``), beside the buffer-mode harness's
usual three (``hx_scenarios._cpu_buffer_mode_shims``: host-memory registration,
``Stream.synchronize``, the MHA device-to-host copy).

``mamba_d2h_copy``
    ``pool_host.mamba.transfer_kv_all_layer_direct_lf_pf``: sgl_kernel's CUDA
    ``kvcacheio`` op, which ``pool_host/mamba.py`` imports only on CUDA/ROCm.  With
    ``--hicache-io-backend direct`` and the ``page_first_direct`` host layout,
    ``MambaPoolHost.backup_from_device_all_layer`` calls it (through
    ``_copy_tensor_all_layers_lf_pf``) for the temporal (SSM) state and for every
    conv state of each backed-up node, so on CPU the first device-to-host backup
    of a Mamba node dies with ``NameError: name
    'transfer_kv_all_layer_direct_lf_pf' is not defined`` (checked on sglang
    0.5.23 and 0.5.21: the scheduler's ``check_hicache_events`` ->
    ``flush_pending_backups`` -> ``start_writing`` raises, and nothing reaches
    host memory or L3).  The stand-in is the same copy in torch, with the op's
    index semantics: slot indices on both sides, one device tensor per layer
    (``[slots, *state]``), one host tensor ``[host slots, layers, page_size,
    *state]`` (Mamba host pages are one slot: ``page_size`` 1).  So the file
    backend writes the node's real Mamba state bytes to L3 (the tests check a
    page file against the device state it came from).

Installed on the module object (``install``), only where the name is missing: a
build that has the kernel keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

APPLIED: list[str] = []


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Device layer-first (one ``[slots, *state]`` tensor per layer) to one host
    ``page_first_direct`` tensor (``[pages, layers, page_size, *state]``)."""
    import torch

    (dst,) = dst_ptrs
    src = src_indices.to(dtype=torch.int64)
    host = dst_indices.to(dtype=torch.int64)
    page, offset = host // page_size, host % page_size
    for layer, layer_state in enumerate(src_ptrs):
        dst[page, layer, offset] = layer_state[src].to(dst.device)


def install() -> list[str]:
    """Patch ``sglang.srt.mem_cache.pool_host.mamba`` (imports it); returns what it did."""
    import sglang.srt.mem_cache.pool_host.mamba as host_mamba

    name = transfer_kv_all_layer_direct_lf_pf.__name__
    if not hasattr(host_mamba, name):
        setattr(host_mamba, name, transfer_kv_all_layer_direct_lf_pf)
        APPLIED.append(f"pool_host.mamba.{name}")
    return list(APPLIED)
