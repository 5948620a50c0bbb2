"""Test-only CPU stand-ins for the CUDA-only calls of sglang's HiCache buffer mode.

Applied by a post-import hook (``install()``, called from this directory's
``sitecustomize``) right after sglang imports the module each one patches, in every
server process. Each stand-in says what fails without it (checked on sglang 0.5.23
by launching the real server with ``HX_CPU_STANDINS_OFF=<name>``, which turns that
one off). ``Stream.synchronize``, which the in-process pipeline tests stub, needs no
stand-in here: with none, the server on torch 2.14.1 writes to and loads from L3
(checked), so this path does not reach it.

``host_register``
    ``pool_host.common._cuda_host_register``: pins the host KV pool with
    ``cudaHostRegister``. Without it the scheduler dies building the host pool
    (``torch.cuda.cudart()`` on a machine without a CUDA driver). On CPU, memory
    needs no registration: a no-op is exact.
``d2h_copy``
    ``pool_host.mha.transfer_kv_all_layer_direct_lf_pf`` (device layer-first ->
    host ``page_first_direct``, every layer) and
    ``pool_host.mha.transfer_kv_per_layer_direct_pf_lf`` (host -> device, one layer):
    sgl_kernel's CUDA ``kvcacheio`` ops, imported by ``mha.py`` only on CUDA/ROCm, so
    on CPU the first backup dies with ``NameError``. These are faithful torch copies
    (same index semantics: token indices on both sides, host pages of ``page_size``
    tokens), so the file backend writes the real KV bytes to L3 and a prefix loaded
    back from L3 yields the same tokens.
``dummy_page``
    ``get_dummy_flat_data_page`` of the host pools in ``pool_host.mha``: the L3 read
    path (``cache_controller``'s prefetch) allocates each target page with
    ``torch.zeros(..., pin_memory=True)``; pinning needs a CUDA driver, so every
    prefetch from L3 fails ("Found no NVIDIA driver", counted by sglang as
    ``storage_prefetch_unfulfilled_tokens_total{reason="storage_transfer"}``) and
    nothing is ever loaded back. The stand-in calls the original with the pool's
    ``pin_memory`` off for that call: the same zeroed page, unpinned.
``host_reserve``
    ``pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES``: sglang keeps 10 GiB of host
    RAM in reserve before it allocates any HiCache host pool, however small. Without
    the stand-in a server fails to start whenever the machine has less than that
    free ("Not enough host memory available. Requesting 0.03 GB but only have -1.14
    GB free", seen here with other servers running; a 7 GB CI runner never has it).
    The stand-in lowers the reserve to 512 MiB; the tiny model's pools need ~30 MB.
``tp_gloo``
    ``distributed.parallel_state.init_model_parallel_group``: off NPU/XPU it
    defaults ``use_pynccl`` to true, and a TP group on CPU then dies in
    ``PyNcclCommunicator`` ("Expected a cuda device, but got: cpu"). The stand-in
    only changes that default to false when the caller left it unset, so TP
    collectives run on the group's torch.distributed (gloo) backend.
``pd_host_indices``
    ``disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices``
    (a class attribute, true upstream). When a sender supports host tensor indices,
    ``disaggregation/prefill.py:_send_kv_chunk`` copies each chunk's page indices into
    a pinned host tensor (``torch.empty(..., pin_memory=True)``) and records a
    ``torch.cuda.Event`` so the transfer worker waits for that copy instead of the
    scheduler. Pinning needs a CUDA driver: the first request through a PD prefill
    server kills its scheduler ("Found no NVIDIA driver on your system", raised from
    ``_send_kv_chunk``). The stand-in sets the attribute to false, so
    ``_send_kv_chunk`` takes upstream's other branch (``kv_to_page_indices``: the
    same page indices computed on the scheduler thread). On CPU the KV indices are
    host tensors already, so the sender gets the same pages and nothing is
    overlapped that could have been.
``pd_early_send_event``
    ``disaggregation/prefill.py``'s ``maybe_send_cached_prefix_chunk`` (on by
    default upstream: ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``): a request
    whose prefix is already on the device has that prefix sent to decode before its
    forward runs, and under overlap scheduling (the default) the scheduler records a
    ``torch.cuda.Event`` on its forward stream so the transfer worker waits for the
    previous forward's KV writes. On CPU the forward stream is a ``torch.cpu.Stream``
    and the first request with a device prefix hit kills the prefill scheduler
    ("expected stream to be a torch.Stream or torch.cuda.Stream object", from
    ``Event.record``). The stand-in runs that method with the scheduler's
    ``enable_overlap`` read as false (the only place the method reads it is that
    event), so the same prefix is sent without an event. On CPU the forward runs
    eagerly on the scheduler thread: the previous forward's writes are complete
    before the next batch is scheduled, so there is nothing to wait for.
``device_module`` (sglang 0.5.19-0.5.21 only)
    ``utils.common.get_device_module``: those releases fall back to
    ``torch.get_device_module()``, which torch 2.14 answers with ``torch.cuda`` on a
    CUDA wheel even with no usable device, so the HiCache controller's
    ``L2TransferEngine`` dies creating its streams ("CUDA driver version is
    insufficient", from ``torch.cuda.Stream()``). 0.5.22 and later return
    ``torch.cpu`` when no accelerator is available; the stand-in does the same on
    the older releases (a no-op where the release already does it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

APPLIED: list[str] = []


def _off(name: str) -> bool:
    return name in os.environ.get("HX_CPU_STANDINS_OFF", "").split(",")


def _patch_host_common(mod: ModuleType) -> None:
    if _off("host_register"):
        return

    def _cuda_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
        return None

    mod._cuda_host_register = _cuda_host_register  # type: ignore[attr-defined]
    APPLIED.append("host_register")


def _split(index: Any, page_size: int) -> tuple[Any, Any]:
    return index // page_size, index % page_size


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Device (one ``[tokens, heads, dim]`` tensor per layer, K layers then V layers)
    to host (``[pages, layers, page_size, heads, dim]`` for K and for V)."""
    layers = len(src_ptrs) // 2
    src = src_indices.to(dtype=_long(src_indices))
    page, offset = _split(dst_indices.to(dtype=_long(dst_indices)), page_size)
    for kv in range(2):
        dst = dst_ptrs[kv]
        for layer in range(layers):
            dst[page, layer, offset] = src_ptrs[kv * layers + layer][src].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    layer_id: int,
    page_size: int,
) -> None:
    """Host ``page_first_direct`` K and V of one layer back to the device tensors."""
    page, offset = _split(src_indices.to(dtype=_long(src_indices)), page_size)
    dst = dst_indices.to(dtype=_long(dst_indices))
    for kv in range(2):
        dst_ptrs[kv][dst] = src_ptrs[kv][page, layer_id, offset].to(dst_ptrs[kv].device)


def _long(t: Any) -> Any:
    import torch

    return torch.int64


def _patch_host_mha(mod: ModuleType) -> None:
    if _off("d2h_copy"):
        return
    for fn in (transfer_kv_all_layer_direct_lf_pf, transfer_kv_per_layer_direct_pf_lf):
        if not hasattr(mod, fn.__name__):
            setattr(mod, fn.__name__, fn)
    APPLIED.append("d2h_copy")


def _patch_dummy_page(mod: ModuleType) -> None:
    if _off("dummy_page"):
        return
    for cls in list(vars(mod).values()):
        if not isinstance(cls, type) or "get_dummy_flat_data_page" not in vars(cls):
            continue
        original = vars(cls)["get_dummy_flat_data_page"]

        def unpinned(self: Any, _original: Any = original) -> Any:
            pinned = self.pin_memory
            self.pin_memory = False
            try:
                return _original(self)
            finally:
                self.pin_memory = pinned

        cls.get_dummy_flat_data_page = unpinned
    APPLIED.append("dummy_page")


def _patch_parallel_state(mod: ModuleType) -> None:
    if _off("tp_gloo"):
        return
    original = mod.init_model_parallel_group

    def init_model_parallel_group(*args: Any, use_pynccl: Any = None, **kwargs: Any) -> Any:
        return original(*args, use_pynccl=False if use_pynccl is None else use_pynccl, **kwargs)

    mod.init_model_parallel_group = init_model_parallel_group
    APPLIED.append("tp_gloo")


def _patch_mooncake_conn(mod: ModuleType) -> None:
    if _off("pd_host_indices"):
        return
    mod.MooncakeKVSender.supports_host_tensor_indices = False
    APPLIED.append("pd_host_indices")


def _patch_prefill(mod: ModuleType) -> None:
    if _off("pd_early_send_event"):
        return
    for cls in list(vars(mod).values()):
        if not isinstance(cls, type) or "maybe_send_cached_prefix_chunk" not in vars(cls):
            continue
        original = vars(cls)["maybe_send_cached_prefix_chunk"]

        def without_event(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            overlap = self.enable_overlap
            self.enable_overlap = False
            try:
                return _original(self, *args, **kwargs)
            finally:
                self.enable_overlap = overlap

        cls.maybe_send_cached_prefix_chunk = without_event
    APPLIED.append("pd_early_send_event")


def _patch_device_module(mod: ModuleType) -> None:
    if _off("device_module"):
        return
    original = mod.get_device_module

    def get_device_module() -> Any:
        import torch

        found = original()
        if found is torch.cuda and not torch.cuda.is_available():
            return torch.cpu
        return found

    mod.get_device_module = get_device_module
    APPLIED.append("device_module")


def _patch_host_base(mod: ModuleType) -> None:
    if _off("host_reserve"):
        return
    mod.HICACHE_HOST_MEMORY_RESERVE_BYTES = 512 * 1024**2  # type: ignore[attr-defined]
    APPLIED.append("host_reserve")


PATCHES: dict[str, list[Callable[[ModuleType], None]]] = {
    "sglang.srt.utils.common": [_patch_device_module],
    "sglang.srt.distributed.parallel_state": [_patch_parallel_state],
    "sglang.srt.mem_cache.pool_host.common": [_patch_host_common],
    "sglang.srt.mem_cache.pool_host.base": [_patch_host_base],
    "sglang.srt.mem_cache.pool_host.mha": [_patch_host_mha, _patch_dummy_page],
    "sglang.srt.disaggregation.mooncake.conn": [_patch_mooncake_conn],
    "sglang.srt.disaggregation.prefill": [_patch_prefill],
}


def on_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch(module)`` right after ``name`` is imported (now if it already is)."""
    PATCHES.setdefault(name, []).append(patch)
    if name in sys.modules:
        patch(sys.modules[name])


def _run(patches: list[Callable[[ModuleType], None]], module: ModuleType) -> None:
    for patch in patches:
        patch(module)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: list[Callable[[ModuleType], None]]):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run(self._patch, module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Patch what is already imported, and the rest as sglang imports it."""
    for name, patches in PATCHES.items():
        if name in sys.modules:
            _run(patches, sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
