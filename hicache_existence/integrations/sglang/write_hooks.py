"""The hooks that feed ``WritePath`` from SGLang's write path, as one table.

Each entry of ``HOOKS`` is a ``Hook`` record: the upstream target, the hook type,
the API generations it serves, whether the write accounting is meaningless
without it, the upstream parameters it reads, and the factory that builds the
installed callable.  Parameters are read by name: at registration the target's
own signature says where each named parameter sits, so a hook never indexes
upstream's arguments by a position guessed here.  A target that lacks a named
parameter counts as missing, exactly like a target that does not resolve.

Every hook calls upstream first or last, exactly once, outside its own ``try``;
every failure of ours is counted by ``WritePath.error`` and never raised into
sglang.  The scheduler-thread hooks do no I/O; the backup-thread hooks only
record what the backend answered.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hicache_existence.integrations.sglang import targets
from hicache_existence.integrations.sglang.write_path import WritePath, current

logger = logging.getLogger("hicache_existence.integrations.sglang")

_MM = "sglang.srt.mem_cache"
PIPELINE = f"{_MM}.buffer_mode.pipeline.BufferModePipeline"
TREE = f"{_MM}.unified_radix_cache.UnifiedRadixCache"
CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"
HYBRID_CONTROLLER = f"{_MM}.hybrid_cache.hybrid_cache_controller.HybridCacheController"
FILE_BACKEND = f"{_MM}.hicache_storage.HiCacheFile"
MOONCAKE_BACKEND = f"{_MM}.storage.mooncake_store.mooncake_store.MooncakeStore"
FLAT_COVERS_ALL = "hicache_existence.core.flat.FlatStorageExistenceCache.covers_all"

Kind = Literal["AROUND", "AFTER"]
Hooked = Callable[..., Any]


class Param:
    """One named parameter of an upstream method, read from a hook's ``(args,
    kwargs)`` (``self`` excluded) at the position the target's signature gives it."""

    __slots__ = ("name", "index")

    #: The index of an optional parameter the target does not have.
    ABSENT = 1 << 30

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        #: Position among the positional arguments after ``self``; -1: keyword-only.
        self.index = index

    @property
    def present(self) -> bool:
        """Whether the target has this parameter (optional ones may be absent)."""
        return self.index != Param.ABSENT

    def __call__(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], default: Any = None
    ) -> Any:
        i = self.index
        if 0 <= i < len(args):
            return args[i]
        return kwargs.get(self.name, default)

    def __repr__(self) -> str:
        return f"Param({self.name!r}, {self.index})"


class Params(Mapping[str, Param]):
    """The named parameters one hook reads, bound to its target's signature.

    ``"name?"`` in a hook's ``params`` is optional: absent from the signature,
    it reads as ``None`` (one API generation has it, the other not)."""

    def __init__(self, found: Mapping[str, Param]) -> None:
        self._found = dict(found)

    def __getitem__(self, name: str) -> Param:
        return self._found[name]

    def __iter__(self) -> Any:
        return iter(self._found)

    def __len__(self) -> int:
        return len(self._found)

    @classmethod
    def bind(cls, target: object, names: tuple[str, ...]) -> Params:
        """Where each of ``names`` sits in ``target``'s signature.

        Raises ``LookupError`` naming a required parameter the signature lacks."""
        fn = targets.original_of(target)
        try:
            signature = inspect.signature(fn)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise LookupError(f"no signature for {target!r}: {exc}") from None
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = list(signature.parameters.values())
        if params and params[0].name in ("self", "cls"):
            params = params[1:]
        where: dict[str, int] = {}
        for i, p in enumerate(params):
            if p.kind in positional:
                where[p.name] = i
            elif p.kind is inspect.Parameter.KEYWORD_ONLY:
                where[p.name] = -1
        found: dict[str, Param] = {}
        for raw in names:
            name = raw.rstrip("?")
            if name in where:
                found[name] = Param(name, where[name])
            elif name == raw:
                raise LookupError(f"{getattr(fn, '__qualname__', fn)} has no parameter {name!r}")
            else:  # optional: never in the call, always the default
                found[name] = Param(name, Param.ABSENT)
        return cls(found)


Mode = Literal["buffer", "cache"]
BUFFER: frozenset[Mode] = frozenset({"buffer"})
CACHE: frozenset[Mode] = frozenset({"cache"})
MODES: frozenset[Mode] = BUFFER | CACHE

#: What stops being counted, per host memory mode, when that mode loses a required hook.
MODE_COUNTERS: Mapping[Mode, str] = {
    "buffer": "buffer-mode write counters (buffer_only servers) are off",
    "cache": "cache-mode write counters and dedup (cache-mode servers) are off",
}


@dataclass(frozen=True)
class Hook:
    """One hook of the write path."""

    #: Dotted path of the upstream callable (what ``HookRegistry`` patches).
    target: str
    kind: Kind
    #: Factory of the installed callable, given the target's bound parameters.
    build: Callable[[Params], Hooked]
    #: API generations it serves (``current``: 0.5.22+, ``flat``: 0.5.19-0.5.21).
    generations: frozenset[str]
    #: Upstream parameters the hook reads (``"name?"``: may be absent).
    params: tuple[str, ...] = ()
    #: Host memory modes whose accounting is wrong without it: a missing one turns
    #: off that mode's hooks (its counters stay absent, never wrong), not the other's.
    required: frozenset[Mode] = frozenset()
    #: What is not counted when this (optional) hook is missing.
    loses: str = ""
    #: Host memory modes it feeds: installed while one of them has all its required hooks.
    serves: frozenset[Mode] = MODES
    #: A class (dotted) without which the hook does not apply at all: when the
    #: installed sglang lacks that class, the hook is skipped with a debug line only.
    only_with: str = ""

    def bound(self, target: object) -> Hooked:
        """The callable to install on ``target`` (raises ``LookupError`` when its
        signature lacks a parameter the hook reads)."""
        return self.build(Params.bind(target, self.params))


def _guard(feed: WritePath, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # accounting never raises into the scheduler
        feed.error(exc)


# -- admission (current generation) ---------------------------------------------------------
def _refresh_pending(p: Params) -> Hooked:
    def around_refresh_pending(original: Hooked, pipeline: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_refresh_pending_backup_intents``: its split repairs re-examine
        admitted intents through ``_write_intents``; they are not new decisions."""
        feed = current()
        if feed is None:
            return original(pipeline, *a, **kw)
        feed.begin_refresh()
        try:
            return original(pipeline, *a, **kw)
        finally:
            feed.end_refresh()

    return around_refresh_pending


def _backup_pool_keys(p: Params) -> Hooked:
    def after_backup_pool_keys(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_backup_pool_keys`` (called by ``_write_intents`` only): the keys
        the decision is about."""
        feed = current()
        if feed is not None:
            feed.note_pool_keys(result)
        return None

    return after_backup_pool_keys


def _write_intents(p: Params) -> Hooked:
    def around_write_intents(original: Hooked, pipeline: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_write_intents``: outside a queue refresh it is an admission
        (``enqueue_backup_intent`` calls it once per node per insert walk, after
        upstream's own dedupe), and the pools it left out were covered: avoided."""
        intents = original(pipeline, *a, **kw)
        feed = current()
        if feed is not None:
            pool_keys = feed.take_pool_keys()
            if pool_keys is not None and feed.owns_pipeline(pipeline):
                _guard(feed, lambda: feed.admitted(pipeline, pool_keys, intents))
        return intents

    return around_write_intents


def _drop_queue_head(p: Params) -> Hooked:
    dropped_of = p["dropped"]

    def around_drop_queue_head(original: Hooked, pipeline: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_drop_queue_head``: ``dropped=False`` retires a queued intent
        whose pool became covered before its launch (avoided at that decision)."""
        feed = current()
        head = None
        if feed is not None and feed.owns_pipeline(pipeline) and dropped_of(a, kw, True) is False:
            queue = getattr(pipeline, "pending_write_queue", None)
            head = queue[0] if queue else None
        result = original(pipeline, *a, **kw)
        if feed is not None and head is not None:
            _guard(feed, lambda: feed.retired(head.pool, head.keys))
        return result

    return around_drop_queue_head


# -- admission (flat generation) --------------------------------------------------------------
def _enqueue_backup_intent(p: Params) -> Hooked:
    node_of = p["node_id"]

    def around_enqueue_backup_intent(original: Hooked, pipeline: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``enqueue_backup_intent`` (flat generation): one admission
        decision, counted at most once per node per insert walk."""
        feed = current()
        if feed is None or not feed.owns_pipeline(pipeline):
            return original(pipeline, *a, **kw)
        feed.begin_admission(node_of(a, kw))
        try:
            return original(pipeline, *a, **kw)
        finally:
            feed.end_admission()

    return around_enqueue_backup_intent


def _flat_covers_all(p: Params) -> Hooked:
    pool_of, hashes_of = p["pool"], p["hashes"]

    def around_flat_covers_all(original: Hooked, cache: Any, *a: Any, **kw: Any) -> Any:
        """AROUND our flat cache's ``covers_all``: True inside an admission is avoided."""
        covered = original(cache, *a, **kw)
        if covered:
            feed = current()
            if feed is not None and cache is feed.cache:
                _guard(
                    feed, lambda: feed.covered_in_admission(pool_of(a, kw), hashes_of(a, kw, ()))
                )
        return covered

    return around_flat_covers_all


def _tree_insert(p: Params) -> Hooked:
    def around_tree_insert(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``UnifiedRadixCache.insert`` (flat): one insert walk, inside which
        a node's admission counts once."""
        feed = current()
        if feed is None or not feed.owns_tree(tree):
            return original(tree, *a, **kw)
        outer = feed.begin_walk()
        try:
            return original(tree, *a, **kw)
        finally:
            feed.end_walk(outer)

    return around_tree_insert


# -- launch and ack ---------------------------------------------------------------------------
def _stage_backup_intent(p: Params) -> Hooked:
    intent_of, keys_of = p["intent"], p["keys_by_pool"]

    def after_stage_backup_intent(result: Any, pipeline: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_stage_backup_intent``: True is the D2H launch of the intent's
        pages (flat generation: the node's KV pages, it passes no ``keys_by_pool``)."""
        if result is not True:
            return None
        feed = current()
        if feed is None or not feed.owns_pipeline(pipeline):
            return None

        def launched() -> None:
            intent = intent_of(a, kw)
            keys = keys_of(a, kw)
            by_pool = keys if isinstance(keys, Mapping) else {"kv": intent.snapshot.hash_values}
            feed.launched(pipeline, intent, by_pool)

        _guard(feed, launched)
        return None

    return after_stage_backup_intent


def _storage_write_ack(p: Params) -> Hooked:
    op_of = p["operation_id"]

    def around_storage_write_ack(original: Hooked, pipeline: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``finish_storage_write_ack``: this rank's outcome of the write,
        read before upstream pops the pipeline's entry."""
        feed = current()
        if feed is None or not feed.owns_pipeline(pipeline):
            return original(pipeline, *a, **kw)
        entry = outcome = None
        try:
            op_id = op_of(a, kw)
            entry = pipeline.ongoing_backup.get(op_id)
            outcome = feed.take_outcome(op_id)
        except Exception as exc:
            feed.error(exc)
        result = original(pipeline, *a, **kw)
        if entry is not None:
            _guard(feed, lambda: feed.acked(entry, outcome))
        return result

    return around_storage_write_ack


# -- the backup thread ------------------------------------------------------------------------
def _page_backup(p: Params) -> Hooked:
    operation_of = p["operation"]

    def around_page_backup(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_page_backup`` (backup thread): collect the backend's existence
        answers during the write, then hand this rank's outcome to the scheduler."""
        feed = current()
        answers = feed.begin_backup(controller) if feed is not None else None
        if feed is None or answers is None:
            return original(controller, *a, **kw)
        try:
            return original(controller, *a, **kw)
        finally:
            try:
                feed.end_backup(controller, operation_of(a, kw), answers)
            except Exception as exc:
                feed.abandon_backup()
                feed.error(exc)

    return around_page_backup


def _file_set(p: Params) -> Hooked:
    key_of = p["key"]

    def around_file_set(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``HiCacheFile.set``: it asks ``exists`` first and skips a stored page."""
        feed = current()
        answers = feed.collecting() if feed is not None else None
        key = key_of(a, kw)
        if answers is None or not isinstance(key, str):
            return original(backend, *a, **kw)
        answers.probe, answers.answer = key, None
        try:
            ok = original(backend, *a, **kw)
        finally:
            answers.probe = None
        if ok and answers.answer:
            answers.saw(key)
        return ok

    return around_file_set


def _file_exists(p: Params) -> Hooked:
    key_of = p["key"]

    def around_file_exists(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``HiCacheFile.exists``: the answer ``set`` acts on."""
        answer = original(backend, *a, **kw)
        feed = current()
        answers = feed.collecting() if feed is not None else None
        if answers is not None and answers.probe is not None and key_of(a, kw) == answers.probe:
            answers.answer = bool(answer)
        return answer

    return around_file_exists


def _mooncake_batch_set_v1(p: Params) -> Hooked:
    keys_of = p["keys"]

    def around_mooncake_batch_set_v1(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore.batch_set_v1``: it asks ``batch_is_exist`` and puts
        only missing objects; the pages it writes are the next query's."""
        feed = current()
        answers = feed.collecting() if feed is not None else None
        if feed is None or answers is None:
            return original(backend, *a, **kw)
        try:
            answers.batch_pages = list(keys_of(a, kw))
        except Exception as exc:
            feed.error(exc)
        try:
            return original(backend, *a, **kw)
        finally:
            answers.batch_pages = None

    return around_mooncake_batch_set_v1


def _mooncake_batch_exist(p: Params) -> Hooked:
    def around_mooncake_batch_exist(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore._batch_exist``: a page existed when all of its
        objects did (objects are laid out page by page)."""
        answer = original(backend, *a, **kw)
        feed = current()
        answers = feed.collecting() if feed is not None else None
        pages = answers.batch_pages if answers is not None else None
        if feed is not None and answers is not None and pages:
            answers.batch_pages = None  # only the write's own query

            def existed() -> None:
                per = len(answer) // len(pages)
                for i, page in enumerate(pages):
                    if per and all(int(s) == 1 for s in answer[i * per : (i + 1) * per]):
                        answers.saw_page("kv", page)

            _guard(feed, existed)
        return answer

    return around_mooncake_batch_exist


# -- cache mode (--hicache-host-memory-mode cache) -------------------------------------------
def _write_backup_storage(p: Params) -> Hooked:
    node_of = p["node_id"]

    def around_write_backup_storage(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``UnifiedRadixCache.write_backup_storage(node_id)`` (cache mode): the
        L3 write of one backed-up node; its ``write_storage`` call is the one the
        cache-mode path counts (and, with ``cache_mode.dedup``, reduces)."""
        feed = current()
        cache_mode = feed.cache_mode if feed is not None else None
        if feed is None or cache_mode is None or not feed.owns_tree(tree):
            return original(tree, *a, **kw)
        cache_mode.begin_node(node_of(a, kw))
        try:
            return original(tree, *a, **kw)
        finally:
            cache_mode.end_node()

    return around_write_backup_storage


def _write_storage(p: Params) -> Hooked:
    host_of, tokens_of, hashes_of = p["host_indices"], p["token_ids"], p["hash_value"]
    prefix_of, extra_of = p["prefix_keys"], p["extra_pools"]

    def around_write_storage(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``write_storage`` (both controllers), inside a cache-mode node write:
        the pages are looked up; the believed ones are left out of the write when
        ``cache_mode.dedup`` is on; the operation's pages are counted written."""
        feed = current()
        cache_mode = feed.cache_mode if feed is not None else None
        if feed is None or cache_mode is None or not cache_mode.in_node:
            return original(controller, *a, **kw)
        node = cache_mode.claim()  # one write per node write; nothing nested is ours
        call = None
        try:
            call = feed.plan_cache_write(
                controller,
                host_of(a, kw),
                tokens_of(a, kw),
                hashes_of(a, kw),
                prefix_of(a, kw),
                extra_of(a, kw),
            )
        except Exception as exc:
            feed.error(exc)
        if call is None:  # could not plan: upstream's write, uncounted
            return original(controller, *a, **kw)
        plan, changes = call
        if changes:
            a, kw = _replaced(a, kw, changes, (host_of, tokens_of, hashes_of, prefix_of, extra_of))
        operation_id = original(controller, *a, **kw)
        _guard(feed, lambda: cache_mode.launched(operation_id, plan, node))
        return operation_id

    return around_write_storage


def _replaced(
    a: tuple[Any, ...], kw: dict[str, Any], changes: Mapping[str, Any], params: tuple[Param, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(a, kw)`` with the named parameters in ``changes`` replaced where they sit."""
    args, kwargs = list(a), dict(kw)
    for param in params:
        if param.name not in changes or not param.present:
            continue
        if 0 <= param.index < len(args):
            args[param.index] = changes[param.name]
        else:
            kwargs[param.name] = changes[param.name]
    return tuple(args), kwargs


def _hit_query(p: Params) -> Hooked:
    operation_of = p["operation"]

    def after_hit_query(result: Any, tree: Any, *a: Any, **kw: Any) -> None:
        """AFTER ``_invalidate_absent_from_hit_query(operation)`` (the rank-agreed
        prefetch hit-query drain, both modes): in cache mode, where upstream heals
        nothing, heal the beliefs from the verdict; in both, remember which stored
        pages the query found too short to prefetch."""
        feed = current()
        if feed is not None and feed.owns_tree(tree):
            _guard(feed, lambda: feed.hit_query(tree, operation_of(a, kw)))
        return None

    return after_hit_query


def _prefetch_result(p: Params) -> Hooked:
    operation_of = p["operation"]

    def around_prefetch_result(original: Hooked, tree: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_handle_prefetch_result(operation)`` (rank-synchronised): the
        pages a prefetch loaded from L3, and those it requested but did not load
        (read before upstream consumes the operation)."""
        feed = current()
        if feed is None or not feed.owns_tree(tree):
            return original(tree, *a, **kw)
        seen = None
        try:
            operation = operation_of(a, kw)
            seen = (list(operation.hash_value or ()), int(operation.completed_tokens))
        except Exception as exc:
            feed.error(exc)
        result = original(tree, *a, **kw)
        if seen is not None:
            _guard(feed, lambda: feed.prefetched(tree, *seen))
        return result

    return around_prefetch_result


_CUR = frozenset({"current"})
_FLAT = frozenset({"flat"})
_BOTH = frozenset({"current", "flat"})

#: Every hook of the write path, in registration order.
HOOKS: tuple[Hook, ...] = (
    Hook(f"{PIPELINE}.enqueue_backup_intent", "AROUND", _enqueue_backup_intent, _FLAT,
         ("node_id",), required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._refresh_pending_backup_intents", "AROUND", _refresh_pending, _CUR,
         required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._backup_pool_keys", "AFTER", _backup_pool_keys, _CUR,
         required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._write_intents", "AROUND", _write_intents, _CUR,
         required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._drop_queue_head", "AROUND", _drop_queue_head, _CUR, ("dropped",),
         loses="buffer mode: queued writes retired before launch (avoided)",
         serves=BUFFER),
    Hook(FLAT_COVERS_ALL, "AROUND", _flat_covers_all, _FLAT, ("pool", "hashes"),
         required=BUFFER, serves=BUFFER),
    Hook(f"{TREE}.insert", "AROUND", _tree_insert, _FLAT, required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}._stage_backup_intent", "AFTER", _stage_backup_intent, _BOTH,
         ("intent", "keys_by_pool?"), required=BUFFER, serves=BUFFER),
    Hook(f"{PIPELINE}.finish_storage_write_ack", "AROUND", _storage_write_ack, _BOTH,
         ("operation_id",), required=BUFFER, serves=BUFFER),
    Hook(f"{CONTROLLER}._page_backup", "AROUND", _page_backup, _BOTH, ("operation",),
         required=MODES),
    # Every tree of sglang 0.5.21-0.5.23 writes L3 through a HybridCacheController
    # (hybrid_pool_assembler builds one for plain models too): its hooks are as
    # required as HiCacheController's, where that class exists.
    Hook(f"{HYBRID_CONTROLLER}._page_backup", "AROUND", _page_backup, _BOTH, ("operation",),
         required=MODES, only_with=HYBRID_CONTROLLER),
    Hook(f"{FILE_BACKEND}.set", "AROUND", _file_set, _BOTH, ("key",),
         loses="file backend: redundant pages (the backend's own answer)"),
    Hook(f"{FILE_BACKEND}.exists", "AROUND", _file_exists, _BOTH, ("key",),
         loses="file backend: redundant pages (the backend's own answer)"),
    Hook(f"{MOONCAKE_BACKEND}.batch_set_v1", "AROUND", _mooncake_batch_set_v1, _BOTH, ("keys",),
         loses="Mooncake backend: redundant pages (the backend's own answer)"),
    Hook(f"{MOONCAKE_BACKEND}._batch_exist", "AROUND", _mooncake_batch_exist, _BOTH,
         loses="Mooncake backend: redundant pages (the backend's own answer)"),
    # cache mode, and the prefetch dispositions behind the causes (both modes)
    Hook(f"{TREE}.write_backup_storage", "AROUND", _write_backup_storage, _BOTH, ("node_id",),
         required=CACHE, serves=CACHE),
    Hook(f"{CONTROLLER}.write_storage", "AROUND", _write_storage, _BOTH,
         ("host_indices", "token_ids", "hash_value", "prefix_keys", "extra_pools?"),
         required=CACHE, serves=CACHE),
    Hook(f"{HYBRID_CONTROLLER}.write_storage", "AROUND", _write_storage, _BOTH,
         ("host_indices", "token_ids", "hash_value", "prefix_keys", "extra_pools?"),
         required=CACHE, serves=CACHE, only_with=HYBRID_CONTROLLER),
    Hook(f"{TREE}._invalidate_absent_from_hit_query", "AFTER", _hit_query, _BOTH, ("operation",),
         loses="prefetch shortfalls (cause prefetch_shortfall) and cache mode's heal"),
    Hook(f"{TREE}._handle_prefetch_result", "AROUND", _prefetch_result, _BOTH, ("operation",),
         loses="prefetch dispositions behind the redundant-write causes"),
)  # fmt: skip


def hook(target_suffix: str, generation: str = "current") -> Hook:
    """The hook whose target ends with ``target_suffix`` (tests, diagnostics)."""
    for h in HOOKS:
        if h.target.endswith(target_suffix) and generation in h.generations:
            return h
    raise KeyError(target_suffix)


def register(
    registry: Any,
    hook_type: Any,
    generation: str,
    resolve: Callable[[str], object],
    warn: Callable[[str], None] | None = None,
    off: set[str] | None = None,
) -> list[str]:
    """Register the write-path hooks the installed sglang has, for ``generation``.

    Each host memory mode stands alone: a required hook of one mode that is missing
    or has another signature turns off that mode's hooks (its counters then stay
    absent: ``off`` receives the modes turned off, for the runtime to leave their
    write families out) and leaves the other mode counting.  Every missing or
    changed target gets one ``warn`` (default: a log warning) naming it and what
    stops being counted; a backend whose module is there but does not import
    (Mooncake without its client), or a hook whose ``only_with`` class the
    installed sglang lacks, is dropped with a debug line only.  Returns the
    targets registered."""
    say = warn if warn is not None else _log_warning
    found: list[tuple[Hook, Hooked]] = []
    modes_off: set[Mode] = set()
    for h in HOOKS:
        if generation not in h.generations:
            continue
        try:
            installed = h.bound(resolve(h.target))
        except Exception as exc:
            if h.only_with and not _resolves(resolve, h.only_with):
                logger.debug("hicache-existence: no %s here; %s not hooked", h.only_with, h.target)
            elif h.required:
                modes_off |= h.required
                stops = "; ".join(MODE_COUNTERS[m] for m in sorted(h.required))
                say(f"{h.target} is missing or changed ({exc}); {stops}")
            elif targets.dependency_missing(h.target):
                logger.debug("hicache-existence: %s not importable (%s); not hooked", h.target, exc)
            else:
                say(f"{h.target} is missing or changed ({exc}); not counted: {h.loses}")
            continue
        found.append((h, installed))
    kept = [(h, installed) for h, installed in found if h.serves - modes_off]
    for h, installed in kept:
        registry.register(h.target, installed, getattr(hook_type, h.kind))
    if off is not None:
        off.update(modes_off)
    return [h.target for h, _ in kept]


def _resolves(resolve: Callable[[str], object], target: str) -> bool:
    try:
        resolve(target)
    except Exception:
        return False
    return True


def _log_warning(message: str) -> None:
    logger.warning("hicache-existence: %s", message)
