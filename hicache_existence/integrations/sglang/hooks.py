"""The hooks themselves: our cache in place of upstream's, and the per-step call
(docs/enable.md §3).

``replacement_class(generation, upstream)`` is what ``HookType.REPLACE`` puts in
place of upstream's ``StorageExistenceCache``: a subclass of our cache whose
metaclass turns construction into "build this process's ``ExistenceRuntime`` and
return its wired cache".  Runtimes are keyed by process id, so a forked child never
steps its parent's.  When the process should not be observed (disabled, HiCache
off, a PD decode server, a second cache in the process, or any failure),
construction returns upstream's own class: that scheduler runs exactly the code it
would without us.

``after_check_hicache_events`` runs AFTER ``UnifiedRadixCache.check_hicache_events``
(scheduler thread, every rank, same order).  Its first call builds the replica
groups (a collective over the whole world, reached once by every rank).  It is a
``core.gate`` step hook: once bound to the tree, a step is one C call with no
Python frame of ours while nothing is due.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from hicache_existence import logs
from hicache_existence.accounting.recorder import instance_name
from hicache_existence.config import Config
from hicache_existence.core import gate as _gate
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.core.stats import COLD
from hicache_existence.exporters import resolve_mode
from hicache_existence.integrations.sglang import conformance as _conformance
from hicache_existence.integrations.sglang import facts as _facts
from hicache_existence.integrations.sglang import kv_events as _kv_events
from hicache_existence.integrations.sglang import recorder_hooks as _recorder_hooks
from hicache_existence.integrations.sglang import targets as _targets
from hicache_existence.integrations.sglang import upstream_overlap as _overlap
from hicache_existence.integrations.sglang import write_hooks as _write_hooks
from hicache_existence.integrations.sglang import write_path as _write_path
from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.targets import Generation
from hicache_existence.integrations.sglang.topology import (
    DeferredAgreement,
    DeferredGroup,
    build,
    unbuilt,
)
from hicache_existence.integrations.sglang.tree_cache_truth import TreeCacheGroundTruth
from hicache_existence.runtime import ExistenceRuntime

logger = logging.getLogger("hicache_existence.integrations.sglang")


class ProcessEntry:
    """The runtime of one scheduler process and what wires it to sglang."""

    def __init__(
        self,
        runtime: ExistenceRuntime,
        facts: _facts.SchedulerFacts,
        group: DeferredGroup | None,
        agreement: DeferredAgreement | None,
        truth: TreeCacheGroundTruth | None,
        overlap: _overlap.Overlap | None = None,
    ) -> None:
        #: What the installed sglang does itself (``upstream_overlap``).
        self.overlap = overlap = overlap or _overlap.Overlap()
        self.runtime = runtime
        self.facts = facts
        self.group = group
        self.agreement = agreement
        self.truth = truth
        #: Feeds ``runtime.writes`` from sglang's write path (write_path.py).
        self.write_path = _write_path.WritePath(
            runtime.writes,
            runtime.cache,
            cache_mode=facts.cache_mode,
            dedup=dedup_effective(runtime.config, facts, overlap),
            upstream_dedup=dedup_label(runtime.config, facts, overlap) == "upstream",
            remembers=remembers_of(runtime),
        )
        self.write_path.attach_recorder(runtime.recorder)
        self.write_path.events = runtime.events
        #: Whether the first step (group wiring) ran.
        self.first_done = False
        self.members: tuple[int, ...] = (0,)

    @property
    def steps(self) -> int:
        """Scheduler steps this runtime has taken."""
        return self.runtime.steps

    @property
    def cache(self) -> ExistenceCache:
        return self.runtime.cache

    def first_step(self, tree_cache: Any) -> None:
        """Bind the tree cache and build the replica groups (once, every rank)."""
        try:
            self._count_admissions(tree_cache)
            self._bracket_inserts(tree_cache)
            self._build_groups(tree_cache)
        finally:  # bound or not, the group's size is final now (unbound: one rank)
            if self.group is not None:
                self.runtime.group_bound()

    def _count_admissions(self, tree_cache: Any) -> None:
        """Buffer mode, current generation: admissions are counted by the cache's
        ``covered()`` tally, or, on a tree with sidecar pools, by the admission
        hooks installed on its pipeline (before its first insert: the first step
        comes before the first batch)."""
        if self.facts.cache_mode or self.runtime.generation != "current":
            return
        if "buffer" in _UNCOUNTED.get(os.getpid(), frozenset()):
            return
        pipeline = getattr(tree_cache, "buffer_pipeline", None)
        if pipeline is None:  # (the tree is ours: ``_first_or_foreign_step`` checked)
            return
        try:
            if not self.write_path.tally_admissions(tree_cache):
                _write_hooks.install_on(pipeline, "current")
        except Exception as exc:  # the groups are still built
            logger.warning("hicache-existence: buffer-mode admissions not counted: %r", exc)

    def _bracket_inserts(self, tree_cache: Any) -> None:
        """With a recorder, each insert into this process's tree is a request
        boundary (``recorder_hooks``: installed here, before the first insert, so
        that a server without a recorder never runs it)."""
        recorder = self.runtime.recorder
        if recorder is None:
            return
        try:
            if not _recorder_hooks.install_on(tree_cache, recorder):
                logger.info(
                    "hicache-existence: %s is no %s; traces have no request boundaries",
                    type(tree_cache).__name__,
                    _recorder_hooks.TARGET.rsplit(".", 1)[0],
                )
        except Exception as exc:  # the trace is still recorded, without boundaries
            logger.warning("hicache-existence: traces have no request boundaries: %r", exc)

    def _build_groups(self, tree_cache: Any) -> None:
        if self.truth is not None:
            self.truth.bind(tree_cache)
        if self.group is None and self.agreement is None:
            return
        timeout = self.runtime.config.divergence.timeout_s
        try:
            groups = build(tree_cache, timeout, agreement=self.agreement is not None)
        except Exception as exc:
            logger.warning(
                "hicache-existence: could not build the replica groups (%r); divergence "
                "checks stop on this rank and reconciler verdicts stay local to it (does "
                "every rank of this server run hicache-existence?)",
                exc,
            )
            groups = unbuilt(timeout, repr(exc))
        self.members = groups.members
        if self.group is not None:
            self.group.bind(groups.divergence)
        if self.agreement is not None:
            self.agreement.bind(groups.agreement)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.runtime.close()

    def bind(self, hook: _gate.StepHookType, tree_cache: Any) -> None:
        """Point ``hook`` at ``tree_cache``: its steps then reap (cache mode, writes
        pending) and step this runtime's gate without a Python frame of ours."""
        reap = self.write_path.reaper()
        cache_mode = self.write_path.cache_mode
        hook.pending = cache_mode.pending_operations if reap and cache_mode else None
        hook.reap = reap
        if reap is None and self.write_path.tallies:  # buffer mode: after each flush
            hook.pending, hook.reap = self.write_path.flushed, self.write_path.flushed_reap
        hook.step = self.runtime.tick
        hook.tree = tree_cache


_LOCK = threading.Lock()
_ENTRIES: dict[int, ProcessEntry] = {}
_DECLINED: dict[int, str] = {}
#: Per pid, host memory modes ("buffer", "cache") missing write-path hooks.
_UNCOUNTED: dict[int, frozenset[str]] = {}


def set_uncounted_modes(modes: set[str] | frozenset[str]) -> None:
    """The plugin's record of the host memory modes left without write accounting:
    a runtime built for one of them exports no write families."""
    _UNCOUNTED[os.getpid()] = frozenset(modes)


def current() -> ProcessEntry | None:
    """This process's entry (``None`` when no cache of ours was built here)."""
    return _ENTRIES.get(PROCESS.pid)


def declined() -> str | None:
    """Why this process runs upstream's cache although the plugin is enabled."""
    return _DECLINED.get(os.getpid())


def _decline(reason: str, level: int = logging.INFO) -> None:
    pid = os.getpid()
    if pid not in _DECLINED:
        _DECLINED[pid] = reason
        logger.log(level, "hicache-existence: not observing this process's cache: %s", reason)


def load_config(facts: _facts.SchedulerFacts) -> tuple[Config, frozenset[str]]:
    """Defaults, ``HICACHE_EXISTENCE_*`` variables, then ``--hicache-existence-config``
    (``--enable-hicache-existence`` switches it on); and the keys these sources set."""
    text = facts.flags.config if facts.flags is not None else None
    config = Config.load(text, dict(os.environ))
    if facts.flags is not None and facts.flags.enabled and not config.enabled:
        config = dataclasses.replace(config, enabled=True)
    return config, Config.given_keys(text, os.environ)


def remembers_of(runtime: ExistenceRuntime) -> Callable[[str, str], bool | None]:
    """Whether this process has a record of a page: believed now, or once believed
    (the miss-reason memory's evicted / invalidated / cleared); ``None`` without
    that memory, when "not believed" cannot tell ours from another instance's."""
    cache, ghosts = runtime.cache, runtime.ghosts

    def remembers(pool: str, page: str) -> bool | None:
        if cache.pool(pool).believed((page,)):
            return True
        memory = ghosts.memories().get(pool) if ghosts is not None else None
        if memory is None:
            return None
        return memory.remembered(page) != COLD

    return remembers


def dedup_effective(
    config: Config, facts: _facts.SchedulerFacts, overlap: _overlap.Overlap | None = None
) -> bool:
    """Whether ``cache_mode.dedup`` applies: cache mode with an L3 backend, on an
    sglang that does not deduplicate those writes itself (no second dedup)."""
    return dedup_label(config, facts, overlap) is True


def dedup_label(
    config: Config, facts: _facts.SchedulerFacts, overlap: _overlap.Overlap | None = None
) -> bool | str:
    """``mode_info``'s ``cache_mode_dedup``: ours on or off, or ``"upstream"``
    (a cache-mode server whose sglang deduplicates its L3 writes itself)."""
    if facts.cache_mode and overlap is not None and overlap.dedups_cache_mode is not None:
        return "upstream"
    return config.cache_mode.dedup and facts.cache_mode and bool(facts.storage_backend)


def _warn_dedup_misplaced(
    config: Config, facts: _facts.SchedulerFacts, overlap: _overlap.Overlap | None = None
) -> None:
    """``cache_mode.dedup`` where it cannot act: one warning naming the key."""
    label = dedup_label(config, facts, overlap)
    if not config.cache_mode.dedup or label is True:
        return
    if label == "upstream" and overlap is not None:
        logger.warning(
            "hicache-existence: cache_mode.dedup is set but the installed sglang "
            "deduplicates cache-mode L3 writes itself (%s); the package only counts them",
            overlap.dedups_cache_mode,
        )
        return
    where = (
        f"host memory mode {facts.host_memory_mode!r} (dedup acts in 'cache' mode only; "
        "buffer_only consults the existence cache already)"
        if not facts.cache_mode
        else "a server without an L3 storage backend (--hicache-storage-backend)"
    )
    logger.warning(
        "hicache-existence: cache_mode.dedup is set but ignored on %s; the server runs without it",
        where,
    )


def _per_rank_port(config: Config, facts: _facts.SchedulerFacts) -> Config:
    """Standalone export binds ``metrics.port`` + this scheduler's index, so the
    schedulers of one server never collide (port 0 stays ephemeral)."""
    section = config.metrics
    if not section.enabled or section.port == 0:
        return config
    if resolve_mode(section.mode) != "standalone":
        return config
    port = section.port + facts.process_index
    if port > 65535:
        # Never the base port (rank 0's): an ephemeral one, named in the start-up line.
        logger.warning(
            "hicache-existence: metrics.port %d + scheduler index %d passes 65535; "
            "this process binds a free port instead",
            section.port,
            facts.process_index,
        )
        port = 0
    return dataclasses.replace(config, metrics=dataclasses.replace(section, port=port))


def build_entry(
    generation: Generation,
    max_entries: int | None,
    facts: _facts.SchedulerFacts,
    config: Config,
    overlap: _overlap.Overlap | None = None,
) -> ProcessEntry:
    """The runtime of this process, wired to sglang (not yet registered);
    ``max_entries`` is the resolved cap (``upstream_overlap.resolve_cap``)."""
    config = _per_rank_port(config, facts)
    if max_entries is not None and max_entries != config.cache.max_entries:
        # Before the runtime exists: the miss-reason memory is sized from it.
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, max_entries=max_entries)
        )
    if config.events.enabled and overlap is not None and overlap.external_events:
        # SGLang publishes the storage tier itself (docs/enable.md §8): none of ours.
        config = dataclasses.replace(
            config, events=dataclasses.replace(config.events, enabled=False)
        )
    logs.configure_package_logging(config.logging.level, json_output=config.logging.json)
    labels = facts.labels(config.metrics.model_name, config.metrics.storage_backend)
    # Even with divergence checks off: the rank joins the start-up handshake.
    group = DeferredGroup(config.divergence.timeout_s)
    reconciling = config.reconciler.enabled
    agreement = DeferredAgreement() if reconciling else None
    truth = TreeCacheGroundTruth(config.reconciler) if reconciling else None
    runtime = ExistenceRuntime(
        config,
        labels,
        generation=generation,
        group=group,
        truth=truth,
        agreement=agreement,
        host_mode=(
            facts.host_memory_mode or "buffer_only",
            facts.write_policy if facts.cache_mode else "",
            dedup_label(config, facts, overlap),
        ),
        instance=instance_name(socket.gethostname(), facts.port, labels.as_dict()),
        count_writes=("cache" if facts.cache_mode else "buffer")
        not in _UNCOUNTED.get(os.getpid(), frozenset()),
        events=(
            _kv_events.placement(
                facts.storage_backend, (facts.tp_rank, facts.pp_rank, facts.dp_rank)
            )
            if config.events.enabled
            else None
        ),
    )
    if runtime.recorder is not None:
        runtime.recorder.set_page_size(facts.page_size)
    return ProcessEntry(runtime, facts, group, agreement, truth, overlap)


def _not_observed(config: Config, facts: _facts.SchedulerFacts) -> str | None:
    """Why this scheduler's cache is not observed (``None``: it is)."""
    if not config.enabled:
        return "disabled by the configuration"
    if facts.hierarchical_cache is False:
        return "HiCache is off (--enable-hierarchical-cache): there is no L3 to observe"
    if facts.engine_type == "decode":
        return (
            "a PD decode server (its KV arrives from prefill; HiCache's existence "
            "cache is a prefill-side concern)"
        )
    if facts.buffer_mode is False and not facts.cache_mode:
        return (
            f"HiCache host memory mode {facts.host_memory_mode!r} is neither buffer_only nor cache"
        )
    return None


def _construct(
    generation: Generation, upstream: type, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """What ``StorageExistenceCache(...)`` returns once the plugin is enabled."""
    pid = os.getpid()
    with _LOCK:
        if pid in _ENTRIES:
            _decline("a second existence cache in one process (only the first is observed)")
            return upstream(*args, **kw)
        try:
            passed = kw.get("max_entries", args[0] if args else None)
            facts = _facts.gather()
            config, given = load_config(facts)
            reason = _not_observed(config, facts)
            if reason is not None:
                _decline(reason)
                return upstream(*args, **kw)
            overlap = _overlap.detect(_targets.resolve)
            _warn_dedup_misplaced(config, facts, overlap)
            cap = _overlap.resolve_cap(
                config.cache.max_entries, "cache.max_entries" in given, os.environ, passed
            )
            if cap.warning:
                logger.warning("hicache-existence: %s", cap.warning)
            entry = build_entry(generation, cap.entries, facts, config, overlap)
        except Exception as exc:
            _decline(f"setting up failed ({exc!r}); upstream's cache is used", logging.WARNING)
            return upstream(*args, **kw)
        _ENTRIES[pid] = entry
        _write_path.attach(entry.write_path)
    try:
        entry.runtime.start()
    except Exception as exc:  # a port in use must not stop the scheduler
        logger.warning(
            "hicache-existence: metrics endpoint not started (%r); counting continues, set "
            "metrics.port or run sglang with --enable-metrics",
            exc,
        )
    atexit.register(entry.close)
    dedup = {True: "on", False: "off", "upstream": "upstream's"}[
        dedup_label(config, facts, overlap)
    ]
    overlaps = entry.overlap.describe()
    logger.info(
        "hicache-existence: observing the %s-generation existence cache "
        "(host memory mode %s%s; cap %d entries from %s%s; tp_rank=%d pp_rank=%d "
        "dp_rank=%d engine=%s metrics=%s%s, facts from %s)",
        generation,
        facts.host_memory_mode or "unknown",
        f", write policy {facts.write_policy}, cache_mode.dedup {dedup}"
        if facts.cache_mode
        else "",
        cap.entries,
        cap.source,
        f"; {overlaps}" if overlaps else "",
        facts.tp_rank,
        facts.pp_rank,
        facts.dp_rank,
        facts.engine_type,
        entry.runtime.telemetry.mode,
        f" events={entry.runtime.events.where}" if entry.runtime.events is not None else "",
        "+".join(facts.sources) or "defaults",
    )
    return entry.cache


class _Factory(type):
    """Metaclass of the replacement: calling the class builds (or declines) the
    process's runtime; ``isinstance`` accepts what construction can return."""

    _hx_generation: Generation
    _hx_upstream: type
    _hx_accepts: tuple[type, ...]

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _construct(cls._hx_generation, cls._hx_upstream, args, kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._hx_accepts)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return isinstance(sub, type) and issubclass(sub, cls._hx_accepts)


def replacement_class(generation: Generation, upstream: type) -> type:
    """The class REPLACEd for upstream's ``StorageExistenceCache``."""
    base = _conformance.ours_for(generation)
    name = "ObservedStorageExistenceCache"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"hicache-existence's {generation}-generation cache in place of "
        f"{upstream.__module__}.{upstream.__qualname__}.",
        "_hx_generation": generation,
        "_hx_upstream": upstream,
        "_hx_accepts": (base, upstream),
    }
    return _Factory(name, (base,), namespace)


def _first_or_foreign_step(result: Any = None, *args: Any, **kwargs: Any) -> None:
    """The step hook's fallback: a tree's first step (not bound yet), or a step of a
    tree not ours (a second tree, or a process without an entry)."""
    entry = _ENTRIES.get(PROCESS.pid)
    if entry is None or not args:
        return None
    tree_cache = args[0]
    if not entry.write_path.owns_tree(tree_cache):
        return None
    if not entry.first_done:
        entry.first_done = True
        try:
            entry.first_step(tree_cache)
        except Exception as exc:  # never into the scheduler
            logger.warning("hicache-existence: first-step wiring failed: %r", exc)
    # Bound to this tree (again, if another tree of this entry took the binding).
    entry.bind(_HOOK, tree_cache)
    _HOOK(result, tree_cache)  # this first step, on the bound path
    return None


#: The per-step hook (``core.gate``), bound to this process's tree after its first
#: step: a step of that tree is then one identity test, one size test and the
#: gate's (no Python frame of ours); any other call takes ``_first_or_foreign_step``.
#: A forked child drops the binding and finds no entry of its own.  Bound through
#: this name, not ``after_check_hicache_events``, which a test probe may wrap.
_HOOK = _gate.step_hook(_first_or_foreign_step)
_HOOK.__name__ = _HOOK.__qualname__ = "after_check_hicache_events"  # type: ignore[attr-defined]
_HOOK.__module__ = __name__
_HOOK.__doc__ = """AFTER ``UnifiedRadixCache.check_hicache_events(self)``: one runtime step.

Never raises, except ``DivergenceError`` under the ``abort`` policy."""

#: What the plugin registers AFTER ``UnifiedRadixCache.check_hicache_events``.
after_check_hicache_events: _gate.StepHookType = _HOOK


def _unbind() -> None:
    _HOOK.tree = _HOOK.step = _HOOK.pending = _HOOK.reap = None


os.register_at_fork(after_in_child=_unbind)


def reset_for_tests() -> None:
    """Forget this process's entry (closing it); tests only."""
    pid = os.getpid()
    _unbind()
    entry = _ENTRIES.pop(pid, None)
    _DECLINED.pop(pid, None)
    _write_path.detach()
    if entry is not None:
        entry.close()


#: Where SGLang empties L3 at run time (``/clear_hicache_storage_backend``).
CLEAR_TARGET = f"{_targets.TREE}.clear_storage_backend"


def after_clear_storage_backend(result: Any, tree: Any, *a: Any, **kw: Any) -> None:
    """AFTER ``UnifiedRadixCache.clear_storage_backend``: L3 was emptied (True), so
    the storage-tier blocks this process published are removed."""
    if result is not True:
        return None
    try:
        feed = _write_path.FEEDS.get(PROCESS.pid)
        if feed is not None and feed.events is not None and feed.owns_tree(tree):
            feed.events.storage_cleared()
    except Exception as exc:  # never into the scheduler
        logger.warning("hicache-existence: storage clear not published (%r)", exc)
    return None
