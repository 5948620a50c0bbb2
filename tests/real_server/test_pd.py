"""PD for real: prefill servers, a decode server and SGLang's router, all started by
the recipes in ``integrations/sglang/`` (``pd.py``), with KV moved over the Mooncake
transfer engine on TCP.

One stack for the module: two prefill servers, one decode server and the router
(round robin, so a conversation's turns alternate between the two prefill servers).
The prefill servers share one L3 (the file backend on one directory) and one ledger
(a real ``redis-server``) through the ledger-recording backend, with the reconciler
on. The same conversations run twice: with cross-instance learning off
(``reconciler.learn: false``), then, after the prefill servers are replaced by ones
with it on, against a fresh L3 and ledger namespace (two fleets side by side would
need four prefill servers at once on CI's two cores).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Server, block_tokens_for
from pd import PAGE_SIZE, PDStack, PrefillSpec, RecipeProcess, RouterSpec

sys.path.insert(0, str(REPO / "tests"))
from reconcile_redis_server import RedisServer

pytestmark = [pytest.mark.real_server, pytest.mark.redis]

P = "hicache_existence_"
WRITE_COUNTERS = ("written_pages", "redundant_written_pages", "write_avoided_pages")
RECONCILER_COUNTERS = (
    "reconciler_pages_learnt",
    "reconciler_pages_invalidated",
    "reconciler_stale_positives",
)
FLEETS = {"off": False, "on": True}
CONVERSATIONS = 6
TURNS = 5
FIRST_PAGES = 20  # 320 tokens: over sglang's 256-token L3 prefetch threshold
TURN_PAGES = 4  # 64 tokens a turn: below it, so a turn's new pages are computed


def prefill_config(redis_url: str, namespace: str, learn: bool) -> dict[str, Any]:
    return {
        "cache": {"max_entries": 65536},
        "reconciler": {
            "enabled": True,
            "redis_url": redis_url,
            "namespace": namespace,
            "learn": learn,
            "sampling_rate": 1.0,
            "verifications_per_s": 1000.0,
            "timeout_ms": 500.0,
            "connect_timeout_ms": 200.0,
        },
    }


def ledger_backend(l3: Path, redis_url: str, namespace: str) -> dict[str, Any]:
    """The ledger-recording backend around the file backend (docs/reconciler.md)."""
    return {
        "backend_name": "hicache-existence-ledger",
        "module_path": "hicache_existence.reconcile.storage_adapters",
        "class_name": "LedgerRecordingStorage",
        "inner_backend": "file",
        "file_storage_path": str(l3),
        "ledger_redis_url": redis_url,
        "ledger_namespace": namespace,
    }


def conversation(c: int) -> list[list[int]]:
    """The prompts of one conversation: each turn is the previous prompt plus a
    page-aligned block (the answer and the next question)."""
    prompt = block_tokens_for(c, FIRST_PAGES * PAGE_SIZE, salt="pd-conv")
    turns = [prompt]
    for t in range(1, TURNS):
        prompt = prompt + block_tokens_for(c * 100 + t, TURN_PAGES * PAGE_SIZE, salt="pd-turn")
        turns.append(prompt)
    return turns


@dataclass
class Fleet:
    name: str
    learn: bool
    l3: Path
    prefills: list[RecipeProcess]
    outputs: list[list[int]]
    seconds: float = 0.0
    figures: dict[str, Any] | None = None


@dataclass
class Stack:
    pd: PDStack
    redis: RedisServer
    fleets: dict[str, Fleet]


def fleet_specs(workdir: Path, redis: RedisServer, name: str, learn: bool) -> list[PrefillSpec]:
    l3, ns = workdir / f"l3-{name}", f"hx-pd-{name}"
    return [
        PrefillSpec(
            config=prefill_config(redis.url, ns, learn),
            l3_backend="dynamic",
            l3_extra_config=ledger_backend(l3, redis.url, ns),
        )
        for _ in range(2)
    ]


def drive(pd: PDStack, fleet: Fleet) -> None:
    """Each conversation's turns in order through the router, then until every
    write is acknowledged; the fleet's figures are read then."""
    t0 = time.monotonic()
    for c in range(CONVERSATIONS):
        for prompt in conversation(c):
            fleet.outputs.append(pd.router.generate(prompt, max_new_tokens=2))
    fleet.seconds = time.monotonic() - t0
    for p in fleet.prefills:
        p.wait_writes_settled(quiet_s=2.0, timeout_s=120.0)
    time.sleep(1.5)  # our series are flushed once a second
    fleet.figures = fleet_figures(fleet)
    print(f"\nfleet {fleet.name}: {json.dumps(fleet.figures)}", flush=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("pd")
    (workdir / "redis").mkdir()
    redis = RedisServer(workdir / "redis").start()
    pd = PDStack(
        workdir,
        fleet_specs(workdir, redis, "off", False),
        [RouterSpec([0, 1], policy="round_robin")],
    )
    fleets: dict[str, Fleet] = {}
    try:
        pd.start()
        for name, learn in FLEETS.items():
            if fleets:
                pd.replace_prefills(fleet_specs(workdir, redis, name, learn), tag=f"-{name}")
            fleets[name] = Fleet(name, learn, workdir / f"l3-{name}", list(pd.prefills), [])
            drive(pd, fleets[name])
        yield Stack(pd, redis, fleets)
    finally:
        pd.stop()
        redis.close()


def counter(srv: Server, name: str) -> float:
    return srv.value(P + name + "_total")


def fleet_figures(fleet: Fleet) -> dict[str, Any]:
    per = [
        {c: counter(p, c) for c in (*WRITE_COUNTERS, *RECONCILER_COUNTERS)} for p in fleet.prefills
    ]
    total = {c: sum(x[c] for x in per) for c in per[0]}
    red = total["redundant_written_pages"]
    return {
        **total,
        "l3_pages": len(fleet.prefills[0].l3_pages()),
        "redundant_share": [x["redundant_written_pages"] / red if red else 0.0 for x in per],
        "per_instance": per,
        "requests": CONVERSATIONS * TURNS,
        "seconds": round(fleet.seconds, 1),
    }


def test_requests_through_the_router_complete(stack: Stack) -> None:
    """Every conversation turn sent through each fleet's router came back with its
    tokens, and both fleets (same model, same prompts) answered alike."""
    off, on = stack.fleets["off"].outputs, stack.fleets["on"].outputs
    assert len(off) == len(on) == CONVERSATIONS * TURNS
    assert all(len(o) == 2 for o in off + on)
    assert off == on


def test_prefill_metrics_carry_engine_type_prefill(stack: Stack) -> None:
    """Our series on every prefill server's /metrics carry engine_type="prefill",
    and both prefill servers wrote pages (round robin put turns on each)."""
    for p in stack.pd.prefills:
        samples = p.samples(P + "written_pages_total")
        assert samples, p.tail()
        assert {lab["engine_type"] for lab, _ in samples} == {"prefill"}
        assert sum(v for _, v in samples) > 0


def test_fleet_writes_with_learning_off_and_on(stack: Stack) -> None:
    """Fleet-wide L3 writes against the shared directory: it holds exactly the
    conversations' distinct pages, and written minus redundant is at least that (two
    servers writing one page before either sees the other's file both count a first
    write); the ledger teaches each server pages only where learning is on."""
    figures = {name: f.figures for name, f in stack.fleets.items()}
    distinct = len(
        {
            tuple(p[: (i + 1) * PAGE_SIZE])
            for c in range(CONVERSATIONS)
            for p in conversation(c)
            for i in range(len(p) // PAGE_SIZE)
        }
    )
    for name, fig in figures.items():
        assert fig["l3_pages"] == distinct, (name, fig)
        assert fig["written_pages"] - fig["redundant_written_pages"] >= fig["l3_pages"], fig
        assert fig["written_pages"] >= fig["l3_pages"]
    assert figures["off"]["reconciler_pages_learnt"] == 0
    # the ledger taught the servers pages the other wrote (turns alternate; learning
    # is sampled, so on a short run one server may learn none)
    assert figures["on"]["reconciler_pages_learnt"] > 0, figures
    out = os.environ.get("HX_PD_FIGURES")
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))
    print(
        "\nfleet figures: "
        + json.dumps(
            {k: {x: v for x, v in f.items() if x != "per_instance"} for k, f in figures.items()}
        )
    )
