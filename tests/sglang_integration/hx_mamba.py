"""A hybrid Mamba model's HiCache L3 writes, through sglang's own classes in process
(the scenario ``mamba_cache_writes`` of ``hx_scenarios.py``), in cache mode (the
default) or buffer mode (``buffer_only``: upstream's pipeline admits each pool's
pages through the existence cache, and writes L3 from a staging buffer).

Why in process: a Mamba hybrid does not start as a real server on sglang's CPU
engine (``docs/enable.md`` §9 says where it stops), but every class its HiCache
write path runs is built here for real, on CPU tensors, as sglang's scheduler
builds them for a ``FULL`` + ``MAMBA`` model:

* ``memory_pool.HybridReqToTokenPool`` (its ``MambaPool``: conv and temporal state
  per Mamba layer, ``enable_mamba_extra_buffer`` so that pages of 4 tokens are
  allowed) and ``memory_pool.HybridLinearKVPool`` (the full-attention layers' KV),
  with a ``TokenToKVPoolAllocator``;
* ``UnifiedRadixCache`` with the ``FULL`` and ``MAMBA`` components
  (``unified_cache/components/mamba.py``: ``MambaComponent``), whose
  ``init_hicache`` assembles (``hybrid_pool_assembler``, the Mamba strategy) an
  ``MHATokenToKVPoolHost`` + ``pool_host/mamba.py:MambaPoolHost`` host-pool group
  and a ``hybrid_cache_controller.HybridCacheController`` over the real file
  backend (``HiCacheFile``) in a temporary directory;
* the write path is upstream's, driven by a scheduler's calls: ``insert`` (write
  through: the node is backed up to host memory at once), then
  ``check_hicache_events`` until drained: the device-to-host ack calls
  ``write_backup_storage(node)``, which hands the node's ``kv`` pages and its
  ``MambaComponent`` transfer (pool ``PoolName.MAMBA`` = ``"mamba"``, one key: the
  node's last page hash, ``TRAILING_PAGES``) to ``write_storage``; the backup
  thread's ``_page_backup`` writes the Mamba page through ``batch_set_v2`` (file
  ``<hash>.mamba_<model>_<rank>_<size>.bin``) and the ``kv`` pages through
  ``batch_set``; the storage drain pops ``ongoing_backup``.  A flush is what
  ``Scheduler.flush_cache`` does: ``tree.reset()`` and the pools cleared (L3 and
  the package's beliefs stay).

The package is installed the way sglang installs it (``load_plugins``, the
entry point), with ``cache_mode.dedup`` from the environment.  The
truth never reads the package: every ``HiCacheFile.set`` call (a probe wrapped
around the class attribute, outermost: the pages the backend was asked to store,
per pool by their storage key) and the page files per pool.  CPU stand-ins: the
harness's usual three and ``hx_mamba_standins`` (the Mamba host pool's
device-to-host copy).
"""

from __future__ import annotations

import json
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import hx_mamba_standins

PAGE = 4
#: Mamba layers 0 and 2, full-attention layers 1 and 3.
MAMBA_LAYERS = [0, 2]
FULL_LAYERS = [1, 3]
TOKENS = 256


def pool_name(pool: object) -> str:
    """``PoolName.MAMBA`` -> ``"mamba"`` (a str enum), strings unchanged."""
    return str.__str__(pool) if isinstance(pool, str) else str(pool)


def pool_of_key(key: str) -> str:
    """The pool of a file-backend storage key: ``<hash>`` (kv) or ``<hash>.<pool>``."""
    _, dot, pool = key.partition(".")
    return pool if dot else "kv"


def pool_of_file(name: str) -> str:
    """The pool of a page file ``<key>_<model>_<rank>_<size>.bin``."""
    return pool_of_key(name.split("_", 1)[0])


class MambaHiCacheServer:
    """A prefill scheduler's hybrid Mamba tree with HiCache (host memory mode
    ``mode``) over the real file backend, on CPU."""

    def __init__(self, hs: Any, mode: str = "cache") -> None:
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from hicache_existence.integrations.sglang import hooks

        self.shims = hs._cpu_buffer_mode_shims() + hx_mamba_standins.install()
        self.l3 = Path(tempfile.mkdtemp(prefix="hx-l3-mamba-"))
        args = hs.server_args(
            served_model_name="model-7b",
            hicache_host_memory_mode=mode,
            hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct",
            hicache_write_policy="write_through",
            hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": 1}),
            hicache_storage_prefetch_policy="wait_complete",
            page_size=PAGE,
        )
        # What the model config would give (a dummy path has none): the Mamba
        # checkpoint grid, a multiple of the page.
        args._mamba_cache_chunk_size = 64
        hs.publish(args)
        with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=32,
                n_groups=1,
                num_heads=2,
                head_dim=16,
                state_size=8,
                conv_kernel=4,
            )
            cache_params = Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)
        self.rtp = HybridReqToTokenPool(
            size=8,
            mamba_size=16,
            mamba_spec_state_size=8,
            max_context_len=TOKENS,
            device="cpu",
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=MAMBA_LAYERS,
            enable_mamba_extra_buffer=True,
            speculative_num_draft_tokens=3,
        )
        kv = HybridLinearKVPool(
            size=TOKENS,
            dtype=torch.bfloat16,
            page_size=PAGE,
            head_num=1,
            head_dim=8,
            full_attention_layer_ids=FULL_LAYERS,
            device="cpu",
            enable_memory_saver=False,
            mamba_pool=self.rtp.mamba_pool,
        )
        self.alloc = TokenToKVPoolAllocator(
            size=TOKENS, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
        params = CacheInitParams(
            req_to_token_pool=self.rtp,
            token_to_kv_pool_allocator=self.alloc,
            page_size=PAGE,
            disable=False,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            enable_mamba_extra_buffer=True,
        )
        self.tree = UnifiedRadixCache(params=params)
        with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(self.l3)):
            self.tree.init_hicache(args, params)
        self.entry = hooks.current()
        self.cache = self.tree.storage_existence_cache
        self.sets: list[str] = []
        self._probe_sets()
        # Random device state, so that a page file can be held to the state it
        # came from (zeros would match a copy that did nothing).
        state = self.rtp.mamba_pool.mamba_cache
        gen = torch.Generator().manual_seed(7)
        for t in [state.temporal, *state.conv]:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        self._rid = 0

    def _probe_sets(self) -> None:
        """Record every ``HiCacheFile.set`` key (outermost wrapper: after the
        plugin's hooks were installed on the class)."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        inner = HiCacheFile.set
        sets = self.sets

        def probed_set(backend: Any, key: str, *a: Any, **kw: Any) -> Any:
            sets.append(key)
            return inner(backend, key, *a, **kw)

        HiCacheFile.set = probed_set  # type: ignore[method-assign]

    def insert(self, tokens: list[int]) -> Any:
        """Insert a prefix with fresh device KV and its request's Mamba state
        (write-through backs the node up), as a finished request would."""
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        value = self.alloc.alloc(len(tokens)).to(torch.int64)
        req = Req(
            rid=f"r{self._rid}",
            origin_input_text="",
            origin_input_ids=array("q"),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        self._rid += 1
        self.rtp.alloc([req])
        params = InsertParams(key=RadixKey(array("q", tokens)), value=value, prev_prefix_len=0)
        params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
        return self.tree.insert(params).last_device_node

    def flush(self) -> None:
        """``Scheduler.flush_cache``: device and host memory emptied; L3 stays."""
        self.tree.reset()
        self.rtp.clear()
        self.alloc.clear()

    def pump(self, timeout: float = 30.0) -> int:
        """Scheduler steps until the write-through and storage acks drained and
        the package accounted them."""
        feed = self.entry.write_path if self.entry else None
        steps = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tree.check_hicache_events()
            steps += 1
            idle = not self.tree.ongoing_write_through and not self.tree.ongoing_backup
            pipeline = self.tree.buffer_pipeline
            if pipeline is not None:
                idle = not pipeline.inflight_backup_node_ids and not pipeline.ongoing_backup
            if idle and (feed is None or feed.cache_mode is None or not feed.cache_mode.pending):
                break
            time.sleep(0.005)
        return steps

    def files(self) -> dict[str, list[str]]:
        """Page files per pool (their storage keys)."""
        out: dict[str, list[str]] = {}
        for p in sorted(self.l3.iterdir()):
            if p.suffix == ".bin":
                out.setdefault(pool_of_file(p.name), []).append(p.name.split("_", 1)[0])
        return out

    def believed(self, pool: str, keys: list[str]) -> list[str]:
        """Which of ``keys`` the installed existence cache believes stored (a read)."""
        if hasattr(self.cache, "clear_inflight"):  # current generation (sglang >= 0.5.22)
            got = set(self.cache.pool(pool).believed(keys))
        else:  # flat (sglang 0.5.19 - 0.5.21)
            got = set(self.cache.believed(pool, keys))
        return [k for k in keys if k in got]

    def mamba_state_bytes(self, node_id: Any) -> bytes:
        """The node's Mamba state on the device, laid out as ``MambaPoolHost``
        lays out one host page (temporal state, then each conv state; every
        Mamba layer in order)."""
        import torch
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        slot = self.tree.tree_core.get_component_device_value(node_id, ComponentType.MAMBA)
        state = self.rtp.mamba_pool.mamba_cache
        i = int(slot.reshape(-1)[0])
        parts = [
            t[:, i].contiguous().view(torch.uint8).reshape(-1)
            for t in [state.temporal, *state.conv]
        ]
        return bytes(torch.cat(parts).numpy().tobytes())

    def close(self) -> None:
        self.tree.cache_controller._stop_storage_threads()


def _written_samples(hs: Any, entry: Any) -> dict[str, float]:
    """``hicache_existence_written_pages_total`` per ``pool`` label, scraped."""
    out: dict[str, float] = {}
    for line in hs.samples(
        hs.scrape(entry) if entry else "", "hicache_existence_written_pages_total"
    ):
        labels, value = line.rsplit(" ", 1)
        pool = labels.split('pool="', 1)[1].split('"', 1)[0]
        out[pool] = out.get(pool, 0.0) + float(value)
    return out


def cache_writes(hs: Any, mode: str = "cache") -> dict[str, Any]:
    """A (8 pages) written; after a flush A4 (A's first 4 pages: its ``kv`` pages
    believed, its Mamba page, keyed by A3, not); after another flush A4 again
    (everything believed).  Per phase: the package's counters per pool, the
    backend's ``set`` keys per pool, the page files per pool, the beliefs."""
    logs = hs.capture_logs()
    hs.load_plugins()
    try:
        server = MambaHiCacheServer(hs, mode)
    except ValueError as exc:
        if mode != "buffer_only":
            raise
        # sglang <= 0.5.21: init_hicache refuses a Mamba tree in buffer mode.
        return {"refused": str(exc), "warnings": logs.warnings()}
    entry = server.entry
    feed = entry.write_path if entry else None
    a = list(range(1, 8 * PAGE + 1))
    phases: dict[str, Any] = {}
    keys: dict[str, list[str]] = {}

    def phase(name: str, tokens: list[int], flush: bool) -> Any:
        if flush:
            server.flush()
        first = len(server.sets)
        node = server.insert(tokens)
        steps = server.pump()
        sets: dict[str, list[str]] = {}
        for key in server.sets[first:]:
            sets.setdefault(pool_of_key(key), []).append(key.split(".", 1)[0])
        if not keys:  # A's pages, in order, from the backend's own calls
            keys["kv"] = sets.get("kv", [])
            keys["mamba"] = sets.get("mamba", [])
        phases[name] = {
            "steps": steps,
            "writes": entry.runtime.writes.stats().as_dict() if entry else {},
            "sets": sets,
            "files": {p: len(v) for p, v in server.files().items()},
            "believed_kv": server.believed("kv", keys["kv"]),
            "believed_mamba": server.believed("mamba", keys["kv"]),
            "drained": not server.tree.ongoing_backup,
        }
        return node

    node_a = phase("a", a, flush=False)
    state_a = server.mamba_state_bytes(node_a)
    mamba_file = (
        next(server.l3.glob(f"{keys['mamba'][0]}.mamba_*.bin"), None) if keys["mamba"] else None
    )
    phase("a4", a[: 4 * PAGE], flush=True)
    phase("a4_again", a[: 4 * PAGE], flush=True)
    result = {
        "shims": server.shims,
        "controller": type(server.tree.cache_controller).__name__,
        "host_pools": sorted(
            f"{pool_name(e.name)}:{type(e.host_pool).__name__}"
            for e in server.tree.cache_controller.mem_pool_host.entries
        ),
        "components": sorted(c.name for c in server.tree.tree_components),
        "cache_type": type(server.cache).__name__,
        "observed": entry is not None and server.cache is entry.runtime.cache,
        "dedup": bool(feed and feed.cache_mode and feed.cache_mode.dedup),
        "keys": keys,
        "phases": phases,
        "mamba_file_equals_device_state": (
            mamba_file is not None and mamba_file.read_bytes() == state_a
        ),
        "mamba_state_bytes": len(state_a),
        "written_samples": _written_samples(hs, entry),
        "errors": feed.errors if feed else None,
        "warnings": logs.warnings(),
    }
    server.close()
    return result
