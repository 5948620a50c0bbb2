"""Write accounting fed from SGLang's real buffer-mode write path.

Where each counter is taken (hooks through sglang's ``HookRegistry``; upstream
code is called unchanged, exactly once per call):

* **avoided**, at admission: ``BufferModePipeline._write_intents`` (0.5.22+) drops
  every pool whose keys ``covered()`` (believed stored or in flight); the pools it
  dropped are the avoided pages (the keys come from ``_backup_pool_keys``, which
  it calls first).  ``enqueue_backup_intent`` calls it once per node per insert
  walk, after upstream's own dedupe, so ``enqueue_backup_intent`` itself (called
  d(d+1)/2 times for a depth-d path) is not hooked.  Split repairs in
  ``_refresh_pending_backup_intents`` call ``_write_intents`` too and are not
  counted: one count per admission decision.  A queued intent retired at launch
  because its pool became covered meanwhile (``_drop_queue_head(dropped=False)``)
  is avoided once more, at that decision.  0.5.19-0.5.21 (flat): ``covers_all``
  answering True inside ``enqueue_backup_intent``, at most once per node per
  insert walk.
* **written**, at the D2H launch: ``_stage_backup_intent`` returning True (the
  point where upstream starts tracking the pages in flight); per pool from its
  ``keys_by_pool`` (flat: the node's KV pages).
* **acknowledged / failed**, at the storage ack: ``finish_storage_write_ack``
  (scheduler thread, rank-synchronised drain) with this rank's outcome, which the
  backup thread recorded when ``HiCacheController._page_backup`` returned
  (``completed_tokens`` for KV, per-pool hit counts for the other pools).
* **redundant**, the backend's own answer, observed on the backup thread inside
  the write: the file backend's ``set`` asks its ``exists`` first and skips a
  stored page; Mooncake's ``batch_set_v1`` asks ``batch_is_exist`` and puts only
  missing objects.  Other backends give no answer: their redundant writes stay 0.
  **redundant_believed**: redundant pages that were believed stored when the
  write launched (read without touching the LRU), e.g. a node spanning believed
  and new pages is written whole.

The scheduler thread does no I/O here: the backup thread hands its outcome over
through a dict keyed by operation id, written before upstream puts the
operation on its ack queue.  Every hook calls upstream first or last, outside
its own ``try``; nothing of ours raises into sglang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.integrations.sglang.process import PROCESS

logger = logging.getLogger("hicache_existence.integrations.sglang")

_MM = "sglang.srt.mem_cache"
PIPELINE = f"{_MM}.buffer_mode.pipeline.BufferModePipeline"
TREE = f"{_MM}.unified_radix_cache.UnifiedRadixCache"
CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"
HYBRID_CONTROLLER = f"{_MM}.hybrid_cache.hybrid_cache_controller.HybridCacheController"
FILE_BACKEND = f"{_MM}.hicache_storage.HiCacheFile"
MOONCAKE_BACKEND = f"{_MM}.storage.mooncake_store.mooncake_store.MooncakeStore"
FLAT_COVERS_ALL = "hicache_existence.core.flat.FlatStorageExistenceCache.covers_all"

#: Outcomes or launch notes kept for operations whose ack never came (a reset).
_MAX_PENDING = 65536

_FEEDS: dict[int, WritePath] = {}
_TLS = threading.local()


def _name(pool: object) -> str:
    """``PoolName.KV`` -> ``"kv"`` (str enums), plain strings unchanged."""
    return str.__str__(pool) if isinstance(pool, str) else str(pool)


@dataclass
class Outcome:
    """One storage operation on this rank: pages stored / not stored per pool,
    and the keys the backend said it already held."""

    stored: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    existed: dict[str, set[str]] = field(default_factory=dict)


class _Collect:
    """What the backup thread learns inside one ``_page_backup`` call."""

    __slots__ = ("existed", "probe", "answer", "batch_pages")

    def __init__(self) -> None:
        self.existed: dict[str, set[str]] = {}
        self.probe: str | None = None
        self.answer: bool | None = None
        self.batch_pages: list[str] | None = None

    def saw(self, storage_key: str) -> None:
        page, _, pool = storage_key.partition(".")
        self.existed.setdefault(pool or "kv", set()).add(page)


class WritePath:
    """The write accounting of one scheduler process, fed by the hooks below."""

    def __init__(self, writes: WriteAccounting, cache: Any, generation: str) -> None:
        self.writes = writes
        self.cache = cache
        self.generation = generation
        self.controller: Any = None
        #: The pipeline of the first launch (its in-flight set, seed generation).
        self.pipeline: Any = None
        self.errors = 0
        self._admitting = 0
        self._refreshing = 0
        self._pool_keys: Mapping[Any, list[str]] | None = None
        self._walk: set[Any] | None = None
        self._count_cover = True
        self._sized: set[str] = set()
        self._outcomes: dict[int, Outcome] = {}
        self._believed: dict[int, dict[str, set[str]]] = {}

    # -- admission -------------------------------------------------------------
    def admitted(
        self, pipeline: Any, pool_keys: Mapping[Any, list[str]], intents: Iterable[Any]
    ) -> None:
        """Pools of ``pool_keys`` that ``_write_intents`` left out were covered."""
        kept = {_name(pool) for pool, _ in intents}
        keys = {_name(p): k for p, k in pool_keys.items() if k}
        sidecars = {
            _name(spec.pool_name): _name(spec.indices_from_pool)
            for spec in getattr(pipeline._cache, "sidecar_pool_specs", None) or ()
        }
        for pool, pages in keys.items():
            driver = sidecars.get(pool, pool)
            if driver in keys and driver not in kept:
                self.writes.avoided(pool, len(pages))

    # -- launch ------------------------------------------------------------------
    def launched(self, pipeline: Any, intent: Any, keys_by_pool: Mapping[Any, list[str]]) -> None:
        """The D2H launch of an admitted intent: its pages are written."""
        if self.controller is None:
            self.controller = pipeline._cache.cache_controller
            self.pipeline = pipeline
        notes: dict[str, set[str]] = {}
        for pool, keys in keys_by_pool.items():
            name = _name(pool)
            if name not in self._sized:
                self._size(name)
            self.writes.written(name, len(keys))
            believed = self._believed_keys(name, keys)
            if believed:
                notes[name] = believed
        if notes:
            if len(self._believed) >= _MAX_PENDING:
                self._believed.pop(next(iter(self._believed)))
            self._believed[id(intent)] = notes

    def inflight_pages(self, pool: str) -> Container[str] | None:
        """The seed generation's pages between D2H launch and storage ack: the
        pipeline's ``inflight_backup_hashes`` (refcounts, KV only; the same set
        it passes to ``covers_all`` as ``extra_cover``).  The reconciler reads
        it so that a verdict never acts on a page still being written."""
        if pool != "kv" or self.pipeline is None:
            return None
        refs = getattr(self.pipeline, "inflight_backup_hashes", None)
        return refs if isinstance(refs, Container) else None

    def _believed_keys(self, pool: str, keys: list[str]) -> set[str]:
        pool_of = getattr(self.cache, "pool", None)
        if pool_of is None:  # flat generation: one index, tagged by pool
            return set(self.cache.believed(pool, keys))
        return set(pool_of(pool).believed(keys))

    def _size(self, pool: str) -> None:
        """Bytes of one page of ``pool`` on this rank, from the host pool layout."""
        self._sized.add(pool)
        host = getattr(self.controller, "mem_pool_host", None)
        entry_map = getattr(host, "entry_map", None)
        pool_host = host
        if isinstance(entry_map, Mapping):
            entry = next((e for n, e in entry_map.items() if _name(n) == pool), None)
            pool_host = getattr(entry, "host_pool", None) if entry is not None else None
        elif pool != "kv":
            pool_host = None
        per_token = getattr(pool_host, "size_per_token", None)
        page_size = getattr(pool_host, "page_size", None)
        if isinstance(per_token, int) and isinstance(page_size, int) and per_token > 0:
            self.writes.set_page_size(pool, per_token * page_size)

    # -- backup thread -------------------------------------------------------------
    def finished(self, controller: Any, operation: Any, collect: _Collect) -> None:
        """Backup thread: this rank's outcome of one storage operation."""
        out = Outcome(existed=collect.existed)
        page_size = int(getattr(controller, "page_size", 0) or 0)
        kv_pages = len(getattr(operation, "hash_value", None) or ())
        if kv_pages and page_size and not getattr(controller, "backup_skip", False):
            ok = min(kv_pages, int(operation.completed_tokens) // page_size)
            out.stored["kv"] = ok
            out.failed["kv"] = kv_pages - ok
        result = getattr(operation, "pool_storage_result", None)
        hits = getattr(result, "extra_pool_hit_pages", None) or {}
        should = getattr(controller, "should_backup", None)
        for transfer in getattr(operation, "pool_transfers", None) or ():
            name = _name(transfer.name)
            expected = len(transfer.keys or ())
            if not expected or (should is not None and not should(transfer)):
                continue
            ok = min(expected, int(hits.get(transfer.name, hits.get(name, 0)) or 0))
            out.stored[name] = out.stored.get(name, 0) + ok
            out.failed[name] = out.failed.get(name, 0) + expected - ok
        outcomes = self._outcomes
        if len(outcomes) >= _MAX_PENDING:
            outcomes.pop(next(iter(outcomes)), None)
        outcomes[int(operation.id)] = out

    # -- storage ack -----------------------------------------------------------------
    def acked(self, entry: Any, outcome: Outcome | None) -> None:
        """Scheduler thread, at the storage ack of a write this pipeline owns."""
        notes = self._believed.pop(id(entry.intent), {})
        if outcome is None:  # this rank wrote nothing (e.g. an MLA non-writer rank)
            return
        keys_by_pool = getattr(entry, "keys_by_pool", None)
        if keys_by_pool is None:  # flat generation: the node's KV pages
            keys_by_pool = {"kv": entry.intent.snapshot.hash_values}
        for pool, keys in keys_by_pool.items():
            name = _name(pool)
            if name not in outcome.stored:
                continue
            stored = outcome.stored[name]
            existed = outcome.existed.get(name, set()).intersection(keys)
            already = min(len(existed), stored)
            believed = min(len(existed & notes.get(name, set())), already)
            self.writes.acked(name, stored, outcome.failed.get(name, 0), already, believed)

    # -- errors -------------------------------------------------------------------------
    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= 3 or self.errors % 1000 == 0:
            logger.warning("hicache-existence: write accounting skipped an event: %r", exc)


def attach(feed: WritePath) -> None:
    """Make ``feed`` this process's write path (the hooks look it up)."""
    _FEEDS[PROCESS.pid] = feed


def detach() -> None:
    _FEEDS.pop(PROCESS.pid, None)


def current() -> WritePath | None:
    return _FEEDS.get(PROCESS.pid)


def _owned(pipeline: Any) -> WritePath | None:
    feed = _FEEDS.get(PROCESS.pid)
    if feed is None:
        return None
    cache = getattr(getattr(pipeline, "_cache", None), "storage_existence_cache", None)
    return feed if cache is feed.cache else None


def _guard(feed: WritePath, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # accounting never raises into the scheduler
        feed.error(exc)


# -- hooks: admission ------------------------------------------------------------------
def around_enqueue_backup_intent(
    original: Callable[..., Any], pipeline: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``enqueue_backup_intent`` (flat generation): marks an admission
    decision, at most once per node per insert walk."""
    feed = _owned(pipeline)
    if feed is None:
        return original(pipeline, *a, **kw)
    walk = feed._walk
    node_id = a[0] if a else kw.get("node_id")
    feed._count_cover = True
    if walk is not None:  # flat: count a node once per insert walk
        try:
            feed._count_cover = node_id not in walk
            walk.add(node_id)
        except TypeError:
            pass
    feed._admitting += 1
    try:
        return original(pipeline, *a, **kw)
    finally:
        feed._admitting -= 1
        feed._pool_keys = None


def around_refresh_pending(original: Callable[..., Any], pipeline: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``_refresh_pending_backup_intents``: its split repairs re-examine
    admitted intents through ``_write_intents``; they are not new decisions."""
    feed = _FEEDS.get(PROCESS.pid)
    if feed is None:
        return original(pipeline, *a, **kw)
    feed._refreshing += 1
    try:
        return original(pipeline, *a, **kw)
    finally:
        feed._refreshing -= 1


def after_backup_pool_keys(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
    """AFTER ``_backup_pool_keys`` (called by ``_write_intents`` only): the keys
    the decision is about."""
    feed = _FEEDS.get(PROCESS.pid)
    if feed is not None and not feed._refreshing:
        feed._pool_keys = result
    return None


def around_write_intents(original: Callable[..., Any], pipeline: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``_write_intents``: outside a queue refresh it is an admission
    (``enqueue_backup_intent`` calls it once per node per insert walk, after
    upstream's own dedupe), and the pools it left out were covered: avoided."""
    intents = original(pipeline, *a, **kw)
    feed = _FEEDS.get(PROCESS.pid)
    if feed is not None and feed._pool_keys is not None:
        pool_keys, feed._pool_keys = feed._pool_keys, None
        if not feed._refreshing and _owned(pipeline) is feed:
            _guard(feed, lambda: feed.admitted(pipeline, pool_keys, intents))
    return intents


def around_drop_queue_head(original: Callable[..., Any], pipeline: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``_drop_queue_head``: ``dropped=False`` retires a queued intent whose
    pool became covered before its launch (avoided at that decision)."""
    feed = _owned(pipeline)
    head = None
    if feed is not None and kw.get("dropped", True) is False:
        queue = getattr(pipeline, "pending_write_queue", None)
        head = queue[0] if queue else None
    result = original(pipeline, *a, **kw)
    if feed is not None and head is not None:
        _guard(feed, lambda: feed.writes.avoided(_name(head.pool), len(head.keys)))
    return result


def around_flat_covers_all(original: Callable[..., Any], cache: Any, *a: Any, **kw: Any) -> Any:
    """AROUND our flat cache's ``covers_all``: True inside an admission is avoided."""
    covered = original(cache, *a, **kw)
    feed = _FEEDS.get(PROCESS.pid)
    counting = feed is not None and feed._admitting and feed._count_cover
    if covered and counting and feed is not None and cache is feed.cache:
        feed._count_cover = False
        pool = a[0] if a else kw.get("pool")
        hashes = a[1] if len(a) > 1 else kw.get("hashes", ())
        _guard(feed, lambda: feed.writes.avoided(_name(pool), len(hashes)))
    return covered


def around_tree_insert(original: Callable[..., Any], tree: Any, *a: Any, **kw: Any) -> Any:
    """AROUND ``UnifiedRadixCache.insert`` (flat): one insert walk."""
    feed = _FEEDS.get(PROCESS.pid)
    if feed is None or getattr(tree, "storage_existence_cache", None) is not feed.cache:
        return original(tree, *a, **kw)
    outer, feed._walk = feed._walk, set()
    try:
        return original(tree, *a, **kw)
    finally:
        feed._walk = outer


# -- hooks: launch and ack --------------------------------------------------------------------
def after_stage_backup_intent(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
    """AFTER ``_stage_backup_intent``: True = the D2H launch of the intent's pages."""
    if result is not True:
        return None
    feed = _owned(pipeline)
    if feed is None:
        return None
    intent: Any = a[0] if a else kw.get("intent")
    keys: Any = a[3] if len(a) > 3 else kw.get("keys_by_pool")

    def launched() -> None:
        by_pool = keys if isinstance(keys, Mapping) else {"kv": intent.snapshot.hash_values}
        feed.launched(pipeline, intent, by_pool)  # flat generation: the node's KV pages

    _guard(feed, launched)
    return None


def around_storage_write_ack(
    original: Callable[..., Any], pipeline: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``finish_storage_write_ack``: this rank's outcome of the write."""
    feed = _owned(pipeline)
    if feed is None:
        return original(pipeline, *a, **kw)
    op_id: Any = a[0] if a else kw.get("operation_id")
    entry = None
    outcome = None
    try:
        entry = pipeline.ongoing_backup.get(op_id)
        outcome = feed._outcomes.pop(op_id, None)
    except Exception as exc:
        feed.error(exc)
    result = original(pipeline, *a, **kw)
    if entry is not None:
        _guard(feed, lambda: feed.acked(entry, outcome))
    return result


# -- hooks: the backup thread -------------------------------------------------------------------
def around_page_backup(
    original: Callable[..., Any], controller: Any, operation: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``_page_backup`` (backup thread): collect the backend's existence
    answers during the write, then hand this rank's outcome to the scheduler."""
    feed = _FEEDS.get(PROCESS.pid)
    if feed is None or controller is not feed.controller or getattr(_TLS, "collect", None):
        return original(controller, operation, *a, **kw)
    collect = _TLS.collect = _Collect()
    try:
        return original(controller, operation, *a, **kw)
    finally:
        _TLS.collect = None
        _guard(feed, lambda: feed.finished(controller, operation, collect))


def around_file_set(
    original: Callable[..., Any], backend: Any, key: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``HiCacheFile.set``: it asks ``exists`` first and skips a stored page."""
    collect = getattr(_TLS, "collect", None)
    if collect is None or not isinstance(key, str):
        return original(backend, key, *a, **kw)
    collect.probe, collect.answer = key, None
    try:
        ok = original(backend, key, *a, **kw)
    finally:
        collect.probe = None
    if ok and collect.answer:
        collect.saw(key)
    return ok


def around_file_exists(
    original: Callable[..., Any], backend: Any, key: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``HiCacheFile.exists``: the answer ``set`` acts on."""
    answer = original(backend, key, *a, **kw)
    collect = getattr(_TLS, "collect", None)
    if collect is not None and collect.probe is not None and key == collect.probe:
        collect.answer = bool(answer)
    return answer


def around_mooncake_batch_set_v1(
    original: Callable[..., Any], backend: Any, keys: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``MooncakeStore.batch_set_v1``: it asks ``batch_is_exist`` and puts
    only missing objects."""
    collect = getattr(_TLS, "collect", None)
    if collect is None:
        return original(backend, keys, *a, **kw)
    collect.batch_pages = list(keys)
    try:
        return original(backend, keys, *a, **kw)
    finally:
        collect.batch_pages = None


def around_mooncake_batch_exist(
    original: Callable[..., Any], backend: Any, key_strs: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND ``MooncakeStore._batch_exist``: a page existed when all of its
    objects did (objects are laid out page by page)."""
    answer = original(backend, key_strs, *a, **kw)
    collect: _Collect | None = getattr(_TLS, "collect", None)
    pages = collect.batch_pages if collect is not None else None
    if collect is not None and pages:
        collect.batch_pages = None  # only the write's own query
        try:
            per = len(answer) // len(pages)
            for i, page in enumerate(pages):
                if per and all(int(s) == 1 for s in answer[i * per : (i + 1) * per]):
                    collect.existed.setdefault("kv", set()).add(page)
        except Exception:
            pass
    return answer


#: (target, hook, hook type name, generations): what ``register`` installs.
HOOKS: tuple[tuple[str, Callable[..., Any], str, tuple[str, ...]], ...] = (
    (f"{PIPELINE}.enqueue_backup_intent", around_enqueue_backup_intent, "AROUND", ("flat",)),
    (
        f"{PIPELINE}._refresh_pending_backup_intents",
        around_refresh_pending,
        "AROUND",
        ("current",),
    ),
    (f"{PIPELINE}._backup_pool_keys", after_backup_pool_keys, "AFTER", ("current",)),
    (f"{PIPELINE}._write_intents", around_write_intents, "AROUND", ("current",)),
    (f"{PIPELINE}._drop_queue_head", around_drop_queue_head, "AROUND", ("current",)),
    (FLAT_COVERS_ALL, around_flat_covers_all, "AROUND", ("flat",)),
    (f"{TREE}.insert", around_tree_insert, "AROUND", ("flat",)),
    (f"{PIPELINE}._stage_backup_intent", after_stage_backup_intent, "AFTER", ("current", "flat")),
    (
        f"{PIPELINE}.finish_storage_write_ack",
        around_storage_write_ack,
        "AROUND",
        ("current", "flat"),
    ),
    (f"{CONTROLLER}._page_backup", around_page_backup, "AROUND", ("current", "flat")),
    (f"{HYBRID_CONTROLLER}._page_backup", around_page_backup, "AROUND", ("current", "flat")),
    (f"{FILE_BACKEND}.set", around_file_set, "AROUND", ("current", "flat")),
    (f"{FILE_BACKEND}.exists", around_file_exists, "AROUND", ("current", "flat")),
    (
        f"{MOONCAKE_BACKEND}.batch_set_v1",
        around_mooncake_batch_set_v1,
        "AROUND",
        ("current", "flat"),
    ),
    (
        f"{MOONCAKE_BACKEND}._batch_exist",
        around_mooncake_batch_exist,
        "AROUND",
        ("current", "flat"),
    ),
)

#: Targets without which nothing is counted (the rest are per backend or per shape).
REQUIRED: frozenset[str] = frozenset(
    {
        f"{PIPELINE}._write_intents",
        f"{PIPELINE}._refresh_pending_backup_intents",
        f"{PIPELINE}.enqueue_backup_intent",
        FLAT_COVERS_ALL,
        f"{PIPELINE}._stage_backup_intent",
        f"{PIPELINE}.finish_storage_write_ack",
    }
)


def register(
    registry: Any, hook_type: Any, generation: str, resolve: Callable[[str], object]
) -> list[str]:
    """Register the write-path hooks the installed sglang has, for ``generation``.

    Returns the targets registered; none when a required one is missing (the
    write counters then stay 0, as before).  A backend module that does not
    import (Mooncake without its client) only drops that backend's hooks."""
    chosen = [h for h in HOOKS if generation in h[3]]
    present: list[tuple[str, Callable[..., Any], str, tuple[str, ...]]] = []
    for hook in chosen:
        try:
            resolve(hook[0])
        except Exception:
            if hook[0] in REQUIRED:
                logger.warning(
                    "hicache-existence: %s is missing; write accounting is not fed", hook[0]
                )
                return []
            continue
        present.append(hook)
    for target, fn, kind, _gens in present:
        registry.register(target, fn, getattr(hook_type, kind))
    return [target for target, *_ in present]
