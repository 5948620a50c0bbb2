"""Storage-tier KV events with Mooncake as L3, measured against the master's keys.

Issue 30 item 3 for the second L3: two real CPU prefill servers (buffer mode,
16-token pages) over one real ``mooncake_master`` (SGLang's own
``--hicache-storage-backend mooncake``, TCP on loopback, a 16 MiB segment each,
the smallest the store client mounts), both with ``events.enabled`` (medium
``EXTERNAL``) and the reconciler verifying against the store itself
(``MooncakeGroundTruth``: ``batch_is_exist`` codes).  Server ``a`` publishes on
the package's own socket, server ``b`` on SGLang's ``--kv-events-config`` stream.
The measurement is ``events_truth.py``'s, the file backend's too.

Truth: the master's own key list (``GET /get_all_keys`` on its HTTP metrics
port, read by the test).  It lists every object of the master's metadata
(``MasterService::GetAllKeys``: no lease granted, unlike ``batch_is_exist``,
which leases what it finds and so would change what Mooncake evicts), the same
metadata every ``get`` and ``batch_is_exist`` is answered from.  SGLang stores a
page of the tiny MHA Llama as two objects (``<model>_<page hash>_0_k`` and
``..._v``): a page is held while both are listed.

The evictor is Mooncake's own eviction under pressure: at the eviction instant a
third store client (another tenant, no segment of its own) puts 256 KiB objects
into the servers' segments until the master evicts (it evicts the objects with
the earliest lease deadline first, 5% of the objects a round, while above its
90% high watermark), then removes its own objects, so that the rest of the
workload usually runs with room (the servers' own writes evicted 41 more objects
in one of eight runs here, none in the others).  Which pages go is the master's
choice; the test reads them from the key list.  After it, each conversation's
first turn stays on the server of its turn before (``stay_once``): that server
holds the evicted pages in its device cache and never asks L3 for them, so only
its reconciler can find them gone (with strict alternation the other server's
hit query finds them missing and rewrites them, and belief-only heals as fast).

Mooncake evicts objects, not prefixes: it may drop a page and keep the pages
after it in the chain.  No prefix lookup reaches those (SGLang's
``batch_exists`` counts leading pages), and a verified absence removes them with
the missing page (docs/kv-events.md), so the recall target is over the held
pages a prefix lookup can reach (``recall_reachable``); recall over every held
page and precision against every listed page are reported beside it.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from events_truth import (
    OWN,
    P,
    Streams,
    Subscriber,
    block_hash,
    kv,
    measure,
    stay_once,
)
from harness import REPO, Server, ServerSpec, launch_together

sys.path.insert(0, str(REPO / "tests"))
from mooncake_master import MooncakeMaster, need_mooncake

pytestmark = [pytest.mark.real_server]

#: Mooncake objects per page for the tiny Llama (MHA, heads not split): k and v.
OBJECTS_PER_PAGE = 2
#: Each server's segment: the store client refuses less than 16 MiB.
SEGMENT = 16 << 20
#: The other tenant's objects: big next to a 2 KiB page object, so that a few
#: puts take the store over its high watermark.
FILLER = 256 << 10
OBJECT_KEY = re.compile(r"^(?P<prefix>.+)_(?P<page>[0-9a-f]{64})_(?P<rank>\d+)_(?P<kv>[kv])$")

#: As the file backend's test: every lookup a candidate, the default budget.
RECONCILER: dict[str, Any] = {
    "enabled": True,
    "sampling_rate": 1.0,
    "verifications_per_s": 50.0,
    "timeout_ms": 1000.0,
}


class MasterKeys:
    """The master's key list (``/get_all_keys``) read as pages."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.url = f"http://127.0.0.1:{master.metrics_port}/get_all_keys"
        self.prefixes: set[str] = set()

    def objects(self) -> list[str]:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return r.read().decode().split()

    def pages(self) -> set[int]:
        """Event hashes of the pages whose every object the master lists."""
        count: Counter[str] = Counter()
        for key in self.objects():
            m = OBJECT_KEY.match(key)
            if m is not None:
                self.prefixes.add(m["prefix"])
                count[m["page"]] += 1
        return {block_hash(page) for page, n in count.items() if n == OBJECTS_PER_PAGE}


class Tenant:
    """Another tenant of the store: a store client with no segment, putting big
    objects until the master evicts, then removing them."""

    def __init__(self, master: MooncakeMaster) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{master.metadata_port}/metadata",
            0,
            16 << 20,
            "tcp",
            "",
            f"127.0.0.1:{master.port}",
        )
        assert rc == 0, f"the other tenant's store client did not set up: {rc}"
        self.keys: list[str] = []

    def evicted(self) -> float:
        return self.master.metrics()["master_evicted_key_count"]

    def press(self, max_puts: int = 400) -> dict[str, float]:
        """Put until the master evicts, wait for its eviction rounds to end, then
        remove every object put: {objects evicted, eviction rounds, puts}."""
        before = self.master.metrics()
        value = b"\0" * FILLER
        for i in range(max_puts):
            key = f"other-tenant-{i}"
            if self.store.put(key, value) == 0:
                self.keys.append(key)
            if self.evicted() > before["master_evicted_key_count"]:
                break
        last, since = self.evicted(), time.monotonic()
        # Rounds run on the master's own thread, further apart on a loaded machine
        # (two CI lanes): the count must stand still for 3 s.
        while time.monotonic() - since < 3.0:
            time.sleep(0.1)
            if (now := self.evicted()) != last:
                last, since = now, time.monotonic()
        after = self.master.metrics()
        for key in self.keys:
            self.store.remove(key)
        rounds, objects = "master_successful_evictions_total", "master_evicted_key_count"
        return {
            "objects_evicted": after[objects] - before[objects],
            "eviction_rounds": after[rounds] - before[rounds],
            "puts": len(self.keys),
        }

    def close(self) -> None:
        self.store.close()


@dataclass
class Stack:
    master: MooncakeMaster
    keys: MasterKeys
    tenant: Tenant
    a: Server
    b: Server
    sub_a: Subscriber
    sub_b: Subscriber


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need_mooncake()
    workdir: Path = tmp_path_factory.mktemp("events-mooncake")
    master = MooncakeMaster(workdir).start()
    streams = Streams()
    store = {**master.extra_config(), "global_segment_size": SEGMENT}
    metrics = {"flush_interval_s": 0.25}
    specs = [
        ServerSpec(
            config={
                "events": {"enabled": True, "endpoint": OWN},
                "metrics": metrics,
                "reconciler": RECONCILER,
            },
            storage_backend="mooncake",
            storage_extra_config=store,
        ),
        ServerSpec(
            config={"events": {"enabled": True}, "metrics": metrics, "reconciler": RECONCILER},
            storage_backend="mooncake",
            storage_extra_config=store,
            extra_args=streams.sglang_args(),
        ),
    ]
    tenant: Tenant | None = None
    try:
        with launch_together(specs, workdir / "servers") as (a, b):
            tenant = Tenant(master)
            sub_a, sub_b = streams.connect(a, b)
            yield Stack(master, MasterKeys(master), tenant, a, b, sub_a, sub_b)
    finally:
        if tenant is not None:
            tenant.close()
        streams.close()
        master.close()


def test_the_consumers_index_against_the_master_keys(stack: Stack) -> None:
    """Issue 30 item 3, Mooncake: two servers over one master, a multi-turn
    workload, then Mooncake evicts under another tenant's pressure.  Sampled over
    time against the master's keys, for SGLang's own events (no storage tier),
    belief-only and ours: recall of acknowledged blocks a lookup can reach is 1.0,
    no removal of ours took out a block a lookup could still reach (our precision is below
    belief-only's only while a rewrite's stored event is on its way), and ours is
    back to >= 0.99 within the window the reconciler's configuration predicts."""
    a, b, keys = stack.a, stack.b, stack.keys
    pressed: dict[str, float] = {}

    def built_ok(built: Any) -> None:
        assert (built.ours, built.belief, built.recall) == (1.0, 1.0, 1.0), built
        assert stack.master.metrics()["master_evicted_key_count"] == 0

    def evict(_chains: dict[int, list[int]]) -> set[int]:
        before = keys.pages()
        pressed.update(stack.tenant.press())
        return before - keys.pages()

    m = measure(
        (a, b),
        (stack.sub_a, stack.sub_b),
        keys.pages,
        evict,
        RECONCILER["timeout_ms"],
        salt="events-mooncake",
        check_built=built_ok,
        route=stay_once,
        # Should the servers' own writes make Mooncake evict after the burst, the
        # master's keys read between the samples see those pages gone.
        watch_s=0.025,
    )
    evicted_after = stack.master.metrics()["master_evicted_key_count"]
    unexplained = m.truth.unexplained_removals(m.doomed)
    figures = m.figures(
        # Removals only the master's keys read between the samples explain.
        explained_by_watch_only=len(
            set(m.truth.unexplained_removals(m.doomed, watched=False)) - set(unexplained)
        ),
        watch_reads=len(m.truth.watched),
        pressure=pressed,
        evicted_objects_total=evicted_after,
        key_prefixes=sorted(keys.prefixes),
    )
    print("events-truth-mooncake", json.dumps(figures, default=lambda o: o.__dict__))

    # One key space: both servers name a page's objects alike, so they share L3.
    assert len(keys.prefixes) == 1, keys.prefixes
    # Mooncake evicted claimed pages.
    assert m.doomed and m.evicted.stale_ours > 0, (m.doomed, m.evicted)
    # Evictions after the burst (the servers' own writes into a full store) are
    # more removals to find: the window and end checks below still hold them to it.
    assert evicted_after >= pressed["objects_evicted"] > 0, (evicted_after, pressed)
    # Every storage-tier event is EXTERNAL; none on b's stream is SGLang's own.
    media = {
        e.medium
        for sub in (stack.sub_a, stack.sub_b)
        for e in sub.pump()
        if isinstance(e, kv.BlockStored | kv.BlockRemoved) and e.medium not in ("GPU", "CPU_PINNED")
    }
    assert media == {"EXTERNAL"}, media
    assert len(m.storage_blocks_b) == b.value(P + "events_published_blocks_total", kind="stored")
    assert a.value(P + "evictions_total") == b.value(P + "evictions_total") == 0

    # Ours is belief-only less its removals: below it only where a removal took out a
    # block L3 holds, which must be one a rewrite undid (its stored event then on its
    # way), never a block a lookup could still reach.
    if unexplained:
        print("events-truth-unexplained", m.truth.report(unexplained))
    assert not unexplained, f"{len(unexplained)} removals unexplained (printed above)"
    # The instance holding the evicted pages in its device cache only learns of
    # the eviction from the reconciler: its removals put ours ahead of belief-only.
    assert m.sources["reconciler"] > 0 and m.delays["blocks"] > 0, (m.sources, m.delays)
    assert any(p.ours > p.belief for p in m.truth.points), m.truth.points
    assert m.end.recall_reachable == 1.0, m.end
    assert m.at_window.ours >= 0.99, (m.window, m.truth.points)
    assert m.end.ours == 1.0 and m.end.stale_ours == 0, m.end
    assert all(r < RECONCILER["verifications_per_s"] for r in m.rates.values()), m.rates
