"""Test-only CPU stand-ins for the CUDA-only calls of sglang's HiCache buffer mode.

Applied by a post-import hook (``install()``, called from this directory's
``sitecustomize``) right after sglang imports the module each one patches, in every
server process. Each stand-in says what fails without it (checked on sglang 0.5.23
by launching the real server with ``HX_CPU_STANDINS_OFF=<name>``, which turns that
one off):

``host_register``
    ``pool_host.common._cuda_host_register``: pins the host KV pool with
    ``cudaHostRegister``. Without it the scheduler dies building the host pool
    (``torch.cuda.cudart()`` on a machine without a CUDA driver). On CPU, memory
    needs no registration: a no-op is exact.
``stream_sync``
    ``torch.cpu.Stream.synchronize``: the cache controller synchronises its copy
    streams; ``torch.cpu.Stream`` has no ``synchronize``, so the first write-back
    dies with ``AttributeError``. CPU copies are synchronous: a no-op is exact.
``d2h_copy``
    ``pool_host.mha.transfer_kv_all_layer_direct_lf_pf`` (device layer-first ->
    host ``page_first_direct``, every layer) and
    ``pool_host.mha.transfer_kv_per_layer_direct_pf_lf`` (host -> device, one layer):
    sgl_kernel's CUDA ``kvcacheio`` ops, imported by ``mha.py`` only on CUDA/ROCm, so
    on CPU the first backup dies with ``NameError``. These are faithful torch copies
    (same index semantics: token indices on both sides, host pages of ``page_size``
    tokens), so the file backend writes the real KV bytes to L3 and a prefix loaded
    back from L3 yields the same tokens.
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


def _patch_torch(mod: ModuleType) -> None:
    if _off("stream_sync"):
        return
    stream = mod.cpu.Stream
    if not hasattr(stream, "synchronize"):
        stream.synchronize = lambda self: None
        APPLIED.append("stream_sync")


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


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch": _patch_torch,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_host_mha,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

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
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
