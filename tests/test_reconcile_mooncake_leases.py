"""The reconciler's observer effect on a real Mooncake master: its probes lease.

``MooncakeGroundTruth`` asks the store client's ``batch_is_exist``; the master
grants a read lease to every object such a query finds (``BatchExistKey``), and
its eviction takes the objects with the oldest lease deadline first (a put sets
the deadline to the put time, a read to read time + ``default_kv_lease_ttl``).
So the pages the reconciler samples are kept alive at the expense of pages it
does not sample, during the lease and after it.

Workload (no SGLang server: a real ``mooncake_master`` on loopback, SGLang's own
``MooncakeStore`` with a 16 MiB segment, objects put through its store client):
20 chains of 4 pages (2 objects of 64 KiB each, 10 MiB) are put chain after
chain; the even chains are the sample; 15 more chains (7.5 MiB) then overflow
the segment and the master evicts. Which old pages survive is read through the
master's admin ``/batch_query_keys`` (which does not lease, shown below), so the
readout does not disturb what it reads. The same workload runs four ways, each
on a fresh master:

* ``off``: nobody probes; the master evicts in put order (oldest chains first),
  sampled or not;
* ``reconciler``: the real ``Reconciler`` over ``MooncakeGroundTruth`` verifies
  the even chains (looked up in the cache), then the overflow starts at once
  (inside the lease);
* ``reconciler_lease_over``: the same with the master's lease at 500 ms and the
  overflow started 1.5 s after the probes (the lease is over);
* ``admin``: the even chains are asked through ``/batch_query_keys`` instead.

Truth is the master's own: its eviction counter and its answers about the keys,
against the put order the test chose. Each run takes ~2-6 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mooncake_master import MooncakeMaster, need_mooncake
from reconcile_helpers import chain, sglang_storage_config, step_until_idle, wired

from hicache_existence.reconcile.mooncake_truth import MooncakeGroundTruth

pytest.importorskip("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")

SEGMENT = 16 << 20
OBJECT = 64 << 10
PAGES = 4  # per chain
OLD, NEW = 20, 15  # chains put before / after the probes
SAMPLE = tuple(range(0, OLD, 2))  # the chains probed


def admin_present(master: MooncakeMaster, keys: Sequence[str]) -> list[bool]:
    """Which ``keys`` the master holds, asked through its admin HTTP server
    (``/batch_query_keys`` on the metrics port), which grants no lease."""
    out: list[bool] = []
    for i in range(0, len(keys), 40):
        batch = list(keys[i : i + 40])
        url = f"http://127.0.0.1:{master.metrics_port}/batch_query_keys?keys=" + ",".join(batch)
        with urllib.request.urlopen(url, timeout=10) as r:
            data = json.loads(r.read())["data"]
        out.extend(bool(data[k]["ok"]) for k in batch)
    return out


def put_objects(store: Any, keys: Sequence[str], timeout_s: float = 20.0) -> None:
    """Put every key in order; a full segment (-200) is retried while the
    master's eviction thread makes room."""
    deadline = time.monotonic() + timeout_s
    for key in keys:
        while (rc := store.store.put(key, b"\x01" * OBJECT)) != 0:
            assert time.monotonic() < deadline, f"put {key} still fails: {rc}"
            time.sleep(0.01)


@dataclass
class Run:
    survived: list[bool]  # per old page, in put order
    evicted_objects: float  # the master's master_evicted_key_count
    lease_counts: dict[str, int]
    queries: dict[tuple[str, str], int]

    def lost(self, chains: Sequence[int]) -> int:
        return sum(not self.survived[c * PAGES + p] for c in chains for p in range(PAGES))


def run(workdir: Path, probe: str, args: tuple[str, ...] = (), wait_s: float = 0.0) -> Run:
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    workdir.mkdir()
    master = MooncakeMaster(workdir, args).start()
    try:
        extra = {**master.extra_config(), "global_segment_size": SEGMENT}
        store = MooncakeStore(sglang_storage_config(extra, page_first=True, model="tiny"), None)
        truth = MooncakeGroundTruth(store)
        chains = [chain(("lease", i), PAGES) for i in range(OLD + NEW)]
        old_keys = [k for c in chains[:OLD] for k in truth._objects(c)[0]]
        put_objects(store, old_keys)
        before = master.metrics()
        # SGLang's MooncakeStore put one 4 KiB warm-up object of its own
        assert before["master_key_count"] == 1 + len(old_keys) == 1 + OLD * PAGES * 2
        assert before["master_evicted_key_count"] == 0  # every probed object is there

        queries: dict[tuple[str, str], int] = {}
        if probe == "reconciler":
            cache, rec = wired(truth)
            kv = cache.pool("kv")
            for c in chains[:OLD]:
                kv.add(c)
            for step, i in enumerate(SAMPLE):  # one lookup per scheduler step
                kv.contains_all(chains[i])
                rec.apply(step)
            step_until_idle(rec)
            queries = rec.snapshot().queries
            # what the metric exports is the truth's own count
            assert rec.snapshot().objects_leased == truth.lease_counts()["objects"] > 0
            rec.close()
        elif probe == "admin":
            sample_keys = [k for i in SAMPLE for k in truth._objects(chains[i])[0]]
            assert all(admin_present(master, sample_keys))
        time.sleep(wait_s)

        put_objects(store, [k for c in chains[OLD:] for k in truth._objects(c)[0]])
        time.sleep(0.3)  # an eviction cycle still running settles
        survived_objects = admin_present(master, old_keys)
        survived = [all(survived_objects[i : i + 2]) for i in range(0, len(old_keys), 2)]
        result = Run(
            survived,
            master.metrics()["master_evicted_key_count"],
            truth.lease_counts(),
            queries,
        )
        store.store.close()  # while the master is up: closing is quick then
        return result
    finally:
        master.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    need_mooncake()
    base = tmp_path_factory.mktemp("leases")
    t0 = time.monotonic()
    out = {
        "off": run(base / "off", "off"),
        "reconciler": run(base / "reconciler", "reconciler"),
        "reconciler_lease_over": run(
            base / "lease_over", "reconciler", ("--default_kv_lease_ttl=500",), wait_s=1.5
        ),
        "admin": run(base / "admin", "admin"),
    }
    unsampled = [i for i in range(OLD) if i not in SAMPLE]
    print(f"\nmooncake leases ({time.monotonic() - t0:.1f} s):")
    for name, r in out.items():
        print(
            f"  {name}: evicted objects {r.evicted_objects:.0f}; old pages lost: sampled "
            f"{r.lost(SAMPLE)}/{len(SAMPLE) * PAGES}, unsampled "
            f"{r.lost(unsampled)}/{len(unsampled) * PAGES}; leases {r.lease_counts}"
        )
    return out


def test_without_probes_the_master_evicts_in_put_order(runs: dict[str, Run]) -> None:
    """The baseline: evictions happened, and what is lost is the oldest pages,
    sampled chains among them (the survivors are a suffix of the put order)."""
    off = runs["off"]
    assert off.evicted_objects > 0
    first = off.survived.index(True)
    assert first > 0 and all(off.survived[first:]), off.survived
    assert off.lost(SAMPLE) > 0


def test_the_reconcilers_probes_keep_the_sampled_pages(runs: dict[str, Run]) -> None:
    """Probed through the reconciler, every sampled page survives the same
    overflow, inside the lease and after it (the master's eviction order puts a
    probed object behind every object put before the probe), and the evictions
    the sample was spared land on unsampled pages instead."""
    off = runs["off"]
    unsampled = [i for i in range(OLD) if i not in SAMPLE]
    for name in ("reconciler", "reconciler_lease_over"):
        on = runs[name]
        assert on.queries.get(("kv", "present")) == len(SAMPLE), (name, on.queries)
        assert on.evicted_objects > 0, name
        assert on.lost(SAMPLE) == 0, (name, on.survived)
        assert on.lost(unsampled) > off.lost(unsampled), name


def test_every_object_a_probe_found_is_counted_as_leased(runs: dict[str, Run]) -> None:
    """``lease_counts`` counts the verifications that found objects and the
    objects found: every object of every sampled chain (all stored, none evicted
    before the probes); the runs that never asked the client count none."""
    for name in ("reconciler", "reconciler_lease_over"):
        assert runs[name].lease_counts == {
            "queries": len(SAMPLE),
            "objects": len(SAMPLE) * PAGES * 2,
        }
    assert runs["off"].lease_counts == runs["admin"].lease_counts == {"queries": 0, "objects": 0}


def test_the_admin_query_leases_nothing(runs: dict[str, Run]) -> None:
    """Asked through the master's ``/batch_query_keys`` instead, the sampled
    pages are evicted like in the run without probes (the alternative the doc
    names, and why the readout above does not disturb what it reads)."""
    admin = runs["admin"]
    assert admin.evicted_objects > 0
    assert admin.lost(SAMPLE) > 0
    first = admin.survived.index(True)
    assert all(admin.survived[first:]), admin.survived
