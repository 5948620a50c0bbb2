"""One interface for both cache generations (``core.protocol``): both offer it,
the seed generation's per-pool views are its own public calls, and no consumer
branches on the generation's type."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.core.protocol import ExistenceCache, PoolView

PACKAGE = Path(__file__).resolve().parents[1] / "hicache_existence"
H = [f"{i:064x}" for i in range(1, 9)]


def _members(proto: type) -> set[str]:
    return {
        n
        for n, v in vars(proto).items()
        if (callable(v) or isinstance(v, property)) and (not n.startswith("_") or n == "__len__")
    }


@pytest.mark.parametrize("cls", [StorageExistenceCache, FlatStorageExistenceCache])
def test_both_generations_offer_every_member_of_the_protocol(cls: type) -> None:
    """Every member of ``ExistenceCache`` on the cache and of ``PoolView`` on its pools."""
    cache = cls(8)
    for name in _members(ExistenceCache):
        assert hasattr(cache, name), name
    view = cache.pool("kv")
    for name in _members(PoolView):
        assert hasattr(view, name), name
    assert cache.shared_lru is (cls is FlatStorageExistenceCache)
    assert cache.pools() == (view,) and cache.pool("kv") is view


@pytest.mark.parametrize("cls", [StorageExistenceCache, FlatStorageExistenceCache])
def test_the_covered_tally_counts_true_answers_only_while_on(cls: type) -> None:
    """``covered_pages`` adds the pages of each ``covered()`` answered True while the
    cache's tally is on (pools created later included); off, or False: nothing.
    The answers, LRU and counters equal an untallied cache's under the same calls."""
    cache, plain = cls(8), cls(8)
    for c in (cache, plain):
        c.pool("kv").add(H[:4])
        c.pool("kv").track_inflight(H[4:5])
    calls = [H[:3], "on", H[:5], H[:6], iter(H[:2]), "swa", "off", H[:4]]
    answers, plain_answers = [], []
    for call in calls:
        if call == "on" or call == "off":
            cache.tally_covered(call == "on")
        elif call == "swa":  # a pool created while the tally is on
            for c in (cache, plain):
                c.pool("swa").add(H[:1])
            answers.append(cache.pool("swa").covered(H[:1]))
            plain_answers.append(plain.pool("swa").covered(H[:1]))
        else:
            seq = list(call)
            answers.append(cache.pool("kv").covered(seq if isinstance(call, list) else iter(seq)))
            plain_answers.append(plain.pool("kv").covered(seq))
    assert answers == plain_answers == [True, True, False, True, True, True]
    assert (cache.pool("kv").covered_pages, cache.pool("swa").covered_pages) == (7, 1)
    assert plain.pool("kv").covered_pages == 0
    assert cache.stats() == plain.stats()
    assert list(cache.lru_items()) == list(plain.lru_items())


def test_a_flat_view_is_the_seed_calls_on_its_pool() -> None:
    """The view's operations equal the seed API's calls on its pool: same LRU
    order, same counters, and a view's ``clear`` leaves the other pools."""
    a, b = FlatStorageExistenceCache(6), FlatStorageExistenceCache(6)
    kv, swa = a.pool("kv"), a.pool("swa")
    b.pool_names()
    kv.add(H[:4])
    b.add("kv", H[:4])
    swa.add(H[4:6])
    b.add("swa", H[4:6])
    assert kv.contains_all(H[:2]) == b.contains_all("kv", H[:2])
    assert kv.covered(H[:5]) == b.covers_all("kv", H[:5])
    kv.invalidate_beyond(H[:4], 3)
    b.invalidate_beyond("kv", H[:4], 3)
    kv.add(H[6:8])
    b.add("kv", H[6:8])
    assert a.lru_keys() == b.lru_keys()
    assert a.stats() == b.stats()
    assert kv.lru_keys() == tuple(k for p, k in b.lru_keys() if p == "kv")
    assert kv.believed(H) == b.believed("kv", H) and len(kv) == len(kv.lru_keys())
    assert kv.max_entries == 6 and kv.stats() == b.stats()["kv"]
    held = sum(1 for p, _ in b.lru_keys() if p == "swa")
    assert held >= 1
    swa.clear()
    assert a.lru_keys() == tuple(x for x in b.lru_keys() if x[0] == "kv")
    assert (a.stats()["swa"].entries, a.stats()["swa"].cleared_pages) == (0, held)


def test_flat_in_flight_pages_are_its_refs_and_upstreams_extra_cover() -> None:
    """In flight on a flat pool: its own refs (cache mode) and the live set
    upstream's pipeline passes to ``covers_all`` (buffer mode)."""
    cache = FlatStorageExistenceCache(8)
    kv = cache.pool("kv")
    assert not kv.inflight_pages()
    kv.track_inflight(H[:2])
    assert kv.covered(H[:2]) and kv.stats().rescues == 2
    assert kv.inflight_pages() == {H[0]: 1, H[1]: 1}
    kv.untrack_inflight(H[:2])
    assert not kv.inflight_pages()
    pipeline_set = {H[5]: 1}
    assert cache.covers_all("kv", H[5:6], extra_cover=pipeline_set)
    assert kv.inflight_pages() is pipeline_set
    pipeline_set[H[6]] = 1  # live: a later launch is seen without another lookup
    assert H[6] in kv.inflight_pages()
    kv.track_inflight(H[7:8])  # both sources at once
    both = kv.inflight_pages()
    assert H[7] in both and H[6] in both and H[0] not in both
    # Its own refs are counted as the current generation counts them; upstream's
    # pipeline set is upstream's accounting, not ours.
    kv.untrack_inflight(H[7:8] * 2)
    kv.track_inflight(H[3:5] * 2)
    s = cache.stats()["kv"]
    assert (s.inflight, s.inflight_tracked, s.inflight_released, s.inflight_unmatched) == (
        2,
        7,
        3,
        1,
    )


#: Consumers that must speak only the protocol: no generation type named.
CONSUMERS = (
    "reconcile/reconciler.py",
    "reconcile/verdicts.py",
    "replay/fleet.py",
    "replicas/digest.py",
    "replicas/divergence.py",
    "runtime.py",
    "accounting/advisor.py",
    "integrations/sglang/cache_mode.py",
    "integrations/sglang/write_path.py",
    "demo/scheduler.py",
)


@pytest.mark.parametrize("rel", CONSUMERS)
def test_consumers_never_branch_on_the_generation_type(rel: str) -> None:
    """No ``isinstance(..., FlatStorageExistenceCache / StorageExistenceCache)``
    and no ``hasattr(cache, "pool")``-style shape test in a consumer."""
    tree = ast.parse((PACKAGE / rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            text = ast.unparse(node)
            if node.func.id == "isinstance":
                assert "StorageExistenceCache" not in text and "PoolBeliefs" not in text, text
            if node.func.id in ("hasattr", "getattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant):
                    assert arg.value not in ("pool", "pools", "_inflight", "_entries"), text


def test_the_protocol_is_what_consumers_annotate() -> None:
    """The reconciler and cache mode take an ``ExistenceCache``, not ``Any``."""
    from hicache_existence.integrations.sglang.cache_mode import CacheModeWrites
    from hicache_existence.reconcile.reconciler import Reconciler

    for fn in (Reconciler.__init__, CacheModeWrites.__init__):
        assert inspect.signature(fn).parameters["cache"].annotation == "ExistenceCache"


class _Log:
    """An observer that records every call it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def added(self, pool: str, hashes: object) -> None:
        self.calls.append(("added", pool))

    def touched(self, pool: str, hashes: object, stop: int) -> None:
        self.calls.append(("touched", pool))

    def invalidated(self, pool: str, hashes: object, keep_pages: int) -> None:
        self.calls.append(("invalidated", pool))

    def inflight(self, pool: str, hashes: object, delta: int) -> None:
        self.calls.append(("inflight", pool))

    def cleared(self, pool: str, inflight_only: bool) -> None:
        self.calls.append(("cleared", pool))


def _ops(cache: ExistenceCache, pool: str) -> None:
    view = cache.pool(pool)
    view.add(H[:3])
    view.covered(H[:4])
    view.track_inflight(H[4:5])
    view.untrack_inflight(H[4:5])
    view.invalidate_beyond(H[:3], 2)


@pytest.mark.parametrize("cls", [StorageExistenceCache, FlatStorageExistenceCache])
def test_an_empty_tee_is_not_called_and_observers_attached_later_see_every_pool(
    cls: type,
) -> None:
    """A cache holds ``None`` while its ``Tee`` is empty (no call per operation), the
    observer itself while there is one (no Python loop in front of it) and the
    ``Tee`` with two, whether attached, appended or assigned, for the pools that
    existed then and those created after; back to ``None`` when the last observer
    goes.  Fails if a pool keeps notifying an empty ``Tee``, or misses a late
    observer, or a second one."""
    from hicache_existence.core.observers import Tee

    tee = Tee()
    cache = cls(16, observer=tee)
    cache.pool("kv")
    assert all(view._observer is None for view in cache.pools())
    log = _Log()
    tee.append(log)
    _ops(cache, "kv")
    _ops(cache, "swa")  # created after the observer came
    kinds = [k for k, _ in log.calls]
    assert {p for _, p in log.calls} == {"kv", "swa"}
    assert {"added", "touched", "invalidated"} <= set(kinds)  # flat reports no in-flight
    assert all(view._observer is log for view in cache.pools())
    second = _Log()
    tee.append(second)
    assert all(view._observer is tee for view in cache.pools())
    _ops(cache, "kv")
    assert second.calls and log.calls[-len(second.calls) :] == second.calls
    tee.discard(second)
    assert all(view._observer is log for view in cache.pools())
    tee.discard(log)
    assert all(view._observer is None for view in cache.pools())
    before = len(log.calls)
    _ops(cache, "kv")
    assert len(log.calls) == before
    tee.observers = (log,)  # assigned, as a recorder toggle does
    _ops(cache, "kv")
    assert len(log.calls) > before


@pytest.mark.parametrize(
    "cls,bad",
    [
        (StorageExistenceCache, {"max_entries": 0}),
        (FlatStorageExistenceCache, {"max_entries": 0}),
        (FlatStorageExistenceCache, {"primary_pool": ""}),
    ],
)
def test_a_cache_that_fails_a_check_is_not_listening_to_its_tee(cls: type, bad: dict) -> None:
    """A constructor that raises leaves its ``Tee`` as it was: the half-built cache is
    not among its listeners, called (and kept alive) at every observer change."""
    from hicache_existence.core.observers import Tee

    tee = Tee()
    kwargs = {"max_entries": 16, **bad}
    with pytest.raises(ValueError):
        cls(kwargs.pop("max_entries"), observer=tee, **kwargs)
    assert tee._listeners == []
    cls(16, observer=tee)
    assert len(tee._listeners) == 1
