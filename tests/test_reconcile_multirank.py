"""The reconciler across real processes: two ranks over torch.distributed gloo on
127.0.0.1, each with its own cache replica, its own ledger shard in one shared
real redis-server (the ranks' L3 shards lost different pages), answers delayed
by a different random jitter per rank, and the TP-divergence checker running on
its own gloo group.  With the reconciler's MIN agreement the replicas end
identical and the checker stays silent; with agreement removed (the control) the
same run diverges and the checker says so."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess, pytest.mark.redis]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from reconcile_helpers import chain  # noqa: E402
from reconcile_redis_server import RedisServer  # noqa: E402

WORLD = 2
STEPS = 300
CHAINS = 40
PAGES = 16
NAMESPACE = "multirank"
#: Pages each rank's L3 shard lost: (chain, page).
DROPS = {0: [(3, 5), (11, 9), (30, 0)], 1: [(3, 7), (20, 2), (30, 0)]}
WORLD_DEADLINE_S = 240


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        return
    message = "torch is not installed (pip install torch==2.13.0, a CPU build)"
    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chains() -> list[list[str]]:
    return [chain(("mr", i), PAGES) for i in range(CHAINS)]


def _shard(rank: int) -> str:
    return f"m_{rank}_{WORLD}"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.close()


def _populate(url: str) -> None:
    """Every rank's shard holds every chain, minus that rank's drops."""
    from hicache_existence.reconcile.redis_truth import LedgerSettings, RedisLedger

    chains = _chains()
    for rank in range(WORLD):
        led = RedisLedger(LedgerSettings(url, namespace=NAMESPACE, shard=_shard(rank)))
        led.clear_shard()
        for c in chains:
            led.record_stored("kv", c)
        led.record_removed("kv", [chains[i][p] for i, p in DROPS[rank]])
        led.close()


def _run_world(url: str, mode: str, out_dir: Path) -> list[dict[str, Any]]:
    _require_torch()
    _populate(url)
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__)),
                "--worker",
                str(rank),
                str(port),
                url,
                mode,
                str(out_dir),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + WORLD_DEADLINE_S
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed ({p.returncode}):\n{log[-3000:]}"
    return [json.loads((out_dir / f"{mode}-{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def agreed(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return _run_world(redis_server.url, "agreed", tmp_path_factory.mktemp("agreed"))


@pytest.fixture(scope="module")
def unagreed(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return _run_world(redis_server.url, "unagreed", tmp_path_factory.mktemp("unagreed"))


def test_replicas_identical_with_agreement(agreed: list[dict[str, Any]]) -> None:
    """With MIN agreement both ranks end with the same LRU (compared directly) and
    the same replica digest, after applying verdicts of truths that disagree."""
    a, b = agreed
    assert a["lru"] == b["lru"]
    assert a["digest"] == b["digest"]
    assert a["reconciler"]["agreements"] == b["reconciler"]["agreements"] > 0


def test_divergence_checker_silent_with_reconciler_on(agreed: list[dict[str, Any]]) -> None:
    """The TP-divergence checker ran (many checks, audits included) and found nothing."""
    for r in agreed:
        assert r["checker"]["active"] and r["checker"]["checks"] >= STEPS // 10
        assert r["checker"]["divergences"] == 0 and r["checker"]["failures"] == 0


def test_min_verdicts_drop_every_rank_s_lost_pages(agreed: list[dict[str, Any]]) -> None:
    """Pages lost on either rank's shard are no longer believed on any rank (a MIN
    over ranks), and the stale positives found are the same on both ranks."""
    chains = _chains()
    lost = {chains[i][p] for drops in DROPS.values() for i, p in drops}
    for r in agreed:
        assert not lost & set(r["lru"]["kv"])
        assert r["reconciler"]["stale_positives"]["kv"] >= 4
    assert agreed[0]["reconciler"]["stale_positives"] == agreed[1]["reconciler"]["stale_positives"]
    assert (
        agreed[0]["reconciler"]["pages_invalidated"] == agreed[1]["reconciler"]["pages_invalidated"]
    )


def test_control_without_agreement_diverges(unagreed: list[dict[str, Any]]) -> None:
    """Control: each rank applying its own verdicts diverges, and the checker catches
    it (so the silence above is not vacuous)."""
    a, b = unagreed
    assert a["lru"] != b["lru"]
    assert max(r["checker"]["divergences"] for r in unagreed) >= 1


def test_report_agreement_cost(
    agreed: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Reports the scheduler-side cost of apply() including the gloo MIN all-reduce."""
    with capsys.disabled():
        for r in agreed:
            rec = r["reconciler"]
            print(
                f"\n[rank {r['rank']}] apply max {rec['max_apply_s'] * 1e3:.3f} ms, of which "
                f"the gloo MIN all-reduce (waiting for the other rank included) max "
                f"{rec['max_agreement_s'] * 1e3:.3f} ms; agreements {rec['agreements']}, "
                f"stale positives {rec['stale_positives']}, learnt {rec['pages_learnt']}"
            )
    assert all(r["reconciler"]["agreements"] >= STEPS // 2 for r in agreed)


# ---------------------------------------------------------------------------
# the worker (runs in each spawned process)


class _Jitter:
    """Delays each answer by a rank-specific random 0-3 ms, so ranks finish queries
    at different times and in different steps."""

    def __init__(self, inner: Any, seed: int) -> None:
        import random

        self.inner = inner
        self.rng = random.Random(seed)

    def leading_present(self, pool: str, hashes: Any) -> int:
        time.sleep(self.rng.uniform(0, 0.003))
        return int(self.inner.leading_present(pool, hashes))

    def present(self, pool: str, hashes: Any) -> list[bool]:
        return list(self.inner.present(pool, hashes))

    def absence_is_evidence(self) -> bool:
        return bool(self.inner.absence_is_evidence())


def _worker(rank: int, port: int, url: str, mode: str, out_dir: Path) -> None:  # pragma: no cover
    import random
    from datetime import timedelta

    import torch.distributed as dist

    from hicache_existence.config import DivergenceSection
    from hicache_existence.core.cache import StorageExistenceCache
    from hicache_existence.core.observers import Tee
    from hicache_existence.reconcile.agreement import GlooAgreement, SingleRank
    from hicache_existence.reconcile.reconciler import Reconciler
    from hicache_existence.reconcile.redis_truth import LedgerSettings, RedisLedger
    from hicache_existence.replicas.digest import ReplicaDigest, combine
    from hicache_existence.replicas.divergence import DivergenceChecker, TorchGlooGroup

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    gloo = GlooAgreement.new_group(timeout_s=60)
    agreement = gloo if mode == "agreed" else SingleRank()
    check_group = TorchGlooGroup.create(timeout_s=30)
    assert check_group is not None

    digest = ReplicaDigest()
    tee = Tee(digest)
    cache = StorageExistenceCache(500, observer=tee)
    ledger = RedisLedger(
        LedgerSettings(url, namespace=NAMESPACE, shard=_shard(rank), socket_timeout_s=0.5)
    )
    rec = Reconciler(
        cache,
        _Jitter(ledger, 1000 + rank),
        agreement=agreement,
        sampling_rate=0.5,
        verifications_per_s=1000.0,
        agree_interval_steps=2,
        timeout_s=1.0,
    )
    tee.observers = (digest, rec)
    checker = DivergenceChecker(
        digest,
        check_group,
        DivergenceSection(interval_steps=10, audit_every_checks=1, timeout_s=30),
        cache=cache,
    )
    chains = _chains()
    rng = random.Random(7)  # the same operation stream on every rank
    kv = cache.pool("kv")
    for step in range(STEPS):
        kv.add(chains[rng.randrange(CHAINS)])  # a storage ack
        for _ in range(3):  # admission lookups
            kv.contains_all(chains[rng.randrange(CHAINS)])
        rec.apply(step)
        checker.on_step()
        time.sleep(0.001)
    # A final sweep without writes: every chain looked up several times, so each
    # is picked (the draw is deterministic, the same on every rank and every run).
    step = STEPS
    for _ in range(8):
        for c in chains:
            kv.contains_all(c)
            rec.apply(step)
            checker.on_step()
            step += 1
    # Drain: keep stepping until every rank is idle (decided together).
    import torch

    while True:
        rec.apply(step)
        checker.on_step()
        step += 1
        busy = torch.tensor([0 if rec.idle() else 1], dtype=torch.int64)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            break
        time.sleep(0.002)
    checker.check()
    snap = rec.snapshot()
    stats = checker.stats()
    report = {
        "rank": rank,
        "lru": {name: list(cache.pool(name).lru_keys()) for name in cache.pool_names()},
        "digest": combine(digest.pool_digests(cache, audit=True)),
        "checker": {
            "active": stats.active,
            "checks": stats.checks,
            "divergences": stats.divergences,
            "failures": stats.failures,
        },
        "reconciler": {
            "agreements": snap.agreements,
            "stale_positives": snap.stale_positives,
            "pages_invalidated": snap.pages_invalidated,
            "pages_learnt": snap.pages_learnt,
            "queries": {f"{p}/{r}": n for (p, r), n in snap.queries.items()},
            "max_apply_s": snap.max_apply_s,
            "max_agreement_s": snap.max_agreement_s,
        },
    }
    (out_dir / f"{mode}-{rank}.json").write_text(json.dumps(report))
    rec.close()
    ledger.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], Path(sys.argv[6]))
