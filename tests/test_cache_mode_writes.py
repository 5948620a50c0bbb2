"""Cache mode's L3 write path without sglang: the hooks on ``write_backup_storage``
and ``write_storage`` called the way upstream calls them, around stand-ins with
upstream's parameter names; our caches and accounting are the real ones.  The
real path runs in tests/real_server/test_cache_mode.py."""

from __future__ import annotations

import enum
import functools
import threading
from types import SimpleNamespace as NS
from typing import Any

import pytest

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core import gate
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.integrations.sglang import write_hooks as wh
from hicache_existence.integrations.sglang import write_path as wp

PAGE = 4


def _plan_write(
    feed: Any, controller: Any, host: Any, tokens: Any, kv: Any, prefix: Any, extra: Any
) -> Any:
    """What the ``write_storage`` hook does: the plan, then the arguments it changes."""
    if feed.cache_mode is None:
        return None
    if feed.controller is None:
        feed.controller = controller
    plan = feed.cache_mode.plan(kv, extra, prefix_keyed=prefix is not None)
    if plan.whole:
        return (plan, {})
    return feed.cache_write_changes(plan, controller, host, tokens, prefix)


def pages(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:063x}" for i in range(n)]


class Indices(list):  # type: ignore[type-arg]
    """Host indices: a list that, like a tensor, takes a list of positions."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, list):
            return Indices(list.__getitem__(self, i) for i in key)
        got = list.__getitem__(self, key)
        return Indices(got) if isinstance(key, slice) else got


class Controller:
    """Upstream's controller as far as the hooks see it: ``write_storage`` queues
    an operation; ``run`` is the backup thread writing it to a file-like L3."""

    page_size = PAGE
    backup_skip = False

    def __init__(self, l3: set[str]) -> None:
        self.l3 = l3
        self.calls: list[dict[str, Any]] = []
        self.queue: list[NS] = []
        self._next = 100

    def write_storage(
        self,
        host_indices: Any,
        token_ids: Any,
        hash_value: Any = None,
        prefix_keys: Any = None,
        extra_pools: Any = None,
    ) -> int:
        self._next += 1
        call = dict(host=list(host_indices), tokens=list(token_ids), pages=list(hash_value or ()))
        call.update(prefix=prefix_keys, extra=extra_pools)
        self.calls.append(call)
        self.queue.append(NS(id=self._next, hash_value=list(hash_value or ()), completed_tokens=0))
        return self._next

    def extend_storage_prefix(self, prefix_keys: Any, hash_values: list[str]) -> Any:
        return [*prefix_keys, *hash_values]


def _write_backup_storage(self: Any, node_id: int) -> None: ...
def _write_storage(
    self: Any,
    host_indices: Any,
    token_ids: Any,
    hash_value: Any = None,
    prefix_keys: Any = None,
    extra_pools: Any = None,
) -> int: ...
def _page_backup(self: Any, operation: Any) -> None: ...
def file_set(self: Any, key: str, value: Any = None) -> bool: ...
def file_exists(self: Any, key: str) -> bool: ...
def _invalidate_absent_from_hit_query(self: Any, operation: Any) -> None: ...
def _handle_prefetch_result(self: Any, operation: Any) -> None: ...


around_node = wh.hook("UnifiedRadixCache.write_backup_storage").bound(_write_backup_storage)
around_write = wh.hook("HybridCacheController.write_storage").bound(_write_storage)
around_backup = wh.hook("HiCacheController._page_backup").bound(_page_backup)
around_set = wh.hook("HiCacheFile.set").bound(file_set)
around_exists = wh.hook("HiCacheFile.exists").bound(file_exists)
after_query = wh.hook("._invalidate_absent_from_hit_query").bound(_invalidate_absent_from_hit_query)
around_prefetch = wh.hook("._handle_prefetch_result").bound(_handle_prefetch_result)


class Tree:
    """``UnifiedRadixCache`` in cache mode: a node's backup calls
    ``write_storage`` with the node's pages, as upstream's does."""

    page_size = PAGE
    prefetch_threshold = 4 * PAGE

    def __init__(self, cache: Any, l3: set[str]) -> None:
        self.storage_existence_cache = cache
        self.cache_controller = Controller(l3)
        self.ongoing_backup: dict[int, Any] = {}
        self.nodes: dict[int, list[str]] = {}

    def write_backup_storage(self, node_id: int, prefix_keys: Any = None) -> None:
        def upstream(tree: Tree, node: int) -> None:
            keys = tree.nodes[node]
            host = Indices(range(1000 + 10 * node * PAGE, 1000 + (10 * node + len(keys)) * PAGE))
            tokens = [7] * len(keys) * PAGE
            cc = tree.cache_controller
            op = around_write(cc.write_storage.__func__, cc, host, tokens, keys, prefix_keys)
            tree.ongoing_backup[op] = node

        around_node(upstream, self, node_id)

    def run_backups(self) -> None:
        """The backup thread writes every queued operation (file backend: a page
        that exists is skipped, and said so by ``exists``)."""
        cc = self.cache_controller

        def backup(controller: Controller, operation: NS) -> None:
            for key in operation.hash_value:

                def file_set_(backend: Any, k: str, value: Any = None) -> bool:
                    if around_exists(lambda b, kk: kk in cc.l3, backend, k):
                        return True
                    cc.l3.add(k)
                    return True

                around_set(file_set_, None, key)
                operation.completed_tokens += PAGE

        for op in cc.queue:
            t = threading.Thread(target=around_backup, args=(backup, cc, op))
            t.start()
            t.join()
        cc.queue.clear()

    def drain_acks(self) -> None:
        """The rank-synchronised drain pops every acknowledged operation."""
        self.ongoing_backup.clear()


@pytest.fixture
def made():
    feeds: list[wp.WritePath] = []

    def make(dedup: bool, flat: bool = False) -> tuple[Tree, wp.WritePath, set[str]]:
        cache: Any = FlatStorageExistenceCache(64) if flat else StorageExistenceCache(64)
        feed = wp.WritePath(WriteAccounting(), cache, cache_mode=True, dedup=dedup)
        wp.attach(feed)
        feeds.append(feed)
        l3: set[str] = set()
        return Tree(cache, l3), feed, l3

    yield make
    wp.detach()


def cycle(tree: Tree, feed: wp.WritePath, *nodes: int) -> None:
    for node in nodes:
        tree.write_backup_storage(node)
    tree.run_backups()
    tree.drain_acks()
    feed.step(tree)


def test_dedup_off_writes_every_page_and_counts_against_l3(made) -> None:
    """Dedup off: the node is written as upstream writes it; written = what the
    backend received; redundant = the pages L3 already held, with causes; the
    acked pages become beliefs, so the savings dedup would bring show as
    redundant_believed."""
    tree, feed, _l3 = made(dedup=False)
    a = pages("a", 6)
    tree.nodes = {1: a, 2: a}
    cycle(tree, feed, 1)
    assert [c["pages"] for c in tree.cache_controller.calls] == [a]
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.acknowledged, kv.redundant, kv.avoided) == (6, 6, 0, 0)
    assert tree.storage_existence_cache.pool("kv").believed(a) == a
    cycle(tree, feed, 2)  # the same pages recomputed by another node
    assert tree.cache_controller.calls[1]["pages"] == a
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.redundant, kv.redundant_believed, kv.avoided) == (12, 6, 6, 0)
    assert dict(kv.causes) == {"recompute": 6}


def test_dedup_on_leaves_believed_pages_out(made) -> None:
    """Dedup on: believed pages are not written (avoided), the rest are, with
    their host indices and tokens; a node fully believed sends an empty write so
    that upstream's bookkeeping (ongoing_backup, the host lock) is unchanged."""
    tree, feed, l3 = made(dedup=True)
    a, b = pages("a", 4), pages("b", 3)
    tree.nodes = {1: a, 2: [*a[:2], *b, *a[2:]], 3: a}
    cycle(tree, feed, 1)
    cycle(tree, feed, 2)
    call = tree.cache_controller.calls[1]
    assert call["pages"] == b
    assert call["host"] == [1000 + 20 * PAGE + i for i in range(2 * PAGE, 5 * PAGE)]
    assert len(call["tokens"]) == 3 * PAGE
    cycle(tree, feed, 3)
    assert (
        tree.cache_controller.calls[2]["pages"] == []
        and tree.cache_controller.calls[2]["host"] == []
    )
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.avoided, kv.redundant, kv.acknowledged) == (7, 8, 0, 7)
    assert l3 == {*a, *b}


def test_prefix_keyed_backends_skip_only_a_believed_prefix(made) -> None:
    """A backend that takes prefix keys: only the leading believed pages are left
    out, and the prefix context is advanced past them."""
    tree, feed, _l3 = made(dedup=True)
    a, b = pages("a", 3), pages("b", 2)
    tree.nodes = {1: a, 2: [*a[:2], *b, a[2]]}
    cycle(tree, feed, 1)
    tree.write_backup_storage(2, prefix_keys=["root"])
    call = tree.cache_controller.calls[1]
    assert call["pages"] == [*b, a[2]] and call["prefix"] == ["root", *a[:2]]
    assert call["host"][0] == 1000 + 20 * PAGE + 2 * PAGE


def test_acks_are_accounted_in_launch_order_once_drained(made) -> None:
    """An operation counts as acknowledged only once the drain took it off
    ``ongoing_backup``; until then it is pending (in flight: covered)."""
    tree, feed, _l3 = made(dedup=True)
    a, b = pages("a", 2), pages("b", 2)
    tree.nodes = {1: a, 2: b, 3: a}
    tree.write_backup_storage(1)
    tree.write_backup_storage(2)
    tree.run_backups()
    feed.step(tree)
    assert feed.cache_mode is not None and feed.cache_mode.pending == 2
    assert feed.writes.stats()["kv"].acknowledged == 0
    tree.write_backup_storage(3)  # a is in flight: covered, left out
    assert tree.cache_controller.calls[-1]["pages"] == []
    tree.ongoing_backup.pop(min(tree.ongoing_backup))
    feed.step(tree)
    assert feed.cache_mode.pending == 2 and feed.writes.stats()["kv"].acknowledged == 2
    tree.run_backups()
    tree.drain_acks()
    feed.step(tree)
    assert feed.cache_mode.pending == 0 and feed.writes.stats()["kv"].acknowledged == 4


def test_hit_queries_heal_the_beliefs_and_name_the_cause(made) -> None:
    """Cache mode: a rank-agreed hit query invalidates beliefs beyond its hit and
    learns up to it; a stored prefix below the threshold, recomputed and
    written again, is counted below_prefetch_threshold."""
    tree, feed, l3 = made(dedup=False)
    a = pages("a", 6)
    kv = tree.storage_existence_cache.pool("kv")
    kv.add(a)
    l3.update(a[:2])
    op = NS(all_hash_values=a, storage_hit_count=2 * PAGE, deadline_expired=False)
    after_query(None, tree, op)
    assert kv.believed(a) == a[:2]
    tree.nodes = {9: a}
    cycle(tree, feed, 9)
    w = feed.writes.stats()["kv"]
    assert (w.redundant, dict(w.causes)) == (2, {"below_prefetch_threshold": 2})


def test_a_cut_query_is_no_verdict(made) -> None:
    """A query cut by its deadline heals nothing."""
    tree, _feed, _l3 = made(dedup=True)
    a = pages("a", 4)
    kv = tree.storage_existence_cache.pool("kv")
    kv.add(a)
    after_query(None, tree, NS(all_hash_values=a, storage_hit_count=0, deadline_expired=True))
    assert kv.believed(a) == a


def test_prefetch_results_split_loaded_from_short(made) -> None:
    """``_handle_prefetch_result``: the loaded pages are a local record, the rest
    of the hit a shortfall if written again."""
    tree, feed, l3 = made(dedup=False)
    a = pages("a", 8)
    l3.update(a)
    after_query(
        None, tree, NS(all_hash_values=a, storage_hit_count=8 * PAGE, deadline_expired=False)
    )
    around_prefetch(lambda t, op: None, tree, NS(hash_value=a, completed_tokens=3 * PAGE))
    tree.nodes = {4: a}
    cycle(tree, feed, 4)
    w = feed.writes.stats()["kv"]
    assert dict(w.causes) == {"recompute": 3, "prefetch_shortfall": 5}
    assert sum(w.causes.values()) == w.redundant == 8


def test_the_flat_generation_dedups_too(made) -> None:
    """0.5.19-0.5.21's cache (one index tagged by pool): the same decisions, its
    in-flight pages tracked by its per-pool view (the seed cache keeps none)."""
    tree, feed, _l3 = made(dedup=True, flat=True)
    a = pages("a", 3)
    tree.nodes = {1: a, 2: a}
    tree.write_backup_storage(1)
    kv = tree.storage_existence_cache.pool("kv")
    assert feed.cache_mode is not None and kv.inflight_refs() == dict.fromkeys(a, 1)
    tree.write_backup_storage(2)  # in flight: covered
    assert tree.cache_controller.calls[-1]["pages"] == []
    tree.run_backups()
    tree.drain_acks()
    feed.step(tree)
    assert tree.storage_existence_cache.believed("kv", a) == a
    assert kv.inflight_refs() == {}
    w = feed.writes.stats()["kv"]
    assert (w.written, w.avoided, w.acknowledged) == (3, 3, 3)


def test_other_write_storage_calls_are_not_ours(made) -> None:
    """``write_storage`` outside a cache-mode node write (the buffer pipeline's,
    the decode offload's) is upstream's alone: not counted, not reduced."""
    tree, feed, _l3 = made(dedup=True)
    cc = tree.cache_controller
    a = pages("a", 2)
    tree.storage_existence_cache.pool("kv").add(a)
    around_write(Controller.write_storage, cc, Indices(range(8)), [1] * 8, a, None)
    assert cc.calls[-1]["pages"] == a and "kv" not in feed.writes.stats()


def test_a_failing_plan_writes_as_upstream(made) -> None:
    """Arguments the plan cannot read: counted as an error, upstream writes the
    node untouched, exactly once."""
    tree, feed, _l3 = made(dedup=True)
    cc = tree.cache_controller

    a = pages("a", 2)
    broken = [NS(keys=["x"])]  # an extra pool without a name

    def upstream(t: Tree, node: int) -> None:
        around_write(Controller.write_storage, cc, Indices(range(8)), [1] * 8, a, None, broken)

    around_node(upstream, tree, 1)
    assert [c["pages"] for c in cc.calls] == [a] and cc.calls[0]["extra"] is broken
    assert feed.errors == 1 and "kv" not in feed.writes.stats()


# -- extra pools (hybrid models): the whole node or nothing -------------------------------------
def _extra_plan(made: Any, kv_believed: int, swa_believed: bool) -> tuple[Any, Any, Any]:
    """A node of 4 KV pages and 2 sliding-window pages, ``kv_believed`` of its KV
    pages and (or not) its SWA pages believed; returns (feed, plan, changes)."""
    tree, feed, _l3 = made(dedup=True)
    kv, swa = pages("k", 4), pages("s", 2)
    cache = tree.storage_existence_cache
    if kv_believed:
        cache.pool("kv").add(kv[:kv_believed])
    if swa_believed:
        cache.pool("swa").add(swa)
    host = Indices(range(4 * PAGE))
    extra = [NS(name="swa", keys=swa)]
    call = _plan_write(feed, tree.cache_controller, host, [7] * 4 * PAGE, kv, None, extra)
    assert call is not None
    return feed, *call


@pytest.mark.parametrize(
    ("kv_believed", "swa_believed"), [(4, False), (2, False), (2, True), (0, True), (0, False)]
)
def test_dedup_writes_a_node_with_extra_pools_whole_unless_all_is_believed(
    made: Any, kv_believed: int, swa_believed: bool
) -> None:
    """Dedup may leave out a node carrying extra pools only when every one of its
    pages, KV and extra, is believed: a node whose KV pages are believed but whose
    sliding-window pages are not is written whole (dropping the SWA pages, or only
    the believed KV ones, would leave L3 with a node it cannot serve)."""
    feed, plan, changes = _extra_plan(made, kv_believed, swa_believed)
    assert plan.whole and plan.extra_written and changes == {}
    assert plan.written_pages == pages("k", 4) and plan.extra == {"swa": pages("s", 2)}
    feed.cache_mode.launched(1, plan, 1)
    stats = feed.writes.stats()
    assert (stats["kv"].written, stats["kv"].avoided) == (4, 0)
    assert (stats["swa"].written, stats["swa"].avoided) == (2, 0)


def test_dedup_leaves_out_a_node_with_extra_pools_all_believed(made: Any) -> None:
    """Every page believed, KV and extra: the write goes out empty (upstream's
    bookkeeping unchanged), the extra pools dropped from it, all counted avoided."""
    feed, plan, changes = _extra_plan(made, 4, True)
    assert plan.keep == [] and not plan.extra_written
    assert changes["hash_value"] == [] and changes["extra_pools"] is None
    assert list(changes["host_indices"]) == [] and list(changes["token_ids"]) == []
    feed.cache_mode.launched(1, plan, 1)
    stats = feed.writes.stats()
    assert (stats["kv"].written, stats["kv"].avoided) == (0, 4)
    assert (stats["swa"].written, stats["swa"].avoided) == (0, 2)


def test_a_non_writer_rank_believes_what_the_writer_rank_believes(made: Any) -> None:
    """MLA: one rank of the TP group writes L3 for the group and the others skip
    (``backup_skip``).  Every rank adds the written pages to its beliefs at the
    ack whatever its own backend did, so the replicas stay identical; only the
    writer counts the backend's outcome."""
    writer, writer_feed, writer_l3 = made(dedup=True)
    skipper, skipper_feed, _skipper_l3 = made(dedup=True)
    skipper.cache_controller.backup_skip = True
    a, b = pages("a", 4), pages("b", 3)
    for tree, feed in ((writer, writer_feed), (skipper, skipper_feed)):
        tree.nodes = {1: a, 2: [*a[:2], *b]}
        wp.attach(feed)
        cycle(tree, feed, 1)
        cycle(tree, feed, 2)
    beliefs = [t.storage_existence_cache.pool("kv") for t in (writer, skipper)]
    assert list(beliefs[0].lru_keys()) == list(beliefs[1].lru_keys())  # same order too
    assert set(beliefs[1].lru_keys()) == {*a, *b}
    assert [c["pages"] for c in skipper.cache_controller.calls] == [a, b]  # same plan
    w, s = writer_feed.writes.stats()["kv"], skipper_feed.writes.stats()["kv"]
    assert (w.written, w.acknowledged, w.avoided) == (7, 7, 2)
    assert (s.written, s.avoided) == (7, 2) and s.acknowledged == 0
    assert writer_l3 == {*a, *b}


@pytest.mark.parametrize("flat", [False, True])
def test_a_node_written_again_after_its_host_copy_went_is_host_copy_reclaimed(
    made: Any, flat: bool
) -> None:
    """The same tree node writing its pages a second time (its host copy was
    reclaimed and backed up again): the redundant pages are ``host_copy_reclaimed``,
    not a recompute by another node; with dedup on the second write is avoided."""
    tree, feed, _l3 = made(dedup=False, flat=flat)
    a = pages("a", 5)
    tree.nodes = {3: a, 4: a}
    cycle(tree, feed, 3)
    cycle(tree, feed, 3)
    w = feed.writes.stats()["kv"]
    assert (w.written, w.redundant, dict(w.causes)) == (10, 5, {"host_copy_reclaimed": 5})
    cycle(tree, feed, 4)  # another node, same pages: that one is a recompute
    assert dict(feed.writes.stats()["kv"].causes) == {"host_copy_reclaimed": 5, "recompute": 5}


def test_in_flight_pages_are_released_at_the_ack_and_not_before(made: Any) -> None:
    """Current generation: a launched page is in flight (covered, not believed)
    from the launch until the drain acknowledges its operation, even after the
    backup thread wrote it; a page in two operations is released once per ack."""
    tree, feed, _l3 = made(dedup=False)
    kv = tree.storage_existence_cache.pool("kv")
    a = pages("a", 3)
    tree.nodes = {1: a, 2: a}
    tree.write_backup_storage(1)
    tree.write_backup_storage(2)
    assert kv.inflight_refs() == dict.fromkeys(a, 2) and kv.believed(a) == []
    tree.run_backups()  # written by the backup thread, not yet drained
    feed.step(tree)
    assert kv.inflight_refs() == dict.fromkeys(a, 2) and kv.believed(a) == []
    tree.ongoing_backup.pop(min(tree.ongoing_backup))
    feed.step(tree)
    assert kv.inflight_refs() == dict.fromkeys(a, 1) and kv.believed(a) == a
    tree.drain_acks()
    feed.step(tree)
    assert kv.inflight_refs() == {} and kv.believed(a) == a


def test_the_flat_generation_heals_from_hit_queries(made: Any) -> None:
    """0.5.21's cache: a rank-agreed hit query unlearns the beliefs beyond its hit
    (the pages L3 lost) and learns the pages up to it, as the current one does."""
    tree, feed, l3 = made(dedup=True, flat=True)
    cache = tree.storage_existence_cache
    a, b = pages("a", 6), pages("b", 4)
    cache.add("kv", a)
    l3.update(a[:2])
    after_query(
        None, tree, NS(all_hash_values=a, storage_hit_count=2 * PAGE, deadline_expired=False)
    )
    assert cache.believed("kv", a) == a[:2]
    after_query(
        None, tree, NS(all_hash_values=b, storage_hit_count=3 * PAGE, deadline_expired=False)
    )
    assert cache.believed("kv", b) == b[:3]
    tree.nodes = {5: a}
    cycle(tree, feed, 5)  # dedup leaves out only what is still believed
    assert tree.cache_controller.calls[-1]["pages"] == a[2:]


def test_a_pool_never_seen_is_counted_under_its_own_name_never_as_kv(made: Any) -> None:
    """A new hybrid component (a pool name no release had, given as a str enum like
    upstream's ``PoolName``): its pages are counted under its own pool, KV's counts
    are KV's alone, and its pages become its own beliefs."""

    class NewPool(str, enum.Enum):
        GDN = "gdn_state"

    tree, feed, _l3 = made(dedup=False)
    kv, gdn = pages("k", 3), pages("g", 1)
    host = Indices(range(3 * PAGE))
    extra = [NS(name=NewPool.GDN, keys=gdn)]
    call = _plan_write(feed, tree.cache_controller, host, [7] * 3 * PAGE, kv, None, extra)
    assert call is not None
    plan, _changes = call
    feed.cache_mode.launched(1, plan, 1)
    stats = feed.writes.stats()
    assert set(stats) == {"kv", "gdn_state"}
    assert (stats["kv"].written, stats["gdn_state"].written) == (3, 1)
    feed.cache_mode._acked(feed.cache_mode._pending.pop(1), None)
    assert tree.storage_existence_cache.pool("gdn_state").believed(gdn) == gdn
    assert tree.storage_existence_cache.pool("kv").believed(gdn) == []


def test_an_extra_pool_s_believed_pages_written_again_are_redundant_believed(made: Any) -> None:
    """Dedup off, a hybrid node whose SWA pages are believed (its KV pages not): the
    SWA pages L3 already held are ``redundant_believed`` in their own pool, as
    KV's are: what dedup would have saved there (0 before: only KV counted)."""
    tree, feed, _l3 = made(dedup=False)
    kv, swa = pages("k", 4), pages("s", 2)
    tree.storage_existence_cache.pool("swa").add(swa)
    host = Indices(range(4 * PAGE))
    extra = [NS(name="swa", keys=swa)]
    call = _plan_write(feed, tree.cache_controller, host, [7] * 4 * PAGE, kv, None, extra)
    assert call is not None
    plan, _changes = call
    feed.cache_mode.launched(1, plan, 1)
    outcome = wp.Outcome(stored={"kv": 4, "swa": 2}, existed={"swa": set(swa)})
    feed.cache_mode._acked(feed.cache_mode._pending.pop(1), outcome)
    stats = feed.writes.stats()
    assert (stats["swa"].redundant, stats["swa"].redundant_believed) == (2, 2)
    assert (stats["kv"].redundant, stats["kv"].redundant_believed) == (0, 0)
    assert dict(stats["swa"].causes) == {"recompute": 2}


@pytest.mark.parametrize("through", ["bound", "hook"])
def test_the_per_step_call_reaps_only_when_the_oldest_write_was_acknowledged(through: str) -> None:
    """The per-step call (a step hook bound by ``ProcessEntry.bind``, and the one
    SGLang calls, bound to the tree by its first call) runs cache mode's reap only
    when the oldest pending operation has left upstream's ``ongoing_backup`` (acks
    drain in launch order): with writes in flight and none drained, a step is one
    membership test; once the oldest is drained, that step accounts it."""
    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang import hooks
    from hicache_existence.integrations.sglang.facts import SchedulerFacts
    from hicache_existence.integrations.sglang.process import PROCESS
    from hicache_existence.runtime import ExistenceRuntime

    config = Config.from_mapping({"enabled": True, "metrics": {"mode": "off"}})
    runtime = ExistenceRuntime(config, generation="current")
    facts = SchedulerFacts(host_memory_mode="cache", storage_backend="file")
    entry = hooks.ProcessEntry(runtime, facts, None, None, None)
    feed = entry.write_path
    assert feed.cache_mode is not None
    reaps: list[int] = []
    reap = feed.cache_mode.reap

    def counted(ongoing: Any, outcomes: Any) -> int:
        reaps.append(runtime.steps)
        return reap(ongoing, outcomes)

    feed.cache_mode.reap = counted  # type: ignore[method-assign]
    wp.attach(feed)
    try:
        tree = Tree(runtime.cache, set())
        if through == "hook":  # its first call binds it to this tree
            hooks._unbind()
            hooks._ENTRIES[PROCESS.pid] = entry
            step = functools.partial(hooks.after_check_hicache_events, None, tree)
        else:

            def unbound(*args: Any, **kwargs: Any) -> None:
                raise AssertionError("a bound hook's step of its own tree took the fallback")

            hook = gate.step_hook(unbound)
            entry.bind(hook, tree)
            step = functools.partial(hook, None, tree)
        step()  # nothing pending
        a, b = pages("a", 2), pages("b", 3)
        tree.nodes = {1: a, 2: b}
        tree.write_backup_storage(1)
        tree.write_backup_storage(2)
        tree.run_backups()
        step()
        step()  # written, not yet drained: nothing to reap
        assert reaps == [] and feed.cache_mode.pending == 2
        tree.ongoing_backup.pop(min(tree.ongoing_backup))
        step()
        assert reaps == [3] and feed.cache_mode.pending == 1
        assert feed.writes.stats()["kv"].acknowledged == 2
        step()  # the second still in ongoing_backup
        tree.drain_acks()
        step()
        assert reaps == [3, 5] and feed.cache_mode.pending == 0
        assert feed.writes.stats()["kv"].acknowledged == 5
    finally:
        if through == "hook":
            hooks._ENTRIES.pop(PROCESS.pid, None)
            hooks._unbind()
        wp.detach()
        runtime.close()
