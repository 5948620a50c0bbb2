"""The per-step hook (``core.gate``): the compiled ``StepHook`` against its pure-Python
twin, ``PyStepHook``, which is the reference (issue 31: an idle step is one C call
and no Python frame of ours, in both host memory modes), and the integration's hook
built on it (``integrations.sglang.hooks.after_check_hicache_events``).

Both hooks are driven through the same scripts of binds, unbinds and calls, with the
bound tree and foreign ones, pending operations empty and not, a ``reap`` and a
``step`` that succeed, raise, or rebind the hook; every call's answer, every call
the hook makes and its state after each call must match, call for call."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.core import gate

CHook = gate.c_hook()
CGate = gate.c_gate()
IMPLS: dict[str, Any] = {"python": (gate.PyStepHook, gate.PyStepGate)}
if CHook is not None and CGate is not None:
    IMPLS["c"] = (CHook, CGate)

needs_c = pytest.mark.skipif(CHook is None, reason="compiled hook not built")

TREES = 3  # tree 0 is the one scripts bind; the others are foreign (or bound later)


class _BadLen:
    def __len__(self) -> int:
        raise ZeroDivisionError("len")


class _Interrupt(BaseException):
    """Not an ``Exception``: a signal, not a failure of ours (KeyboardInterrupt)."""


def _drive(impl: Any, gate_impl: Any, script: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``script`` through a hook of ``impl``; what each call returned or raised,
    what the hook called (``log``) and its state after each call."""
    log: list[Any] = []
    trees = [NS(name=f"tree{i}") for i in range(TREES)]
    clock = NS(now=0.0)

    def fallback(*args: Any, **kwargs: Any) -> str:
        log.append(("fallback", [_name(a) for a in args], sorted(kwargs)))
        return "fallback"

    hook = impl(fallback)

    def due(n: int, now: float, flush: bool) -> str:
        log.append(("due", n))
        g.wake = n + 2  # every other step is due
        g.flush_at = float("inf")
        return "due"

    g = gate_impl(due, lambda: clock.now, 0.002, 0.5)

    def steps(kind: str) -> Any:
        def counted() -> str:
            log.append(("step",))
            return "stepped"

        def raising() -> None:
            log.append(("step raises",))
            raise RuntimeError("divergence")

        return {"none": None, "gate": g, "counted": counted, "raises": raising}[kind]

    def reaps(kind: str) -> Any:
        def reap(tree: Any) -> str:
            log.append(("reap", _name(tree)))
            if kind == "raises":
                raise ValueError("reap")
            if kind == "interrupt":
                raise _Interrupt("stop")
            if kind == "unbinds":
                hook.tree = hook.step = None
            if kind == "restep":
                hook.step = steps("counted")
            if kind == "drains":
                pending.clear()
            return "reaped"

        return None if kind == "none" else reap

    pending: Any = {}
    out: list[Any] = []
    for op, *arg in script:
        if op == "bind":
            tree, step_kind, pending_kind, reap_kind = arg
            pending = {
                "none": None,
                "dict": {},
                "set": set(),
                "list": [],
                "bad": _BadLen(),
                "unsized": object(),
            }[pending_kind]
            hook.tree, hook.step, hook.pending, hook.reap = (
                trees[tree],
                steps(step_kind),
                pending,
                reaps(reap_kind),
            )
            continue
        if op == "unbind":
            hook.tree = hook.step = hook.pending = hook.reap = None
            continue
        if op == "launch":  # writes in flight (or acknowledged) in the bound pending
            if isinstance(pending, dict):
                pending[len(pending)] = "op"
            elif isinstance(pending, (set, list)):
                getattr(pending, "add", getattr(pending, "append", None))(len(pending))
            continue
        if op == "drain":
            if isinstance(pending, (dict, set, list)):
                pending.clear()
            continue
        # a call: ("call", shape, tree) as sglang's AFTER wrapper makes it, or odder
        shape, tree = arg
        clock.now += 0.001
        args: tuple[Any, ...] = {
            "after": ("result", trees[tree]),
            "more": ("result", trees[tree], "extra"),
            "short": (trees[tree],),
            "none": (),
            "first": (trees[tree], "result"),
            "nothing": ("result", None),  # None in the tree's place: unbound is not None
        }[shape]
        kwargs = {"kw": 1} if shape == "more" else {}
        try:
            answer: Any = ("returned", hook(*args, **kwargs))
        except (Exception, _Interrupt) as exc:
            answer = ("raised", type(exc).__name__, str(exc))
        state = (
            _name(hook.tree),
            hook.step is None,
            hook.reap_errors,
            g.steps,
        )
        out.append((answer, state, list(log)))
        log.clear()
    return out


def _name(obj: Any) -> Any:
    return getattr(obj, "name", obj if obj is None or isinstance(obj, str) else type(obj).__name__)


binds = st.tuples(
    st.just("bind"),
    st.sampled_from([0, 0, 0, 1]),
    st.sampled_from(["none", "gate", "gate", "counted", "raises"]),
    st.sampled_from(["none", "dict", "dict", "dict", "set", "list", "bad", "unsized"]),
    st.sampled_from(["none", "ok", "ok", "raises", "interrupt", "unbinds", "restep", "drains"]),
)
calls = st.tuples(
    st.just("call"),
    st.sampled_from(["after"] * 6 + ["more", "short", "none", "first", "nothing"]),
    st.sampled_from([0, 0, 0, 0, 1, 2]),
)
#: A bind first, then mostly calls (most of them steps of tree 0, the one bound
#: most often), writes launched and drained, binds and unbinds.
scripts = st.tuples(
    binds,
    st.lists(
        st.one_of(
            calls,
            calls,
            calls,
            st.tuples(st.just("launch")),
            st.tuples(st.just("launch")),
            st.tuples(st.just("drain")),
            binds,
            st.tuples(st.just("unbind")),
        ),
        min_size=10,
        max_size=60,
    ),
).map(lambda first_rest: [first_rest[0], *first_rest[1]])


@needs_c
@settings(max_examples=400, deadline=None)
@given(script=scripts)
def test_compiled_hook_answers_as_the_python_one(script):
    """Same answers, same calls of fallback / reap / step (and the gate's due), same
    state after every call; the compiled hook with the compiled gate as its step
    (called without dispatch) and with the Python one (called as any callable)."""
    expected = _drive(gate.PyStepHook, gate.PyStepGate, script)
    assert CHook is not None and CGate is not None
    assert _drive(CHook, CGate, script) == expected
    assert _drive(CHook, gate.PyStepGate, script) == expected


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_a_bound_step_reaps_only_while_writes_are_pending(name):
    """Bound, a call for its tree reaps only with operations pending, then steps,
    and returns ``None`` (an AFTER hook's answer that keeps upstream's result);
    every other call, unbound or for another tree, is the fallback's, as given."""
    impl, _ = IMPLS[name]
    seen: list[Any] = []
    hook = impl(lambda *a, **k: seen.append(("fallback", a, k)) or "fb")
    tree, other, pending = object(), object(), {}
    assert hook("r", tree) == "fb" and seen == [("fallback", ("r", tree), {})]
    hook.tree, hook.pending = tree, pending
    hook.step = lambda: seen.append("step") or "ignored"
    hook.reap = lambda t: seen.append(("reap", t is tree))
    seen.clear()
    assert hook("r", tree) is None and seen == ["step"]
    pending[7] = "op"
    assert hook("r", tree, "x") is None and seen == ["step", ("reap", True), "step"]
    seen.clear()
    assert hook("r", other, k=1) == "fb" and seen == [("fallback", ("r", other), {"k": 1})]
    assert hook(tree) == "fb"  # the tree as the result: not a step of it
    hook.tree = None
    seen.clear()
    assert hook("r", tree) == "fb" and seen == [("fallback", ("r", tree), {})]


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_reap_failures_stop_at_the_hook_and_step_failures_do_not(name):
    """An ``Exception`` from ``reap`` (or from sizing ``pending``) is counted in
    ``reap_errors`` and the step still runs; a ``BaseException`` that is not one
    (a KeyboardInterrupt) and every exception of ``step`` (a ``DivergenceError``
    under the ``abort`` policy) reach the caller."""
    impl, _ = IMPLS[name]
    steps: list[int] = []
    hook = impl(lambda *a, **k: None)
    tree = object()

    def reap(t: Any) -> None:
        raise OSError("reap")

    hook.tree, hook.pending, hook.reap = tree, {1: "op"}, reap
    hook.step = lambda: steps.append(1)
    assert hook(None, tree) is None and hook.reap_errors == 1 and steps == [1]
    hook.pending = _BadLen()
    assert hook(None, tree) is None and hook.reap_errors == 2 and steps == [1, 1]

    def interrupt(t: Any) -> None:
        raise KeyboardInterrupt

    hook.pending, hook.reap = {1: "op"}, interrupt
    with pytest.raises(KeyboardInterrupt):
        hook(None, tree)
    assert hook.reap_errors == 2 and steps == [1, 1]

    def divergence() -> None:
        raise RuntimeError("replicas diverged")

    hook.reap, hook.step = None, divergence
    with pytest.raises(RuntimeError, match="diverged"):
        hook(None, tree)
    with pytest.raises(TypeError):
        impl(None)


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_the_hook_is_collected_with_what_it_holds(name):
    """The hook holds arbitrary objects (a tree that may point back at it): a cycle
    through it is collected (the compiled type is GC-tracked)."""
    import gc
    import weakref

    impl, _ = IMPLS[name]

    class Tree:
        pass

    tree = Tree()
    hook = impl(lambda *a, **k: None)
    hook.tree, hook.step, tree.hook = tree, (lambda: None), hook
    ref = weakref.ref(tree)
    del tree, hook
    gc.collect()
    assert ref() is None


def test_compiled_hook_is_in_use_where_required():
    """CI (REQUIRE_ALL) builds the index's extension: the integration's hook is then
    the compiled one (a build without it would put a Python frame in every step)."""
    from hicache_existence.integrations.sglang import hooks

    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") != "1" and CHook is None:
        pytest.skip("compiled hook not built (allowed outside CI)")
    if os.environ.get("HICACHE_EXISTENCE_BACKEND", "auto") == "python":
        assert gate._C_HOOK is None and type(hooks._HOOK) is gate.PyStepHook
        return
    assert CHook is not None and gate._C_HOOK is CHook
    assert type(hooks.after_check_hicache_events) is CHook


# -- the integration's hook ------------------------------------------------------------


class _Tree:
    def __init__(self, cache: Any, ongoing: Any = None) -> None:
        self.storage_existence_cache = cache
        if ongoing is not None:
            self.ongoing_backup = ongoing


def _entry(cache_mode: bool) -> Any:
    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang import hooks
    from hicache_existence.integrations.sglang.facts import SchedulerFacts
    from hicache_existence.integrations.sglang.process import PROCESS
    from hicache_existence.runtime import ExistenceRuntime

    config = Config.from_mapping({"enabled": True, "metrics": {"mode": "off"}})
    runtime = ExistenceRuntime(config, generation="current")
    facts = (
        SchedulerFacts(host_memory_mode="cache", storage_backend="file")
        if cache_mode
        else SchedulerFacts()
    )
    entry = hooks.ProcessEntry(runtime, facts, None, None, None)
    hooks._ENTRIES[PROCESS.pid] = entry
    return entry


@pytest.fixture
def clean() -> Any:
    from hicache_existence.integrations.sglang import hooks

    hooks.reset_for_tests()
    yield hooks
    hooks.reset_for_tests()


@pytest.mark.parametrize("cache_mode", [False, True], ids=["buffer", "cache"])
def test_the_first_step_binds_the_hook_to_the_runtime_s_gate(clean, cache_mode):
    """The first step of the tree holding our cache binds the hook to that tree and
    the runtime's gate itself (the compiled gate is then called without a frame);
    cache mode also hands it the write path's pending operations and its reap; a
    reset unbinds it."""
    hooks = clean
    entry = _entry(cache_mode)
    tree = _Tree(entry.cache, {} if cache_mode else None)
    assert hooks.after_check_hicache_events(None, tree) is None
    hook = hooks._HOOK
    assert hook.tree is tree and hook.step is entry.runtime.tick and entry.runtime.steps == 1
    if cache_mode:
        assert hook.pending is entry.write_path.cache_mode.pending_operations
        assert callable(hook.reap)
    else:
        assert hook.pending is None and hook.reap is None
    hooks.after_check_hicache_events(None, _Tree(object()))  # a foreign tree
    hooks.after_check_hicache_events(None, tree)
    assert entry.runtime.steps == 2
    hooks.reset_for_tests()
    assert (hook.tree, hook.step, hook.pending, hook.reap) == (None, None, None, None)


def test_the_first_step_of_a_single_rank_process_stops_the_digest(clean):
    """SGLang's entry is built with a ``DeferredGroup`` (size unknown, so the digest
    observes); the first step builds the groups (no torch.distributed here: one
    rank) and the digest stops observing: a world of one compares nothing."""
    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang import hooks
    from hicache_existence.integrations.sglang.facts import SchedulerFacts
    from hicache_existence.integrations.sglang.process import PROCESS
    from hicache_existence.integrations.sglang.topology import DeferredGroup
    from hicache_existence.runtime import ExistenceRuntime

    config = Config.from_mapping({"enabled": True, "metrics": {"mode": "off"}})
    group = DeferredGroup(config.divergence.timeout_s)
    runtime = ExistenceRuntime(config, generation="current", group=group)
    entry = hooks.ProcessEntry(runtime, SchedulerFacts(), group, None, None)
    hooks._ENTRIES[PROCESS.pid] = entry
    assert runtime.digest in runtime.tee.observers
    hooks.after_check_hicache_events(None, _Tree(entry.cache))
    assert entry.first_done and runtime.steps == 1
    assert runtime.digest not in runtime.tee.observers


def test_a_failing_reap_is_the_write_path_s_error_not_the_hook_s(clean):
    """In cache mode the reap reports its own failures (a tree whose
    ``ongoing_backup`` cannot be read) to the write path's error counter, which is
    exported and logged; the hook's last-resort count stays at zero and the step
    runs."""
    hooks = clean
    entry = _entry(True)
    tree = _Tree(entry.cache)  # no ongoing_backup
    hooks.after_check_hicache_events(None, tree)
    entry.write_path.cache_mode._pending[1] = object()  # a write in flight
    hooks.after_check_hicache_events(None, tree)
    assert entry.write_path.errors == 1 and hooks._HOOK.reap_errors == 0
    assert entry.runtime.steps == 2


def test_the_cost_probe_times_the_hook_under_its_name():
    """The real-server cost probe (``hx_probes._probe_cost_hooks``) wraps the
    module attribute in Python and finds the per-step hook by its qualified name:
    the hook object answers to it, so its time is still counted as the hook's."""
    from hicache_existence.integrations.sglang import hooks

    standins = Path(__file__).parent / "real_server" / "standins"
    sys.path.insert(0, str(standins))
    try:
        spec = importlib.util.spec_from_file_location("hx_probes_test", standins / "hx_probes.py")
        assert spec is not None and spec.loader is not None
        probes = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probes)
    finally:
        sys.path.remove(str(standins))
    hook = hooks.after_check_hicache_events
    mod = NS(after_check_hicache_events=hook)
    probes._probe_cost_hooks(mod)
    assert mod.after_check_hicache_events is not hook
    probes._COST.main = threading.get_ident()
    assert mod.after_check_hicache_events("r", NS()) is None  # no entry: the fallback's
    assert probes._COST.by_name["after_check_hicache_events"][1] == 1
    assert probes._COST.calls == 1 and probes._COST.hook_ns == probes._COST.ns


def test_the_first_step_brackets_inserts_only_with_a_recorder(clean, tmp_path):
    """The recorder's insert hook is installed on this process's tree at the first
    step, before any insert, and only when a recorder is configured: a server
    without one never runs it; a foreign tree is left alone."""
    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang import hooks
    from hicache_existence.integrations.sglang.facts import SchedulerFacts
    from hicache_existence.integrations.sglang.process import PROCESS
    from hicache_existence.runtime import ExistenceRuntime

    class UnifiedRadixCache(_Tree):
        def insert(self, key: Any) -> Any:
            return key

    plain = UnifiedRadixCache(_entry(cache_mode=False).cache)
    hooks.after_check_hicache_events(None, plain)
    assert "insert" not in vars(plain)  # no recorder: the class's insert, untouched
    hooks.reset_for_tests()

    config = Config.from_mapping(
        {
            "enabled": True,
            "metrics": {"mode": "off"},
            "recorder": {"enabled": True, "path": str(tmp_path / "trace")},
        }
    )
    runtime = ExistenceRuntime(config, generation="current")
    entry = hooks.ProcessEntry(runtime, SchedulerFacts(), None, None, None)
    hooks._ENTRIES[PROCESS.pid] = entry
    hooks._write_path.attach(entry.write_path)  # as the cache's construction does
    foreign = UnifiedRadixCache(object())
    hooks.after_check_hicache_events(None, foreign)
    assert "insert" not in vars(foreign)
    ours = UnifiedRadixCache(entry.cache)
    hooks.after_check_hicache_events(None, ours)
    assert entry.first_done and "insert" in vars(ours)
    assert ours.insert("k") == "k"
    assert runtime.recorder is not None
    taken = runtime.recorder.tap.take(100)
    assert [x[1] for x in taken] == ["request"]  # one insert, one request
