"""The ledger race, against a real redis-server: a page acknowledged before a
verification whose ledger record is still queued in the writer must not read as
absent (docs/reconciler.md, "Writes racing a query").

The storage path records into the ledger from a background thread
(``LedgerWriter``), so a record reaches Redis after the storage ack that made the
page believed.  The tests hold that thread on a gate inside the ledger's
``record_stored`` so the window is open for as long as they choose, which makes
the interleaving deterministic rather than a matter of timing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reconcile_helpers import chain, step_until_idle, wired
from reconcile_redis_server import RedisServer

pytestmark = pytest.mark.redis

pytest.importorskip("redis")

from hicache_existence.reconcile.redis_truth import LedgerSettings, RedisLedger  # noqa: E402
from hicache_existence.reconcile.storage_adapters import LedgerRecordingStorage  # noqa: E402

#: ``reconciler.timeout_ms`` of the first test, which bounds how long a question
#: waits for the queued records: far beyond the gate's hold, so only a wrong
#: answer (not a timeout) can fail it.
PATIENT_MS = 20_000
#: How long the gate holds the writer when no answer arrives first.
HOLD_S = 1.0


class GatedLedger:
    """A real ``RedisLedger`` whose writes wait until ``gate`` opens (the writer
    thread is held there); ``answered`` is set after each answer is taken."""

    def __init__(self, ledger: RedisLedger) -> None:
        self.ledger = ledger
        self.settings = ledger.settings
        self.gate = threading.Event()
        self.answered = threading.Event()

    def record_stored(self, pool: str, hashes: Sequence[str]) -> int:
        assert self.gate.wait(30), "the test never opened the gate"
        return self.ledger.record_stored(pool, hashes)

    def record_removed(self, pool: str, hashes: Sequence[str]) -> int:
        return self.ledger.record_removed(pool, hashes)

    def clear_shard(self) -> int:
        return self.ledger.clear_shard()

    def leading_present(self, pool: str, hashes: Sequence[str]) -> int:
        answer = self.ledger.leading_present(pool, hashes)
        self.answered.set()
        return answer

    def present(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        answer = self.ledger.present(pool, hashes)
        self.answered.set()
        return answer

    def absence_is_evidence(self) -> bool:
        return self.ledger.absence_is_evidence()

    def close(self) -> None:
        self.ledger.close()


class MemoryBackend:
    """The real backend's part the wrapper delegates writes to: stores anything."""

    def __init__(self) -> None:
        self.data: set[str] = set()

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list:
        self.data.update(keys)
        return [True] * len(keys)


class StorageConfig:
    extra_config: ClassVar[dict[str, Any]] = {}
    tp_rank, tp_size, is_mla_model, model_name = 0, 1, False, "m"


Recording = Callable[[int], tuple[Any, GatedLedger]]


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recording]:
    """Makes the ledger-recording backend over a gated real Redis ledger (epoch
    set), configured as a server is: ``reconciler.timeout_ms`` from the environment."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir).start()
    made: list[tuple[Any, GatedLedger]] = []

    def make(timeout_ms: int) -> tuple[Any, GatedLedger]:
        monkeypatch.setenv("HICACHE_EXISTENCE_RECONCILER__TIMEOUT_MS", str(timeout_ms))
        settings = LedgerSettings(server.url, namespace="race", shard="s0", socket_timeout_s=5.0)
        gated = GatedLedger(RedisLedger(settings))
        gated.ledger.record_stored("kv", chain("epoch", 1))  # an epoch: absence is evidence
        backend = LedgerRecordingStorage(StorageConfig(), {}, inner=MemoryBackend(), ledger=gated)
        made.append((backend, gated))
        return backend, gated

    try:
        yield make
    finally:
        for backend, gated in made:
            gated.gate.set()
            backend.close()
        server.close()


def _write_and_ack(kv: Any, backend: Any, gated: GatedLedger, pages: list[str]) -> None:
    """One write as the scheduler and the storage thread make it: D2H launch,
    the storage call (its ledger record is queued, held at the gate), the ack."""
    kv.track_inflight(pages)
    assert backend.batch_set_v1(pages, None) == [True] * len(pages)
    assert not gated.gate.is_set()  # the storage call did not wait for the ledger
    kv.add(pages)
    kv.untrack_inflight(pages)
    # The window is open: the page is believed and stored, Redis lacks it.
    assert gated.ledger.leading_present("kv", pages) == 0


def test_page_acked_before_the_query_is_not_read_absent(recording: Recording) -> None:
    """A verification admitted after a write's ack, while its ledger record is still
    queued, answers "present" (the question waits for the records offered before
    it), so nothing is invalidated; the scheduler keeps stepping meanwhile."""
    backend, gated = recording(PATIENT_MS)
    cache, rec = wired(backend.ledger_ground_truth(), timeout_s=PATIENT_MS / 1000)
    kv = cache.pool("kv")
    pages = chain("race", 8)
    _write_and_ack(kv, backend, gated, pages)
    assert kv.contains_all(pages)  # a lookup: the chain becomes a candidate

    def open_gate() -> None:
        # Open once an answer was taken (the race: it was taken without the
        # record), or after HOLD_S with none taken (the question is waiting).
        gated.answered.wait(HOLD_S)
        gated.gate.set()

    opener = threading.Thread(target=open_gate)
    opener.start()
    steps_while_waiting = 0
    for step in range(100_000):
        rec.apply(step)
        if rec.outstanding() and not gated.gate.is_set():
            steps_while_waiting += 1  # apply returned while the worker waited
        if rec.idle():
            break
        time.sleep(0.001)
    opener.join()
    snap = rec.snapshot()
    assert snap.stale_positives == {} and snap.pages_invalidated == {}
    assert snap.queries == {("kv", "present"): 1}
    assert kv.lru_keys() == tuple(pages)
    # The scheduler thread never waited for Redis: it stepped while the question
    # waited.  (How many steps depends on thread scheduling; at least one does.)
    assert steps_while_waiting >= 1
    assert gated.ledger.leading_present("kv", pages) == 8


def test_question_past_its_wait_is_an_error_never_absence(recording: Recording) -> None:
    """When the queued records are not written within the wait, the verification
    fails as ``ledger_behind`` (an error, never evidence of absence): no belief is
    dropped; once the writer catches up, the next verification finds the pages."""
    backend, gated = recording(50)  # the default reconciler.timeout_ms
    cache, rec = wired(backend.ledger_ground_truth(), timeout_s=PATIENT_MS / 1000)
    kv = cache.pool("kv")
    pages = chain("behind", 8)
    _write_and_ack(kv, backend, gated, pages)
    assert kv.contains_all(pages)
    step_until_idle(rec, max_steps=100_000)
    snap = rec.snapshot()
    assert snap.queries == {("kv", "error"): 1}
    assert snap.errors == {"ledger_behind": 1}
    assert snap.stale_positives == {} and kv.lru_keys() == tuple(pages)
    gated.gate.set()
    assert backend.flush_ledger(5)
    assert kv.contains_all(pages)
    step_until_idle(rec, max_steps=100_000)
    snap = rec.snapshot()
    assert snap.queries == {("kv", "error"): 1, ("kv", "present"): 1}
    assert snap.stale_positives == {}
