"""Test-only probes in the server processes (not stand-ins: nothing fails without them).

Enabled by the harness with ``HX_PROBES=1``; each writes one ``HX-PROBE {json}`` line
to the process's stderr (the server log), which ``Server.probes()`` reads back.

``tree``
    After ``UnifiedRadixCache.__init__``: the class of the tree's
    ``storage_existence_cache``, so a test sees which implementation the real
    server built (ours with the flag, upstream's without).

``diverge`` (only with ``HX_PROBE_DIVERGE_FILE`` set)
    Before each per-step hook call: once that file exists and holds this process's
    TP rank, replace the oldest of this rank's ``kv`` beliefs by a made-up page hash,
    once: a replica divergence of the same size injected in one rank, which only the
    digests can find, for the next check to report.

``cost`` (only with ``HX_PROBE_COST_DIR`` set; for ``benchmarks/real_server_cost.py``)
    In each scheduler process: the CPU time of the scheduler thread (its
    ``pthread_getcpuclockid`` clock, read from a helper thread) and the thread CPU
    time spent inside the package on that thread (CPU, not wall: a busy machine
    preempting the thread inside a call must not count as the package's) in every
    method of the current generation's ``PoolBeliefs`` and ``StorageExistenceCache``,
    of the write accounting (``WritePath``, cache mode's ``CacheModeWrites`` and
    ``Beliefs``, the ``CauseTracker``) and in the per-step hook
    ``after_check_hicache_events`` (nested calls counted once), and the write-path
    hooks themselves (``hook:<target>``; an AROUND hook net of upstream's call inside
    it, so the frames the hooks add around upstream count too; the write accounting's
    own methods, which only the hooks call, are timed inside them with
    ``HX_PROBE_COST_DETAIL=1``, for a breakdown). Written every 0.5 s
    to ``cost-<pid>.json`` in that directory, with a per-function breakdown.
    With ``HX_PROBE_RECORDER_TOGGLE=<path>`` the recorder is attached only while that
    file exists (``_RecorderToggle``; the record's ``recorder_on`` says which).
    With ``HX_PROBE_RECORDER=1`` also the trace recorder's scheduler-side calls (its
    ``tap``'s methods, which the cache's Tee calls, and ``Recorder.written``,
    ``prefetch``, ``begin_request``, ``end_request``), timed on their own (nested
    inside the cache's methods, so their time is also part of the package's):
    ``rec_busy`` and ``rec_poll`` hold ``[thread ns, calls]`` per kind of iteration. The
    timers' own cost (a thread-CPU clock read is a system call, ~1 us here) falls
    partly inside the measured interval: the raw share is an upper bound. The probe
    also measures, on the scheduler thread at start-up, what one timed call of an
    empty function records (``timer_ns_per_call``), so a reader can subtract it.
"""

from __future__ import annotations

import json
import os
import sys
from types import ModuleType
from typing import Any

import hx_cpu_standins


def emit(kind: str, **fields: Any) -> None:
    rec = {"kind": kind, "pid": os.getpid(), **fields}
    sys.stderr.write("HX-PROBE " + json.dumps(rec, sort_keys=True) + "\n")
    sys.stderr.flush()


def _probe_tree(mod: ModuleType) -> None:
    cls = mod.UnifiedRadixCache
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        cache = getattr(self, "storage_existence_cache", None)
        kind = type(cache)
        emit("tree", cache_class=f"{kind.__module__}.{kind.__qualname__}")

    cls.__init__ = __init__


class _Cost:
    """What the cost probe has counted on the scheduler thread (thread CPU ns)."""

    def __init__(self) -> None:
        self.ns = 0  # inside the package (top-level calls; nested calls counted once)
        self.calls = 0
        self.hook_ns = 0  # of which inside the per-step hook
        self.depth = 0
        self.main: int | None = None
        # Calls of a timed function inside another's timed call on the scheduler
        # thread: each passes through its wrapper (a frame and two tests) inside
        # the outer call's interval; the share nets them out (``passthrough_ns``).
        self.nested = 0
        self.hook_nested = 0  # of which inside the per-step hook
        self.passthrough_ns = 0.0  # one nested wrapper's cost (start-up calibration)
        self.timer_ns = 0.0  # one timed call's timers (start-up calibration)
        self.it_nested0 = (0, 0)
        self.pid = os.getpid()
        #: name -> [ns, calls, this iteration's ns, calls, busy ns, calls, poll ns, calls]
        self.by_name: dict[str, list[int]] = {}
        #: The slots of ``by_name`` touched in the current iteration.
        self.touched: list[list[int]] = []
        # Scheduler loop iterations: "busy" ones ran a batch or processed a batch's
        # result; "poll" ones did neither (idle, or waiting for transfers/storage).
        self.it_t0 = 0
        self.it_ns0 = 0
        self.it_calls0 = 0
        self.it_hook0 = 0
        self.it_work = False
        # iterations, thread ns, package ns, package calls, nested calls
        self.busy = [0, 0, 0, 0, 0]
        # iterations, thread ns, package ns, calls, hook ns, nested calls, of which in the hook
        self.poll = [0, 0, 0, 0, 0, 0, 0]
        # The recorder's own methods (nested timers): total and per iteration kind.
        self.rec_ns = 0
        self.rec_calls = 0
        self.it_rec0 = (0, 0)
        self.rec_busy = [0, 0]
        self.rec_poll = [0, 0]
        # The in-situ timer control (``_probe_cost_hooks``): an empty function timed
        # beside every per-step hook call, in the same cache state: [ns, calls].
        self.ctrl_ns = 0
        self.ctrl_calls = 0
        self.it_ctrl0 = (0, 0)
        self.ctrl_busy = [0, 0]
        self.ctrl_poll = [0, 0]
        # The in-situ AROUND control (``_around_control``): an empty AROUND hook timed
        # beside every real one, as ``_hook_timed`` times it (its pause included):
        # [ns, calls]; and the real AROUND hook calls per iteration kind.
        self.actrl_ns = 0
        self.actrl_calls = 0
        self.around_calls = 0
        self.it_actrl0 = (0, 0, 0)
        self.actrl_busy = [0, 0, 0]  # ns, control calls, real AROUND calls
        self.actrl_poll = [0, 0, 0]
        # The per-site control (``_site_control``): an empty function timed beside
        # every other top-level call of the package (a method, an AFTER hook: all but
        # the per-step hook and the AROUND hooks, which have their own), at its own
        # call site: [ns, calls].
        self.sctrl_ns = 0
        self.sctrl_calls = 0
        self.it_sctrl0 = (0, 0)
        self.sctrl_busy = [0, 0]
        self.sctrl_poll = [0, 0]


_COST = _Cost()
_HOOK = "after_check_hicache_events"


def _timed(fn: Any, prefix: str = "") -> Any:
    """``fn`` timed on the scheduler thread.  ``prefix`` (upstream's own cache, timed
    under ``upstream.``): kept in the per-function breakdown only, never in the
    package's totals."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident
    name = prefix + getattr(fn, "__qualname__", getattr(fn, "__name__", "wrapped"))
    slot = _COST.by_name.setdefault(name, [0] * 8)
    is_hook = name == _HOOK
    own = not prefix
    # The per-step hook has its own control (``_probe_cost_hooks``); upstream's
    # cache is not the package's, so its timers are not netted out of it.
    control = _site_control() if own and not is_hook else None
    flip = [False]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _COST.depth:
            if get_ident() == _COST.main:
                _COST.nested += 1
            return fn(*args, **kwargs)
        if get_ident() != _COST.main:
            return fn(*args, **kwargs)
        first = False
        if control is not None:
            first = flip[0] = not flip[0]
            if first:
                control(args, kwargs)
        _COST.depth = 1
        n0 = _COST.nested
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = perf() - t0
            if own:
                _COST.ns += dt
                _COST.calls += 1
            else:  # not the package's: its nested calls are not either (their
                # wrappers' calibrated cost is taken off this call's time instead)
                dt -= int((_COST.nested - n0) * _COST.passthrough_ns)
                _COST.nested = n0
            if is_hook:
                _COST.hook_ns += dt
                _COST.hook_nested += _COST.nested - n0
            slot[0] += dt
            slot[1] += 1
            if not slot[3]:
                _COST.touched.append(slot)
            slot[2] += dt
            slot[3] += 1
            _COST.depth = 0
            if control is not None and not first:
                control(args, kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _site_control() -> Any:
    """An empty function timed as ``_timed`` times the package's, with the same
    arguments, into ``sctrl_*``: what the timers record per call at that call site,
    in its own cold state.  Run before the timed call one call and after it the
    next (as the per-step hook's control), so that neither always finds the timers'
    code warmed by the other; the share net of it (``share_insitu_site``) nets every
    timed call at a control taken beside it rather than beside the per-step hook."""
    import time

    perf = time.thread_time_ns

    def empty(*args: Any, **kwargs: Any) -> None:
        return None

    def control(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t0 = perf()
        try:
            empty(*args, **kwargs)
        finally:
            _COST.sctrl_ns += perf() - t0
            _COST.sctrl_calls += 1

    return control


def _rec_timed(fn: Any) -> Any:
    """A recorder method, timed whatever the nesting (its own counters)."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_ident() != _COST.main:
            return fn(*args, **kwargs)
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            _COST.rec_ns += perf() - t0
            _COST.rec_calls += 1

    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _inner_timed(fn: Any, name: str) -> Any:
    """A function inside the package's timed calls (``HX_PROBE_COST_INNER=1``), timed
    whatever the nesting into its own ``by_name`` slot ``inner:<name>`` (not added
    to the package's total, which already holds it): where a timed call's time goes."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident
    slot = _COST.by_name.setdefault(f"inner:{name}", [0] * 8)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_ident() != _COST.main:
            return fn(*args, **kwargs)
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = perf() - t0
            slot[0] += dt
            slot[1] += 1
            if not slot[3]:
                _COST.touched.append(slot)
            slot[2] += dt
            slot[3] += 1

    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


#: ``HX_PROBE_COST_INNER=1``: module -> (class, method) timed as ``_inner_timed``.
_INNER = {
    "hicache_existence.runtime": (("ExistenceRuntime", "_step_due"),),
    "hicache_existence.exporters": (("Telemetry", "step"),),
    "hicache_existence.exporters.multiprocess": (("MultiprocessFeeder", "flush"),),
    # cache mode's acks, as the step hook's reaper runs them
    "hicache_existence.integrations.sglang.cache_mode": (("CacheModeWrites", "reap"),),
}


def _probe_inner(mod: ModuleType) -> None:
    for cls_name, method in _INNER.get(mod.__name__, ()):
        cls = getattr(mod, cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is not None:
            setattr(
                cls, method, _inner_timed(getattr(fn, "__wrapped__", fn), f"{cls_name}.{method}")
            )


class _TimedTap:
    """The recorder's tap (what the cache's Tee calls) with each method timed; its
    attributes (``request``, ``dropped``, ``errors``) are the tap's own."""

    _METHODS = ("touched", "added", "invalidated", "inflight", "cleared")

    def __init__(self, tap: Any) -> None:
        object.__setattr__(self, "_tap", tap)
        for name in self._METHODS:
            object.__setattr__(self, name, _rec_timed(getattr(tap, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_tap"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_tap"), name, value)


def _probe_cost_recorder(mod: ModuleType) -> None:
    cls = mod.Recorder
    for name in ("begin_request", "end_request"):
        setattr(cls, name, _rec_timed(getattr(cls, name)))
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.tap = _TimedTap(self.tap)
        # the write path's calls: the tap's own methods, held on the instance
        # since the compiled tap (on the class before)
        for name in ("written", "prefetch"):
            setattr(self, name, _rec_timed(getattr(self, name)))

    cls.__init__ = __init__


def _wrap_class(cls: type) -> None:
    for name, value in list(vars(cls).items()):
        if callable(value) and not name.startswith("__") and not isinstance(value, type):
            setattr(cls, name, _timed(value))


def _probe_cost_cache(mod: ModuleType) -> None:
    _wrap_class(mod.PoolBeliefs)
    _wrap_class(mod.StorageExistenceCache)


def _probe_cost_upstream_cache(mod: ModuleType) -> None:
    # Upstream's own existence cache, which ours replaces: what the server without
    # the package spends in the same calls (``upstream.`` in the breakdown only).
    for name in ("PoolExistenceBeliefs", "StorageExistenceCache"):  # 0.5.21: the second only
        cls = getattr(mod, name, None)
        if cls is None or not cls.__module__.startswith("sglang."):  # ours, if replaced
            continue
        for attr, value in list(vars(cls).items()):
            if callable(value) and not attr.startswith("__") and not isinstance(value, type):
                setattr(cls, attr, _timed(value, "upstream."))


def _probe_cost_flat(mod: ModuleType) -> None:
    _wrap_class(mod.FlatStorageExistenceCache)
    if hasattr(mod, "FlatPoolBeliefs"):  # the flat generation's pool view
        _wrap_class(mod.FlatPoolBeliefs)


def _probe_cost_write_path(mod: ModuleType) -> None:
    # The write accounting's work (the hooks' own frames: ``_probe_cost_write_hooks``).
    _wrap_class(mod.WritePath)


def _accounter(name: str) -> Any:
    """``account(dt)``: one top-level call of the package, ``dt`` ns, under ``name``."""
    slot = _COST.by_name.setdefault(name, [0] * 8)

    def account(dt: int) -> None:
        _COST.ns += dt
        _COST.calls += 1
        slot[0] += dt
        slot[1] += 1
        if not slot[3]:
            _COST.touched.append(slot)
        slot[2] += dt
        slot[3] += 1

    return account


def _hook_timed(hooked: Any, kind: str, name: str, compiled: bool = False) -> Any:
    """A write-path hook as SGLang calls it, timed as one of the package's top-level
    calls (``hook:<name>``): an AFTER hook whole; an AROUND hook net of upstream's
    call inside it, during which the timer stops and the package's own methods that
    upstream calls are top-level calls again (as they are without the hook)."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident
    account = _accounter(f"hook:{name}")

    if kind == "AFTER":
        site = _site_control()
        turn = [False]

        def after(*args: Any, **kwargs: Any) -> Any:
            if _COST.depth or get_ident() != _COST.main:
                return hooked(*args, **kwargs)
            first = turn[0] = not turn[0]
            if first:
                site(args, kwargs)
            _COST.depth = 1
            t0 = perf()
            try:
                return hooked(*args, **kwargs)
            finally:
                account(perf() - t0)
                _COST.depth = 0
                if not first:
                    site(args, kwargs)

        return after

    control = _around_control(compiled)
    flip = [False]

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:
        if _COST.depth or get_ident() != _COST.main:
            return hooked(original, *args, **kwargs)
        # The control nests with the hook around the same upstream call, inside it one
        # call and outside it the next: whichever is inside runs its tail first after
        # upstream, in the cold state upstream leaves (``_around_control``).
        _COST.around_calls += 1
        inside = flip[0] = not flip[0]
        if inside:

            def nested(*a: Any, **kw: Any) -> Any:
                return control(lambda: original(*a, **kw))

            return _paused(perf, account, hooked, nested, args, kwargs)
        return control(lambda: _paused(perf, account, hooked, original, args, kwargs))

    return around


def _paused(
    perf: Any,
    record: Any,
    hooked: Any,
    original: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``hooked(original, *args, **kwargs)`` timed into ``record`` with the timer
    paused during ``original`` (upstream's call): an AROUND hook's own time.  The
    AROUND control runs this very code around an empty hook and upstream."""
    spent = [0]  # upstream's time inside the hook (its own timers included)

    def upstream(*a: Any, **kw: Any) -> Any:
        _COST.depth = 0
        u0 = perf()
        try:
            return original(*a, **kw)
        finally:
            spent[0] += perf() - u0
            _COST.depth = 1

    _COST.depth = 1
    t0 = perf()
    try:
        return hooked(upstream, *args, **kwargs)
    finally:
        # The pause's own timers are a timed call's more: off at their calibration.
        record(max(0, perf() - t0 - spent[0] - int(_COST.timer_ns)))
        _COST.depth = 0


def _around_control(compiled: bool = False) -> Any:
    """``control(call)``: ``call()`` (by default an empty upstream) inside an empty
    AROUND hook timed by the code that times a real AROUND hook (``_paused``), into
    ``actrl_*``.  A real hook's timed call nests with it around the same upstream
    call, inside it one call and outside it the next: the timers and frames after a
    real upstream call run cold (upstream evicted them), and a control beside the
    hook, after an empty upstream, ran them hot and under-netted every AROUND call
    (in process, an empty hook around an upstream that leaves the caches cold nets
    at about 0.85 us a call against a control beside it, about 0 nested).
    ``compiled``: the hook is a C call into upstream (``operator.call``, 3.11+), for
    a compiled hook such as the recorder's bracket, whose control must not run a
    Python frame the hook does not."""
    import operator
    import time

    perf = time.thread_time_ns

    def empty_upstream() -> None:
        return None

    def empty_hook(original: Any) -> Any:
        return original()

    if compiled and hasattr(operator, "call"):
        empty_hook = operator.call

    def record(dt: int) -> None:
        _COST.actrl_ns += dt
        _COST.actrl_calls += 1

    def control(call: Any = empty_upstream) -> Any:
        return _paused(perf, record, empty_hook, call, (), {})

    return control


def _probe_cost_write_hooks(mod: ModuleType) -> None:
    bound = mod.Hook.bound

    def timed_bound(self: Any, target: object) -> Any:
        hooked = bound(self, target)
        return _hook_timed(hooked, self.kind, self.target.rsplit(".", 1)[-1])

    mod.Hook.bound = timed_bound


def _probe_cost_recorder_hooks(mod: ModuleType) -> None:
    # The recorder's request boundaries where the plugin registered them on the
    # class, an AROUND hook (before 2209f49), rather than through ``Hook.bound``:
    # timed as the write-path hooks are.
    if hasattr(mod, "around_insert"):
        mod.around_insert = _hook_timed(mod.around_insert, "AROUND", "insert")


def _probe_cost_recorder_bracket(mod: ModuleType) -> None:
    """The recorder's request boundaries where the runtime brackets the tree's
    insert with ``Recorder.bracket`` (one closure calling insert): timed as an
    AROUND hook is (``_paused``: the timer stops during insert, inside which the
    package's methods are top-level calls again), with the AROUND control nested
    with it (inside it one call, outside it the next) and its time as ``hook:insert``."""
    import threading
    import time

    if not hasattr(mod.Recorder, "bracket"):
        return
    perf = time.thread_time_ns
    get_ident = threading.get_ident
    original_bracket = mod.Recorder.bracket
    account = _accounter("hook:insert")

    def bracket(self: Any, insert: Any) -> Any:
        spent = [0]
        timing = [False]
        inside = [False]  # the control nested between the bracket and insert

        def upstream(*a: Any, **kw: Any) -> Any:
            if not timing[0]:
                return insert(*a, **kw)
            _COST.depth = 0
            u0 = perf()
            try:
                if inside[0]:
                    return control(lambda: insert(*a, **kw))
                return insert(*a, **kw)
            finally:
                spent[0] += perf() - u0
                _COST.depth = 1

        inner = original_bracket(self, upstream)
        compiled = type(inner).__name__ == "Bracket"  # the C bracket: no Python frame
        control = _around_control(compiled)

        def run(a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
            spent[0] = 0
            timing[0] = True
            _COST.depth = 1
            t0 = perf()
            try:
                return inner(*a, **kw)
            finally:
                account(max(0, perf() - t0 - spent[0] - int(_COST.timer_ns)))
                timing[0] = False
                _COST.depth = 0

        def timed(*a: Any, **kw: Any) -> Any:
            if _COST.depth or get_ident() != _COST.main:
                return inner(*a, **kw)
            # The control nests with the bracket around the insert, inside it one call
            # and outside it the next (``_around_control``).
            _COST.around_calls += 1
            inside[0] = not inside[0]
            if inside[0]:
                return run(a, kw)
            return control(lambda: run(a, kw))

        timed.hx_brackets = inner.hx_brackets  # type: ignore[attr-defined]
        return timed

    mod.Recorder.bracket = bracket


def _probe_cost_cache_mode(mod: ModuleType) -> None:
    # Cache mode's write path: the dedup plan, the ack reaping, the beliefs it keeps.
    _wrap_class(mod.CacheModeWrites)
    if hasattr(mod, "Beliefs"):  # before one protocol served both generations (6f8cdfc)
        _wrap_class(mod.Beliefs)


def _probe_cost_causes(mod: ModuleType) -> None:
    _wrap_class(mod.CauseTracker)


def _control() -> Any:
    """An empty hook timed like ``_timed`` times the real one, into ``ctrl_*``: what
    the timers record per call in the cold state of a scheduler iteration (the
    start-up calibration, ``timer_ns_per_call``, runs hot, and under-subtracts)."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident

    def empty(result: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def control(result: Any, *args: Any, **kwargs: Any) -> None:
        if _COST.depth or get_ident() != _COST.main:
            return None
        t0 = perf()
        try:
            return empty(result, *args, **kwargs)
        finally:
            _COST.ctrl_ns += perf() - t0
            _COST.ctrl_calls += 1

    return control


def _probe_cost_hooks(mod: ModuleType) -> None:
    hook = _timed(mod.after_check_hicache_events)
    control = _control()
    flip = [False]

    def after_check_hicache_events(result: Any, *args: Any, **kwargs: Any) -> None:
        # The control runs before the hook one call and after it the next, so that
        # neither always finds the timers' code warmed by the other.
        first = flip[0] = not flip[0]
        if first:
            control(result, *args, **kwargs)
        try:
            return hook(result, *args, **kwargs)
        finally:
            if not first:
                control(result, *args, **kwargs)

    after_check_hicache_events.__wrapped__ = hook  # type: ignore[attr-defined]
    mod.after_check_hicache_events = after_check_hicache_events


def _iteration_marks(cls: type) -> None:
    """Close a loop iteration at each ``ingest_requests`` (the first call of every
    iteration of both event loops) and mark it busy when it runs a batch or
    processes a batch's result."""
    import threading
    import time

    perf = time.thread_time_ns
    get_ident = threading.get_ident
    ingest = cls.ingest_requests

    def ingest_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        c = _COST
        if get_ident() == c.main:
            if _TOGGLE is not None:
                _TOGGLE.poll()
            now = perf()
            if c.it_t0:
                dns, dcalls = c.ns - c.it_ns0, c.calls - c.it_calls0
                rec = c.rec_busy if c.it_work else c.rec_poll
                rec[0] += c.rec_ns - c.it_rec0[0]
                rec[1] += c.rec_calls - c.it_rec0[1]
                ctrl = c.ctrl_busy if c.it_work else c.ctrl_poll
                ctrl[0] += c.ctrl_ns - c.it_ctrl0[0]
                ctrl[1] += c.ctrl_calls - c.it_ctrl0[1]
                actrl = c.actrl_busy if c.it_work else c.actrl_poll
                actrl[0] += c.actrl_ns - c.it_actrl0[0]
                actrl[1] += c.actrl_calls - c.it_actrl0[1]
                actrl[2] += c.around_calls - c.it_actrl0[2]
                sctrl = c.sctrl_busy if c.it_work else c.sctrl_poll
                sctrl[0] += c.sctrl_ns - c.it_sctrl0[0]
                sctrl[1] += c.sctrl_calls - c.it_sctrl0[1]
                dnested = c.nested - c.it_nested0[0]
                if c.it_work:
                    b = c.busy
                    b[0] += 1
                    b[1] += now - c.it_t0
                    b[2] += dns
                    b[3] += dcalls
                    b[4] += dnested
                else:
                    q = c.poll
                    q[0] += 1
                    q[1] += now - c.it_t0
                    q[2] += dns
                    q[3] += dcalls
                    q[4] += c.hook_ns - c.it_hook0
                    q[5] += dnested
                    q[6] += c.hook_nested - c.it_nested0[1]
                at = 4 if c.it_work else 6
                for slot in c.touched:
                    slot[at] += slot[2]
                    slot[at + 1] += slot[3]
                    slot[2] = slot[3] = 0
                c.touched.clear()
            c.it_t0, c.it_ns0, c.it_calls0, c.it_hook0 = now, c.ns, c.calls, c.hook_ns
            c.it_rec0 = (c.rec_ns, c.rec_calls)
            c.it_ctrl0 = (c.ctrl_ns, c.ctrl_calls)
            c.it_actrl0 = (c.actrl_ns, c.actrl_calls, c.around_calls)
            c.it_sctrl0 = (c.sctrl_ns, c.sctrl_calls)
            c.it_nested0 = (c.nested, c.hook_nested)
            c.it_work = False
        return ingest(self, *args, **kwargs)

    cls.ingest_requests = ingest_requests
    for name in ("run_batch", "process_batch_result"):
        original = getattr(cls, name)

        def marked(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            _COST.it_work = True
            return _original(self, *args, **kwargs)

        setattr(cls, name, marked)


class _RecorderToggle:
    """``HX_PROBE_RECORDER_TOGGLE=<path>``: the recorder records while that file
    exists and is detached while it does not (its tap out of the cache's Tee, the
    write path's and insert hook's recorder unset), checked every 256 scheduler
    iterations, so one server runs alternating rounds with and without it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        self.on: bool | None = None

    def poll(self) -> None:
        self.count += 1
        if self.count % 256:
            return
        want = os.path.exists(self.path)
        if want == self.on:
            return
        from hicache_existence.integrations.sglang import hooks

        entry = hooks.current()
        recorder = entry.runtime.recorder if entry is not None else None
        if entry is None or recorder is None:
            return
        tee = entry.runtime.tee
        others = tuple(o for o in tee.observers if o is not recorder.tap)
        tee.observers = (*others, recorder.tap) if want else others
        entry.write_path.attach_recorder(recorder if want else None)
        # The insert hook, where the runtime installs it on the tree (only with a
        # recorder): out of the tree while detached, as in a server without one.
        from hicache_existence.integrations.sglang import recorder_hooks

        tree = getattr(hooks._HOOK, "tree", None)
        if tree is not None and hasattr(recorder_hooks, "install_on"):
            if want:
                recorder_hooks.install_on(tree, recorder)
            else:
                vars(tree).pop("insert", None)
        self.on = want


_TOGGLE: _RecorderToggle | None = None


def _cost_writer(out_dir: str) -> None:
    import threading
    import time

    main = threading.get_ident()
    _COST.main = main
    clock = time.pthread_getcpuclockid(main)
    # Calibration: what the timers alone record per call (same wrapper, empty body).
    empty = _timed(lambda: None)
    ns0, calls0 = _COST.ns, _COST.calls
    for _ in range(2000):
        empty()
    timer_ns = _COST.timer_ns = (_COST.ns - ns0) / max(1, _COST.calls - calls0)
    # What a nested call's wrapper adds to its caller's interval: a timed loop of
    # wrapped calls against the same loop of direct calls (hot, so it under-subtracts).
    inner_fn = lambda: None  # noqa: E731
    inner = _timed(inner_fn)

    def via_wrapper() -> None:
        for _ in range(200):
            inner()

    def direct() -> None:
        for _ in range(200):
            inner_fn()

    costs = []
    for body in (via_wrapper, direct):
        timed = _timed(body)
        ns1 = _COST.ns
        for _ in range(50):
            timed()
        costs.append(_COST.ns - ns1)
    passthrough_ns = _COST.passthrough_ns = max(0.0, (costs[0] - costs[1]) / (50 * 200))
    _COST.ns, _COST.calls, _COST.nested = ns0, calls0, 0
    _COST.sctrl_ns = _COST.sctrl_calls = 0
    for fn in (empty, inner, via_wrapper, direct):
        _COST.by_name.pop(getattr(getattr(fn, "__wrapped__", fn), "__qualname__", ""), None)

    def run() -> None:
        path = os.path.join(out_dir, f"cost-{os.getpid()}.json")
        while True:
            rec = {
                "pid": os.getpid(),
                "sched_cpu_ns": time.clock_gettime_ns(clock),
                "pkg_ns": _COST.ns,
                "pkg_calls": _COST.calls,
                "hook_ns": _COST.hook_ns,
                "busy": list(_COST.busy),
                "poll": list(_COST.poll),
                "timer_ns_per_call": timer_ns,
                "passthrough_ns_per_call": passthrough_ns,
                "recorder_on": _TOGGLE.on if _TOGGLE is not None else None,
                "rec_busy": list(_COST.rec_busy),
                "rec_poll": list(_COST.rec_poll),
                "ctrl_busy": list(_COST.ctrl_busy),
                "ctrl_poll": list(_COST.ctrl_poll),
                "actrl_busy": list(_COST.actrl_busy),
                "actrl_poll": list(_COST.actrl_poll),
                "sctrl_busy": list(_COST.sctrl_busy),
                "sctrl_poll": list(_COST.sctrl_poll),
                "by_name": {k: list(v) for k, v in _COST.by_name.items()},
                "t": time.time(),
            }
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, path)
            time.sleep(0.5)

    threading.Thread(target=run, name="hx-cost-probe", daemon=True).start()


def _probe_cost_scheduler(mod: ModuleType) -> None:
    global _TOGGLE
    out_dir = os.environ["HX_PROBE_COST_DIR"]
    if os.environ.get("HX_PROBE_RECORDER_TOGGLE"):
        _TOGGLE = _RecorderToggle(os.environ["HX_PROBE_RECORDER_TOGGLE"])
    cls = mod.Scheduler
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _cost_writer(out_dir)

    cls.__init__ = __init__
    _iteration_marks(cls)


def _probe_diverge(mod: ModuleType) -> None:
    trigger = os.environ["HX_PROBE_DIVERGE_FILE"]
    step = mod.after_check_hicache_events
    done = []

    def after_check_hicache_events(result: Any, *args: Any, **kwargs: Any) -> None:
        if not done and os.path.exists(trigger):
            entry = mod.current()
            rank = getattr(getattr(entry, "facts", None), "tp_rank", None)
            with open(trigger) as f:
                wanted = f.read().strip()
            if entry is not None and str(rank) == wanted:
                # Replace this rank's oldest belief by a made-up page: the pool keeps
                # its size, so only the digests can tell the replicas apart.
                pool = entry.cache.pool("kv")
                before = len(pool)
                oldest = pool.lru_keys()[:1]
                pool.invalidate_beyond(oldest, 0)
                pool.add(["f" * 64])
                emit(
                    "diverge",
                    tp_rank=rank,
                    page="f" * 64,
                    replaced=oldest,
                    sizes=[before, len(pool)],
                )
            done.append(True)
        return step(result, *args, **kwargs)

    mod.after_check_hicache_events = after_check_hicache_events


def install() -> None:
    hx_cpu_standins.on_import("sglang.srt.mem_cache.unified_radix_cache", _probe_tree)
    if os.environ.get("HX_PROBE_COST_DIR"):
        if os.environ.get("HX_PROBE_COST_CACHE", "1") != "0":
            # ``HX_PROBE_COST_CACHE=0`` (cache mode): upstream asks the cache nothing
            # there, so its methods run only nested inside the package's hooks, where a
            # wrapper adds its cold cost, which the hot calibration under-subtracts, and
            # nothing to the breakdown.
            hx_cpu_standins.on_import("hicache_existence.core.cache", _probe_cost_cache)
            hx_cpu_standins.on_import("hicache_existence.core.flat", _probe_cost_flat)
        hx_cpu_standins.on_import(
            "sglang.srt.mem_cache.buffer_mode.storage_existence_cache", _probe_cost_upstream_cache
        )
        if os.environ.get("HX_PROBE_COST_DETAIL"):
            # The write accounting's methods, which only the hooks call: a breakdown
            # of the hooks' time, at the price of a nested wrapper per call, whose
            # cold cost inside the hook's interval the hot calibration under-subtracts.
            hx_cpu_standins.on_import(
                "hicache_existence.integrations.sglang.write_path", _probe_cost_write_path
            )
            hx_cpu_standins.on_import(
                "hicache_existence.integrations.sglang.cache_mode", _probe_cost_cache_mode
            )
            hx_cpu_standins.on_import("hicache_existence.accounting.causes", _probe_cost_causes)
        hx_cpu_standins.on_import(
            "hicache_existence.integrations.sglang.write_hooks.binding", _probe_cost_write_hooks
        )
        hx_cpu_standins.on_import("hicache_existence.integrations.sglang.hooks", _probe_cost_hooks)
        hx_cpu_standins.on_import(
            "hicache_existence.integrations.sglang.recorder_hooks", _probe_cost_recorder_hooks
        )
        hx_cpu_standins.on_import(
            "hicache_existence.accounting.recorder", _probe_cost_recorder_bracket
        )
        hx_cpu_standins.on_import("sglang.srt.managers.scheduler", _probe_cost_scheduler)
        if os.environ.get("HX_PROBE_COST_INNER"):
            for module in _INNER:
                hx_cpu_standins.on_import(module, _probe_inner)
        if os.environ.get("HX_PROBE_RECORDER"):
            hx_cpu_standins.on_import("hicache_existence.accounting.recorder", _probe_cost_recorder)
    if os.environ.get("HX_PROBE_DIVERGE_FILE"):
        hx_cpu_standins.on_import("hicache_existence.integrations.sglang.hooks", _probe_diverge)
