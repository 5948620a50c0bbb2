"""Scenarios run against the real sglang wheel, one fresh process each.

``python hx_scenarios.py <name> [args...]`` (or ``python -m hx_scenarios`` with
this directory on ``PYTHONPATH``, which is how the launcher test execs it)
runs one scenario and prints ``HX-RESULT <json>`` as its last stdout line.
Exit status 3 means the environment cannot run it (sglang, torch or a module
the scenario needs does not import); the tests turn that into a skip, or a
failure when ``HICACHE_EXISTENCE_REQUIRE_SGLANG=1``.

A process per scenario keeps hooks from leaking: sglang's ``HookRegistry`` and
``load_plugins`` are process-global and cannot be undone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT = "HX-RESULT "
ENV_EXIT = 3
SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}

#: The deployment the scenarios publish, as a PD prefill server would be launched.
SERVED_MODEL = "org/model-7b"
#: The upstream class the plugin REPLACEs (its key in sglang's hook registry).
CACHE_CLASS_NAME = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"


def scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


class Captured(logging.Handler):
    """Records of the ``hicache_existence`` loggers (what an operator would see)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))

    def warnings(self) -> list[str]:
        return [m for level, m in self.records if level in ("WARNING", "ERROR", "CRITICAL")]


def capture_logs() -> Captured:
    handler = Captured()
    root = logging.getLogger("hicache_existence")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    return handler


# -- sglang helpers ------------------------------------------------------------------
def load_plugins() -> None:
    """sglang's own plugin loader (entry points of group sglang.srt.plugins)."""
    from sglang.srt.plugins import load_plugins as _load

    _load()


def registry_state() -> dict[str, list[list[Any]]]:
    """What is registered in sglang's HookRegistry: target -> [type, plugin, dist]."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    out: dict[str, list[list[Any]]] = {}
    for target, hooks in HookRegistry._hooks.items():
        out[target] = [
            [ht.value, getattr(src, "plugin_name", None), getattr(src, "dist_name", None)]
            for ht, _hook, src in hooks
        ]
    return out


def class_identity() -> dict[str, Any]:
    """Where upstream's names point now (after apply_hooks)."""
    import sglang.srt.mem_cache.buffer_mode.storage_existence_cache as sec
    import sglang.srt.mem_cache.unified_radix_cache as urc

    cls = sec.StorageExistenceCache
    step = urc.UnifiedRadixCache.check_hicache_events
    return {
        "class_module": cls.__module__,
        "class_name": cls.__qualname__,
        "urc_binding_is_same": urc.StorageExistenceCache is cls,
        "step_wrapped": hasattr(step, "__wrapped__"),
        "step_qualname": getattr(getattr(step, "__wrapped__", step), "__qualname__", ""),
    }


def server_args(**overrides: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    kwargs: dict[str, Any] = {
        "model_path": "dummy",
        "served_model_name": SERVED_MODEL,
        "disaggregation_mode": "prefill",
        "enable_hierarchical_cache": True,
        "hicache_host_memory_mode": "buffer_only",
        "hicache_storage_backend": "file",
        "page_size": 4,
    }
    kwargs.update(overrides)
    return ServerArgs(**kwargs)


def publish(args: Any, world_rank: int = 0) -> None:
    """Publish the scheduler's runtime context, as run_scheduler_process does."""
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.runtime_context import publish as _publish

    _publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))


def build_tree(page_size: int = 4, tokens: int = 256, groups: dict[str, Any] | None = None) -> Any:
    """A real UnifiedRadixCache over CPU memory pools (its constructor builds the
    existence cache: ``self.storage_existence_cache = StorageExistenceCache()``)."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    rtp = ReqToTokenPool(size=8, max_context_len=tokens, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = TokenToKVPoolAllocator(
        size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
    )
    params = CacheInitParams(
        req_to_token_pool=rtp,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        disable=False,
        tree_components=(ComponentType.FULL,),
        **(groups or {}),
    )
    tree = UnifiedRadixCache(params=params)
    tree.cache_init_params = params
    return tree


def cache_report(cache: Any) -> dict[str, Any]:
    stats = cache.stats()
    return {
        "type": f"{type(cache).__module__}.{type(cache).__qualname__}",
        "pools": {
            name: {
                k: getattr(s, k)
                for k in (
                    "queries",
                    "query_hits",
                    "adds",
                    "inserts",
                    "entries",
                    "inflight_tracked",
                    "inflight_released",
                    "capacity",
                )
            }
            for name, s in stats.items()
        },
    }


def scrape(entry: Any) -> str:
    import urllib.request

    server = entry.runtime.telemetry.server
    if server is None:
        return ""
    with urllib.request.urlopen(server.url, timeout=10) as response:
        return str(response.read().decode())


def samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def loaded_plugins() -> tuple[Captured, dict[str, Any]]:
    """Capture logs, run sglang's plugin loading, and report what it left: the
    plugin's status, the registry and the classes' identity."""
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import plugin

    out: dict[str, Any] = {
        "status": plugin.status(),
        "registry": registry_state(),
        "identity": class_identity(),
    }
    return logs, out


# -- scenarios -----------------------------------------------------------------------
@scenario
def enabled() -> dict[str, Any]:
    """Plugin loaded by load_plugins with HICACHE_EXISTENCE_ENABLED=1; a real
    UnifiedRadixCache builds our cache; real check_hicache_events steps it."""
    logs, out = loaded_plugins()
    import sglang.srt.mem_cache.buffer_mode.storage_existence_cache as sec

    from hicache_existence.integrations.sglang import hooks

    publish(server_args())
    tree = build_tree()
    cache = tree.storage_existence_cache
    entry = hooks.current()
    out["constructed"] = {
        "cache": cache_report(cache),
        "isinstance_upstream_name": isinstance(cache, sec.StorageExistenceCache),
        "is_runtime_cache": entry is not None and cache is entry.runtime.cache,
        "labels": entry.runtime.labels.as_dict() if entry else None,
        "metrics_mode": entry.runtime.telemetry.mode if entry else None,
        "sources": list(entry.facts.sources) if entry else None,
    }
    # The upstream call sites, through upstream's names, on our object.
    chain = [f"{i:064x}" for i in range(1, 9)]
    if hasattr(cache, "clear_inflight"):  # current generation (sglang >= 0.5.22)
        pool = cache.pool("kv")
        pool.track_inflight(chain)
        pool.add(chain)
        pool.untrack_inflight(chain)
        hits = [pool.covered(chain), pool.contains(chain[0]), pool.contains_all(["f" * 64])]
    else:  # flat (seed) generation (sglang 0.5.19 - 0.5.21)
        cache.add("kv", chain)
        hits = [
            cache.covers_all("kv", chain),
            cache.contains("kv", chain[0]),
            cache.contains_all("kv", ["f" * 64]),
        ]
    out["generation"] = "current" if hasattr(cache, "clear_inflight") else "flat"
    steps = int(os.environ.get("HX_STEPS", "7"))
    for _ in range(steps):
        tree.check_hicache_events()
    checker = entry.runtime.checker if entry else None
    text = scrape(entry) if entry else ""
    second = build_tree()
    out["stepped"] = {
        "hits": hits,
        "entry_steps": entry.steps if entry else None,
        "runtime_steps": entry.runtime.steps if entry else None,
        "members": list(entry.members) if entry else None,
        "checks": checker.stats().checks if checker else None,
        "divergence_active": checker.stats().active if checker else None,
        "queries_samples": samples(text, "hicache_existence_queries_total"),
        "checks_samples": samples(text, "hicache_existence_divergence_checks_total"),
        "cache_after": cache_report(cache),
    }
    out["second_tree"] = {
        "cache_module": type(second.storage_existence_cache).__module__,
        "declined": hooks.declined(),
    }
    out["warnings"] = logs.warnings()
    return out


def kv_add(cache: Any, hashes: list[str]) -> None:
    """Believe ``hashes`` stored in pool kv, in either generation's API."""
    if hasattr(cache, "clear_inflight"):  # current (sglang >= 0.5.22)
        cache.pool("kv").add(hashes)
    else:  # flat (seed, sglang 0.5.19 - 0.5.21)
        cache.add("kv", hashes)


def kv_keys(cache: Any) -> list[str]:
    """Pool kv's believed page hashes, oldest first, in either generation."""
    if hasattr(cache, "clear_inflight"):
        return list(cache.pool("kv").lru_keys())
    return [h for pool, h in cache.lru_keys() if pool == "kv"]


def kv_contains(cache: Any, page: str) -> bool:
    """Whether pool kv believes ``page`` stored (a hit refreshes it), either generation."""
    if hasattr(cache, "clear_inflight"):
        return bool(cache.pool("kv").contains(page))
    return bool(cache.contains("kv", page))


def _cpu_buffer_mode_shims() -> list[str]:
    """The three CUDA-only calls the buffer-mode pipeline makes, made CPU no-ops.

    * registering host memory with the CUDA driver (``cudaHostRegister``);
    * ``Stream.synchronize`` (``torch.cpu.Stream`` has none: CPU work is synchronous);
    * sgl_kernel's device-to-host KV copy kernel (CUDA-only; the bytes copied do
      not matter to existence beliefs, which see page hashes only).
    Everything else (tree, pipeline, cache controller, file backend, storage
    threads, acks, check_hicache_events) is upstream's code."""
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha
    import torch

    host_common._cuda_host_register = lambda *a, **k: None
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
    host_mha.transfer_kv_all_layer_direct_lf_pf = lambda *a, **k: None
    shims = [
        "pool_host.common._cuda_host_register",
        "torch.cpu.Stream.synchronize",
        "pool_host.mha.transfer_kv_all_layer_direct_lf_pf",
    ]
    # sglang <= 0.5.21 resolves its device module with a bare torch.get_device_module(),
    # which from torch 2.14 (the seed environment's torch; 0.5.21 pinned 2.13) is
    # torch.cuda on a CUDA wheel even with no device; 0.5.23 checks for an available
    # accelerator and gets torch.cpu.  Give the older code what the newer one resolves.
    import sglang.srt.mem_cache.l2_transfer as l2_transfer

    if l2_transfer.device_module is torch.cuda and not torch.cuda.is_available():
        l2_transfer.device_module = torch.cpu
        shims.append("mem_cache.l2_transfer.device_module (torch.cpu, as sglang 0.5.23 picks)")
    return shims


class BufferModeServer:
    """A prefill scheduler's tree in HiCache buffer mode over the real file
    backend, on CPU (see ``_cpu_buffer_mode_shims``)."""

    def __init__(self, l3_max_bytes: int = 0) -> None:
        from sglang.srt.environ import envs

        from hicache_existence.integrations.sglang import hooks

        self.shims = _cpu_buffer_mode_shims()
        self.l3 = Path(tempfile.mkdtemp(prefix="hx-l3-"))
        extra: dict[str, Any] = {"prefetch_threshold": 1}
        if l3_max_bytes:
            extra["max_size"] = l3_max_bytes  # the file backend's own LRU eviction
        args = server_args(
            served_model_name="model-7b",  # the file backend puts it in file names
            hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct",
            hicache_write_policy="write_through",
            hicache_storage_backend_extra_config=json.dumps(extra),
            hicache_storage_prefetch_policy="wait_complete",
        )
        publish(args)
        self.tree = build_tree()
        with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(self.l3)):
            self.tree.init_hicache(args, self.tree.cache_init_params)
        self.entry = hooks.current()
        self.cache = self.tree.storage_existence_cache
        self.pipeline = self.tree.buffer_pipeline

    def insert(self, tokens: list[int]) -> None:
        """Insert a prefix with fresh device KV (write-through backs it up)."""
        from array import array

        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        value = self.tree.token_to_kv_pool_allocator.alloc(len(tokens)).to(torch.int64)
        key = RadixKey(array("q", tokens))
        self.tree.insert(InsertParams(key=key, value=value, prev_prefix_len=0))

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=10_000))

    def pump(self, until: Callable[[], bool] | None = None, timeout: float = 20.0) -> int:
        """Scheduler steps (check_hicache_events) until the writes drained (and
        ``until`` holds)."""
        steps = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tree.check_hicache_events()
            steps += 1
            drained = (
                not self.pipeline.inflight_backup_node_ids and not self.pipeline.ongoing_backup
            )
            if drained and (until is None or until()):
                break
            time.sleep(0.005)
        return steps

    def files(self) -> list[str]:
        """Page files in place (a ``.<uuid>.tmp`` is the backend's write in flight)."""
        return sorted(p.name for p in self.l3.iterdir() if not p.name.startswith("."))

    def in_l3(self, hashes: list[str]) -> int:
        """Leading pages of ``hashes`` the backend itself says it holds."""
        return int(self.tree.cache_controller.storage_backend.batch_exists(hashes, None))

    def close(self) -> None:
        self.tree.cache_controller._stop_storage_threads()


@scenario
def buffer_pipeline() -> dict[str, Any]:
    """The real buffer-mode pipeline on CPU: inserts write through the file
    backend, acks drain in check_hicache_events, our cache learns the pages;
    a re-insert is admitted without a write because the pages are believed."""
    logs = capture_logs()
    load_plugins()
    server = BufferModeServer()
    tokens = list(range(1, 33))  # 8 pages of 4 tokens
    server.insert(tokens)
    first_steps = server.pump()
    after_write = cache_report(server.cache)
    files_after_write = server.files()
    server.evict_all()
    server.insert(tokens)
    second_steps = server.pump()
    after_reinsert = cache_report(server.cache)
    entry = server.entry
    text = scrape(entry) if entry else ""
    server.close()
    return {
        "shims": server.shims,
        "pipeline": type(server.pipeline).__name__ if server.pipeline is not None else None,
        "observed": entry is not None and server.cache is entry.runtime.cache,
        "steps": [first_steps, second_steps, entry.steps if entry else None],
        "after_write": after_write,
        "after_reinsert": after_reinsert,
        "l3_files": [len(files_after_write), len(server.files())],
        "page_hits_samples": samples(text, "hicache_existence_page_hits_total"),
        "warnings": logs.warnings(),
    }


@scenario
def buffer_reconcile() -> dict[str, Any]:
    """L3 (the file backend, capped) evicts pages the beliefs still hold: the
    re-insert skips their write (stale positives), the reconciler verifies the
    chain against the backend's batch_exists on its worker thread, the agreed
    verdict is applied after check_hicache_events, and the next insert writes
    the evicted pages again."""
    logs = capture_logs()
    load_plugins()
    page_bytes = 4 * 2 * 2 * 8 * 2  # tokens x layers x (K, V) x head_dim x bf16
    server = BufferModeServer(l3_max_bytes=10 * page_bytes)
    entry = server.entry
    reconciler = entry.runtime.reconciler if entry else None
    a, b = list(range(1, 33)), list(range(1001, 1033))  # two 8-page prefixes
    server.insert(a)
    server.pump()
    chain_a = kv_keys(server.cache)
    server.insert(b)  # L3 evicts most of a to make room
    server.pump()
    believed_a = sum(1 for h in chain_a if kv_contains(server.cache, h))
    in_l3_a = server.in_l3(chain_a)
    server.evict_all()
    tracked = server.cache.stats()["kv"].inflight_tracked
    server.insert(a)  # believed stored: no write

    def healed() -> bool:
        snap = reconciler.snapshot() if reconciler else None
        return bool(snap and snap.pages_invalidated.get("kv")) and bool(
            reconciler and reconciler.idle()
        )

    heal_steps = server.pump(until=healed)
    skipped_write = server.cache.stats()["kv"].inflight_tracked == tracked
    snap = reconciler.snapshot() if reconciler else None
    believed_after_heal = sum(1 for h in chain_a if h in kv_keys(server.cache))
    server.evict_all()
    server.insert(a)  # the healed beliefs let the lost pages be written again
    server.pump()
    result = {
        "truth": entry.truth.describe() if entry and entry.truth else None,
        "chain_pages": len(chain_a),
        "believed_a": believed_a,
        "in_l3_a": in_l3_a,
        "skipped_write": skipped_write,
        "heal_steps": heal_steps,
        "stale_positives": dict(snap.stale_positives) if snap else None,
        "pages_invalidated": dict(snap.pages_invalidated) if snap else None,
        "queries": {f"{p}/{r}": n for (p, r), n in snap.queries.items()} if snap else None,
        "believed_after_heal": believed_after_heal,
        "rewritten_pages": server.cache.stats()["kv"].inflight_tracked - tracked,
        "in_l3_a_after": server.in_l3(chain_a),
        "warnings": logs.warnings(),
    }
    server.close()
    return result


@scenario
def buffer_inflight() -> dict[str, Any]:
    """The reconciler's view of pages being written, against the real pipeline:
    a write-through insert, then one scheduler step at a time until the acks
    drained; at every step, the pages the reconciler would treat as in flight
    (the pool's ``inflight_pages()``: the cache's refs in the current generation;
    in the seed generation the pipeline's own set, which it passes to
    ``covers_all``)."""
    logs = capture_logs()
    load_plugins()
    server = BufferModeServer()
    entry = server.entry
    rec = entry.runtime.reconciler if entry else None

    def in_flight() -> set[str]:
        if rec is None:
            return set()
        return set(server.cache.pool("kv").inflight_pages())  # type: ignore[call-overload]

    server.insert(list(range(1, 33)))  # 8 pages of 4 tokens
    seen = [sorted(in_flight())]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        server.tree.check_hicache_events()
        seen.append(sorted(in_flight()))
        if not server.pipeline.inflight_backup_node_ids and not server.pipeline.ongoing_backup:
            break
        time.sleep(0.005)
    result = {
        "reconciler": rec is not None,
        "reads_pipeline_set": server.cache.pool("kv").inflight_pages()
        is getattr(server.pipeline, "inflight_backup_hashes", None),
        "written": sorted(kv_keys(server.cache)),
        "seen_in_flight": sorted({h for step in seen for h in step}),
        "after_ack": seen[-1],
        "warnings": logs.warnings(),
    }
    server.close()
    return result


def write_report(server: BufferModeServer) -> dict[str, Any]:
    """The write accounting, the miss reasons and the L3 files now."""
    entry = server.entry
    writes = entry.runtime.writes.stats().as_dict() if entry else {}
    kv = server.cache.stats()["kv"]
    return {
        "writes": writes.get("kv", {}),
        "files": len(server.files()),
        "misses": {
            r: getattr(kv, f"misses_{r}") for r in ("cold", "evicted", "invalidated", "cleared")
        },
        "entries": kv.entries,
    }


@scenario
def buffer_writes(cap: str = "0", admission_hooks: str = "0") -> dict[str, Any]:
    """Write accounting fed by the real buffer-mode write path over the real file
    backend: a prefix written, re-admitted without a write, extended (the node
    spans believed pages and is written whole), and, with a small cap, replayed
    after its beliefs were evicted while L3 kept the pages.  ``admission_hooks``:
    count admissions as on a tree with sidecar pools (the two hooks installed on
    the pipeline), not by the cache's tally."""
    logs = capture_logs()
    load_plugins()
    if int(admission_hooks):
        from hicache_existence.integrations.sglang.write_path import WritePath

        WritePath.tally_admissions = lambda self, tree: False  # type: ignore[method-assign]
    server = BufferModeServer()
    feed = server.entry.write_path if server.entry else None
    server.pump()  # a scheduler steps before its first batch (admissions get wired)
    a = list(range(1, 33))  # 8 pages of 4 tokens
    b = list(range(101, 133))  # 8 more
    c = list(range(501, 533))  # 8 unrelated pages
    phases: dict[str, Any] = {}

    def phase(name: str, tokens: list[int], evict: bool = True) -> None:
        if evict:
            server.evict_all()
        server.insert(tokens)
        server.pump()
        phases[name] = write_report(server)

    phase("a", a, evict=False)
    phase("a_again", a)
    if int(cap):
        phase("c", c)  # pushes a's beliefs out (cap = 8 pages)
        phase("a_replayed", a)
    else:
        phase("a_b", a + b)
    entry = server.entry
    text = scrape(entry) if entry else ""
    result = {
        "phases": phases,
        "hooks": sorted(registry_state()),
        "tallied": feed.tallies if feed else None,
        "on_pipeline": sorted(k for k in vars(server.pipeline) if k.startswith("_write_i")),
        "errors": feed.errors if feed else None,
        "page_bytes": entry.runtime.writes.page_size("kv") if entry else None,
        "host_page_bytes": (
            server.tree.cache_controller.mem_pool_host.anchor_entry.host_pool.size_per_token * 4
        ),
        "written_samples": samples(text, "hicache_existence_written_pages_total"),
        "written_bytes_samples": samples(text, "hicache_existence_written_bytes_total"),
        "warnings": logs.warnings(),
    }
    server.close()
    return result


@scenario
def mamba_cache_writes(mode: str = "cache") -> dict[str, Any]:
    """A hybrid Mamba tree's L3 writes through sglang's own classes
    (``hx_mamba.py``) in host memory mode ``mode``, dedup as the environment says."""
    import hx_mamba

    return hx_mamba.cache_writes(sys.modules[__name__], mode)


@scenario
def disabled(argv_json: str = '["--model-path", "dummy"]') -> dict[str, Any]:
    """Installed but not enabled: only the parser hooks exist; sglang's classes,
    methods and parse results are untouched."""
    logs, out = loaded_plugins()
    from hicache_existence.integrations.sglang import hooks

    publish(server_args())
    tree = build_tree()
    for _ in range(3):
        tree.check_hicache_events()
    out["cache_module"] = type(tree.storage_existence_cache).__module__
    out["entry"] = hooks.current() is not None
    out["parsed"] = parse_repr(json.loads(argv_json))
    out["env_enabled"] = os.environ.get("HICACHE_EXISTENCE_ENABLED")
    out["warnings"] = logs.warnings()
    return out


def parse_repr(argv: list[str]) -> dict[str, Any]:
    """sglang's own prepare_server_args on ``argv``: the record and its extras."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    return {
        "repr": repr(args),
        "extras": sorted(k for k in vars(args) if k.startswith("_hicache")),
    }


@scenario
def detokenizer() -> dict[str, Any]:
    """sglang's real detokenizer entry (``run_detokenizer_process``) loads plugins
    itself; with the plugin enabled, it must recognise the process and register
    no cache hooks.  The entry fails right after (no server args), by design."""
    from sglang.srt.managers import detokenizer_manager

    from hicache_existence.integrations.sglang import plugin

    failed_after = None
    try:
        detokenizer_manager.run_detokenizer_process(None, None)
    except Exception as exc:  # configure_logger(None), after load_plugins()
        failed_after = type(exc).__name__
    registry = registry_state()
    return {
        "status": plugin.status(),
        "failed_after": failed_after,
        "cache_hooked": CACHE_CLASS_NAME in registry,
        "role_here": plugin._process_role(),
    }


@scenario
def logging_settings() -> dict[str, Any]:
    """``logging.level`` / ``logging.json`` from the environment configure the
    package's logger in the scheduler process (not the root logger)."""
    root_before = (logging.getLogger().level, len(logging.getLogger().handlers))
    load_plugins()
    publish(server_args())
    tree = build_tree()
    for _ in range(2):
        tree.check_hicache_events()
    package = logging.getLogger("hicache_existence")
    from hicache_existence import logs

    logs.get_logger("hicache_existence.runtime").debug("hicache_existence.test_probe", probe=1)
    sys.stderr.flush()
    return {
        "level": logging.getLevelName(package.level),
        "propagate": package.propagate,
        "handlers": [type(h).__name__ for h in package.handlers],
        "root_unchanged": root_before
        == (logging.getLogger().level, len(logging.getLogger().handlers)),
    }


@scenario
def missing_target() -> dict[str, Any]:
    """An sglang without the per-step method: one warning, nothing replaced."""
    import sglang.srt.mem_cache.base_prefix_cache as base
    import sglang.srt.mem_cache.unified_radix_cache as urc

    for cls in (urc.UnifiedRadixCache, base.BasePrefixCache):
        if "check_hicache_events" in vars(cls):
            delattr(cls, "check_hicache_events")
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import hooks, plugin

    publish(server_args())
    tree = build_tree()
    return {
        "status": plugin.status(),
        "registry": registry_state(),
        "class_module": type(tree.storage_existence_cache).__module__,
        "upstream_class_module": __import__(
            "sglang.srt.mem_cache.buffer_mode.storage_existence_cache", fromlist=["x"]
        ).StorageExistenceCache.__module__,
        "entry": hooks.current() is not None,
        "warnings": logs.warnings(),
    }


@scenario
def unknown_shape() -> dict[str, Any]:
    """An existence cache class of an API shape we do not know: one warning,
    nothing registered for the cache, upstream's class still in place."""
    import sglang.srt.mem_cache.buffer_mode.storage_existence_cache as sec

    class Unknown:
        def lookup(self, key: str) -> bool:
            return False

    sec.StorageExistenceCache = Unknown
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import plugin

    return {
        "status": plugin.status(),
        "registry": registry_state(),
        "still_unknown": sec.StorageExistenceCache is Unknown,
        "warnings": logs.warnings(),
    }


@scenario
def upstream_grew() -> dict[str, Any]:
    """A newer sglang whose existence cache has a public method ours lacks (added
    to the per-pool beliefs on the current generation, to the cache on the flat
    one) and that its scheduler calls: one warning naming it, upstream's class
    stays, and the call works on the tree's cache."""
    import sglang.srt.mem_cache.buffer_mode.storage_existence_cache as sec

    from hicache_existence.integrations.sglang import targets

    generation = targets.detect_generation(sec.StorageExistenceCache)
    grown = sec.StorageExistenceCache
    if generation == "current":
        grown = type(sec.StorageExistenceCache(max_entries=8).pool("kv"))

    def hx_future_sweep(self: Any, budget: int = 0) -> str:
        return "upstream's"

    grown.hx_future_sweep = hx_future_sweep
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import hooks, plugin

    publish(server_args())
    tree = build_tree()
    cache = tree.storage_existence_cache
    target = cache.pool("kv") if generation == "current" else cache
    return {
        "status": plugin.status(),
        "registry": registry_state(),
        "class_module": type(cache).__module__,
        "called": target.hx_future_sweep(1),
        "entry": hooks.current() is not None,
        "warnings": logs.warnings(),
    }


@scenario
def buffer_method_removed() -> dict[str, Any]:
    """A newer sglang without one of buffer mode's pipeline methods: one warning
    names it and says the buffer-mode counters stop; cache mode's hooks and the
    cache replacement stay."""
    import sglang.srt.mem_cache.buffer_mode.pipeline as pipeline

    from hicache_existence.integrations.sglang import targets

    sec = __import__("sglang.srt.mem_cache.buffer_mode.storage_existence_cache", fromlist=["x"])
    generation = targets.detect_generation(sec.StorageExistenceCache)
    name = "_write_intents" if generation == "current" else "enqueue_backup_intent"
    for cls in pipeline.BufferModePipeline.__mro__:
        if name in vars(cls):
            delattr(cls, name)
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import plugin

    return {
        "removed": f"sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline.{name}",
        "status": plugin.status(),
        "registry": registry_state(),
        "warnings": logs.warnings(),
    }


def _child_reads(args: Any, queue: Any) -> None:
    from hicache_existence.integrations.sglang.flags import stored_values

    values = stored_values(args)
    queue.put(
        {
            "values": dataclasses.asdict(values) if values else None,
            "env_enabled": os.environ.get("HICACHE_EXISTENCE_ENABLED"),
        }
    )


@scenario
def flags() -> dict[str, Any]:
    """The flags through sglang's real prepare_server_args (argv, --config YAML,
    a JSON file), carried into a spawned process like a scheduler's."""
    import contextlib
    import io
    import multiprocessing as mp

    logs = capture_logs()
    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    from hicache_existence.integrations.sglang.flags import stored_values

    out: dict[str, Any] = {"env_before": os.environ.get("HICACHE_EXISTENCE_ENABLED")}
    tmp = Path(tempfile.mkdtemp(prefix="hx-flags-"))
    config_file = tmp / "hx.json"
    config_file.write_text('{"divergence": {"interval_steps": 7, "policy": "heal"}}')
    args = prepare_server_args(
        [
            "--model-path",
            "dummy",
            "--enable-hicache-existence",
            "--hicache-existence-config",
            f"@{config_file}",
        ]
    )
    values = stored_values(args)
    out["argv"] = dataclasses.asdict(values) if values else None
    out["env_after"] = os.environ.get("HICACHE_EXISTENCE_ENABLED")
    restored = pickle.loads(pickle.dumps(args))
    again = stored_values(restored)
    out["pickled"] = dataclasses.asdict(again) if again else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(args, queue))
    proc.start()
    out["spawned"] = queue.get(timeout=120)
    proc.join(60)

    yaml_file = tmp / "server.yaml"
    yaml_file.write_text(
        "model-path: dummy\n"
        "enable-hicache-existence: true\n"
        'hicache-existence-config: \'{"metrics": {"port": 9555}}\'\n'
    )
    from_yaml = stored_values(prepare_server_args(["--config", str(yaml_file)]))
    out["yaml"] = dataclasses.asdict(from_yaml) if from_yaml else None

    plain = prepare_server_args(["--model-path", "dummy"])
    out["plain_extras"] = stored_values(plain) is not None

    bad: dict[str, Any] = {}
    for name, value in (
        ("policy", '{"divergence": {"policy": "nope"}}'),
        ("json", "{not json"),
        ("file", str(tmp / "missing.json")),
    ):
        err = io.StringIO()
        code: Any = None
        with contextlib.redirect_stderr(err):
            try:
                prepare_server_args(["--model-path", "dummy", "--hicache-existence-config", value])
            except SystemExit as exc:
                code = exc.code
        bad[name] = {"code": code, "stderr": err.getvalue().strip().splitlines()[-1:]}
    out["bad"] = bad
    out["warnings"] = logs.warnings()
    return out


@scenario
def launched(*argv: str) -> dict[str, Any]:
    """Exec'd by ``hicache-existence launch``: what arrived, and whether the
    plugin, loaded by sglang's own loader, saw itself enabled."""
    env = {k: v for k, v in os.environ.items() if k.startswith("HICACHE_EXISTENCE_")}
    load_plugins()
    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang import plugin

    return {
        "argv": list(argv),
        "env": env,
        "status": plugin.status(),
        "config_interval": Config.from_env().divergence.interval_steps,
    }


@scenario
def multirank(rank: str, world: str, port: str, diverge_at: str = "0") -> dict[str, Any]:
    """Two scheduler-like processes over gloo: a real UnifiedRadixCache each,
    whose check_hicache_events all-reduces over the TP group; our hook builds
    the dedicated replica group on the first step and checks replicas."""
    import torch.distributed as dist

    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w)
    tp = dist.new_group(list(range(w)), backend="gloo")
    logs = capture_logs()
    load_plugins()
    from hicache_existence.integrations.sglang import hooks

    publish(server_args(tp_size=w), world_rank=r)
    tree = build_tree(groups={"tp_cache_group": tp})
    entry = hooks.current()
    chain = [f"{i:064x}" for i in range(1, 5)]
    kv_add(tree.storage_existence_cache, chain)
    at = int(diverge_at)
    steps = int(os.environ.get("HX_STEPS", "8"))
    for step in range(1, steps + 1):
        if at and step == at and r == w - 1:
            kv_add(tree.storage_existence_cache, [f"{999:064x}"])
        tree.check_hicache_events()
    stats = entry.runtime.checker.stats() if entry else None
    series = entry.runtime.telemetry.series_reader.sample() if entry else {}
    dist.barrier()
    return {
        "rank": r,
        "observed": entry is not None,
        "tp_rank_label": entry.runtime.labels.tp_rank if entry else None,
        "members": list(entry.members) if entry else None,
        "steps": entry.steps if entry else None,
        "checks": stats.checks if stats else None,
        "divergences": stats.divergences if stats else None,
        "active": stats.active if stats else None,
        "config_mismatches": stats.config_mismatches if stats else None,
        "failures": stats.failures if stats else None,
        # What /metrics would show: the divergence families, with their values.
        "divergence_series": {
            name: sorted(values.values()) for name, values in series.items() if "divergence" in name
        },
        "warnings": logs.warnings(),
    }


def _scheduler_child(queue: Any) -> None:
    """A scheduler process of a server started with --enable-metrics: loads the
    plugins, builds its tree, runs steps (the feeder writes multiprocess files)."""
    load_plugins()
    from hicache_existence.integrations.sglang import hooks

    publish(server_args())
    tree = build_tree()
    cache = tree.storage_existence_cache
    chain = [f"{i:064x}" for i in range(1, 5)]
    kv_add(cache, chain)
    if hasattr(cache, "clear_inflight"):
        cache.pool("kv").covered(chain)
    else:
        cache.covers_all("kv", chain)
    for _ in range(3):
        tree.check_hicache_events()
    entry = hooks.current()
    queue.put({"mode": entry.runtime.telemetry.mode if entry else None})


@scenario
def metrics_multiprocess() -> dict[str, Any]:
    """--enable-metrics: sglang's set_prometheus_multiproc_dir before the
    schedulers start, a spawned scheduler process feeding our series, and
    sglang's own /metrics route (add_prometheus_middleware) serving them."""
    import multiprocessing as mp

    from sglang.srt.utils.common import add_prometheus_middleware, set_prometheus_multiproc_dir

    set_prometheus_multiproc_dir()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_scheduler_child, args=(queue,))
    proc.start()
    child = queue.get(timeout=300)
    proc.join(120)

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    app = FastAPI()
    add_prometheus_middleware(app)
    text = TestClient(app).get("/metrics").text
    return {
        "child": child,
        "exitcode": proc.exitcode,
        "queries": samples(text, "hicache_existence_queries_total"),
        "entries": samples(text, "hicache_existence_entries"),
    }


@scenario
def recipes(prefill_json: str, decode_json: str) -> dict[str, Any]:
    """The recipes' sglang arguments through sglang's own parser and upstream's
    HiCache host-memory validator (the reason the flags are prefill-only)."""
    load_plugins()
    from sglang.srt.arg_groups.hicache_hook import validate_hicache_host_memory_mode
    from sglang.srt.server_args import prepare_server_args

    from hicache_existence.integrations.sglang.flags import stored_values

    out: dict[str, Any] = {}
    for name, argv in (("prefill", json.loads(prefill_json)), ("decode", json.loads(decode_json))):
        args = prepare_server_args(argv)
        values = stored_values(args)
        try:
            validate_hicache_host_memory_mode(args)
            verdict = "ok"
        except ValueError as exc:
            verdict = str(exc)
        out[name] = {
            "flags": dataclasses.asdict(values) if values else None,
            "host_memory_mode": args.hicache_host_memory_mode,
            "disaggregation_mode": args.disaggregation_mode,
            "validator": verdict,
        }
    decode_with_buffer = [
        *json.loads(decode_json),
        "--enable-hierarchical-cache",
        "--hicache-host-memory-mode",
        "buffer_only",
        "--hicache-storage-backend",
        "file",
    ]
    try:
        validate_hicache_host_memory_mode(prepare_server_args(decode_with_buffer))
        out["decode_buffer_only"] = "ok"
    except ValueError as exc:
        out["decode_buffer_only"] = str(exc)
    return out


@scenario
def step_overhead(rounds: str = "15", calls: str = "2000") -> dict[str, Any]:
    """Not a test: the cost our AFTER hook adds to one real check_hicache_events
    (minimal tree, default configuration), interleaved with the unhooked
    original in the same process; medians of ``rounds`` rounds of ``calls``.

        HICACHE_EXISTENCE_ENABLED=1 python tests/sglang_integration/hx_scenarios.py step_overhead
    """
    import statistics

    load_plugins()
    import sglang.srt.mem_cache.unified_radix_cache as urc

    publish(server_args())
    tree = build_tree()
    hooked = urc.UnifiedRadixCache.check_hicache_events
    original = hooked.__wrapped__
    n = int(calls)
    plain: list[float] = []
    observed: list[float] = []
    for _ in range(int(rounds)):
        t0 = time.perf_counter()
        for _ in range(n):
            original(tree)
        t1 = time.perf_counter()
        for _ in range(n):
            hooked(tree)
        t2 = time.perf_counter()
        plain.append((t1 - t0) / n * 1e9)
        observed.append((t2 - t1) / n * 1e9)
    base, ours = statistics.median(plain), statistics.median(observed)
    return {
        "original_ns": round(base),
        "hooked_ns": round(ours),
        "added_ns": round(ours - base),
        "rounds": int(rounds),
        "calls": n,
    }


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SCENARIOS:
        print(f"usage: hx_scenarios.py {{{','.join(SCENARIOS)}}} [args...]", file=sys.stderr)
        return 2
    try:
        import sglang.srt.mem_cache.unified_radix_cache
        import sglang.srt.plugins  # noqa: F401
    except Exception as exc:
        print(f"{RESULT}{json.dumps({'environment': repr(exc)})}")
        return ENV_EXIT
    try:
        result = SCENARIOS[argv[0]](*argv[1:])
    except Exception:
        print(f"{RESULT}{json.dumps({'error': traceback.format_exc()})}")
        return 1
    sys.stdout.flush()
    print(f"{RESULT}{json.dumps(result, default=str)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
