"""The MLA shape (DeepSeek-style latent attention) in real servers: TP=2, where one
rank writes L3 for the group and the other skips.

Why: production PD fleets serve MLA models. MLA's KV (one latent row per token) is
the same on every TP rank, so SGLang writes each page once for the group: the
storage writer (``HiCacheStorageConfig.is_storage_writer``: rank 0) writes, and the
other ranks' ``HiCacheController.backup_skip`` acknowledges their copy of every
backup without touching L3 (``completed_tokens`` stays 0). The package's rule that
every rank adds the written pages to its beliefs whatever its own backend answered
is what keeps the replicas identical there; this module runs that path in real
servers, in both host memory modes.

The model is a tiny random-weight ``DeepseekV2ForCausalLM`` written on the fly
(``MLA_MODEL``: kv_lora_rank 32, qk_rope_head_dim 16, so a latent row is 48 bf16
values; 2 layers, both dense: ``first_k_dense_replace`` = ``num_hidden_layers``, the
two experts the config schema requires are never built). On the CPU engine it
needs the stand-ins of ``standins/hx_mla_standins.py`` (each says what fails
without it). Page files are ``<hash>_tiny-llama.bin``, with no rank in the name:
one file per page for the whole TP group.

Three TP=2 servers side by side (``sleep_on_idle``: six schedulers on two cores),
one per mode: buffer mode, cache mode with ``cache_mode.dedup`` off, and on; all on
64-token pages. Each serves the same greedy workload (``WORKLOAD``): A (3 pages),
then A+B+D (6: A from the device tree); flush; A+C (A is in L3 but, at 192 tokens,
below SGLang's 256-token prefetch threshold: computed again, so it is rewritten
with dedup off and avoided with it on); flush; A+B+D again (its 5-page prefix is
loaded back from L3, so its output must equal the first A+B+D's).

Truth the counters are held to, none of it from the package:

* SGLang's ``sglang:backuped_tokens_total`` per rank (counted at the same storage
  ack from the backup's ``completed_tokens``): the writer's / 64 = written pages;
  the skipping rank's is 0.
* The file backend's own calls (probe ``l3_set`` of ``hx_mla_standins``: which rank
  called ``HiCacheFile.batch_set``, with how many pages, creating how many files)
  and the page files renamed into place (inotify, ``FileCreations``).
* Greedy outputs: equal across the three servers, and equal after an L3 round trip.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness import (
    VOCAB,
    FileCreations,
    Server,
    ServerSpec,
    block_tokens_for,
    cause_pages,
    launch_together,
    parse_metrics,
    sample_value,
    settle,
    side_by_side,
)

pytestmark = [pytest.mark.real_server, pytest.mark.torch]

P = "hicache_existence_"
TP = 2
PAGE = 64
LAYERS = 2
KV_LORA_RANK = 32
QK_ROPE_HEAD_DIM = 16
#: One page file: every layer's latent rows (kv_lora_rank + rope dims, bf16) of a
#: page, the whole page whatever the rank (MLA is rank-replicated).
PAGE_BYTES = LAYERS * PAGE * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 2
#: A DeepSeek-V2-style MLA model small enough for CPU; all layers dense.
MLA_MODEL: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # The schema wants integers here; first_k_dense_replace >= num_hidden_layers
    # means no layer is a MoE layer, so no expert is built.
    "first_k_dense_replace": LAYERS,
    "n_routed_experts": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    # The CPU engine builds DeepSeek rope only from a deepseek_yarn scaling
    # (rotary_embedding/factory.py:get_rope_cpu); factor 1 scales nothing.
    "rope_scaling": {
        "rope_type": "deepseek_yarn",
        "type": "deepseek_yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "vocab_size": VOCAB,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
#: (host memory mode, cache_mode.dedup) of each server.
MODES: dict[str, tuple[str, bool | None]] = {
    "buffer": ("buffer_only", None),
    "cache_dedup_off": ("cache", False),
    "cache_dedup_on": ("cache", True),
}
OURS = (
    "written_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "redundant_written_pages",
    "write_avoided_pages",
    "entries",
    "divergence_checks",
    "divergences",
)


def pages(seed: int, n: int) -> list[int]:
    return block_tokens_for(seed, PAGE * n, salt="mla")


A, B, C, D = pages(1, 3), pages(2, 2), pages(3, 2), pages(4, 1)
#: (prompt, flush the device and host trees after it, once its writes settled).
WORKLOAD: list[tuple[list[int], bool]] = [
    (A, False),
    (A + B + D, True),
    (A + C, True),
    (A + B + D, False),
]
NEW_TOKENS = 4


def spec(mode: str) -> ServerSpec:
    host_memory_mode, dedup = MODES[mode]
    config: dict[str, Any] = {
        # audit_every_checks=1: every check also folds the exact membership audit.
        "divergence": {"enabled": True, "interval_steps": 10, "audit_every_checks": 1},
    }
    if dedup is not None:
        config["cache_mode"] = {"dedup": dedup}
    return ServerSpec(
        tp_size=TP,
        page_size=PAGE,
        host_memory_mode=host_memory_mode,
        max_total_tokens=4096,
        model=MLA_MODEL,
        model_drop=("head_dim",),
        config=config,
        sleep_on_idle=True,
        env={"HX_PROBE_L3_SETS": "1"},
    )


@dataclass
class Run:
    server: Server
    outputs: list[list[int]]
    #: Our counters by rank ("0", "1"), once everything settled.
    ours: dict[str, dict[str, float]]
    #: sglang:backuped_tokens_total by rank (0 where SGLang never created it).
    backuped: dict[str, float]
    prefetched_tokens: float
    #: The file backend's batch_set calls: [{"tp_rank", "pages", "created", "ok"}].
    l3_sets: list[dict[str, Any]]
    renames: Counter[str]
    files: dict[str, int]
    notes: dict[str, Any] = field(default_factory=dict)


def by_rank(fams: dict[str, Any], name: str, *, absent_ok: bool = False) -> dict[str, float]:
    """A family's ``_total`` samples (or a gauge's) summed by ``tp_rank``; strict:
    a family that is not on /metrics raises unless ``absent_ok``."""
    fam = fams.get(name)
    if fam is None:
        if absent_ok:
            return {}
        raise AssertionError(f"{name} is not on /metrics")
    out: Counter[str] = Counter()
    for sample, labels, value in fam.samples:
        if sample.endswith("_total") or fam.type == "gauge":
            out[labels["tp_rank"]] += value
    return dict(out)


def reading(srv: Server) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    fams = parse_metrics(srv.metrics_text())
    ours = {name: by_rank(fams, P + name) for name in OURS}
    backuped = by_rank(fams, "sglang:backuped_tokens", absent_ok=True)
    return ours, backuped


def settled(srv: Server) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Our counters and SGLang's backed-up count once neither moves (the
    divergence checks keep counting: left out of the comparison)."""
    srv.wait_writes_settled()

    def moving() -> Any:
        ours, backuped = reading(srv)
        return {k: v for k, v in ours.items() if not k.startswith("divergence")}, backuped

    settle(moving, quiet_s=3.0)
    return reading(srv)


def drive(srv: Server) -> list[list[int]]:
    outs = []
    for prompt, flush in WORKLOAD:
        outs.append(srv.generate(prompt, NEW_TOKENS))
        if flush:
            settled(srv)
            srv.flush_cache()
    return outs


def checks_after(srv: Server, before: dict[str, float], more: int = 2) -> dict[str, float]:
    """Divergence checks by rank once each rank completed ``more`` after ``before``."""
    deadline = time.monotonic() + 120
    while True:
        ours, _ = reading(srv)
        checks = ours["divergence_checks"]
        if set(checks) == {"0", "1"} and all(
            checks[r] >= before.get(r, 0) + more for r in ("0", "1")
        ):
            return checks
        assert time.monotonic() < deadline, (checks, before, srv.tail())
        time.sleep(1.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    workdir = tmp_path_factory.mktemp("mla")
    t0 = time.monotonic()
    with launch_together([spec(m) for m in MODES], workdir) as servers:
        up_s = time.monotonic() - t0
        watchers = [FileCreations(srv.l3_dir) for srv in servers]
        outputs = side_by_side(*(lambda s=s: drive(s) for s in servers))
        out: dict[str, Run] = {}
        for mode, srv, watch, outs in zip(MODES, servers, watchers, outputs):
            ours, backuped = settled(srv)
            # Replicas compared after the last belief changed: two more checks.
            ours["divergence_checks"] = checks_after(srv, ours["divergence_checks"])
            ours["divergences"] = reading(srv)[0]["divergences"]
            out[mode] = Run(
                server=srv,
                outputs=outs,
                ours=ours,
                backuped=backuped,
                prefetched_tokens=sample_value(
                    srv.metrics(), "sglang:prefetched_tokens_total", absent_ok=True
                ),
                l3_sets=srv.probes("l3_set"),
                renames=watch.close(),
                files=srv.l3_pages(),
                notes={
                    "up_s": up_s,
                    "wall_s": time.monotonic() - t0,
                    "causes": cause_pages(srv.metrics()),
                },
            )
        print(
            "\nMLA shape figures:",
            {
                m: (r.ours, r.backuped, r.prefetched_tokens, len(r.files), r.notes)
                for m, r in out.items()
            },
        )
        yield out


@pytest.mark.parametrize("mode", list(MODES))
def test_written_pages_match_sglang_backed_up_count_on_both_ranks(
    runs: dict[str, Run], mode: str
) -> None:
    """Both ranks count the same written pages (the same plan), equal to SGLang's
    own backed-up count of the writer / 64; only the writer acknowledges them,
    and SGLang counts nothing backed up on the skipping rank (``backup_skip``)."""
    run = runs[mode]
    o = run.ours
    written = o["written_pages"]
    assert set(written) == {"0", "1"} and written["0"] == written["1"] > 0, o
    assert run.backuped.get("0", 0.0) == written["0"] * PAGE, (run.backuped, o)
    assert run.backuped.get("1", 0.0) == 0, run.backuped
    assert o["write_acknowledged_pages"] == {"0": written["0"], "1": 0.0}, o
    assert o["write_failed_pages"] == {"0": 0.0, "1": 0.0}, o


@pytest.mark.parametrize("mode", list(MODES))
def test_only_rank_0_writes_l3_and_its_new_files_are_written_minus_redundant(
    runs: dict[str, Run], mode: str
) -> None:
    """The file backend is called by rank 0 only, with exactly the written pages;
    the files it created (absent before its call) = the renames into place = the
    files in L3 = written - redundant; the pages it was handed whose file was
    there already = our redundant count. Every file is one whole latent page,
    with no rank in its name."""
    run = runs[mode]
    o = run.ours
    sets = run.l3_sets
    assert sets and {s["tp_rank"] for s in sets} == {0}, sets
    assert all(s["ok"] for s in sets), sets
    handed = sum(s["pages"] for s in sets)
    created = sum(s["created"] for s in sets)
    assert handed == o["written_pages"]["0"], (handed, o)
    assert handed - created == o["redundant_written_pages"]["0"], (handed, created, o)
    assert set(run.renames.values()) == {1}, run.renames
    assert created == len(run.renames) == len(run.files), (created, run.renames, run.files)
    assert created == o["written_pages"]["0"] - o["redundant_written_pages"]["0"], o
    assert set(run.files.values()) == {PAGE_BYTES}, set(run.files.values())
    assert all(n.endswith("_tiny-llama.bin") for n in run.files), sorted(run.files)


@pytest.mark.parametrize("mode", list(MODES))
def test_both_ranks_hold_the_same_beliefs(runs: dict[str, Run], mode: str) -> None:
    """The skipping rank believes what the writer believes: the same number of
    entries (every page created in L3), and the divergence checks (an exact
    membership audit at every check) ran on both ranks after the last write and
    found no difference; both avoided the same pages."""
    run = runs[mode]
    o = run.ours
    assert o["entries"]["0"] == o["entries"]["1"] == len(run.files), (o, len(run.files))
    assert min(o["divergence_checks"].values()) >= 2, o
    assert o["divergences"] == {"0": 0.0, "1": 0.0}, o
    # The same plan on both ranks (avoided is decided from the beliefs); a
    # redundant page is the backend's answer, which only the writer asked for.
    assert o["write_avoided_pages"]["0"] == o["write_avoided_pages"]["1"], o
    assert o["redundant_written_pages"]["1"] == 0, o


def test_dedup_on_avoids_the_pages_dedup_off_rewrites(runs: dict[str, Run]) -> None:
    """A+C after the flush: A's pages are in L3 (below the prefetch threshold, so
    computed again). Dedup off writes them again (each is redundant: its file
    was there); dedup on leaves exactly those out. Both end with the same L3."""
    off, on = runs["cache_dedup_off"].ours, runs["cache_dedup_on"].ours
    assert on["redundant_written_pages"]["0"] == 0, on
    assert off["redundant_written_pages"]["0"] > 0, off
    extra = off["written_pages"]["0"] - on["written_pages"]["0"]
    assert extra == off["redundant_written_pages"]["0"], (off, on)
    assert extra == on["write_avoided_pages"]["0"] - off["write_avoided_pages"]["0"], (off, on)
    assert set(runs["cache_dedup_off"].files) == set(runs["cache_dedup_on"].files)


def test_greedy_outputs_are_equal_across_modes_and_after_an_l3_round_trip(
    runs: dict[str, Run],
) -> None:
    """The same tokens from all three servers (dedup changes which pages are
    written, never what is computed), and A+B+D answers the same after its prefix
    came back from L3 (SGLang counted prefetched tokens) as when it was computed:
    the latent bytes survived device -> host -> file -> host -> device."""
    outs = {mode: run.outputs for mode, run in runs.items()}
    assert len({repr(o) for o in outs.values()}) == 1, outs
    for mode, run in runs.items():
        assert run.prefetched_tokens > 0, (mode, run.prefetched_tokens)
        assert run.outputs[3] == run.outputs[1], (mode, run.outputs)
