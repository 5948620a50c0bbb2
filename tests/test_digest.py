"""The replica digest: deterministic across processes, sensitive to every divergence
it claims to cover, and honest about the one it leaves to the audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.observers import BeliefObserver, Tee
from hicache_existence.replicas.digest import (
    MASK63,
    ReplicaDigest,
    SharedLruDigest,
    audit_pool,
    combine,
    mix,
    slot_of,
)
from hicache_existence_bench import workload

HEX = workload.chain(1, 6, "digest-test")
# Realistic 64-hex pages plus odd strings the API accepts (no NUL: see the docs).
PAGES = [*HEX, "", "é", "\ud800", "kv", "0x1f"]
POOLS = ["kv", "swa", "mamba"]

Op = list[Any]

pages_st = st.lists(st.sampled_from(PAGES), max_size=5)
op_st: st.SearchStrategy[Op] = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("contains"), st.sampled_from(POOLS), st.sampled_from(PAGES)).map(list),
    st.tuples(st.just("contains_all"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("covered"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("invalidate"), st.sampled_from(POOLS), pages_st, st.integers(0, 5)).map(list),
    st.tuples(st.just("track"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("untrack"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("clear_pool"), st.sampled_from(POOLS)).map(list),
    st.tuples(st.just("clear_inflight"), st.sampled_from(POOLS)).map(list),
    st.tuples(st.just("clear_all")).map(list),
)
streams = st.lists(op_st, max_size=40)


def apply(cache: StorageExistenceCache, stream: Sequence[Op]) -> None:
    """Apply a serialisable operation stream to a current-generation cache."""
    for op in stream:
        kind = op[0]
        if kind == "clear_all":
            cache.clear()
            continue
        pool = cache.pool(op[1])
        if kind == "add":
            pool.add(op[2])
        elif kind == "contains":
            pool.contains(op[2])
        elif kind == "contains_all":
            pool.contains_all(op[2])
        elif kind == "covered":
            pool.covered(op[2])
        elif kind == "invalidate":
            pool.invalidate_beyond(op[2], op[3])
        elif kind == "track":
            pool.track_inflight(op[2])
        elif kind == "untrack":
            pool.untrack_inflight(op[2])
        elif kind == "clear_pool":
            pool.clear()
        elif kind == "clear_inflight":
            pool.clear_inflight()
        else:  # pragma: no cover
            raise ValueError(kind)


class Recorder:
    """Records exactly what the operation digest promises to cover, per pool (the
    current generation's pools are independent LRUs)."""

    def __init__(self) -> None:
        self.by_pool: dict[str, list[tuple[Any, ...]]] = {}

    @property
    def calls(self) -> dict[str, list[tuple[Any, ...]]]:
        return self.by_pool

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self.by_pool.setdefault(pool, []).append(("A", pool, tuple(hashes)))

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        self.by_pool.setdefault(pool, []).append(("T", pool, stop, hashes[0], hashes[stop - 1]))

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        self.by_pool.setdefault(pool, []).append(("V", pool, tuple(hashes[keep_pages:])))

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        self.by_pool.setdefault(pool, []).append(("I", pool, delta, tuple(hashes)))

    def cleared(self, pool: str, inflight_only: bool) -> None:
        self.by_pool.setdefault(pool, []).append(("C", pool, inflight_only))


def replica(
    stream: Sequence[Op], cap: int = 4
) -> tuple[StorageExistenceCache, ReplicaDigest, Recorder]:
    digest, rec = ReplicaDigest(), Recorder()
    cache = StorageExistenceCache(cap, observer=Tee(digest, rec))
    apply(cache, stream)
    return cache, digest, rec


def words(cache: Any, digest: ReplicaDigest, audit: bool) -> dict[str, int]:
    return {name: d.digest for name, d in digest.pool_digests(cache, audit=audit).items()}


def membership(cache: StorageExistenceCache) -> dict[str, Any]:
    """What the audit covers: believed pages (as a set) and in-flight refcounts."""
    return {
        p.name: (frozenset(p.lru_keys()), sorted(p.inflight_refs().items()))
        for p in cache.pools()
        if len(p) or p.inflight_refs()
    }


def digests_of(stream: Sequence[Op]) -> dict[str, Any]:
    """Everything a rank would contribute, as JSON-safe hex (used in subprocesses)."""
    cache, digest, _ = replica(stream)
    ops_only = digest.pool_digests(cache)
    audited = digest.pool_digests(cache, audit=True)
    return {
        "ops": {k: f"{v.digest:x}" for k, v in ops_only.items()},
        "audited": {k: f"{v.digest:x}" for k, v in audited.items()},
        "replica": f"{combine(audited):x}",
        "slots": {p: slot_of(p, 16) for p in POOLS},
    }


def _child_main() -> None:  # pragma: no cover - runs in a subprocess
    batch = json.load(sys.stdin)
    json.dump({"digests": [digests_of(s) for s in batch], "str_hash": hash("kv")}, sys.stdout)


# ---------------------------------------------------------------------------


def test_is_a_belief_observer() -> None:
    """``ReplicaDigest`` satisfies the ``BeliefObserver`` protocol the caches call."""
    assert isinstance(ReplicaDigest(), BeliefObserver)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(streams, min_size=8, max_size=8))
def test_equal_streams_give_equal_digests_in_other_processes(batch: list[list[Op]]) -> None:
    """Equal operation streams give equal digests in processes with different
    PYTHONHASHSEED (whose ``hash()`` of str really differs)."""
    local = [digests_of(s) for s in batch]
    str_hashes = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, __file__, "--child"],
            input=json.dumps(batch),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=True,
        )
        out = json.loads(proc.stdout)
        assert out["digests"] == local
        str_hashes.append(out["str_hash"])
    assert str_hashes[0] != str_hashes[1]


@settings(max_examples=300, deadline=None)
@given(streams, streams)
def test_equal_streams_equal_digests_and_differences_are_seen(a: list[Op], b: list[Op]) -> None:
    """Same covered call stream => same operation digest; a different one => a
    different digest; different membership => different audited digests."""
    ca, da, ra = replica(a)
    cb, db, rb = replica(b)
    if ra.calls == rb.calls:
        assert words(ca, da, False) == words(cb, db, False)
    else:
        assert words(ca, da, False) != words(cb, db, False)
    if membership(ca) != membership(cb):
        assert words(ca, da, True) != words(cb, db, True)


mutations = st.sampled_from(["extra_add", "drop", "swap", "repage"])


@settings(max_examples=300, deadline=None)
@given(streams, mutations, st.data())
def test_any_mutation_that_changes_the_calls_changes_the_digest(
    base: list[Op], kind: str, data: st.DataObject
) -> None:
    """One extra add, one dropped op, two ops swapped or one page changed: whenever
    that changes what the cache reports, the digest changes too."""
    mutated = [list(op) for op in base]
    if kind == "extra_add":
        i = data.draw(st.integers(0, len(mutated)))
        mutated.insert(i, ["add", data.draw(st.sampled_from(POOLS)), data.draw(pages_st)])
    else:
        assume(len(mutated) >= (2 if kind == "swap" else 1))
        i = data.draw(st.integers(0, len(mutated) - 1))
        if kind == "drop":
            del mutated[i]
        elif kind == "swap":
            j = data.draw(st.integers(0, len(mutated) - 1))
            mutated[i], mutated[j] = mutated[j], mutated[i]
        else:
            op = mutated[i]
            assume(len(op) > 2 and isinstance(op[2], list) and op[2])
            op[2][data.draw(st.integers(0, len(op[2]) - 1))] = data.draw(st.sampled_from(PAGES))
    c1, d1, r1 = replica(base)
    c2, d2, r2 = replica(mutated)
    assume(r1.calls != r2.calls)
    assert words(c1, d1, False) != words(c2, d2, False)


A, B, C, D = HEX[:4]


HEALTHY: list[Op] = [
    ["add", "kv", [A, B]],
    ["contains", "kv", A],
    ["contains", "kv", B],
    ["invalidate", "kv", [A, B], 1],
    ["track", "kv", [C]],
    ["untrack", "kv", [C]],
]
FAULTY: dict[str, list[Op]] = {
    "one_extra_add": [HEALTHY[0], ["add", "kv", [D]], *HEALTHY[1:]],
    "touch_order": [HEALTHY[0], HEALTHY[2], HEALTHY[1], *HEALTHY[3:]],
    "missed_invalidate_beyond": [*HEALTHY[:3], *HEALTHY[4:]],
    "missed_untrack_inflight": HEALTHY[:5],
}


@pytest.mark.parametrize("fault", sorted(FAULTY))
def test_each_kind_of_divergence_changes_the_digest(fault: str) -> None:
    """Each divergence of the issue changes the pool's operation digest word."""
    ch, dh, _ = replica(HEALTHY)
    cf, df, _ = replica(FAULTY[fault])
    assert words(ch, dh, False)["kv"] != words(cf, df, False)["kv"]


def test_touch_order_that_changes_a_later_eviction() -> None:
    """Touch orders A,B vs B,A differ at once, and after the next add evicts a
    different page the audited state differs too."""
    prefix: list[Op] = [["add", "kv", [A, B]]]
    one = [*prefix, ["contains", "kv", A], ["contains", "kv", B]]
    two = [*prefix, ["contains", "kv", B], ["contains", "kv", A]]
    c1, d1, _ = replica(one, cap=2)
    c2, d2, _ = replica(two, cap=2)
    assert words(c1, d1, False) != words(c2, d2, False)
    for cache in (c1, c2):
        cache.pool("kv").add([C])
    assert set(c1.pool("kv").lru_keys()) == {B, C}
    assert set(c2.pool("kv").lru_keys()) == {A, C}
    assert audit_pool(c1.pool("kv")) != audit_pool(c2.pool("kv"))
    assert words(c1, d1, True) != words(c2, d2, True)


def test_lookup_digest_covers_endpoints_only_and_the_audit_closes_the_gap() -> None:
    """Two lookups over non-chained lists with the same first page, last page and
    stop fold identically (documented limitation); the audit, which reads the
    pool in LRU order, tells the replicas apart at once, and the difference
    persists once the orders evict differently."""
    base: list[Op] = [["add", "kv", [A, B, C, D]]]
    one = [*base, ["contains_all", "kv", [A, B, D]]]
    two = [*base, ["contains_all", "kv", [A, C, D]]]
    c1, d1, _ = replica(one, cap=4)
    c2, d2, _ = replica(two, cap=4)
    assert c1.pool("kv").lru_keys() != c2.pool("kv").lru_keys()
    assert set(c1.pool("kv").lru_keys()) == set(c2.pool("kv").lru_keys())
    assert words(c1, d1, False) == words(c2, d2, False)
    assert words(c1, d1, True) != words(c2, d2, True)  # same membership, other order
    e = workload.chain(2, 1, "digest-test")[0]
    for cache in (c1, c2):
        cache.pool("kv").add([e])
    assert set(c1.pool("kv").lru_keys()) != set(c2.pool("kv").lru_keys())
    # The last audit is folded into every later word, so the difference stays
    # visible between audits too.
    assert words(c1, d1, False) != words(c2, d2, False)
    assert words(c1, d1, True) != words(c2, d2, True)


def test_cap_difference_is_seen_without_an_audit() -> None:
    """Pools with different caps differ even with identical operations."""
    c1, d1, _ = replica([["add", "kv", [A]]], cap=4)
    c2, d2, _ = replica([["add", "kv", [A]]], cap=5)
    assert words(c1, d1, False) != words(c2, d2, False)


def test_digest_is_pinned() -> None:
    """The serialisation is stable: a fixed stream gives a fixed word (bump
    DIGEST_VERSION when this has to change)."""
    cache, digest, _ = replica(
        [["add", "kv", [A, B]], ["contains_all", "kv", [A, B]], ["track", "swa", [C]]]
    )
    got = {k: f"{v:016x}" for k, v in words(cache, digest, True).items()}
    assert got == PINNED
    assert all(0 <= v <= MASK63 for v in words(cache, digest, True).values())


PINNED = {"kv": "389b64f6af1e02cc", "swa": "3e4c7a95c672b657"}


def test_unused_pool_equals_absent_pool() -> None:
    """A pool created but never used does not change the replica's digests."""
    c1, d1, _ = replica([["add", "kv", [A]]])
    c2, d2, _ = replica([["add", "kv", [A]]])
    c2.pool("swa")
    assert words(c1, d1, True) == words(c2, d2, True)


def test_reset_after_clear_equals_a_fresh_replica() -> None:
    """Clearing a pool then resetting its digest matches a replica that never used it."""
    c1, d1, _ = replica([["add", "kv", [A]], ["add", "swa", [B]]])
    c1.pool("kv").clear()
    d1.reset("kv")
    c2, d2, _ = replica([["add", "swa", [B]]])
    assert words(c1, d1, True) == words(c2, d2, True)


class CountingSeq(Sequence[str]):
    """A sequence that counts element reads."""

    def __init__(self, items: list[str]) -> None:
        self.items = items
        self.reads = 0

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("touched() must not iterate the chain")


def test_touched_is_constant_work_per_call() -> None:
    """``touched`` reads two pages whatever the chain length (O(1) per lookup)."""
    digest = ReplicaDigest()
    for n in (1, 10, 10_000):
        seq = CountingSeq([f"{i:064x}" for i in range(n)])
        digest.touched("kv", seq, n)
        assert seq.reads == 2


def test_observer_errors_poison_instead_of_raising() -> None:
    """A call the digest cannot fold is counted and makes the pool differ; it never
    raises into the cache."""
    d1, d2 = ReplicaDigest(), ReplicaDigest()
    d1.touched("kv", [], 1)
    assert d1.errors == 1 and d1.stream("kv") != d2.stream("kv")


def test_flat_generation_digests() -> None:
    """The seed generation: equal streams agree, a touch-order divergence shows
    at once and the different eviction it causes shows in the global audit."""

    def run(order: tuple[str, str]) -> tuple[FlatStorageExistenceCache, SharedLruDigest]:
        digest = SharedLruDigest()
        cache = FlatStorageExistenceCache(2, observer=digest)
        cache.add("kv", [A, B])
        for page in order:
            cache.contains("kv", page)
        return cache, digest

    (c1, d1), (c2, d2), (c3, d3) = run((A, B)), run((A, B)), run((B, A))
    assert words(c1, d1, True) == words(c2, d2, True)
    assert words(c1, d1, False) != words(c3, d3, False)
    for cache in (c1, c3):
        cache.covers_all("swa", [D], extra_cover={D})
        cache.add("swa", [C])
    assert set(c1.lru_keys()) == {("kv", B), ("swa", C)}
    assert set(c3.lru_keys()) == {("kv", A), ("swa", C)}
    assert words(c1, d1, True)["kv"] != words(c3, d3, True)["kv"]


flat_op_st: st.SearchStrategy[Op] = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("contains"), st.sampled_from(POOLS), st.sampled_from(PAGES)).map(list),
    st.tuples(st.just("contains_all"), st.sampled_from(POOLS), pages_st).map(list),
    st.tuples(st.just("covers_all"), st.sampled_from(POOLS), pages_st, pages_st).map(list),
    st.tuples(st.just("invalidate"), st.sampled_from(POOLS), pages_st, st.integers(0, 5)).map(list),
    st.tuples(st.just("clear_all")).map(list),
)


class FlatRecorder:
    """The flat cache's call stream, globally ordered (its pools share one LRU)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def added(self, pool: str, hashes: Sequence[str]) -> None:
        self.calls.append(("A", pool, tuple(hashes)))

    def touched(self, pool: str, hashes: Sequence[str], stop: int) -> None:
        self.calls.append(("T", pool, stop, hashes[0], hashes[stop - 1]))

    def invalidated(self, pool: str, hashes: Sequence[str], keep_pages: int) -> None:
        self.calls.append(("V", pool, tuple(hashes[keep_pages:])))

    def inflight(self, pool: str, hashes: Sequence[str], delta: int) -> None:
        self.calls.append(("I", pool, delta, tuple(hashes)))

    def cleared(self, pool: str, inflight_only: bool) -> None:
        self.calls.append(("C", pool, inflight_only))


def flat_replica(
    stream: Sequence[Op],
) -> tuple[FlatStorageExistenceCache, SharedLruDigest, FlatRecorder]:
    digest, rec = SharedLruDigest(), FlatRecorder()
    cache = FlatStorageExistenceCache(5, observer=Tee(digest, rec))
    for op in stream:
        kind = op[0]
        if kind == "clear_all":
            cache.clear()
        elif kind == "add":
            cache.add(op[1], op[2])
        elif kind == "contains":
            cache.contains(op[1], op[2])
        elif kind == "contains_all":
            cache.contains_all(op[1], op[2])
        elif kind == "covers_all":
            cache.covers_all(op[1], op[2], frozenset(op[3]))
        elif kind == "invalidate":
            cache.invalidate_beyond(op[1], op[2], op[3])
    return cache, digest, rec


@settings(max_examples=300, deadline=None)
@given(st.lists(flat_op_st, max_size=30), st.lists(flat_op_st, max_size=30))
def test_flat_streams_equal_digests_and_differences_are_seen(a: list[Op], b: list[Op]) -> None:
    """Seed generation: same global call stream => same digests, a different one
    (cross-pool interleaving included) => different, different membership =>
    different audit."""
    ca, da, ra = flat_replica(a)
    cb, db, rb = flat_replica(b)
    if ra.calls == rb.calls:
        assert words(ca, da, False) == words(cb, db, False)
    else:
        assert words(ca, da, False) != words(cb, db, False)
    if set(ca.lru_keys()) != set(cb.lru_keys()):
        assert words(ca, da, True) != words(cb, db, True)


def test_flat_interleaving_across_pools_matters() -> None:
    """Seed generation: the same per-pool operations interleaved differently change
    which page the shared LRU evicts, and the digest tells them apart."""
    one = [["add", "kv", [A]], ["add", "swa", [B]]]
    two = [["add", "swa", [B]], ["add", "kv", [A]]]
    c1, d1, _ = flat_replica(one)
    c2, d2, _ = flat_replica(two)
    assert c1.lru_keys() != c2.lru_keys()
    assert words(c1, d1, False) != words(c2, d2, False)


def test_mix_and_slots_are_deterministic_values() -> None:
    """``mix`` and ``slot_of`` are fixed functions of their inputs (no per-process salt)."""
    assert mix("a", 1) == mix("a", 1) != mix("a", 2)
    assert slot_of("kv", 16) == slot_of("kv", 16) < 16


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    _child_main()
