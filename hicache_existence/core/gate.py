"""The runtime's per-step test, compiled when possible.

SGLang calls the package every scheduler event-loop iteration, idle polling included
(thousands per second); one with nothing due must cost one cheap test (issue 31).
``StepGate`` counts a step, reads the clock and calls ``due(steps, now, flush)``
(``ExistenceRuntime._step_due``, which sets ``wake`` and ``flush_at``) only when
``steps >= wake`` (step-counted work, so the same on every TP rank: lockstep points
stay put) or a rank-local metrics flush is due (``now >= flush_at``), unless the
previous iteration ran a batch (``busy_s < gap < defer_s``) and the flush may wait
(``now < flush_at + defer_s``): a flush spends idle time, not a batch's.

``StepHook`` is what SGLang calls (``after_check_hicache_events(result, tree_cache)``),
bound to one tree: a call for it runs ``reap(tree)`` if the write path's ``pending`` is
not empty (cache mode), then ``step()``; other calls (the first, a foreign tree, an
unbound hook) go to ``fallback`` as given.  An idle step is one C call, no Python frame
of ours, in both host memory modes.  ``step``'s exceptions reach the caller
(``abort``'s ``DivergenceError`` is meant for the scheduler); an ``Exception`` from
``reap`` (or sizing ``pending``) never does: the hook, the scheduler's boundary, counts
it in ``reap_errors``, whatever ``reap`` catches and reports itself.

C ``core._lru.StepGate``/``StepHook`` (``time.monotonic`` read in C when it is
``clock``; a ``StepGate`` as ``step`` is called without dispatch) and their fallbacks
and test references ``PyStepGate``/``PyStepHook`` behave alike; the backend switch
picks one, as for the index.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sized
from typing import Any, Protocol

from hicache_existence.core import lru

#: ``due(steps, now, flush)``: a let-through step's work (``flush``: metrics flush due).
Due = Callable[[int, float, bool], Any]


class StepGateType(Protocol):
    """The interface both implementations provide."""

    steps: int
    wake: int
    flush_at: float
    last: float

    def __call__(self) -> Any: ...


class PyStepGate:
    """Pure-Python ``StepGate``: the same test, attribute by attribute."""

    __slots__ = ("_due", "_clock", "steps", "wake", "flush_at", "last", "busy_s", "defer_s")

    def __init__(
        self, due: Due, clock: Callable[[], float] | None, busy_s: float, defer_s: float
    ) -> None:
        if not callable(due) or (clock is not None and not callable(clock)):
            raise TypeError("StepGate: due and clock must be callable")
        self._due = due
        self._clock = clock or time.monotonic
        self.steps = 0
        self.wake = 1
        self.flush_at = -math.inf
        self.last = -math.inf
        self.busy_s = float(busy_s)
        self.defer_s = float(defer_s)

    def __call__(self) -> Any:
        n = self.steps = self.steps + 1
        now = self._clock()
        gap, self.last = now - self.last, now
        flush = not (
            now < self.flush_at
            or (self.busy_s < gap < self.defer_s and now < self.flush_at + self.defer_s)
        )
        if n < self.wake and not flush:
            return None
        return self._due(n, now, flush)


class StepHookType(Protocol):
    """The interface both hook implementations provide."""

    tree: Any
    step: Callable[[], Any] | None
    pending: Sized | None
    reap: Callable[[Any], Any] | None
    reap_errors: int

    @property
    def fallback(self) -> Callable[..., Any]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class PyStepHook:
    """Pure-Python ``StepHook``, attribute by attribute (``None`` unsets one; ``__dict__``
    takes the name and docstring of the hook it stands for)."""

    __slots__ = ("_fallback", "tree", "step", "pending", "reap", "reap_errors", "__dict__")

    def __init__(self, fallback: Callable[..., Any]) -> None:
        if not callable(fallback):
            raise TypeError("StepHook: fallback must be callable")
        self._fallback = fallback
        self.tree: Any = None
        self.step: Callable[[], Any] | None = None
        self.pending: Sized | None = None
        self.reap: Callable[[Any], Any] | None = None
        self.reap_errors = 0

    @property
    def fallback(self) -> Callable[..., Any]:
        return self._fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tree = self.tree
        if tree is None or len(args) < 2 or args[1] is not tree:
            return self._fallback(*args, **kwargs)
        pending, reap = self.pending, self.reap
        if pending is not None and reap is not None:
            try:
                if len(pending):
                    reap(tree)
            except Exception:  # never into the scheduler
                self.reap_errors += 1
        step = self.step  # read after reap, which may have rebound it
        if step is not None:
            step()
        return None


def c_gate() -> Callable[..., StepGateType] | None:
    """The compiled implementation, or ``None`` when it is not built."""
    return lru.c_type("StepGate")  # type: ignore[no-any-return]


def c_hook() -> Callable[[Callable[..., Any]], StepHookType] | None:
    """The compiled hook, or ``None`` when it is not built."""
    return lru.c_type("StepHook")  # type: ignore[no-any-return]


#: The selected backend's (``HICACHE_EXISTENCE_BACKEND``, as the index) compiled types.
_C_GATE = c_gate() if lru.BACKEND == "c" else None
_C_HOOK = c_hook() if lru.BACKEND == "c" else None


def step_gate(due: Due, clock: Callable[[], float], busy_s: float, defer_s: float) -> StepGateType:
    """The selected backend's gate; compiled, it reads ``time.monotonic`` in C (same values)."""
    if _C_GATE is not None:
        return _C_GATE(due, None if clock is time.monotonic else clock, busy_s, defer_s)
    return PyStepGate(due, clock, busy_s, defer_s)


def step_hook(fallback: Callable[..., Any]) -> StepHookType:
    """A hook of the selected backend, unbound (every call goes to ``fallback``)."""
    if _C_HOOK is not None:
        return _C_HOOK(fallback)
    return PyStepHook(fallback)
