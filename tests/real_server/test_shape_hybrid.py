"""A hybrid sliding-window model in real servers: L3 writes counted per pool
(``kv`` and ``swa``) against the page files of each pool, cache mode with
``cache_mode.dedup`` off and on, and buffer mode.

The model is a tiny random-weight ``MellumForCausalLM`` (sglang 0.5.23's
``models/mellum.py``: Qwen3-MoE layers with per-layer ``layer_types``; both MLPs
dense here, so no MoE kernel runs), written on the fly: layer 0 slides over a
32-token window (two 16-token pages), layer 1 attends fully.  sglang lists the
architecture as hybrid SWA (``configs/model_config.py:is_hybrid_swa_model``), so
it builds an ``SWAKVPool`` on the device, a ``UnifiedRadixCache`` with the FULL and
SWA components, and a host pool stack "Full + SWA" whose controller
(``mem_cache/hybrid_cache/hybrid_cache_controller.py``) writes each node's ``swa``
pages beside its ``kv`` pages.  ``swa`` is a trailing-pages pool: a node carries
the window state of the pages whose SWA slots are still held on the device, keyed
by the same page hashes (a decode step frees the slots that left the window, so a
request decoded for a few tokens keeps its last pages' state only, and a prompt
with a single output token keeps all of it).  The file
backend names a page ``<key>_<model>_<tp rank>_<tp size>.bin`` with ``key`` the
page hash for ``kv`` and ``<hash>.<pool>`` for any other pool
(``mem_cache/hicache_storage.py``, ``HiCacheFile._log_key``), so the L3 directory
tells the pools apart.  The host side needs no stand-in beyond the harness's
usual ones (the SWA host pool is an MHA host pool: the same D2H/H2D copies and
dummy page); the attention does (last paragraph).

Three servers start side by side (``--sleep-on-idle``: three schedulers spinning
on two cores slow each other): cache mode with dedup off, with dedup on, and
``buffer_only``; each has its own L3 directory, loads each prefetch whole
(``harness.LOAD_WHOLE``: the servers are compared on exact counts), and serves the
same requests:

1. **L2 pressure** (as ``test_cache_mode.py``): a multi-turn conversation workload
   (``harness.conversation_requests``, 8 conversations of 6 turns) through a
   2048-token device pool and a host pool twice its size, less than the
   conversations' distinct tokens, so prefixes leave host memory and come back
   from L3 (``sglang:prefetched_tokens_total``) or are computed and written again.
2. **computed, then loaded from L3**: a 384-token prompt ``L`` (above sglang's
   256-token prefetch threshold); ``/flush_cache`` (device and host memory
   emptied); ``L`` again, now loaded from L3, ``kv`` and the ``swa`` window: the
   same greedy output.
3. **KV believed, SWA not**: ``A`` (10 pages, below the prefetch threshold, so
   nothing is read from L3; 4 output tokens) is written as one node: ``kv`` pages
   A0..A9 and the ``swa`` state of its last pages only (the decode freed the
   rest).  ``/flush_cache``; then ``A6``, A's first six pages with one output
   token: its node's ``kv`` pages A0..A5 are all believed stored, but its ``swa``
   pages are A0..A5 too (no decode step freed a slot), and no write stored them.
   Dedup must write that node whole (``WritePlan``: the whole node or nothing
   when extra pools ride along): six ``kv`` pages again (redundant, believed) and
   the six ``swa`` pages, whose files appear beside the ``kv`` files ``A``
   stored.  ``/flush_cache``; ``A6`` again: now every page of the node, ``kv`` and
   ``swa``, is believed, and dedup leaves the whole node out.  Buffer mode
   (upstream's admission, pool by pool) writes only the six ``swa`` pages there.

The truth never reads our counters: the page files per pool (the file backend
skips a page whose file exists, so a file is created once), SGLang's own count
of KV pages written to L3 (``sglang:backuped_tokens_total``, counted at the
storage ack; it has no pool label, and ``sglang:hicache_backup_tokens_total{pool}``
counts device-to-host copies, not L3 writes), and the greedy outputs.

CPU stand-in: ``standins/hx_swa_attention.py`` (``torch_native`` reads a sliding
layer's KV at full-pool indices of the SWA pool; without it the first request
past the SWA pool's size kills the scheduler with an ``IndexError``).

No Mamba hybrid here: on sglang 0.5.23's CPU path a linear-attention model
(e.g. ``Qwen3NextForCausalLM``) stops at start-up, first at
``models/qwen3_next.py:252`` (``torch.get_device_module().current_device()``
answers ``torch.cuda`` on the CUDA wheel: "Found no NVIDIA driver"), then at
``layers/attention/linear/kda_backend.py:39`` (``from sgl_kernel.mamba import
causal_conv1d_update_cpu``, imported from ``attention_registry.py:410``): its
kernels (``causal_conv1d_*_cpu``, ``chunk_gated_delta_rule_cpu``,
``fused_gdn_gating_cpu``, ``fused_sigmoid_gating_delta_rule_update_cpu``) live
only in sgl_kernel's CPU build, which is not on PyPI; Mamba2 mixers
(``layers/attention/mamba/mamba.py``) bind ``causal_conv1d_fn`` on CUDA, NPU and
XPU only and scan with Triton.  sglang's own Mamba HiCache classes run in process
instead: ``tests/sglang_integration/test_sglang_mamba.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import (
    LOAD_WHOLE,
    TINY_LLAMA,
    Server,
    ServerSpec,
    block_tokens_for,
    conversation_requests,
    family,
    launch_together,
    settle,
    sglang_total,
    side_by_side,
)

pytestmark = [pytest.mark.real_server]

PAGE = 16
WINDOW_PAGES = 2
P = "hicache_existence_"
#: A tiny hybrid-SWA Mellum: layer 0 sliding (32 tokens), layer 1 full.
MELLUM: dict[str, Any] = {
    "architectures": ["MellumForCausalLM"],
    "model_type": "mellum",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": TINY_LLAMA["vocab_size"],
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "sliding_window": WINDOW_PAGES * PAGE,
    "layer_types": ["sliding_attention", "full_attention"],
    "mlp_layer_types": ["dense", "dense"],
    # unused by dense layers, but sglang's expert map needs one expert at least
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
WORKLOAD: dict[str, Any] = {
    "conversations": 8,
    "turns": 6,
    "system_tokens": 64,
    "user_tokens": (16, 96),
    "reply_tokens": (16, 64),
    "salt": "hybrid-swa",
}
COUNTERS = (
    "written_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "redundant_written_pages",
    "redundant_believed_pages",
    "write_avoided_pages",
)
MODES = ("cache_off", "cache_on", "buffer")


def spec(mode: str) -> ServerSpec:
    cache = mode.startswith("cache")
    return ServerSpec(
        model=MELLUM,
        model_drop=tuple(TINY_LLAMA),
        host_memory_mode="cache" if cache else "buffer_only",
        max_total_tokens=2048,
        hicache_ratio=2.0,
        config={"cache_mode": {"dedup": mode == "cache_on"}} if cache else None,
        sleep_on_idle=True,
        prefetch_policy=LOAD_WHOLE,
    )


def tokens(seed: int, pages: int) -> list[int]:
    return block_tokens_for(seed, PAGE * pages, salt="hybrid-swa-script")


def pool_of(file_name: str) -> str:
    """The pool of an L3 page file: ``<hash>[.<pool>]_<model>_<rank>_<size>.bin``."""
    key = file_name.split("_", 1)[0]
    return key.split(".", 1)[1] if "." in key else "kv"


def files_by_pool(srv: Server) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for name in srv.l3_pages():
        out.setdefault(pool_of(name), set()).add(name)
    return {pool: frozenset(names) for pool, names in out.items()}


def per_pool(fams: Mapping[str, Any], name: str) -> dict[str, float]:
    """One of our counters by pool (strict: our families exist from the start)."""
    out: Counter[str] = Counter()
    for sample, labels, value in family(fams, P + name).samples:
        if sample.endswith("_total"):
            out[labels["pool"]] += value
    return dict(out)


@dataclass
class Reading:
    """One server's figures once its writes settled."""

    counters: dict[str, dict[str, float]]
    #: SGLang's own count of pages written to L3 (``sglang:backuped_tokens_total``:
    #: the storage operations' completed KV tokens; it has no pool label).
    l3_kv_pages: float
    #: SGLang's device-to-host (L2) backups per pool
    #: (``sglang:hicache_backup_tokens_total{pool}``), beside the L3 figures.
    l2_pages: dict[str, float]
    prefetched_tokens: float
    files: dict[str, frozenset[str]]

    def c(self, name: str, pool: str) -> float:
        return self.counters[name].get(pool, 0.0)

    def n_files(self, pool: str) -> int:
        return len(self.files.get(pool, frozenset()))


def _read(srv: Server) -> tuple[Any, ...]:
    fams = srv.metrics()
    counters = {n: per_pool(fams, n) for n in COUNTERS}
    l2: Counter[str] = Counter()
    fam = fams.get("sglang:hicache_backup_tokens")  # created at the first backup
    for sample, labels, value in fam.samples if fam is not None else ():
        if sample.endswith("_total"):
            l2[labels["pool"]] += value / PAGE
    l3 = sglang_total(fams, "sglang:backuped_tokens") / PAGE
    prefetched = sglang_total(fams, "sglang:prefetched_tokens")
    files = files_by_pool(srv)
    frozen = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in counters.items()))
    return frozen, l3, tuple(sorted(l2.items())), prefetched, tuple(sorted(files.items()))


def reading(srv: Server) -> Reading:
    srv.wait_writes_settled(quiet_s=2.0)
    frozen, l3, l2, prefetched, files = settle(lambda: _read(srv), quiet_s=3.0)
    counters = {name: dict(values) for name, values in frozen}
    return Reading(counters, l3, dict(l2), prefetched, dict(files))


@dataclass
class Run:
    """Everything one server did: outputs in request order, readings by phase."""

    outputs: list[list[int]] = field(default_factory=list)
    at: dict[str, Reading] = field(default_factory=dict)
    log_clean: bool = True


def serve(srv: Server, run: Run) -> None:
    out = run.outputs
    for turn in conversation_requests(**WORKLOAD):
        out.append(srv.generate(turn.input_ids, max_new_tokens=2))
    run.at["conversations"] = reading(srv)
    long = tokens(1, 24)
    out.append(srv.generate(long, max_new_tokens=4))
    run.at["l_computed"] = reading(srv)
    srv.flush_cache()
    out.append(srv.generate(long, max_new_tokens=4))
    run.at["l_loaded"] = reading(srv)
    a = tokens(2, 10)
    out.append(srv.generate(a, max_new_tokens=4))
    run.at["a"] = reading(srv)
    srv.flush_cache()
    out.append(srv.generate(a[: 6 * PAGE], max_new_tokens=1))
    run.at["a6"] = reading(srv)
    srv.flush_cache()
    out.append(srv.generate(a[: 6 * PAGE], max_new_tokens=1))
    run.at["a6_again"] = reading(srv)
    run.log_clean = "Traceback" not in srv.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    workdir: Path = tmp_path_factory.mktemp("shape-hybrid")
    with launch_together([spec(m) for m in MODES], workdir) as servers:
        out = {m: Run() for m in MODES}
        side_by_side(*(lambda s=s, m=m: serve(s, out[m]) for s, m in zip(servers, MODES)))
        for srv, mode in zip(servers, MODES):
            assert out[mode].log_clean, f"{mode}: {srv.tail()}"
    for mode, run in out.items():
        print(f"\n{mode}:")
        before = None
        for phase, r in run.at.items():
            print(f"  {phase} (change): " + describe(r, run.at[before] if before else None))
            before = phase
        print(f"  total: {describe(run.at['a6_again'], None)}")
    yield out


def describe(r: Reading, b: Reading | None) -> str:
    """One reading's figures per pool (their change since ``b``, if given)."""

    def figures(x: Reading) -> dict[str, dict[str, float]]:
        out = {
            pool: {
                "written": x.c("written_pages", pool),
                "redundant": x.c("redundant_written_pages", pool),
                "believed": x.c("redundant_believed_pages", pool),
                "avoided": x.c("write_avoided_pages", pool),
                "files": float(x.n_files(pool)),
                "l2": x.l2_pages.get(pool, 0.0),
            }
            for pool in ("kv", "swa")
        }
        out["sglang"] = {"l3 kv": x.l3_kv_pages, "prefetched": x.prefetched_tokens}
        return out

    now, then = figures(r), figures(b) if b is not None else None
    return "; ".join(
        f"{group}: "
        + " ".join(f"{k}={v - (then[group][k] if then else 0):.0f}" for k, v in vals.items())
        for group, vals in now.items()
    )


def step(run: Run, before: str, after: str) -> dict[str, dict[str, float]]:
    """Per counter and pool, the change between two phases."""
    b, a = run.at[before], run.at[after]
    return {
        name: {pool: a.c(name, pool) - b.c(name, pool) for pool in ("kv", "swa")}
        for name in COUNTERS
    } | {
        "files": {pool: a.n_files(pool) - b.n_files(pool) for pool in ("kv", "swa")},
        "l3_kv": {"kv": a.l3_kv_pages - b.l3_kv_pages},
    }


@pytest.mark.parametrize("mode", MODES)
def test_counters_per_pool_equal_sglangs_count_and_the_files_of_each_pool(
    runs: dict[str, Run], mode: str
) -> None:
    """Every phase, every pool: written = acknowledged (nothing failed); written -
    redundant = the pool's page files; ``kv`` written = SGLang's own count of KV
    pages written to L3.  Both pools have files (``swa`` really goes to L3)."""
    for phase, r in runs[mode].at.items():
        for pool in ("kv", "swa"):
            written = r.c("written_pages", pool)
            if pool == "kv":
                assert written == r.l3_kv_pages, (phase, r)
            assert written == r.c("write_acknowledged_pages", pool), (phase, pool, r)
            assert r.c("write_failed_pages", pool) == 0, (phase, pool, r)
            assert written - r.c("redundant_written_pages", pool) == r.n_files(pool), (
                phase,
                pool,
                r,
            )
    end = runs[mode].at["a6_again"]
    assert end.n_files("kv") > 0 and end.n_files("swa") > 0, end.files.keys()
    assert set(end.files) == {"kv", "swa"}, end.files.keys()


def test_outputs_are_identical_in_every_mode_and_from_l3(runs: dict[str, Run]) -> None:
    """Identical greedy outputs for every request in the three servers; ``L``
    computed and ``L`` loaded from L3 (after a flush) give the same output, and it
    was loaded (prefetched tokens rose by L's pages at least)."""
    outs = [runs[m].outputs for m in MODES]
    assert outs[0] == outs[1] == outs[2]
    n = WORKLOAD["conversations"] * WORKLOAD["turns"]
    assert len(outs[0]) == n + 5
    assert outs[0][n] == outs[0][n + 1]
    for mode in MODES:
        run = runs[mode]
        assert run.at["conversations"].prefetched_tokens > 0, mode  # the L2 pressure
        loaded = run.at["l_loaded"].prefetched_tokens - run.at["l_computed"].prefetched_tokens
        assert loaded >= 23 * PAGE, (mode, loaded)


def test_cache_mode_files_equal_with_dedup_off_and_on(runs: dict[str, Run]) -> None:
    """Dedup changes no page of any pool in L3; with L2 pressure it leaves out
    writes dedup-off repeats: off writes = on writes + on avoided, per pool."""
    off, on = runs["cache_off"].at["a6_again"], runs["cache_on"].at["a6_again"]
    assert off.files == on.files
    for pool in ("kv", "swa"):
        w_off, w_on = off.c("written_pages", pool), on.c("written_pages", pool)
        assert w_off == w_on + on.c("write_avoided_pages", pool), pool
        assert off.c("write_avoided_pages", pool) == 0, pool
        assert on.c("redundant_written_pages", pool) <= off.c("redundant_written_pages", pool)
    assert off.c("redundant_written_pages", "kv") > 0


def kv_hashes(files: frozenset[str]) -> set[str]:
    return {name.split("_", 1)[0] for name in files}


def swa_hashes(files: frozenset[str]) -> set[str]:
    return {name.split("_", 1)[0].split(".", 1)[0] for name in files}


@pytest.mark.parametrize("mode", ("cache_off", "cache_on"))
def test_a_node_with_kv_believed_and_swa_not_is_written_whole(
    runs: dict[str, Run], mode: str
) -> None:
    """``A`` (decoded for 4 tokens) stores its ten ``kv`` pages and the ``swa``
    window of its last pages only; ``A6`` after a flush (one token: no decode step
    frees a slot, its node keeps the ``swa`` state of all six pages) has six ``kv``
    pages believed and six ``swa`` pages no write stored.  Both servers write the
    node whole: six ``kv`` pages (redundant and believed: no new ``kv`` file) and
    six ``swa`` pages, whose files appear, each beside a ``kv`` file ``A`` stored;
    dedup on avoids nothing."""
    run = runs[mode]
    a = step(run, "l_loaded", "a")
    assert a["written_pages"]["kv"] == a["files"]["kv"] == 10, a
    assert 0 < a["written_pages"]["swa"] == a["files"]["swa"] < 10, a
    d = step(run, "a", "a6")
    assert d["written_pages"] == {"kv": 6, "swa": 6}, d
    assert d["write_avoided_pages"] == {"kv": 0, "swa": 0}, d
    assert d["redundant_believed_pages"]["kv"] == 6, d
    assert d["redundant_written_pages"] == {"kv": 6, "swa": 0}, d
    assert d["files"] == {"kv": 0, "swa": 6}, d
    assert d["l3_kv"] == {"kv": 6}, d
    before, after = run.at["a"].files, run.at["a6"].files
    new_swa = swa_hashes(after["swa"] - before["swa"])
    stored_by_a = kv_hashes(before["kv"] - run.at["l_loaded"].files["kv"])
    assert len(new_swa) == 6 and new_swa <= stored_by_a, (new_swa, stored_by_a)


def test_a_node_whose_every_pool_is_believed_is_left_out_by_dedup(
    runs: dict[str, Run],
) -> None:
    """``A6`` again after a flush: every page of its node, ``kv`` and ``swa``, is
    believed.  Dedup off writes it all again (redundant, no new file); dedup on
    leaves the whole node out (avoided in both pools; SGLang wrote nothing)."""
    off = step(runs["cache_off"], "a6", "a6_again")
    on = step(runs["cache_on"], "a6", "a6_again")
    whole = {"kv": 6, "swa": 6}
    none = {"kv": 0, "swa": 0}
    assert off["written_pages"] == off["redundant_written_pages"] == whole, off
    # what dedup saves, per pool: the believed pages written again (swa too)
    assert off["redundant_believed_pages"] == whole, off
    assert off["write_avoided_pages"] == none and off["files"] == none, off
    assert off["l3_kv"] == {"kv": 6}, off
    assert on["written_pages"] == none and on["l3_kv"] == {"kv": 0}, on
    assert on["write_avoided_pages"] == whole and on["files"] == none, on


def test_buffer_mode_admits_each_pool_on_its_own(runs: dict[str, Run]) -> None:
    """Upstream's buffer pipeline on the same ``A6``: its ``kv`` pages are believed
    and left out, its ``swa`` pages are not and are written (new files); the
    counters follow it pool by pool."""
    d = step(runs["buffer"], "a", "a6")
    assert d["written_pages"] == {"kv": 0, "swa": 6}, d
    assert d["write_avoided_pages"] == {"kv": 6, "swa": 0}, d
    assert d["files"] == {"kv": 0, "swa": 6}, d
    assert d["l3_kv"] == {"kv": 0}, d
