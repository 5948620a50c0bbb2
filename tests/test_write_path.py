"""The write-path hooks on both API shapes, without sglang: each hook is called the
way upstream's code calls it (0.5.22+ per-pool pipeline, 0.5.19-0.5.21 flat
pipeline), around stand-in callables that play upstream's part; our caches are
the real ones.  The real pipeline is exercised in
tests/sglang_integration/test_sglang_writes.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace as NS
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.integrations.sglang import write_hooks as wh
from hicache_existence.integrations.sglang import write_path as wp


# -- stand-ins for upstream's callables: the parameter names are upstream's, since the
# hooks read their arguments by name from the target's signature.
def _write_intents(self: Any, snapshot: Any) -> Any: ...
def _backup_pool_keys(self: Any, snapshot: Any) -> Any: ...
def _refresh_pending_backup_intents(self: Any) -> Any: ...
def _drop_queue_head(self: Any, intent_tokens: int, *, dropped: bool) -> None: ...
def _stage_backup_intent(
    self: Any, intent: Any, device_value: Any, transfers: Any, keys_by_pool: Any
) -> bool: ...
def _stage_backup_intent_flat(
    self: Any, intent: Any, device_value: Any, comp_xfers: Any
) -> bool: ...
def finish_storage_write_ack(self: Any, operation_id: int) -> None: ...
def _page_backup(self: Any, operation: Any) -> None: ...
def file_set(self: Any, key: str, value: Any = None, target_location: Any = None) -> bool: ...
def file_exists(self: Any, key: str) -> bool: ...
def enqueue_backup_intent(self: Any, node_id: int) -> None: ...
def tree_insert(self: Any, params: Any) -> Any: ...


def installed(suffix: str, like: Any, generation: str = "current") -> Any:
    """The hook the plugin would install on a target with ``like``'s signature."""
    return wh.hook(suffix, generation).bound(like)


after_write_intents = installed("._write_intents", _write_intents)
after_backup_pool_keys = installed("._backup_pool_keys", _backup_pool_keys)
around_refresh_pending = installed(
    "._refresh_pending_backup_intents", _refresh_pending_backup_intents
)
around_drop_queue_head = installed("._drop_queue_head", _drop_queue_head)
after_stage_backup_intent = installed("._stage_backup_intent", _stage_backup_intent)
after_stage_flat = installed("._stage_backup_intent", _stage_backup_intent_flat, "flat")
around_storage_write_ack = installed(".finish_storage_write_ack", finish_storage_write_ack)
around_page_backup = installed("HiCacheController._page_backup", _page_backup)
around_file_set = installed("HiCacheFile.set", file_set)
around_file_exists = installed("HiCacheFile.exists", file_exists)
around_enqueue_backup_intent = installed(".enqueue_backup_intent", enqueue_backup_intent, "flat")
around_flat_covers_all = installed(
    "FlatStorageExistenceCache.covers_all", FlatStorageExistenceCache.covers_all, "flat"
)
around_tree_insert = installed("UnifiedRadixCache.insert", tree_insert, "flat")


def pages(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:063x}" for i in range(n)]


@pytest.fixture
def feed_of():
    made: list[wp.WritePath] = []

    def make(cache: Any, generation: str) -> wp.WritePath:
        feed = wp.WritePath(WriteAccounting(), cache)
        wp.attach(feed)
        made.append(feed)
        return feed

    yield make
    wp.detach()


def host(size_per_token: int, page_size: int) -> NS:
    return NS(size_per_token=size_per_token, page_size=page_size)


def pipeline(cache: Any, entry_map: dict[str, Any] | None = None, sidecars: Any = ()) -> NS:
    controller = NS(
        mem_pool_host=NS(entry_map={k: NS(host_pool=v) for k, v in (entry_map or {}).items()}),
        page_size=4,
        backup_skip=False,
    )
    tree = NS(
        storage_existence_cache=cache, cache_controller=controller, sidecar_pool_specs=sidecars
    )
    return NS(_cache=tree, ongoing_backup={}, pending_write_queue=[])


# -- current generation (per-pool) ----------------------------------------------------
def admit_current(p: NS, pool_keys: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """enqueue_backup_intent's call of _write_intents -> _backup_pool_keys, as upstream."""
    cache = p._cache.storage_existence_cache

    def backup_pool_keys(pipe: NS, snap: Any) -> dict[str, list[str]]:
        return pool_keys

    def write_intents(pipe: NS, snap: Any) -> list[tuple[str, list[str]]]:
        keys = backup_pool_keys(pipe, snap)
        after_backup_pool_keys(keys, pipe, snap)
        return [(pool, k) for pool, k in keys.items() if not cache.pool(pool).covered(k)]

    intents = write_intents(p, "snap")
    after_write_intents(intents, p, "snap")  # AFTER: upstream's wrapper calls it so
    return list(intents)


def test_current_shape_counts_avoided_written_acked_and_redundant(feed_of) -> None:
    """Covered pools are avoided once per admission; the launch counts written
    pages and bytes from the host pool; the ack counts this rank's outcome and
    the pages the file backend said it already held (believed ones apart)."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    p = pipeline(cache, {"kv": host(256, 4), "swa": host(32, 4)})
    a, b = pages("a", 4), pages("b", 4)
    cache.pool("kv").add(a)
    cache.pool("swa").add(a[-1:])
    intents = admit_current(p, {"kv": a + b, "swa": a[-1:]})
    assert [pool for pool, _ in intents] == ["kv"]  # swa covered: avoided
    assert feed.writes.stats()["swa"].avoided == 1
    # split repairs call _write_intents inside a queue refresh: not counted
    around_refresh_pending(lambda pipe: admit_current(pipe, {"kv": a + b, "swa": a[-1:]}), p)
    assert feed.writes.stats()["swa"].avoided == 1

    intent = NS(pool="kv", keys=a + b, snapshot=NS(hash_values=a + b))
    staged = {"kv": a + b}
    after_stage_backup_intent(True, p, intent, None, [], staged)
    after_stage_backup_intent(False, p, intent, None, [], staged)  # not staged: nothing
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.written_bytes) == (8, 8 * 1024)

    # backup thread: the file backend's set asks exists and skips stored pages
    on_disk = set(a)

    def exists(backend: Any, key: str) -> bool:
        return key in on_disk

    def file_set(backend: Any, key: str, value: Any = None) -> bool:
        if around_file_exists(exists, backend, key):
            return True
        on_disk.add(key)
        return True

    operation = NS(id=11, hash_value=a + b, completed_tokens=0, pool_transfers=None)

    def page_backup(controller: Any, op: NS) -> None:
        for key in op.hash_value:
            around_file_set(file_set, None, key, None)
            op.completed_tokens += controller.page_size

    worker = threading.Thread(
        target=around_page_backup, args=(page_backup, p._cache.cache_controller, operation)
    )
    worker.start()
    worker.join()
    p.ongoing_backup[11] = NS(intent=intent, keys_by_pool=staged)
    around_storage_write_ack(lambda pipe, op_id: pipe.ongoing_backup.pop(op_id), p, 11)
    kv = feed.writes.stats()["kv"]
    assert (kv.acknowledged, kv.failed, kv.redundant, kv.redundant_believed) == (8, 0, 4, 4)
    assert feed.errors == 0


def test_launch_retirement_is_avoided_once(feed_of) -> None:
    """_drop_queue_head(dropped=False) retires a head whose pool became covered
    (believed, or in flight): its pages are avoided; a real drop (dropped=True)
    is not, nor a head retired with nothing left to write (not covered)."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    p = pipeline(cache)
    heads = [pages("c", 3), pages("d", 2), pages("f", 2), pages("g", 4)]
    p.pending_write_queue = [NS(pool="kv", keys=k) for k in heads]
    cache.pool("kv").add(pages("c", 3))  # covered since admission: why it retires
    cache.pool("kv").track_inflight(pages("f", 2))  # in flight: covered too

    def drop(pipe: NS, tokens: int, *, dropped: bool) -> None:
        pipe.pending_write_queue.pop(0)

    around_drop_queue_head(drop, p, 12, dropped=False)
    around_drop_queue_head(drop, p, 8, dropped=True)
    around_drop_queue_head(drop, p, 8, dropped=False)
    around_drop_queue_head(drop, p, 16, dropped=False)  # nothing left to write
    assert feed.writes.stats()["kv"].avoided == 3 + 2


def test_failed_pages_and_untouched_lru(feed_of) -> None:
    """A write that stops after one batch: the rest are failed; reading whether
    pages were believed neither touches nor counts a lookup."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    p = pipeline(cache, {"kv": host(8, 4)})
    a = pages("e", 6)
    cache.pool("kv").add(a[:2])
    queries = cache.stats()["kv"].queries
    order = cache.pool("kv").lru_keys()
    intent = NS(pool="kv", keys=a, snapshot=NS(hash_values=a))
    after_stage_backup_intent(True, p, intent, None, [], {"kv": a})
    assert cache.stats()["kv"].queries == queries and cache.pool("kv").lru_keys() == order
    operation = NS(id=3, hash_value=a, completed_tokens=8, pool_transfers=None)
    around_page_backup(lambda c, op: None, p._cache.cache_controller, operation)
    p.ongoing_backup[3] = NS(intent=intent, keys_by_pool={"kv": a})
    around_storage_write_ack(lambda pipe, op_id: None, p, 3)
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.acknowledged, kv.failed, kv.redundant) == (6, 2, 4, 0)


# -- current generation, admissions tallied by the cache --------------------------------
class BufferModePipeline:
    """Upstream's admission and flush, reduced to the calls that matter here (named
    as upstream's class, which ``install_on`` matches): ``_write_intents`` asks
    ``covered()`` once per pool with keys; the flush refreshes the queue (its
    repairs ask again), then asks once more per head at launch, retiring a covered
    head with ``_drop_queue_head(dropped=False)``; the step hook follows the flush."""

    def __init__(self, cache: Any, feed: wp.WritePath, sidecars: Any = ()) -> None:
        self._cache = NS(storage_existence_cache=cache, sidecar_pool_specs=sidecars)
        self.cache, self.feed = cache, feed
        self.pending_write_queue: list[NS] = []
        self.launched: list[NS] = []

    def _backup_pool_keys(self, snapshot: Any) -> dict[str, list[str]]:
        return dict(snapshot)

    def _write_intents(self, snapshot: Any) -> list[tuple[str, list[str]]]:
        keys = self._backup_pool_keys(snapshot)
        sidecars = {s.pool_name: s.indices_from_pool for s in self._cache.sidecar_pool_specs}
        intents = []
        for pool, k in sorted(keys.items()):
            if pool in sidecars or not k:
                continue
            riders = [n for n, source in sidecars.items() if source == pool and keys.get(n)]
            if not all(self.cache.pool(n).covered(keys[n]) for n in (pool, *riders)):
                intents.append((pool, k))
        return intents

    def enqueue_backup_intent(self, snapshot: dict[str, list[str]]) -> None:
        for pool, keys in self._write_intents(snapshot):
            self.pending_write_queue.append(NS(pool=pool, keys=keys))

    def _refresh_pending_backup_intents(self) -> None:
        for intent in self.pending_write_queue:  # a split repair re-asks
            self._write_intents({intent.pool: intent.keys})

    def _drop_queue_head(self, intent_tokens: int, *, dropped: bool) -> None:
        self.pending_write_queue.pop(0)

    def flush_pending_writes(self, launches: int) -> None:
        """Refresh, then launch up to ``launches`` heads (the rest wait: staging full)."""
        if not self.pending_write_queue:
            return
        around_refresh_pending(type(self)._refresh_pending_backup_intents, self)
        while self.pending_write_queue:
            head = self.pending_write_queue[0]
            if self.cache.pool(head.pool).covered(head.keys):
                around_drop_queue_head(type(self)._drop_queue_head, self, 0, dropped=False)
                continue
            if launches <= 0:
                break
            launches -= 1
            self.cache.pool(head.pool).track_inflight(head.keys)
            self.launched.append(self.pending_write_queue.pop(0))

    def ack_all(self) -> None:
        for intent in self.launched:
            self.cache.pool(intent.pool).untrack_inflight(intent.keys)
            self.cache.pool(intent.pool).add(intent.keys)
        self.launched.clear()

    def step(self) -> None:
        """The step hook after ``check_hicache_events`` (its flush included)."""
        if self.feed.flushed:
            self.feed.flushed_reap(self._cache)


def test_tallied_admissions_are_avoided_once_and_the_flush_counts_none(feed_of) -> None:
    """Without sidecar pools, each covered() True of an admission is that pool's
    avoided pages, counted by the cache itself; the flush's repairs and launch checks
    count nothing (the tally is off from its refresh to the step hook), and a head
    retired at launch counts once, at its retirement."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    p = BufferModePipeline(cache, feed)
    assert feed.tally_admissions(p._cache) and feed.tallies
    a, b = pages("a", 4), pages("b", 3)
    cache.pool("kv").add(a)
    p.enqueue_backup_intent({"kv": a, "swa": a[-1:]})  # kv covered: avoided 4
    p.enqueue_backup_intent({"kv": b})
    assert [(i.pool, len(i.keys)) for i in p.pending_write_queue] == [("swa", 1), ("kv", 3)]
    w = feed.writes.stats()
    assert (w["kv"].avoided, "swa" in w) == (4, False)
    cache.pool("swa").add(a[-1:])  # the swa head became covered while queued
    p.flush_pending_writes(launches=0)  # repairs ask 2x, the launch check 1x: True
    assert feed.flushed and cache.pool("kv").tally is False
    w = feed.writes.stats()
    assert (w["kv"].avoided, w["swa"].avoided) == (4, 1)  # the retirement only
    p.enqueue_backup_intent({"kv": a})  # before the step hook: not possible upstream
    p.step()
    assert not feed.flushed and cache.pool("swa").tally is True
    p.enqueue_backup_intent({"kv": a, "swa": a[-1:]})
    w = feed.writes.stats()
    assert (w["kv"].avoided, w["swa"].avoided) == (8, 2)
    assert feed.errors == 0


def test_a_tree_with_sidecar_pools_gets_the_admission_hooks_on_its_pipeline(feed_of) -> None:
    """Upstream's all() over a driver and its riders stops at the first pool not
    covered, so a covered() True is not one avoided pool there: such a tree keeps
    the tally off, and its pipeline (that instance only) gets the two admission
    hooks, which count a driver avoided only with its riders covered."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    sidecars = [NS(pool_name="idx", indices_from_pool="kv")]
    p = BufferModePipeline(cache, feed, sidecars)
    other = BufferModePipeline(cache, feed, sidecars)
    assert not feed.tally_admissions(p._cache) and not feed.tallies
    done = wh.install_on(p)
    assert done == [f"{wh.PIPELINE}._backup_pool_keys", f"{wh.PIPELINE}._write_intents"]
    assert "_write_intents" in vars(p) and "_write_intents" not in vars(other)
    a = pages("a", 4)
    cache.pool("kv").add(a)
    assert p._write_intents({"kv": a, "idx": a}) == [("kv", a)]  # the rider is not covered
    assert "kv" not in feed.writes.stats() and cache.pool("kv").covered_pages == 0
    cache.pool("idx").add(a)
    assert p._write_intents({"kv": a, "idx": a}) == []
    assert feed.writes.stats()["kv"].avoided == 4  # the driver; its rider has no intent
    other._write_intents({"kv": a, "idx": a})  # not hooked
    assert feed.writes.stats()["kv"].avoided == 4


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "flush", "ack", "step"]),
        st.dictionaries(
            st.sampled_from(["kv", "swa", "mamba"]),
            st.lists(st.integers(0, 11), max_size=5, unique=True),
            max_size=3,
        ),
        st.integers(0, 2),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_the_tally_counts_what_the_admission_hooks_count(ops: list[Any]) -> None:
    """Differential: any sequence of admissions, flushes (some heads left queued),
    acks and steps gives the same avoided pages per pool counted by the cache's
    tally as by the two admission hooks (the accounting of 0.5.22-0.5.23 until now,
    held exact by the real-server tests)."""
    counted = []
    for tallied in (True, False):
        cache = StorageExistenceCache(8)  # small: evictions too
        feed = wp.WritePath(WriteAccounting(), cache)
        wp.attach(feed)
        try:
            p = BufferModePipeline(cache, feed)
            if tallied:
                assert feed.tally_admissions(p._cache)
            else:
                wh.install_on(p)
            for op, keys, launches in ops:
                if op == "admit":
                    p.enqueue_backup_intent({k: [f"{i:064x}" for i in v] for k, v in keys.items()})
                elif op == "flush":
                    p.flush_pending_writes(launches)
                    p.step()  # upstream: the step hook follows every flush
                elif op == "ack":
                    p.ack_all()
            counted.append({k: s.avoided for k, s in feed.writes.stats().items() if s.avoided})
        finally:
            wp.detach()
    assert counted[0] == counted[1]


# -- flat generation (0.5.19 - 0.5.21) -------------------------------------------------
def test_flat_shape_counts_a_node_once_per_insert_walk(feed_of) -> None:
    """covers_all True inside enqueue_backup_intent is avoided, once per node per
    insert walk (0.5.21 presents a node again for each deeper node); launch and
    ack count the node's KV pages."""
    cache = FlatStorageExistenceCache(64)
    feed = feed_of(cache, "flat")
    p = pipeline(cache)
    a = pages("f", 5)
    cache.add("kv", a)
    presented: list[int] = []

    def enqueue(pipe: NS, node_id: int) -> None:
        presented.append(node_id)
        around_flat_covers_all(
            FlatStorageExistenceCache.covers_all, cache, "kv", a, extra_cover=frozenset()
        )

    def insert(tree: Any, params: Any) -> None:
        for node in (1, 1, 1):
            around_enqueue_backup_intent(enqueue, p, node)

    tree = NS(storage_existence_cache=cache)
    around_tree_insert(insert, tree, None)
    assert presented == [1, 1, 1]
    assert feed.writes.stats()["kv"].avoided == 5
    around_tree_insert(insert, tree, None)  # the next walk decides again
    assert feed.writes.stats()["kv"].avoided == 10

    queries = cache.stats()["kv"].queries
    assert cache.believed("kv", [a[1], *pages("0", 1)]) == [a[1]]
    assert cache.believed("swa", a) == [] and cache.stats()["kv"].queries == queries

    b = pages("9", 3)
    intent = NS(snapshot=NS(hash_values=b))
    after_stage_flat(True, p, intent, None, {})  # flat signature
    operation = NS(id=5, hash_value=b, completed_tokens=12, pool_transfers=None)
    around_page_backup(lambda c, op: None, p._cache.cache_controller, operation)
    p.ongoing_backup[5] = NS(intent=intent)  # no keys_by_pool in the flat entry
    around_storage_write_ack(lambda pipe, op_id: None, p, 5)
    kv = feed.writes.stats()["kv"]
    assert (kv.written, kv.acknowledged, kv.failed) == (3, 3, 0)


def test_flat_in_flight_pages_reach_the_reconciler(feed_of) -> None:
    """Seed generation: the pipeline's ``inflight_backup_hashes`` (what it passes
    to ``covers_all``) is what the reconciler reads, through the pool's
    ``inflight_pages()``; none before the first admission or for other pools, and
    a stale verdict past an in-flight page is withheld."""
    from hicache_existence.core.observers import Tee
    from hicache_existence.reconcile.ground_truth import InMemoryGroundTruth
    from hicache_existence.reconcile.reconciler import Reconciler

    tee = Tee()
    cache = FlatStorageExistenceCache(64, observer=tee)
    feed_of(cache, "flat")  # the write path the hooks feed
    truth = InMemoryGroundTruth()
    rec = Reconciler(cache, truth, sampling_rate=1.0, agree_interval_steps=1)
    tee.observers = (rec,)
    p = pipeline(cache)
    p.inflight_backup_hashes = {}
    assert not cache.pool("kv").inflight_pages()
    a, b = pages("a", 2), pages("b", 2)
    cache.add("kv", b)
    truth.record_stored("kv", b)
    intent = NS(snapshot=NS(hash_values=a))
    after_stage_flat(True, p, intent, None, {})
    p.inflight_backup_hashes.update(dict.fromkeys(a, 1))  # upstream's _track_content_refs
    assert cache.covers_all("kv", [*a, *b], extra_cover=p.inflight_backup_hashes)
    assert cache.pool("kv").inflight_pages() is p.inflight_backup_hashes
    assert not cache.pool("swa").inflight_pages()
    for step in range(200):
        rec.apply(step)
        if rec.idle() and rec.snapshot().verdicts_applied:
            break
        threading.Event().wait(0.001)
    assert cache.believed("kv", b) == b
    assert rec.snapshot().invalidations_withheld == {"kv": 1}
    rec.close()


# -- never into the scheduler -------------------------------------------------------------
def test_broken_input_never_raises_and_upstream_runs_once(feed_of) -> None:
    """Hooks facing objects they do not understand count an error, and upstream's
    function still runs exactly once and returns its result."""
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    p = pipeline(cache)
    calls: list[str] = []

    def upstream(*a: Any, **kw: Any) -> str:
        calls.append("x")
        return "result"

    assert after_stage_backup_intent(True, p, NS(), None, [], {"kv": [1, 2]}) is None
    p.ongoing_backup[1] = NS(intent=NS(), keys_by_pool={"kv": None})
    feed._outcomes[1] = wp.Outcome(stored={"kv": 1})  # what a backup would have left
    assert around_storage_write_ack(upstream, p, 1) == "result"
    assert around_page_backup(upstream, p._cache.cache_controller, NS(id=None)) == "result"
    assert calls == ["x", "x"] and feed.errors == 2  # the ack (keys None), the backup (id None)
    other = pipeline(StorageExistenceCache(8))  # not this process's cache: untouched
    assert around_storage_write_ack(upstream, other, 1) == "result"


def _any_target(
    self: Any,
    node_id: Any = None,
    pool: Any = None,
    hashes: Any = None,
    intent: Any = None,
    keys_by_pool: Any = None,
    operation_id: Any = None,
    operation: Any = None,
    key: Any = None,
    keys: Any = None,
    host_indices: Any = None,
    token_ids: Any = None,
    hash_value: Any = None,
    prefix_keys: Any = None,
    extra_pools: Any = None,
    *,
    dropped: bool = True,
) -> None:
    """A stand-in target whose signature has every parameter a hook reads."""


def _registering() -> tuple[list[str], Any, Any]:
    got: list[str] = []
    registry = NS(register=lambda target, fn, kind: got.append(target))
    return got, registry, NS(AROUND="AROUND", AFTER="AFTER")


_CACHE_MODE = (f"{wh.TREE}.write_backup_storage", f"{wh.CONTROLLER}.write_storage")


def test_register_installs_what_resolves() -> None:
    """Optional targets that do not resolve are skipped, each with one warning that
    names it and what stops being counted."""
    got, registry, kinds = _registering()
    said: list[str] = []

    def resolve_without_mooncake(target: str) -> object:
        if "mooncake" in target:
            raise LookupError(target)
        return _any_target

    done = wh.register(registry, kinds, "current", resolve_without_mooncake, said.append)
    assert done == got
    assert not any("mooncake" in t for t in done)
    assert f"{wh.PIPELINE}._refresh_pending_backup_intents" in done
    assert wh.FLAT_COVERS_ALL not in done
    assert f"{wh.PIPELINE}.enqueue_backup_intent" not in done  # the d(d+1)/2 hot call
    # checked, but installed per pipeline (install_on), only where a tree has sidecars
    per_pipeline = {f"{wh.PIPELINE}._write_intents", f"{wh.PIPELINE}._backup_pool_keys"}
    assert {h.target for h in wh.HOOKS if h.per_instance} == per_pipeline
    assert not per_pipeline & set(done)
    assert set(_CACHE_MODE) <= set(done)
    mooncake = [h.target for h in wh.HOOKS if "mooncake" in h.target]
    assert len(said) == len(mooncake) and all(t in m for t, m in zip(mooncake, said))
    assert all("not counted: Mooncake backend" in m for m in said)


def test_a_missing_buffer_mode_target_leaves_cache_mode_counting() -> None:
    """A buffer-mode pipeline method gone (both generations): the buffer-mode
    hooks stay out, the cache-mode ones go in, and each missing target is named
    once with the counters that stop."""
    for generation in ("current", "flat"):
        got, registry, kinds = _registering()
        said: list[str] = []

        def resolve_without_pipeline(target: str) -> object:
            if target.startswith(wh.PIPELINE):
                raise LookupError(target)
            return _any_target

        done = wh.register(registry, kinds, generation, resolve_without_pipeline, said.append)
        assert done == got and set(_CACHE_MODE) <= set(done)
        assert not any(t.startswith(wh.PIPELINE) or t == wh.FLAT_COVERS_ALL for t in done)
        assert f"{wh.TREE}.insert" not in done  # buffer mode's (flat) walk bracket
        assert f"{wh.CONTROLLER}._page_backup" in done  # both modes read the backend
        pipeline = [
            h.target
            for h in wh.HOOKS
            if generation in h.generations and h.target.startswith(wh.PIPELINE)
        ]
        assert len(said) == len(pipeline)
        for target, message in zip(pipeline, said):
            assert message.startswith(target)
            assert "buffer-mode write counters" in message or "counted: buffer mode" in message


def test_a_missing_cache_mode_target_leaves_buffer_mode_counting() -> None:
    """The reverse: ``write_storage`` changed; cache mode is off, with a warning
    naming it, and buffer mode counts as before."""
    _, registry, kinds = _registering()
    said: list[str] = []

    def write_storage_renamed(self: Any, host_indices: Any, token_ids: Any) -> None: ...

    def resolve(target: str) -> object:
        return write_storage_renamed if target.endswith(".write_storage") else _any_target

    done = wh.register(registry, kinds, "current", resolve, said.append)
    assert not any(t in done for t in _CACHE_MODE)
    assert f"{wh.PIPELINE}._drop_queue_head" in done
    assert f"{wh.PIPELINE}.finish_storage_write_ack" in done
    assert len(said) == 2  # the two controllers' write_storage
    assert said[0].startswith(f"{wh.CONTROLLER}.write_storage") and "cache-mode" in said[0]
    assert said[1].startswith(f"{wh.HYBRID_CONTROLLER}.write_storage") and "cache-mode" in said[1]


def test_a_target_both_modes_need_turns_both_off() -> None:
    """``HiCacheController._page_backup`` gives both modes this rank's outcome:
    without it no counter would be right, so none is fed."""
    got, registry, kinds = _registering()
    said: list[str] = []

    def resolve(target: str) -> object:
        if target == f"{wh.CONTROLLER}._page_backup":
            raise LookupError(target)
        return _any_target

    assert wh.register(registry, kinds, "current", resolve, said.append) == [] and got == []
    assert len(said) == 1 and "buffer-mode" in said[0] and "cache-mode" in said[0]


def test_a_target_without_a_named_parameter_counts_as_missing() -> None:
    """Hooks read upstream's arguments by name: a required target whose signature
    lacks the name turns its mode off; an optional one is skipped alone."""
    _, registry, kinds = _registering()
    said: list[str] = []

    def renamed_ack(self: Any, op_id: int) -> None: ...

    def renamed_file_key(self: Any, name: str) -> bool: ...

    def resolve(target: str) -> object:
        if target.endswith(".finish_storage_write_ack"):
            return renamed_ack
        return _any_target

    done = wh.register(registry, kinds, "current", resolve, said.append)
    assert not any(t.startswith(wh.PIPELINE) for t in done) and set(_CACHE_MODE) <= set(done)
    assert len(said) == 1 and "operation_id" in said[0]

    def resolve_file(target: str) -> object:
        return renamed_file_key if target.startswith(wh.FILE_BACKEND) else _any_target

    said.clear()
    done = wh.register(registry, kinds, "current", resolve_file, said.append)
    assert done and not any(t.startswith(wh.FILE_BACKEND) for t in done)
    assert f"{wh.PIPELINE}._drop_queue_head" in done and len(said) == 2
    assert all("has no parameter 'key'" in m and "file backend" in m for m in said)


def test_a_backend_whose_dependency_is_absent_is_dropped_quietly(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """A backend module that is installed but needs a client library this host
    lacks is an optional part of the deployment: a debug line, no warning; a
    target whose module is gone altogether is a change of upstream's: a warning."""
    pkg = tmp_path / "hx_fake_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text("import hx_client_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert wh.targets.dependency_missing("hx_fake_backend.store.Store.put")
    assert not wh.targets.dependency_missing("hx_fake_backend.gone.Store.put")
    assert not wh.targets.dependency_missing("hx_fake_backend.Store.put")


def test_parameters_are_read_by_name_wherever_upstream_puts_them() -> None:
    """A parameter passed by keyword or by position reads the same, and an
    optional one the signature lacks reads as None."""

    def target(
        self: Any, intent: Any, device_value: Any, transfers: Any, keys_by_pool: Any
    ) -> None:
        """upstream's shape"""

    params = wh.Params.bind(target, ("intent", "keys_by_pool", "absent?"))
    intent, keys = params["intent"], params["keys_by_pool"]
    assert intent(("i", None, [], {"kv": []}), {}) == "i"
    assert keys(("i", None, []), {"keys_by_pool": {"kv": []}}) == {"kv": []}
    assert keys(("i", None, [], {"kv": ["a"]}), {}) == {"kv": ["a"]}
    assert params["absent"](("i", None, [], {}), {}) is None
    with pytest.raises(LookupError, match="no parameter 'missing'"):
        wh.Params.bind(target, ("missing",))


def test_every_hook_has_a_docstring() -> None:
    """CONTRIBUTING: every hook says why it is there."""

    names: dict[str, str] = {}
    for h in wh.HOOKS:
        fn = h.bound(_any_target)
        assert fn.__doc__ and fn.__doc__.strip(), h.target
        # the name sglang's hook registry logs: shared only by one method's hooks on
        # two classes (HiCacheController / HybridCacheController)
        method = h.target.rsplit(".", 1)[-1]
        assert names.setdefault(fn.__name__, method) == method, (fn.__name__, h.target)


def test_storage_tier_events_only_at_the_ack_and_only_for_stored_pages(feed_of) -> None:
    """KV events: nothing at the launch; at the storage ack, BlockStored for the
    leading pages this rank's backend stored (2 of 3 here), with their tokens."""
    from hicache_existence.events.emitter import KvEvents
    from hicache_existence.events.wire import Stored, block_hash

    sent: list[Any] = []
    sink = NS(send=lambda ts, events: sent.extend(events), close=lambda: None)
    events = KvEvents(lambda: sink, medium="DISK")  # type: ignore[arg-type,return-value]
    assert events.start()
    cache = StorageExistenceCache(64)
    feed = feed_of(cache, "current")
    feed.events = events
    p = pipeline(cache, {"kv": host(256, 4)})
    a = pages("e", 3)
    key = NS(token_ids=list(range(12)), extra_key=None, cache_salt=None, is_bigram=False)
    snapshot = NS(hash_values=a, key=key, parent_is_root=True, parent_last_hash=None)
    intent = NS(pool="kv", keys=a, snapshot=snapshot)
    after_stage_backup_intent(True, p, intent, None, [], {"kv": a})
    operation = NS(id=12, hash_value=a, completed_tokens=0, pool_transfers=None)

    def page_backup(controller: Any, op: NS) -> None:
        op.completed_tokens = 2 * controller.page_size  # the third page failed

    worker = threading.Thread(
        target=around_page_backup, args=(page_backup, p._cache.cache_controller, operation)
    )
    worker.start()
    worker.join()
    events.close()
    assert sent == []  # launched and written, not acknowledged
    events = KvEvents(lambda: sink, medium="DISK")  # type: ignore[arg-type,return-value]
    assert events.start()
    feed.events = events
    p.ongoing_backup[12] = NS(intent=intent, keys_by_pool={"kv": a})
    around_storage_write_ack(lambda pipe, op_id: pipe.ongoing_backup.pop(op_id), p, 12)
    events.close()
    (event,) = sent
    assert isinstance(event, Stored)
    assert event.block_hashes == (block_hash(a[0]), block_hash(a[1]))
    assert event.token_ids == tuple(range(8)) and event.parent_block_hash is None
    assert feed.errors == 0
