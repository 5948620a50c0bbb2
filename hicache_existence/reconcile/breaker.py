"""A circuit breaker with exponential backoff, shared by the worker and the scheduler.

After ``failures`` consecutive errors the circuit opens: queries fail fast (no
I/O) and the scheduler admits none.  Once the backoff has passed one probe goes
through (half-open): its success closes the circuit, its failure re-opens it
with the backoff doubled up to ``backoff_max_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED = 0
OPEN = 1
HALF_OPEN = 2


class CircuitBreaker:
    """Thread-safe; every method holds the lock for a few instructions only.
    Its settings are checked where they enter (``ReconcilerSection``)."""

    def __init__(
        self,
        failures: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failures
        self._base = float(backoff_s)
        self._max = float(backoff_max_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0
        self._backoff = self._base
        self._reopen_at = 0.0
        self._probe_out = False
        #: Transitions into OPEN, for the metrics layer.
        self.opened = 0

    @property
    def state(self) -> int:
        """CLOSED, OPEN or HALF_OPEN (an OPEN circuit whose backoff has passed
        reads HALF_OPEN: it will admit a probe)."""
        with self._lock:
            if self._state == OPEN and self._clock() >= self._reopen_at:
                return HALF_OPEN
            return self._state

    def permits(self) -> int:
        """How many new queries may be admitted now: unbounded (-1) when closed,
        1 when a probe is due, else 0."""
        with self._lock:
            if self._state == CLOSED:
                return -1
            if self._probe_out:
                return 0
            return int(self._state == HALF_OPEN or self._clock() >= self._reopen_at)

    def admitted(self) -> bool:
        """Record that a query was admitted; True when it is the probe (one per
        backoff: a query admitted while none is due is rejected by the worker)."""
        with self._lock:
            if self._state == CLOSED or self._probe_out:
                return False
            if self._state == OPEN:
                if self._clock() < self._reopen_at:
                    return False
                self._state = HALF_OPEN
            self._probe_out = True
            return True

    def abandoned(self) -> None:
        """The probe was dropped without being asked (voided): another may go."""
        with self._lock:
            self._probe_out = False

    def rejects(self, probe: bool) -> bool:
        """Whether the worker should fail a query fast instead of doing I/O."""
        with self._lock:
            return self._state != CLOSED and not probe

    def success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._consecutive = 0
            self._backoff = self._base
            self._probe_out = False

    def failure(self, probe: bool) -> None:
        with self._lock:
            self._consecutive += 1
            if probe:
                self._backoff = min(self._backoff * 2.0, self._max)
                self._open()
            # Half-open, a query admitted before the probe failing late says
            # nothing new: the probe's outcome decides (re-opening here would
            # free a second probe while the first is out).
            elif self._state == CLOSED and self._consecutive >= self._threshold:
                self._open()

    def _open(self) -> None:
        if self._state != OPEN:
            self.opened += 1
        self._state = OPEN
        self._probe_out = False
        self._reopen_at = self._clock() + self._backoff
