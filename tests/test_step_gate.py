"""The runtime's per-step test (``core.gate``): the compiled ``StepGate`` against its
pure-Python twin, ``PyStepGate``, which is the reference (issue 31 item 2: a step
with nothing due is one cheap test, identical on every TP rank).

Both gates are driven through the same clock readings and the same ``due`` work
(which moves ``wake`` and ``flush_at`` as the runtime's ``_step_due`` does); every
call's answer and every state change must match, step for step."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.core import gate

CGate = gate.c_gate()
IMPLS: dict[str, Any] = {"python": gate.PyStepGate}
if CGate is not None:
    IMPLS["c"] = CGate

needs_c = pytest.mark.skipif(CGate is None, reason="compiled gate not built")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(impl: Any, script: list[tuple[float, int, float]], busy: float, defer: float):
    """Run ``script`` (clock advance, next wake in steps, next flush delay) through
    a gate of ``impl``; what each call returned and the gate's state after it."""
    clock = _Clock()
    calls: list[tuple[int, float, float]] = []
    plan = iter(script)
    g: Any = None

    def due(n: int, now: float, gap: float) -> str:
        calls.append((n, now, gap))
        try:
            _, wake, delay = next(plan)
        except StopIteration:
            wake, delay = 1, 0.0
        g.wake = n + wake
        g.flush_at = now + delay
        return f"due {n}"

    g = impl(due, clock, busy, defer)
    trace = []
    for advance, _, _ in script:
        clock.now += advance
        trace.append((g(), g.steps, g.wake, g.flush_at, g.last))
    return calls, trace


steps_script = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0001, 0.001, 0.0025, 0.01, 0.4, 0.6, 2.0]),
        st.integers(1, 7),
        st.sampled_from([0.0, 0.001, 0.005, 0.05, 1.0]),
    ),
    max_size=80,
)


@needs_c
@settings(max_examples=300, deadline=None)
@given(script=steps_script, busy=st.sampled_from([0.002, 0.0]), defer=st.sampled_from([0.5, 0.01]))
def test_compiled_gate_answers_as_the_python_one(script, busy, defer):
    """Same due calls (step, clock, gap), same return values, same state."""
    assert _drive(CGate, script, busy, defer) == _drive(gate.PyStepGate, script, busy, defer)


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_a_step_with_nothing_due_calls_nothing(name):
    """Below ``wake`` and before ``flush_at`` a step only counts; ``wake`` reached,
    or the flush time passed after an idle iteration, it calls ``due`` once."""
    clock = _Clock()
    seen: list[int] = []
    g = IMPLS[name](lambda n, now, gap: seen.append(n), clock, 0.002, 0.5)
    assert g() is None and seen == [1]  # wake 1, flush_at -inf: the first step is due
    g.wake, g.flush_at = 10, 100.0
    for _ in range(8):
        g()
    assert seen == [1] and g.steps == 9
    g()
    assert seen == [1, 10]
    g.wake = 1 << 62
    clock.now = 100.0001  # flush due, the iteration before was short: due
    g()
    assert seen == [1, 10, 11]
    g.flush_at = 100.0
    clock.now += 0.01  # flush due after a long (busy) iteration: it waits...
    g()
    assert seen == [1, 10, 11]
    clock.now += 0.0001  # ...for the next short one
    g()
    assert seen == [1, 10, 11, 13]


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_the_real_clock_is_time_monotonic(name):
    """``step_gate`` hands the compiled gate no clock for ``time.monotonic`` (it reads
    that clock in C): its readings stay ``time.monotonic``'s."""
    if name == "c":
        assert CGate is not None
        g = CGate(lambda n, now, gap: None, None, 0.002, 0.5)
    else:
        g = gate.PyStepGate(lambda n, now, gap: None, None, 0.002, 0.5)
    before = time.monotonic()
    g()
    after = time.monotonic()
    assert before <= g.last <= after


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_errors_pass_through(name):
    """A failing clock or ``due`` raises to the caller (the runtime guards its own work)."""

    def bad_clock() -> float:
        raise RuntimeError("clock")

    g = IMPLS[name](lambda n, now, gap: None, bad_clock, 0.002, 0.5)
    with pytest.raises(RuntimeError, match="clock"):
        g()

    def bad_due(n: int, now: float, gap: float) -> None:
        raise ValueError("due")

    g = IMPLS[name](bad_due, _Clock(), 0.002, 0.5)
    with pytest.raises(ValueError, match="due"):
        g()
    with pytest.raises(TypeError):
        IMPLS[name](None, None, 0.002, 0.5)
    assert math.isinf(IMPLS[name](lambda *a: None, None, 0.002, 0.5).flush_at)


def test_compiled_gate_is_in_use_where_required():
    """CI (REQUIRE_ALL) builds the index's extension: the runtime's gate is then the
    compiled one (a build without it would leave every step in Python)."""
    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") != "1" and CGate is None:
        pytest.skip("compiled gate not built (allowed outside CI)")
    if os.environ.get("HICACHE_EXISTENCE_BACKEND", "auto") == "python":
        assert gate._C_GATE is None
        return
    assert CGate is not None and gate._C_GATE is CGate
    g = gate.step_gate(lambda *a: None, time.monotonic, 0.002, 0.5)
    assert type(g) is CGate
