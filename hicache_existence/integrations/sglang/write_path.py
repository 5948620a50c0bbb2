"""Write accounting of one scheduler process, fed from SGLang's real L3 write path.

``WritePath`` turns what the hooks (``write_hooks``) learn between a write's
decision, launch and storage ack into ``WriteAccounting`` calls; the hooks only
read upstream's arguments and call its methods.  Where each counter is taken, per
host memory mode and API generation: docs/metrics.md, "Write accounting".

The scheduler thread does no I/O here: the backup thread hands its outcome over
through a dict keyed by operation id, written before upstream queues the ack.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_existence.accounting.causes import CauseTracker, Remembers
from hicache_existence.accounting.recorder import Recorder
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.events.emitter import KvEvents
from hicache_existence.integrations.sglang import kv_events
from hicache_existence.integrations.sglang.cache_mode import (
    CacheModeWrites,
    WritePlan,
    account_ack,
    pool_name,
)
from hicache_existence.integrations.sglang.process import PROCESS

logger = logging.getLogger("hicache_existence.integrations.sglang")

#: Outcomes or launch notes kept for operations whose ack never came (a reset).
MAX_PENDING = 65536


@dataclass
class Outcome:
    """One storage operation on this rank: pages stored / not stored per pool,
    and the keys the backend said it already held."""

    stored: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    existed: dict[str, set[str]] = field(default_factory=dict)


class BackendAnswers:
    """What the backup thread learns inside one ``_page_backup`` call: the pages
    the backend said it already held, and the probe in progress."""

    __slots__ = ("existed", "probe", "answer", "batch_spans")

    def __init__(self) -> None:
        self.existed: dict[str, set[str]] = {}
        #: The file backend's key whose ``set`` is asking ``exists`` right now.
        self.probe: str | None = None
        self.answer: bool | None = None
        #: Mooncake: (pool, pages, objects per page; ``None``: as the answer has) of
        #: the ``batch_set`` whose existence query is next.
        self.batch_spans: list[tuple[str, list[str], int | None]] | None = None

    def saw(self, storage_key: str) -> None:
        """The backend held ``storage_key`` (``<page>`` or ``<page>.<pool>``)."""
        page, _, pool = storage_key.partition(".")
        self.existed.setdefault(pool or "kv", set()).add(page)

    def saw_page(self, pool: str, page: str) -> None:
        self.existed.setdefault(pool, set()).add(page)


class WritePath:
    """The write accounting of one scheduler process, fed by ``write_hooks``."""

    def __init__(
        self,
        writes: WriteAccounting,
        cache: ExistenceCache,
        *,
        cache_mode: bool = False,
        dedup: bool = False,
        upstream_dedup: bool = False,
        remembers: Remembers | None = None,
    ) -> None:
        self.writes = writes
        self.cache = cache
        self.causes = CauseTracker(remembers)
        #: The cache-mode write path (``None``: buffer mode).
        self.cache_mode: CacheModeWrites | None = (
            CacheModeWrites(
                writes,
                cache,
                dedup=dedup,
                upstream_dedup=upstream_dedup,
                causes=self.causes,
                size_pool=self._size,
            )
            if cache_mode
            else None
        )
        #: The trace recorder (``attach_recorder``; ``None``: not recording).
        self.recorder: Recorder | None = None
        #: Storage-tier KV events (``None``: off, or another rank publishes).
        self.events: KvEvents | None = None
        #: The controller whose backup thread writes this cache's pages (first launch).
        self.controller: Any = None
        #: Hook failures.
        self.errors = 0
        self._errors_lock = threading.Lock()
        self._admitting = 0
        #: Queue refreshes running (their ``_write_intents`` calls are repairs).
        self.refreshing = 0
        #: Whether the cache's ``covered()`` tally counts admissions (``tally_admissions``).
        self.tallies = False
        #: Not empty from a flush's queue refresh to the step hook after it, which
        #: then calls ``flushed_reap`` (the step hook's ``pending`` in buffer mode).
        self.flushed: list[None] = []
        #: What ``_backup_pool_keys`` answered for the admission being decided
        #: (the AFTER hook sets it outside a refresh; ``admission`` takes it).
        self.pool_keys: Mapping[Any, list[str]] | None = None
        #: The tree whose sidecar pools (pool -> its driver) ``_sidecars`` holds.
        self._sidecar_tree: Any = None
        self._sidecars: dict[str, str] = {}
        self._walk: set[Any] | None = None
        self._count_cover = True
        self._sized: set[str] = set()
        self._outcomes: dict[int, Outcome] = {}
        self._believed: dict[int, dict[str, set[str]]] = {}
        self._backup = threading.local()
        #: A fully believed node write's empty host indices, per controller: one slice,
        #: reused (a tensor slice per node write is a trip through torch's dispatcher).
        self._empty_host: tuple[Any, Any] | None = None

    def attach_recorder(self, recorder: Recorder | None) -> None:
        """Record this path's writes and prefetch hit queries in ``recorder``."""
        self.recorder = recorder
        if self.cache_mode is not None:
            self.cache_mode.recorder = recorder

    # -- ownership -------------------------------------------------------------------
    def owns_tree(self, tree: Any) -> bool:
        """Whether ``tree`` holds this process's cache."""
        return getattr(tree, "storage_existence_cache", None) is self.cache

    # -- admission (current generation) -------------------------------------------------
    def tally_admissions(self, tree: Any) -> bool:
        """Count the admissions of ``tree`` from the cache's ``covered()`` tally;
        False (nothing changed) for a tree with sidecar pools.  Upstream asks
        ``covered()`` in an admission's ``_write_intents`` (once per pool with keys,
        True leaving that pool out) and inside ``flush_pending_writes``: so the tally,
        off from the flush's queue refresh to the step hook after it, is exactly the
        admissions' avoided pages."""
        if getattr(tree, "sidecar_pool_specs", None):
            return False
        self.tallies = True
        self.writes.avoided_from(self._tally)
        self.cache.tally_covered(True)
        return True

    def _tally(self) -> list[tuple[str, int]]:
        """Each pool's tallied pages (any thread: a tuple of pools, then ints)."""
        return [(p.name, p.covered_pages) for p in self.cache.pools()]

    def flushed_reap(self, tree: Any) -> None:
        """The step hook after a flush (``flushed`` is filled only while tallying):
        admissions come next."""
        self.flushed.clear()
        self.cache.tally_covered(True)

    def begin_refresh(self) -> None:
        """A queue refresh starts: its ``_write_intents`` calls are split repairs,
        and the flush it opens asks ``covered()`` at launch (not admissions)."""
        self.refreshing += 1
        if self.tallies and not self.flushed:
            self.cache.tally_covered(False)
            self.flushed.append(None)

    def end_refresh(self) -> None:
        self.refreshing -= 1

    def admission(self, pipeline: Any, intents: list[Any]) -> None:
        """``_write_intents`` returned ``intents`` on a tree with sidecar pools (the
        only trees whose pipeline has this hook): outside a queue refresh, for this
        cache's pipeline, a pool with noted keys left out because its driver pool was
        covered is avoided."""
        pool_keys = self.pool_keys
        if pool_keys is None:
            return
        self.pool_keys = None
        if self.refreshing:
            return
        tree = getattr(pipeline, "_cache", None)
        if getattr(tree, "storage_existence_cache", None) is not self.cache:  # owns_tree
            return  # (inline: no frame per admission)
        if tree is not self._sidecar_tree:
            self._sidecar_tree = tree
            self._sidecars = {
                pool_name(spec.pool_name): pool_name(spec.indices_from_pool)
                for spec in getattr(tree, "sidecar_pool_specs", None) or ()
            }
        kept = {pool_name(pool) for pool, _ in intents}
        keys = {pool_name(p): k for p, k in pool_keys.items() if k}
        for pool, pages in keys.items():
            driver = self._sidecars.get(pool, pool)
            if driver in keys and driver not in kept:
                self.writes.avoided(pool, len(pages))

    def retired(self, pool: Any, keys: list[str], tree: Any = None) -> None:
        """A queued intent retired at launch because its pool became covered
        (upstream also retires a head with nothing left to write, e.g. an SWA
        window gone from the device: not covered, so not avoided), with its riding
        sidecar pools covered too (upstream writes them under the same keys).
        Read without touching the LRU or counting a lookup."""
        name = pool_name(pool)
        if not self._covered_now(name, keys):
            return
        self.writes.avoided(name, len(keys))
        for spec in getattr(tree, "sidecar_pool_specs", None) or ():
            if pool_name(spec.indices_from_pool) != name:
                continue
            rider = pool_name(spec.pool_name)
            if self._covered_now(rider, keys):
                self.writes.avoided(rider, len(keys))

    def _covered_now(self, name: str, keys: list[str]) -> bool:
        view = self.cache.pool(name)
        believed = set(view.believed(keys))
        inflight = view.inflight_pages()
        return all(k in believed or k in inflight for k in keys)

    # -- admission (flat generation) ----------------------------------------------------
    def begin_walk(self) -> set[Any] | None:
        """An insert walk starts; returns the enclosing walk for ``end_walk``."""
        outer, self._walk = self._walk, set()
        return outer

    def end_walk(self, outer: set[Any] | None) -> None:
        self._walk = outer

    def begin_admission(self, node_id: Any) -> None:
        """``enqueue_backup_intent(node_id)`` starts: its ``covers_all`` counts once
        per node per insert walk."""
        self._count_cover = True
        walk = self._walk
        if walk is not None:
            try:
                self._count_cover = node_id not in walk
                walk.add(node_id)
            except TypeError:  # an unhashable node id: count every decision
                self._count_cover = True
        self._admitting += 1

    def end_admission(self) -> None:
        self._admitting -= 1
        self.pool_keys = None

    def covered_in_admission(self, pool: Any, hashes: Any) -> None:
        """``covers_all`` answered True: avoided, if it is this admission's first."""
        if self._admitting and self._count_cover:
            self._count_cover = False
            self.writes.avoided(pool_name(pool), len(hashes))

    # -- launch ------------------------------------------------------------------------
    def launched(self, pipeline: Any, intent: Any, keys_by_pool: Mapping[Any, list[str]]) -> None:
        """The D2H launch of an admitted intent: its pages are written."""
        if self.controller is None:
            self.controller = pipeline._cache.cache_controller
            if self.recorder is not None:
                self.recorder.set_page_size(int(getattr(self.controller, "page_size", 0) or 0))
        notes: dict[str, set[str]] = {}
        for pool, keys in keys_by_pool.items():
            name = pool_name(pool)
            if name not in self._sized:
                self._size(name)
            self.writes.written(name, len(keys))
            if self.recorder is not None:
                self.recorder.written(name, keys)
            believed = set(self.cache.pool(name).believed(keys))
            if believed:
                notes[name] = believed
            if name == "kv":
                self.causes.launched(_node_of(intent), keys)
        if notes:
            if len(self._believed) >= MAX_PENDING:
                self._believed.pop(next(iter(self._believed)))
            self._believed[id(intent)] = notes

    def _size(self, pool: str) -> None:
        """Bytes of one page of ``pool`` on this rank, from the host pool layout."""
        self._sized.add(pool)
        host = getattr(self.controller, "mem_pool_host", None)
        entry_map = getattr(host, "entry_map", None)
        pool_host = host
        if isinstance(entry_map, Mapping):
            entry = next((e for n, e in entry_map.items() if pool_name(n) == pool), None)
            pool_host = getattr(entry, "host_pool", None) if entry is not None else None
        elif pool != "kv":
            pool_host = None
        per_token = getattr(pool_host, "size_per_token", None)
        page_size = getattr(pool_host, "page_size", None)
        if isinstance(per_token, int) and isinstance(page_size, int) and per_token > 0:
            self.writes.set_page_size(pool, per_token * page_size)

    # -- backup thread -------------------------------------------------------------------
    def begin_backup(self, controller: Any) -> BackendAnswers | None:
        """``_page_backup`` starts on this thread: collect the backend's answers
        (``None``: not this cache's controller, or already collecting)."""
        if controller is not self.controller or getattr(self._backup, "answers", None):
            return None
        answers = self._backup.answers = BackendAnswers()
        return answers

    def collecting(self) -> BackendAnswers | None:
        """The answers being collected on this thread, if a backup is running."""
        answers: BackendAnswers | None = getattr(self._backup, "answers", None)
        return answers

    def end_backup(self, controller: Any, operation: Any, answers: BackendAnswers) -> None:
        """Backup thread: this rank's outcome of one storage operation."""
        self._backup.answers = None
        out = Outcome(existed=answers.existed)
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
            name = pool_name(transfer.name)
            expected = len(transfer.keys or ())
            if not expected or (should is not None and not should(transfer)):
                continue
            ok = min(expected, int(hits.get(transfer.name, hits.get(name, 0)) or 0))
            out.stored[name] = out.stored.get(name, 0) + ok
            out.failed[name] = out.failed.get(name, 0) + expected - ok
        outcomes = self._outcomes
        if len(outcomes) >= MAX_PENDING:
            outcomes.pop(next(iter(outcomes)), None)
        outcomes[int(operation.id)] = out

    # -- storage ack -----------------------------------------------------------------------
    def take_outcome(self, operation_id: Any) -> Outcome | None:
        """This rank's outcome of ``operation_id`` (once), if its backup recorded one."""
        return self._outcomes.pop(operation_id, None)

    def acked(self, entry: Any, outcome: Outcome | None) -> None:
        """Scheduler thread, at the storage ack of a write this pipeline owns."""
        notes = self._believed.pop(id(entry.intent), {})
        if outcome is None:  # this rank wrote nothing (e.g. an MLA non-writer rank)
            return
        keys_by_pool = getattr(entry, "keys_by_pool", None)
        if keys_by_pool is None:  # flat generation: the node's KV pages
            keys_by_pool = {"kv": entry.intent.snapshot.hash_values}
        node = _node_of(entry.intent)
        for pool, keys in keys_by_pool.items():
            name = pool_name(pool)
            if name not in outcome.stored:
                continue
            noted = notes.get(name, set())
            # The admission decided: believed pages were held, yet written.
            account_ack(self.writes, self.causes, name, keys, outcome, node, noted, noted)
            if name == "kv":  # buffer mode keeps no node record (no host copy to lose)
                self.causes.stored(None, keys)
                if self.events is not None:  # the stored pages, leading ones (end_backup)
                    kv_events.feed(self.events, entry.intent, keys, outcome.stored[name])

    # -- cache mode ------------------------------------------------------------------------
    def cache_write_changes(
        self, plan: WritePlan, controller: Any, host_indices: Any, token_ids: Any, prefix_keys: Any
    ) -> tuple[WritePlan, dict[str, Any]]:
        """The ``write_storage`` arguments a plan (``CacheModeWrites.plan``) not
        written whole changes (and the plan, made whole when the host indices do not
        span its pages)."""
        pages = plan.pages
        page = int(getattr(controller, "page_size", 0) or 0)
        shape = getattr(host_indices, "shape", None)  # a tensor's ``len`` is Python code
        size = shape[0] if shape else len(host_indices)
        keep = plan.keep
        if keep is None or page <= 0 or size != len(pages) * page:  # written whole
            return plan._replace(keep=None, extra_written=True), {}
        more: dict[str, Any] = {}  # extra pools dropped, prefix keys advanced
        if not keep:  # every page believed: an empty write, no gather
            empty = self._empty_host
            if empty is None or empty[0] is not controller:
                empty = self._empty_host = (controller, host_indices[:0])
            host, tokens, hashes = empty[1], token_ids[:0], []
            if not plan.extra_written:
                more["extra_pools"] = None
        elif keep == list(range(keep[0], len(pages))):  # a believed prefix left out
            first = keep[0]
            host, tokens = host_indices[first * page :], token_ids[first * page :]
            hashes = pages[first:]
            if prefix_keys is not None:
                extend = getattr(controller, "extend_storage_prefix", None)
                skipped = pages[:first]
                more["prefix_keys"] = (
                    extend(prefix_keys, skipped) if callable(extend) else [*prefix_keys, *skipped]
                )
        else:
            positions = [i * page + j for i in keep for j in range(page)]
            host, tokens = host_indices[positions], [token_ids[t] for t in positions]
            hashes = [pages[i] for i in keep]
        return plan, {"host_indices": host, "token_ids": tokens, "hash_value": hashes, **more}

    def hit_query(self, tree: Any, operation: Any) -> None:
        """A rank-agreed prefetch hit query: heal (cache mode) and remember which
        stored pages it found, for the cause of a later rewrite (both modes)."""
        chain = getattr(operation, "all_hash_values", None)
        if not chain:
            return
        page = int(tree.page_size)
        if self.cache_mode is not None:
            self.cache_mode.heal(operation, list(chain), page)
        hit_tokens = int(getattr(operation, "storage_hit_count", 0) or 0)
        recorder = self.recorder
        if recorder is not None:
            if recorder.page_size != page:
                recorder.set_page_size(page)
            recorder.prefetch("kv", chain, hit_tokens // page)
        threshold = int(getattr(tree, "prefetch_threshold", 0) or 0)
        self.causes.queried(chain, hit_tokens // page, below_threshold=hit_tokens < threshold)

    def reaper(self) -> Callable[[Any], None] | None:
        """Cache mode's reap of a tree's acknowledged operations (``None`` in buffer
        mode), which the step hook calls while writes are pending: one frame of ours
        per step.  Acks come in launch order, so while the oldest pending operation is
        in ``ongoing_backup`` nothing is reaped.  Never raises (``error``)."""
        cache_mode = self.cache_mode
        if cache_mode is None:
            return None
        pending = cache_mode.pending_operations
        reap, outcomes, error = cache_mode.reap, self._outcomes, self.error

        def reap_acknowledged(tree: Any) -> None:
            try:
                if pending:
                    ongoing = tree.ongoing_backup
                    if next(iter(pending)) not in ongoing:
                        reap(ongoing, outcomes)
            except Exception as exc:
                error(exc)

        return reap_acknowledged

    def step(self, tree: Any) -> None:
        """The reaper's work as one call, for a caller that drives the tree itself
        (tests, tools); the server's step hook binds ``reaper()`` instead."""
        reap = self.reaper()
        if reap is not None:
            reap(tree)

    # -- errors ----------------------------------------------------------------------------
    def error(self, exc: BaseException) -> None:
        """A hook could not account for an event (never raised into sglang)."""
        with self._errors_lock:
            self.errors += 1
            errors = self.errors
        if errors <= 3 or errors % 1000 == 0:
            logger.warning(
                "hicache-existence: write accounting skipped an event (%d so far): %r",
                errors,
                exc,
            )


def _node_of(intent: Any) -> Any:
    """The tree node a buffer-mode intent writes (``None`` when it does not say)."""
    return getattr(getattr(intent, "snapshot", None), "node_id", None)


#: pid -> that process's write path.  The hooks read it inline, as
#: ``FEEDS.get(PROCESS.pid)`` (``None``: the package observes no cache in this
#: process): a lookup function would be one more cold frame per event.
FEEDS: dict[int, WritePath] = {}


def attach(feed: WritePath) -> None:
    """Make ``feed`` this process's write path (the hooks look it up)."""
    FEEDS[PROCESS.pid] = feed


def detach() -> None:
    FEEDS.pop(PROCESS.pid, None)
