"""Cross-rank divergence checks of cache replicas (TP / attention-TP / PP).

Every rank calls ``DivergenceChecker.on_step()`` once per scheduler step at a
lockstep point (in SGLang: right after ``check_hicache_events``); every
``interval_steps`` steps it all-reduces one word of its step and replica digest
as ``[w, -w]`` (MAX gives maximum and minimum) and, only when those differ,
all-gathers per-slot words to name the ranks and pools, then applies the policy
(``log``, ``heal`` or ``abort``).  docs/tp-divergence.md gives the protocol and
why a healthy job is never hung by it (lockstep collectives, a group timeout,
a start-up handshake).  ``torch`` is imported only by ``TorchGlooGroup``;
``InProcessWorld`` runs the checker over threads for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

from hicache_existence import logs
from hicache_existence.config import DivergenceSection
from hicache_existence.core._validate import count
from hicache_existence.core.protocol import ExistenceCache
from hicache_existence.replicas.digest import (
    DIGEST_VERSION,
    MASK63,
    PoolDigest,
    ReplicaDigest,
    SharedLruDigest,
    combine,
    mix,
    slot_of,
)

#: ``steps_to_due`` of work that never comes (checks off or stopped).
NEVER = 1 << 62

logger = logging.getLogger(__name__)
_events = logs.get_logger(__name__)

POLICIES: tuple[str, ...] = ("log", "heal", "abort")

#: Names of the structured events (``logs.EventLogger``; also passed to ``on_event``).
EVENT_STARTED = "hicache_existence.replicas.divergence.started"
EVENT_CONFIG_MISMATCH = "hicache_existence.replicas.divergence.config_mismatch"
EVENT_DETECTED = "hicache_existence.replicas.divergence.detected"
EVENT_CHECK_FAILED = "hicache_existence.replicas.divergence.check_failed"

#: Layout of the check vector: header words, then three blocks of ``slots`` words.
_STEP, _STATUS, _REPLICA = 0, 1, 2
_HEADER = 3


class GroupError(RuntimeError):
    """A collective failed (a peer is gone, the transport broke)."""


class GroupTimeout(GroupError):
    """A collective did not complete within the group's timeout."""


class DivergenceError(RuntimeError):
    """Raised only under the ``abort`` policy; ``event`` is the structured report."""

    def __init__(self, message: str, event: dict[str, Any]) -> None:
        super().__init__(message)
        self.event = event


class DivergenceTimeoutError(DivergenceError):
    """``abort`` policy: a check (or the start-up handshake) timed out or failed."""


class DivergenceConfigError(DivergenceError):
    """``abort`` policy: ranks disagree on the divergence settings."""


@runtime_checkable
class CheckGroup(Protocol):
    """The collectives the checker needs, over fixed-size lists of int64 values.
    Every member calls each at the same point, with lists of the same length; one
    that cannot complete within ``timeout_s`` raises ``GroupTimeout``, any other
    failure ``GroupError``."""

    #: This member's index in the group.
    rank: int
    size: int
    #: Global ranks of the members (what reports name), by group index.
    ranks: tuple[int, ...]
    timeout_s: float

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum over the group."""

    def all_gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every member's ``values``, by group index."""


class TorchGlooGroup:
    """A ``torch.distributed`` gloo (CPU) group; never NCCL: checks stay off the GPU.

    Use a *dedicated* group (``create``): the checker's collectives then never
    interleave with the job's own, and its timeout (gloo's per operation, set at
    creation) bounds how long a check can wait for a rank that does not come.
    """

    def __init__(self, group: Any = None, *, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first)")
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(f"group must be a gloo (CPU) group, got backend {backend!r}")
        self._dist = dist
        self._group = group
        self.rank = int(dist.get_rank(group))
        self.size = int(dist.get_world_size(group))
        members = range(self.size) if group is None else dist.get_process_group_ranks(group)
        self.ranks = tuple(int(r) for r in members)
        self.timeout_s = float(timeout_s)

    @classmethod
    def create(
        cls, ranks: Sequence[int] | None = None, *, timeout_s: float
    ) -> TorchGlooGroup | None:
        """A new dedicated gloo group with a ``timeout_s`` per operation.  Like every
        ``new_group``, call it on *every* rank of the default group, in the same
        order; ranks outside ``ranks`` get ``None``."""
        import torch.distributed as dist

        group = dist.new_group(
            ranks=list(ranks) if ranks is not None else None,
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
        )
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        return cls(group, timeout_s=timeout_s)

    def _run(self, what: str, fn: Callable[[], object]) -> None:
        start = time.monotonic()
        try:
            fn()
        except RuntimeError as exc:  # DistBackendError is a RuntimeError
            elapsed = time.monotonic() - start
            text = str(exc)
            low = text.lower()
            # With three ranks or more, a rank waiting on the one whose timer fired
            # first sees "Connection closed by peer" about as late: both are timeouts.
            if "timeout" in low or "timed out" in low or elapsed >= self.timeout_s * 0.9:
                raise GroupTimeout(
                    f"{what} on the divergence-check gloo group timed out after {elapsed:.1f}s "
                    f"(timeout {self.timeout_s:g}s): a rank did not reach the check ({text})"
                ) from exc
            raise GroupError(
                f"{what} on the divergence-check gloo group failed after {elapsed:.1f}s: {text}"
            ) from exc

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        import torch

        dist = self._dist
        t = torch.tensor(list(values), dtype=torch.int64)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group))
        return [int(v) for v in t.tolist()]

    def all_gather(self, values: Sequence[int]) -> list[list[int]]:
        import torch

        dist = self._dist
        t = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", lambda: dist.all_gather(out, t, group=self._group))
        return [[int(v) for v in o.tolist()] for o in out]


class InProcessWorld:
    """``size`` group members in threads of one process (fast tests).  Collectives
    meet at a ``threading.Barrier`` with ``timeout_s``; a member that does not
    arrive breaks it for everyone, as a lost rank breaks a gloo group."""

    def __init__(self, size: int, timeout_s: float = 5.0) -> None:
        self.size = size = count(size, "size", 1)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._barrier = threading.Barrier(size, timeout=self.timeout_s)
        self._slots: list[list[int]] = [[] for _ in range(size)]

    def group(self, rank: int) -> InProcessGroup:
        """The handle of member ``rank``."""
        if count(rank, "rank") >= self.size:
            raise ValueError(f"rank must be within [0, {self.size}), got {rank}")
        return InProcessGroup(self, rank)

    def _exchange(self, rank: int, values: Sequence[int], what: str) -> list[list[int]]:
        start = time.monotonic()
        try:
            self._slots[rank] = [int(v) for v in values]
            self._barrier.wait()
            out = [list(s) for s in self._slots]
            self._barrier.wait()  # nobody overwrites a slot before all have read
        except threading.BrokenBarrierError:
            elapsed = time.monotonic() - start
            if elapsed >= self.timeout_s * 0.99:
                raise GroupTimeout(
                    f"{what} on the in-process group timed out after {elapsed:.1f}s "
                    f"(timeout {self.timeout_s:g}s): a rank did not reach the check"
                ) from None
            raise GroupError(
                f"{what} on the in-process group failed: broken by another rank"
            ) from None
        if len({len(s) for s in out}) != 1:
            raise GroupError(f"{what}: members passed vectors of different lengths")
        return out


class InProcessGroup:
    """One member of an ``InProcessWorld``."""

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.size = world.size
        self.ranks = tuple(range(world.size))
        self.timeout_s = world.timeout_s

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        out = self._world._exchange(self.rank, values, "all_reduce")
        return [max(column) for column in zip(*out)]

    def all_gather(self, values: Sequence[int]) -> list[list[int]]:
        return self._world._exchange(self.rank, values, "all_gather")


@dataclass(frozen=True)
class CheckResult:
    """What one check found."""

    step: int
    #: ``ok``: every rank equal; ``diverged``: some differ (see ``event``);
    #: ``failed``: the collective failed or timed out, the checker stopped.
    status: Literal["ok", "diverged", "failed"]
    duration_s: float
    event: dict[str, Any] | None = None


@dataclass(frozen=True)
class DivergenceStats:
    """A snapshot of the checker's counters, for exporters (see docs/tp-divergence.md)."""

    #: Configured on (``divergence.enabled``).
    enabled: bool
    #: Still checking: enabled, handshake passed, no failure since.
    active: bool
    steps: int
    checks: int
    divergences: int
    heals: int
    #: Checks (or handshakes) whose collective failed: timed out, or another error.
    timeouts: int
    errors: int
    config_mismatches: int
    #: Step of the last completed check / the last detected divergence (0: none).
    last_check_step: int
    last_divergence_step: int
    check_seconds: float
    #: Divergences by pool name (names seen locally in a diverged slot).
    divergences_by_pool: MappingProxyType[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def failures(self) -> int:
        """Failed checks, timeouts included (counted apart, so that neither label
        of the exported family can be seen to fall between two increments)."""
        return self.timeouts + self.errors


@dataclass
class _Counts:
    """The counters of ``DivergenceStats`` (what ``stats()`` copies)."""

    checks: int = 0
    divergences: int = 0
    heals: int = 0
    timeouts: int = 0
    errors: int = 0
    config_mismatches: int = 0
    last_check_step: int = 0
    last_divergence_step: int = 0
    check_seconds: float = 0.0


class DivergenceChecker:
    """Compares this rank's replica digest with every other member of ``group``.
    ``digest`` must observe ``cache`` (or be in its ``Tee``); ``cache`` supplies
    state sizes and audits and is what ``heal`` clears; ``on_event`` receives every
    structured event (besides the log record)."""

    def __init__(
        self,
        digest: ReplicaDigest,
        group: CheckGroup,
        config: DivergenceSection | None = None,
        *,
        cache: ExistenceCache | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(digest, ReplicaDigest):
            raise TypeError(f"digest must be a ReplicaDigest, got {type(digest).__name__}")
        if not isinstance(group, CheckGroup):
            raise TypeError("group must provide CheckGroup's attributes and collectives")
        config = DivergenceSection() if config is None else config
        if not isinstance(config, DivergenceSection):
            raise TypeError(f"config must be a DivergenceSection, got {type(config).__name__}")
        if config.policy == "heal" and cache is None:
            raise ValueError("cache is required with policy 'heal' (it is what gets cleared)")
        if cache is not None and cache.shared_lru and not isinstance(digest, SharedLruDigest):
            raise TypeError(
                "digest must be a SharedLruDigest for a shared-LRU cache "
                "(FlatStorageExistenceCache: its pools share one LRU, so their "
                "interleaving matters)"
            )
        self._digest = digest
        self._group = group
        self._config = config
        self._cache = cache
        self._on_event = on_event
        self._clock = clock
        self._slots = config.pool_slots
        self._interval = config.interval_steps
        self._step = 0
        self._started = False
        self._active = False
        self._check_index = 0
        self._counts = _Counts()
        self._by_pool: dict[str, int] = {}
        self._failure_event: dict[str, Any] | None = None

    # -- the per-step hook ---------------------------------------------------
    @property
    def step(self) -> int:
        """Steps counted so far (calls of ``on_step``)."""
        return self._step

    def steps_to_due(self) -> int:
        """``on_step`` calls until one has work (1: the next), for a caller that
        credits those between with ``advance``; steps only, so equal on every rank."""
        if not self._started:
            return 1
        if not self._active:
            return NEVER
        return self._interval - self._step % self._interval

    def advance(self, steps: int) -> None:
        """Count ``steps`` scheduler steps on which nothing is due (fewer than
        ``steps_to_due()``): what that many ``on_step`` calls would have done."""
        self._step += steps

    def on_step(self) -> CheckResult | None:
        """Count one scheduler step; run the check when due.  Call it on every rank
        at the same lockstep point of every step; the first call runs the handshake
        (unless ``start`` did).  Raises only under ``abort``; else problems are events.
        """
        self._step += 1
        if self._active:
            if self._step % self._interval:
                return None
        elif self._started:
            return None
        try:
            if not self._started and not self.start():
                return None
            if self._step % self._interval:
                return None
            return self.check()
        except DivergenceError:
            raise
        except Exception:  # never raise into the scheduler for observability
            logger.exception("hicache-existence: divergence check failed unexpectedly")
            return None

    # -- start-up ------------------------------------------------------------
    def _handshake(self) -> dict[str, int]:
        """The settings ranks must agree on, in handshake-vector order."""
        c = self._config
        return {
            "digest_version": DIGEST_VERSION,
            "enabled": int(c.enabled),
            "interval_steps": c.interval_steps,
            "policy": POLICIES.index(c.policy),
            "audit_every_checks": c.audit_every_checks,
            "pool_slots": c.pool_slots,
            "timeout_ms": round(c.timeout_s * 1000),
        }

    def start(self) -> bool:
        """The one start-up handshake (idempotent): every rank must call it, enabled
        or not, so that ranks whose settings differ all stay inactive (a disabled
        rank would otherwise leave the others waiting at every check)."""
        if self._started:
            return self._active
        self._started = True
        settings = self._handshake()
        values = list(settings.values())
        n = len(values)
        try:
            reduced = self._group.all_reduce_max(values + [-v for v in values])
        except GroupError as exc:
            self._record_failure(0, exc, "handshake")
            return False
        hi, lo = reduced[:n], [-v for v in reduced[n:]]
        if hi != lo:
            self._counts.config_mismatches += 1
            differing = {
                name: {"min": lo[i], "max": hi[i], "local": values[i]}
                for i, name in enumerate(settings)
                if hi[i] != lo[i]
            }
            event = self._event(
                EVENT_CONFIG_MISMATCH,
                policy=self._config.policy,
                differing=differing,
                action="checks disabled on every rank",
            )
            self._emit(logging.ERROR, event)
            if self._config.policy == "abort":
                raise DivergenceConfigError(
                    "hicache-existence divergence settings differ between ranks: "
                    + ", ".join(sorted(differing)),
                    event,
                )
            return False
        self._active = self._config.enabled
        if self._active:
            c = self._config
            self._emit(
                logging.INFO,
                self._event(
                    EVENT_STARTED,
                    interval_steps=self._interval,
                    policy=c.policy,
                    audit_every_checks=c.audit_every_checks,
                    timeout_s=c.timeout_s,
                ),
            )
        return self._active

    # -- one check -----------------------------------------------------------
    def check(self) -> CheckResult:
        """Compare replicas now; every rank at the same point (as ``on_step`` does)."""
        step = self._step
        t0 = self._clock()
        digests: dict[str, PoolDigest] = {}
        gathered: list[list[int]] | None = None
        # A world of one (a single-rank server) has no other replica to differ from:
        # its checks are ok without a digest or a collective (~100 us each, for nothing).
        if self._group.size > 1:
            self._check_index += 1
            audit_every = self._config.audit_every_checks
            audit = bool(audit_every) and self._check_index % audit_every == 0
            try:
                digests = self._digest.pool_digests(self._cache, audit=audit)
                vector = self._vector(step, digests)
            except Exception:  # still take part, or every other rank would wait
                logger.exception("hicache-existence: computing the replica digest failed")
                vector = [0] * (_HEADER + 3 * self._slots)
                vector[_STEP], vector[_STATUS] = step, 1
            # The header folded into one word, as [w, -w]: two int64 are gloo's
            # cheapest all-reduce (6 words on 4 ranks cost several times 2).
            word = mix("check", *vector[:_HEADER])
            try:
                reduced = self._group.all_reduce_max([word, -word])
                gathered = self._group.all_gather(vector) if reduced[0] != -reduced[1] else None
            except GroupError as exc:
                self._record_failure(step, exc, "check")
                return CheckResult(step, "failed", self._clock() - t0, self._failure_event)
        self._counts.checks += 1
        self._counts.last_check_step = step
        event = None if gathered is None else self._diverged(step, gathered, digests)
        duration = self._clock() - t0
        self._counts.check_seconds += duration
        if event is None:
            return CheckResult(step, "ok", duration)
        event["check_duration_s"] = round(duration, 6)
        self._emit(logging.ERROR, event)
        if self._config.policy == "abort":
            raise DivergenceError(
                f"hicache-existence replicas diverged at step {step}: ranks "
                f"{event['diverged_ranks']} differ from {event['reference_ranks']} "
                f"(pools {event['diverged_pools']}, kinds {event['kinds']})",
                event,
            )
        return CheckResult(step, "diverged", duration, event)

    def _vector(self, step: int, digests: dict[str, PoolDigest]) -> list[int]:
        k = self._slots
        vector = [0] * (_HEADER + 3 * k)
        vector[_STEP] = step
        vector[_REPLICA] = combine(digests)
        for name, d in digests.items():
            s = slot_of(name, k)
            vector[_HEADER + s] = (vector[_HEADER + s] + d.digest) & MASK63
            vector[_HEADER + k + s] += d.entries
            vector[_HEADER + 2 * k + s] += d.inflight
        return vector

    def _diverged(
        self, step: int, gathered: list[list[int]], digests: dict[str, PoolDigest]
    ) -> dict[str, Any]:
        k = self._slots
        group = self._group

        def differs(index: int) -> bool:
            return len({vec[index] for vec in gathered}) > 1

        # Every rank holds the same gathered vectors, so every rank derives the
        # same diverged slots (what ``heal`` clears) and the same groups of ranks.
        slots = [s for s in range(k) if differs(_HEADER + s)]
        found = {
            "digest_error": differs(_STATUS),
            "state": bool(slots) or differs(_REPLICA),
            "step": differs(_STEP),
        }
        kinds = [kind for kind, seen in found.items() if seen]
        # Ranks grouped by identical vectors; steps aside, unless only they differ.
        only_steps = kinds == ["step"]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for index, vec in enumerate(gathered):
            key = tuple(vec[:1]) if only_steps else tuple(vec[_STATUS:])
            buckets.setdefault(key, []).append(index)
        ordered = sorted(buckets.values(), key=lambda idx: (-len(idx), min(idx)))
        reference = ordered[0]
        diverged = sorted(i for idx in ordered[1:] for i in idx)
        slot_set = set(slots)
        names = self._cache.stats() if self._cache is not None else ()
        local = sorted({*self._digest.pools(), *names})
        pools = [name for name in local if slot_of(name, k) in slot_set]
        # A diverged slot holding none of this rank's pools: a pool only other ranks
        # have (ranks that disagree on which pools exist); those ranks name it.
        unnamed = sorted(slot_set - {slot_of(name, k) for name in local})
        replicas = []
        for idx in ordered:
            vec = gathered[idx[0]]
            replicas.append(
                {
                    "ranks": [group.ranks[i] for i in idx],
                    "steps": sorted({gathered[i][_STEP] for i in idx}),
                    "digest": f"{vec[_REPLICA]:016x}",
                    "digest_error": bool(vec[_STATUS]),
                    "slots": {
                        str(s): {
                            "digest": f"{vec[_HEADER + s]:016x}",
                            "entries": vec[_HEADER + k + s],
                            "inflight": vec[_HEADER + 2 * k + s],
                        }
                        for s in slots
                    },
                }
            )
        self._counts.divergences += 1
        self._counts.last_divergence_step = step
        for name in pools:
            self._by_pool[name] = self._by_pool.get(name, 0) + 1
        action = {"log": "logged", "heal": "none", "abort": "aborted"}[self._config.policy]
        if self._config.policy == "heal" and slots:
            self._heal(pools)
            self._counts.heals += 1
            action = "healed: cleared " + (", ".join(pools) if pools else "no local pool")
        return self._event(
            EVENT_DETECTED,
            {"step": step, "policy": self._config.policy, "action": action, "kinds": kinds},
            reference_ranks=[group.ranks[i] for i in reference],
            diverged_ranks=[group.ranks[i] for i in diverged],
            diverged_slots=slots,
            diverged_pools=pools,
            unnamed_slots=unnamed,
            replicas=replicas,
            local={
                name: {
                    "slot": slot_of(name, k),
                    "digest": f"{d.digest:016x}",
                    "entries": d.entries,
                    "inflight": d.inflight,
                    "capacity": d.capacity,
                    "ops": d.ops,
                }
                for name, d in digests.items()
                if slot_of(name, k) in slot_set
            },
            digest_errors=self._digest.errors,
        )

    def _heal(self, pools: list[str]) -> None:
        """Clear the local ``pools`` of the diverged slots and restart their digests.

        Every rank derives the slots from the same gathered words, so every rank
        clears the same pools at the same step; beliefs are advisory, so the cost
        is redundant writes (those misses count as ``cleared``).
        """
        cache = self._cache
        assert cache is not None  # policy 'heal' requires one
        if cache.shared_lru:
            # One shared LRU: a divergence in one pool moves every pool's
            # evictions, so every pool is cleared.
            cache.clear()
            self._digest.reset_all()
            return
        existing = set(cache.pool_names())
        for name in pools:
            if name in existing:
                cache.pool(name).clear()
            self._digest.reset(name)

    # -- failures and events -------------------------------------------------
    def _record_failure(self, step: int, exc: GroupError, what: str) -> None:
        self._active = False
        timed_out = isinstance(exc, GroupTimeout)
        if timed_out:
            self._counts.timeouts += 1
        else:
            self._counts.errors += 1
        event = self._event(
            EVENT_CHECK_FAILED,
            {"step": step, "stage": what},
            timeout=timed_out,
            timeout_s=self._group.timeout_s,
            error=str(exc),
            action="checks stopped on this rank",
        )
        self._failure_event = event
        self._emit(logging.ERROR, event)
        if self._config.policy == "abort":
            raise DivergenceTimeoutError(str(exc), event) from exc

    def _event(
        self, name: str, lead: dict[str, Any] | None = None, **fields: Any
    ) -> dict[str, Any]:
        """A structured event naming this rank and the group's ranks, after the
        ``lead`` fields (what the logged line shows first)."""
        group = self._group
        return {
            "event": name,
            **(lead or {}),
            "rank": group.ranks[group.rank],
            "ranks": list(group.ranks),
            **fields,
        }

    def _emit(self, level: int, event: dict[str, Any]) -> None:
        """One structured event: to the package's event logger, then ``on_event``."""
        try:
            fields = {k: v for k, v in event.items() if k != "event"}
            (_events.error if level >= logging.ERROR else _events.info)(event["event"], **fields)
            if self._on_event is not None:
                self._on_event(event)
        except Exception:  # a broken sink must not break the scheduler
            logger.debug("hicache-existence: divergence event sink failed", exc_info=True)

    # -- reporting -----------------------------------------------------------
    def stats(self) -> DivergenceStats:
        """An immutable snapshot of the counters; safe from another thread."""
        return DivergenceStats(
            enabled=self._config.enabled,
            active=self._active,
            steps=self._step,
            # vars(), not dataclasses.asdict: flat scalars need no deep copy, and
            # asdict's was a quarter of a metrics flush on the scheduler thread.
            **vars(self._counts),
            divergences_by_pool=MappingProxyType(dict(self._by_pool)),
        )
