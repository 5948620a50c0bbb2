"""Differential test: ``hicache_existence.FlatStorageExistenceCache`` against the seed
generation's own code, reimplemented as ``benchmarks/hicache_existence_bench/seed.py``.

Why: the flat cache claims to behave exactly like the seed's cache (one global LRU
over ``(pool, page_hash)``, one cap shared by every pool) while keying its primary
pool by the bare hash for speed.  That trick must be invisible: after EVERY operation
the return value, the global LRU order (``list(seed._entries)`` against our
``lru_keys()``) and the length must match, whichever pool is primary.

The seed has no in-flight refs and no heal policies, so it needs no sglang: this file
runs everywhere (no ``sglang`` mark).
"""

from __future__ import annotations

import importlib.util
import random
from collections import Counter
from enum import Enum
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from upstream_support import (
    ALPHABET,
    Divergence,
    Op,
    assert_every_kind_ran,
    fail_with,
    fresh_iterable,
    fresh_sequence,
    page_ids,
    pages,
    raised,
    seed_baseline,
)

import hicache_existence as ours


class PoolName(str, Enum):
    """A str enum like sglang's ``PoolName``, so enum spellings are covered without
    importing sglang."""

    KV = "kv"
    MAMBA = "mamba"


#: Pool slots; "kv" and PoolName.KV are one pool in both caches.
POOLS: tuple[str, ...] = ("kv", PoolName.KV, "swa", PoolName.MAMBA, "draft_kv")
ITER_KINDS = ("list", "tuple", "gen", "iter")
SEQ_KINDS = ("list", "tuple")
#: extra_cover as the seed's callers pass it, or left at its default.
COVER_KINDS = ("default", "frozenset", "set", "list", "tuple")
PRIMARIES = ("kv", "swa", "draft_kv")


def cover(kind: str, idx: tuple[int, ...]) -> Any:
    hashes = pages(idx)
    return {"frozenset": frozenset, "set": set, "list": list, "tuple": tuple}[kind](hashes)


def _flat_wheel() -> tuple[str, Any] | None:
    """The installed sglang's own cache class when it is of the seed generation
    (sglang 0.5.19 - 0.5.21: ``add(pool, hashes)``), with its version; else None."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        import sglang
        from sglang.srt.mem_cache.buffer_mode.storage_existence_cache import (
            StorageExistenceCache,
        )
    except Exception:  # not importable here: the sglang-marked tests report why
        return None
    if hasattr(StorageExistenceCache, "pool") or not hasattr(StorageExistenceCache, "covers_all"):
        return None
    return f"sglang {getattr(sglang, '__version__', '?')}", StorageExistenceCache


#: The seed wheel's class, where one is installed (CI's sglang 0.5.21 environment).
FLAT_WHEEL = _flat_wheel()


class FlatPair:
    """The seed baseline (the benchmarks' reimplementation, or with ``wheel=True`` the
    installed seed wheel's own class) and our flat cache, driven in lockstep."""

    def __init__(self, cap: int, primary: str, wheel: bool = False) -> None:
        self.setup = {"max_entries": cap, "primary_pool": primary, "wheel": wheel}
        if wheel:
            assert FLAT_WHEEL is not None
            self.seed = FLAT_WHEEL[1](cap)
        else:
            self.seed = seed_baseline().SeedStorageExistenceCache(cap)
        self.mine = ours.FlatStorageExistenceCache(cap, primary_pool=primary)
        #: op kind -> operations of that kind that returned on both sides.
        self.ran: Counter[str] = Counter()

    def apply(self, op: Op) -> tuple[object, object]:
        outcomes = (_outcome(self.seed, op), _outcome(self.mine, op))
        if not any(raised(o) for o in outcomes):
            self.ran[op[0]] += 1
        return outcomes

    def check(self, program: list[Op], step: int, outcomes: tuple[object, object]) -> None:
        """Compare after ``program[step]``; raise ``Divergence`` on any difference."""
        what = ""
        if outcomes[0] != outcomes[1]:
            what = (
                f"return value differs at step {step}: seed {outcomes[0]!r}, ours {outcomes[1]!r}"
            )
        else:
            # Seed keys may hold a PoolName member; compare by the plain string value.
            theirs = [(str.__str__(pool), h) for pool, h in self.seed._entries]
            mine = list(self.mine.lru_keys())
            if theirs != mine:
                what = (
                    f"global LRU order (oldest first) differs after step {step}:\n"
                    f"  seed {page_ids(theirs)!r}\n  ours {page_ids(mine)!r}"
                )
            elif len(self.seed) != len(self.mine):
                what = (
                    f"len differs after step {step}: seed {len(self.seed)}, ours {len(self.mine)}"
                )
            elif self.seed.max_entries != self.mine.max_entries:
                what = f"max_entries differs after step {step}"
        if what:
            raise Divergence(
                what,
                "SeedStorageExistenceCache / FlatStorageExistenceCache",
                self.setup,
                program[: step + 1],
            )


def _outcome(cache: Any, op: Op) -> object:
    """The return value, or the exception's type."""
    try:
        return _run(cache, op)
    except Exception as exc:
        return ("raised", type(exc).__name__)


def _run(cache: Any, op: Op) -> object:
    name = op[0]
    if name == "clear":
        return cache.clear()
    if name == "cap":
        cache.max_entries = op[1]
        return None
    pool = POOLS[op[1]]
    if name == "add":
        return cache.add(pool, fresh_iterable(op[3], op[2]))
    if name == "contains":
        return cache.contains(pool, ALPHABET[op[2]])
    if name == "contains_all":
        return cache.contains_all(pool, fresh_iterable(op[3], op[2]))
    if name == "covers_all":
        _, _, batch, kind, cover_idx, cover_kind = op
        if cover_kind == "default":
            return cache.covers_all(pool, fresh_iterable(kind, batch))
        return cache.covers_all(pool, fresh_iterable(kind, batch), cover(cover_kind, cover_idx))
    if name == "invalidate":
        return cache.invalidate_beyond(pool, fresh_sequence(op[3], op[2]), op[4])
    raise AssertionError(f"unknown op {op!r}")


def run_program(setup: dict[str, Any], program: list[Op]) -> FlatPair:
    """Replay ``program`` on a fresh pair, comparing after every operation."""
    pair = FlatPair(setup["max_entries"], setup["primary_pool"], setup.get("wheel", False))
    pair.check(program, -1, (None, None))
    for step, op in enumerate(program):
        pair.check(program, step, pair.apply(op))
    return pair


def report(found: Divergence) -> None:
    fail_with(lambda p: run_program(found.setup, p), found, "the seed baseline")


# -- hypothesis ------------------------------------------------------------------------
_page = st.integers(0, 5)
_batch = st.lists(_page, max_size=10).map(tuple)
_short = st.lists(_page, max_size=3).map(tuple)
_slot = st.sampled_from((0, 1, 0, 1, 2, 3, 4))
_kind = st.sampled_from(ITER_KINDS)
_cap = st.integers(1, 8)

# One strategy per family, one rule each: swarm testing concentrates some runs.
ADD = st.tuples(st.just("add"), _slot, _batch, _kind)
WALK = st.one_of(
    st.tuples(st.just("contains_all"), _slot, _short, _kind),
    st.tuples(st.just("covers_all"), _slot, _short, _kind, _short, st.sampled_from(COVER_KINDS)),
)
CONTAINS = st.tuples(st.just("contains"), _slot, _page)
INVALIDATE = st.tuples(
    st.just("invalidate"), _slot, _batch, st.sampled_from(SEQ_KINDS), st.integers(0, 12)
)
CLEAR_OR_CAP = st.one_of(st.tuples(st.just("clear")), st.tuples(st.just("cap"), _cap))


class FlatMachine(RuleBasedStateMachine):
    """Stateful search (long runs, step deletion when shrinking) over flat programs."""

    #: Across all examples: kinds generated, and kinds that ran without raising.
    kinds: ClassVar[set[str]] = set()
    ran: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.program: list[Op] = []
        self.pair: FlatPair | None = None

    @initialize(cap=_cap, primary=st.sampled_from(PRIMARIES))
    def start(self, cap: int, primary: str) -> None:
        self.pair = FlatPair(cap, primary)

    def _step(self, op: Op) -> None:
        assert self.pair is not None
        self.program.append(op)
        self.pair.check(self.program, len(self.program) - 1, self.pair.apply(op))
        FlatMachine.kinds.add(op[0])
        if self.pair.ran[op[0]]:
            FlatMachine.ran[op[0]] += 1

    @rule(op=ADD)
    def add(self, op: Op) -> None:
        self._step(op)

    @rule(op=WALK)
    def walk(self, op: Op) -> None:
        self._step(op)

    @rule(op=CONTAINS)
    def contains(self, op: Op) -> None:
        self._step(op)

    @rule(op=INVALIDATE)
    def invalidate(self, op: Op) -> None:
        self._step(op)

    @rule(op=CLEAR_OR_CAP)
    def clear_or_cap(self, op: Op) -> None:
        self._step(op)


def test_random_programs_match_seed() -> None:
    """Hypothesis programs: after every operation, results, the global LRU order over
    (pool, hash), len and max_entries equal the seed's, for any primary pool."""
    FlatMachine.kinds, FlatMachine.ran = set(), Counter()
    try:
        run_state_machine_as_test(
            FlatMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=60,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    except Divergence as found:
        report(found)
    assert len(FlatMachine.kinds) == 7, sorted(FlatMachine.kinds)
    assert_every_kind_ran(FlatMachine.ran, FlatMachine.kinds)


# -- seeded replay ---------------------------------------------------------------------
def random_batch(rng: random.Random, longest: int = 10) -> tuple[int, ...]:
    return tuple(rng.randrange(len(ALPHABET)) for _ in range(rng.randint(0, longest)))


def random_op(rng: random.Random) -> Op:
    r = rng.random()
    slot = rng.randrange(len(POOLS))
    if r < 0.35:
        return ("add", slot, random_batch(rng), rng.choice(ITER_KINDS))
    if r < 0.55:
        return ("contains_all", slot, random_batch(rng, 4), rng.choice(ITER_KINDS))
    if r < 0.75:
        return (
            "covers_all",
            slot,
            random_batch(rng, 4),
            rng.choice(ITER_KINDS),
            random_batch(rng, 4),
            rng.choice(COVER_KINDS),
        )
    if r < 0.82:
        return ("contains", slot, rng.randrange(len(ALPHABET)))
    if r < 0.94:
        batch = random_batch(rng)
        return ("invalidate", slot, batch, rng.choice(SEQ_KINDS), rng.randint(0, len(batch) + 2))
    if r < 0.97:
        return ("clear",)
    return ("cap", rng.randint(1, 8))


@pytest.mark.parametrize(
    "primary,wheel",
    [(p, False) for p in PRIMARIES]
    + [pytest.param(p, True, marks=pytest.mark.sglang) for p in PRIMARIES if FLAT_WHEEL],
    ids=lambda v: (
        {False: "reimplementation", True: "seed-wheel"}.get(v, v) if isinstance(v, bool) else v
    ),
)
def test_seeded_long_replay_matches_seed(primary: str, wheel: bool) -> None:
    """25,000 seeded random operations per primary pool, compared after every one, with
    the seed's reimplementation and, where the seed wheel is installed, its own class."""
    rng = random.Random(f"flat-{primary}")
    setup = {"max_entries": rng.randint(1, 8), "primary_pool": primary, "wheel": wheel}
    program = [random_op(rng) for _ in range(25_000)]
    try:
        pair = run_program(setup, program)
    except Divergence as found:
        report(found)
    assert {op[0] for op in program} == {
        "add",
        "contains",
        "contains_all",
        "covers_all",
        "invalidate",
        "clear",
        "cap",
    }
    assert_every_kind_ran(pair.ran, {op[0] for op in program})
    assert {pool for pool, _ in pair.mine.lru_keys()} <= {"kv", "swa", "mamba", "draft_kv"}


def test_seed_baseline_is_the_seed() -> None:
    """The baseline itself behaves as the seed's code does on a hand-checked trace
    (shared cap across pools, batch overshoot, extra_cover not touched)."""
    seed = seed_baseline().SeedStorageExistenceCache(3)
    seed.add("kv", ["a", "b"])
    seed.add("swa", ["a", "c", "d", "c"])  # overshoots to 5, evicts the 2 oldest
    assert list(seed._entries) == [("swa", "a"), ("swa", "d"), ("swa", "c")]
    assert seed.covers_all("swa", ["d", "x"], frozenset({"x"}))
    assert not seed.contains_all("swa", ["a", "x", "c"])  # touches a, stops at x
    assert list(seed._entries) == [("swa", "c"), ("swa", "d"), ("swa", "a")]
    seed.invalidate_beyond("swa", ["c", "zz", "a"], 1)
    assert list(seed._entries) == [("swa", "c"), ("swa", "d")] and len(seed) == 2
    seed.clear()
    assert len(seed) == 0
