"""Differential test: ``hicache_existence.StorageExistenceCache`` against the REAL
upstream class from the installed sglang wheel.

Why: our cache is a drop-in replacement, so "same results, same LRU order, same
in-flight refcounts after every operation" is the whole contract.  A model written
from the docs could share our misreadings; sglang's own code cannot.  Each operation
sequence runs on both caches side by side, and after EVERY operation the return
value, each pool's entries in LRU order, its in-flight refs, its length and caps are
compared.  Caps are tiny (1..8) and the hash alphabet is small, so nearly every
``add`` evicts and batches repeat pages.

Operations are plain tuples of small ints (page ``3`` is ``ALPHABET[3]``) so that a
divergence is reported as a short, replayable program (see ``render``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from upstream_support import Upstream, require_upstream

import hicache_existence as ours

pytestmark = pytest.mark.sglang

#: Small alphabet of real-looking page hashes (64-char lowercase hex, like sglang's).
ALPHABET: tuple[str, ...] = tuple(
    hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(10)
)
#: Pool slots; "kv" and PoolName.KV must reach the same pool in both caches.
POOL_SLOTS: tuple[str, ...] = ("kv", "PoolName.KV", "swa", "PoolName.MAMBA", "draft_kv")
ITER_KINDS = ("list", "tuple", "gen", "iter")
SEQ_KINDS = ("list", "tuple")
#: Heal policy choices: two explicit classes and default_belief_policy(hit policy).
POLICIES = ("chain", "trailing", "all_pages", "trailing_pages", "block_groups")
#: Who heals OUR pool: our policy objects, or upstream's (what sglang code does when
#: it keeps calling its own policies on our pools after a REPLACE hook).
DRIVERS = ("ours", "upstream")

Op = tuple[Any, ...]


# -- building the inputs ------------------------------------------------------------------
def pages(idx: Sequence[int]) -> list[str]:
    return [ALPHABET[i] for i in idx]


def fresh_iterable(kind: str, idx: Sequence[int]) -> Iterable[str]:
    """A new iterable of the pages each call: each cache must get its own one-shot
    iterator, never a shared one."""
    hashes = pages(idx)
    if kind == "list":
        return hashes
    if kind == "tuple":
        return tuple(hashes)
    if kind == "gen":
        return (h for h in hashes)
    if kind == "iter":
        return iter(hashes)
    raise AssertionError(kind)


def fresh_sequence(kind: str, idx: Sequence[int]) -> Sequence[str]:
    hashes = pages(idx)
    return hashes if kind == "list" else tuple(hashes)


def pool_name(up: Upstream, slot: int) -> str:
    name = POOL_SLOTS[slot]
    if name.startswith("PoolName."):
        return getattr(up.PoolName, name.removeprefix("PoolName."))  # type: ignore[no-any-return]
    return name


def policies(up: Upstream, choice: str, our_flavour: int) -> tuple[Any, Any]:
    """(upstream policy, our policy) for ``choice``.  Ours gets the hit policy as the
    enum member or as its plain string value (``our_flavour``), both allowed."""
    if choice == "chain":
        return up.ChainPagesPolicy(), ours.ChainPagesPolicy()
    if choice == "trailing":
        return up.TrailingWindowPolicy(), ours.TrailingWindowPolicy()
    member = up.PoolHitPolicy(choice)
    return (
        up.default_belief_policy(member),
        ours.default_belief_policy(member if our_flavour == 0 else member.value),
    )


# -- the pair of caches -------------------------------------------------------------------
class Divergence(AssertionError):
    pass


class Pair:
    """Upstream's cache and ours, driven in lockstep and compared after each step."""

    def __init__(self, up: Upstream, cap: int) -> None:
        self.up = up
        self.cap0 = cap
        self.theirs = up.StorageExistenceCache(cap)
        self.mine = ours.StorageExistenceCache(cap)

    def apply(self, op: Op) -> tuple[object, object]:
        """Run ``op`` on both caches; return (upstream outcome, our outcome)."""
        return _outcome(self._run, self.theirs, op, True), _outcome(self._run, self.mine, op, False)

    def _run(self, cache: Any, op: Op, upstream: bool) -> object:
        up = self.up
        name = op[0]
        if name == "clear":
            return cache.clear()
        if name == "clear_inflight":
            return cache.clear_inflight()
        if name == "cache_cap":
            cache.max_entries = op[1]
            return None
        pool = cache.pool(pool_name(up, op[1]))
        if name == "add":
            return pool.add(fresh_iterable(op[3], op[2]))
        if name == "contains":
            return pool.contains(ALPHABET[op[2]])
        if name == "contains_all":
            return pool.contains_all(fresh_iterable(op[3], op[2]))
        if name == "covered":
            return pool.covered(fresh_iterable(op[3], op[2]))
        if name == "track":
            return pool.track_inflight(fresh_iterable(op[3], op[2]))
        if name == "untrack":
            return pool.untrack_inflight(fresh_iterable(op[3], op[2]))
        if name == "invalidate":
            return pool.invalidate_beyond(fresh_sequence(op[3], op[2]), op[4])
        if name == "pool_clear":
            return pool.clear()
        if name == "pool_clear_inflight":
            return pool.clear_inflight()
        if name == "pool_cap":
            pool.max_entries = op[2]
            return None
        if name == "heal_query":
            _, _, choice, chain, keys, hit, evidence, driver, flavour = op
            theirs_policy, our_policy = policies(up, choice, flavour)
            policy = theirs_policy if upstream or driver == "upstream" else our_policy
            return policy.heal_from_query(
                pool, fresh_sequence("list", chain), tuple(pages(keys)), hit, evidence=evidence
            )
        if name == "heal_transfer":
            _, _, choice, keys, delivered, driver, flavour = op
            theirs_policy, our_policy = policies(up, choice, flavour)
            policy = theirs_policy if upstream or driver == "upstream" else our_policy
            return policy.heal_from_transfer(pool, fresh_sequence("tuple", keys), delivered)
        raise AssertionError(f"unknown op {op!r}")

    def state(self) -> tuple[dict[str, tuple[Any, ...]], dict[str, tuple[Any, ...]]]:
        """Every pool's observable state, upstream's read from its private fields
        (it has no accessors) and ours through the public introspection."""
        theirs: dict[str, tuple[Any, ...]] = {}
        for key, pool in self.theirs._pools.items():
            entries = list(pool._entries)
            theirs[str.__str__(key)] = (
                entries,
                dict(pool._inflight),
                len(entries),
                pool.max_entries,
            )
        mine: dict[str, tuple[Any, ...]] = {}
        for key in self.mine.pool_names():
            pool = self.mine.pool(key)
            mine[key] = (list(pool.lru_keys()), pool.inflight_refs(), len(pool), pool.max_entries)
        return theirs, mine

    def check(self, program: Sequence[Op], step: int, outcomes: tuple[object, object]) -> None:
        if outcomes[0] != outcomes[1]:
            raise Divergence(
                f"return value differs at step {step}: upstream {outcomes[0]!r}, "
                f"ours {outcomes[1]!r}\n{render(self.cap0, program[: step + 1])}"
            )
        theirs, mine = self.state()
        if theirs != mine:
            raise Divergence(
                f"state differs after step {step}:\n  upstream {short(theirs)}\n"
                f"  ours     {short(mine)}\n{render(self.cap0, program[: step + 1])}"
            )
        if self.theirs.max_entries != self.mine.max_entries:
            raise Divergence(f"cache max_entries differs after step {step}")
        total = sum(len(p._entries) for p in self.theirs._pools.values())
        if len(self.mine) != total:
            raise Divergence(f"len(cache) {len(self.mine)} != upstream total {total}")


def _outcome(run: Any, cache: Any, op: Op, upstream: bool) -> object:
    """The return value, or the exception's type (messages may differ; types must not)."""
    try:
        return run(cache, op, upstream)
    except Exception as exc:
        return ("raised", type(exc).__name__)


def short(state: dict[str, tuple[Any, ...]]) -> str:
    """State with page hashes shown as alphabet indexes."""
    index = {h: i for i, h in enumerate(ALPHABET)}
    return repr(
        {
            name: (
                [index.get(h, h) for h in entries],
                {index.get(h, h): n for h, n in refs.items()},
                length,
                cap,
            )
            for name, (entries, refs, length, cap) in sorted(state.items())
        }
    )


def render(cap: int, program: Sequence[Op]) -> str:
    """A divergence as a replayable program (page i = ALPHABET[i])."""
    lines = [f"  cache = StorageExistenceCache({cap})"]
    lines += [f"  [{i}] {op!r}" for i, op in enumerate(program)]
    return "\n".join(lines)


def run_program(up: Upstream, cap: int, program: Sequence[Op]) -> Pair:
    pair = Pair(up, cap)
    pair.check(program, -1, (None, None))
    for step, op in enumerate(program):
        pair.check(program, step, pair.apply(op))
    return pair


# -- hypothesis programs ---------------------------------------------------------------
# Hypothesis draws few, short lists; so that two operations meet on the same pool and
# the same pages often enough, it uses 6 pages and mostly the kv pool (slots 0 and 1
# are the same pool, spelt "kv" and PoolName.KV).
_page = st.integers(0, 5)
_batch = st.lists(_page, max_size=10).map(tuple)
# Queries and in-flight refs on short batches: a chain walk only gets past its first
# page, and in-flight cover only decides a result, when most of a batch is covered.
_short = st.lists(_page, max_size=3).map(tuple)
_slot = st.sampled_from((0, 1, 0, 1, 2, 3, 4))
_kind = st.sampled_from(ITER_KINDS)
_seq_kind = st.sampled_from(SEQ_KINDS)
_cap = st.integers(1, 8)
_policy = st.sampled_from(POLICIES)
_driver = st.sampled_from(DRIVERS)

_add = st.tuples(st.just("add"), _slot, _batch, _kind)
_query = st.tuples(st.sampled_from(("contains_all", "covered")), _slot, _short, _kind)
_inflight = st.tuples(st.sampled_from(("track", "untrack")), _slot, _short, _kind)
OPS = st.one_of(
    _add,
    _add,
    _query,
    _query,
    _inflight,
    st.tuples(st.just("contains"), _slot, _page),
    st.tuples(st.just("invalidate"), _slot, _batch, _seq_kind, st.integers(0, 12)),
    st.tuples(
        st.just("heal_query"),
        _slot,
        _policy,
        _batch,
        _batch,
        st.integers(0, 12),
        st.booleans(),
        _driver,
        st.integers(0, 1),
    ),
    st.tuples(
        st.just("heal_transfer"), _slot, _policy, _batch, st.integers(0, 12), _driver,
        st.integers(0, 1),
    ),
    st.tuples(st.sampled_from(("pool_clear", "pool_clear_inflight")), _slot),
    st.tuples(st.sampled_from(("clear", "clear_inflight"))),
    st.tuples(st.just("pool_cap"), _slot, _cap),
    st.tuples(st.just("cache_cap"), _cap),
)


class ProgramMachine(RuleBasedStateMachine):
    """Hypothesis stateful search over operation programs: one rule applies any
    operation to both caches and compares them.  Stateful runs are long (up to
    ``stateful_step_count`` steps) and shrink by deleting steps, so a divergence is
    reported as the shortest program found, printed as replayable ``step(op=...)``."""

    upstream: Upstream | None = None

    def __init__(self) -> None:
        super().__init__()
        self.program: list[Op] = []
        self.pair: Pair | None = None

    @initialize(cap=_cap)
    def start(self, cap: int) -> None:
        assert self.upstream is not None
        self.pair = Pair(self.upstream, cap)

    @rule(op=OPS)
    def step(self, op: Op) -> None:
        assert self.pair is not None
        self.program.append(op)
        self.pair.check(self.program, len(self.program) - 1, self.pair.apply(op))


def test_random_programs_match_upstream() -> None:
    """Hypothesis programs: after every operation, results and every pool's LRU order,
    in-flight refs, length and caps equal upstream's."""
    ProgramMachine.upstream = require_upstream()
    run_state_machine_as_test(
        ProgramMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- a long seeded replay ----------------------------------------------------------------
def random_batch(rng: random.Random, longest: int = 10) -> tuple[int, ...]:
    return tuple(rng.randrange(len(ALPHABET)) for _ in range(rng.randint(0, longest)))


def random_op(rng: random.Random) -> Op:
    """One operation; the mix favours add and the chain walks, as in serving."""
    r = rng.random()
    slot = rng.randrange(len(POOL_SLOTS))
    if r < 0.25:
        return ("add", slot, random_batch(rng), rng.choice(ITER_KINDS))
    if r < 0.45:
        kind = rng.choice(("contains_all", "covered"))
        return (kind, slot, random_batch(rng), rng.choice(ITER_KINDS))
    if r < 0.57:
        kind = rng.choice(("track", "untrack"))
        return (kind, slot, random_batch(rng), rng.choice(ITER_KINDS))
    if r < 0.62:
        return ("contains", slot, rng.randrange(len(ALPHABET)))
    if r < 0.70:
        batch = random_batch(rng)
        return ("invalidate", slot, batch, rng.choice(SEQ_KINDS), rng.randint(0, len(batch) + 2))
    if r < 0.82:
        chain = random_batch(rng)
        return (
            "heal_query",
            slot,
            rng.choice(POLICIES),
            chain,
            random_batch(rng),
            rng.randint(0, len(chain) + 2),
            rng.random() < 0.5,
            rng.choice(DRIVERS),
            rng.randrange(2),
        )
    if r < 0.88:
        keys = random_batch(rng)
        return (
            "heal_transfer",
            slot,
            rng.choice(POLICIES),
            keys,
            rng.randint(0, len(keys) + 2),
            rng.choice(DRIVERS),
            rng.randrange(2),
        )
    if r < 0.93:
        return (rng.choice(("pool_clear", "pool_clear_inflight")), slot)
    if r < 0.95:
        return (rng.choice(("clear", "clear_inflight")),)
    if r < 0.98:
        return ("pool_cap", slot, rng.randint(1, 8))
    return ("cache_cap", rng.randint(1, 8))


SEEDED_OPS = 25_000


@pytest.mark.parametrize("seed", [20260, 7])
def test_seeded_long_replay_matches_upstream(seed: int) -> None:
    """25,000 seeded random operations per seed, compared after every one (the
    long-haul complement of the shrinking hypothesis search)."""
    up = require_upstream()
    rng = random.Random(seed)
    program = [random_op(rng) for _ in range(SEEDED_OPS)]
    pair = run_program(up, rng.randint(1, 8), program)
    # The run must have exercised what it claims to: evictions, hits and in-flight.
    kinds = {op[0] for op in program}
    assert kinds >= {"add", "covered", "track", "heal_query", "clear", "cache_cap"}
    assert pair.mine.pool_names()


# -- smaller contracts ------------------------------------------------------------------
def test_default_policy_choice_matches_upstream() -> None:
    """default_belief_policy picks the same policy class as upstream for every
    PoolHitPolicy, given as the enum member or as its string value."""
    up = require_upstream()
    for member in up.PoolHitPolicy:
        expected = type(up.default_belief_policy(member)).__name__
        assert type(ours.default_belief_policy(member)).__name__ == expected, member
        assert type(ours.default_belief_policy(member.value)).__name__ == expected, member


def test_default_cap_matches_upstream() -> None:
    """The default per-pool cap is upstream's constant and reaches new pools."""
    up = require_upstream()
    assert ours.HICACHE_EXISTENCE_CACHE_MAX_ENTRIES == up.module.HICACHE_EXISTENCE_CACHE_MAX_ENTRIES
    assert ours.StorageExistenceCache().pool("kv").max_entries == (
        up.StorageExistenceCache().pool("kv").max_entries
    )


def test_large_batches_at_default_cap_match_upstream() -> None:
    """Without eviction pressure (upstream's 512K cap) long chains behave the same:
    the C fast path of our walk is taken, not only the miss path."""
    up = require_upstream()
    rng = random.Random(99)
    universe = [hashlib.sha256(f"chain-{i}".encode()).hexdigest() for i in range(3000)]
    theirs, mine = up.StorageExistenceCache(), ours.StorageExistenceCache()
    for _ in range(200):
        start = rng.randrange(0, 2000)
        chain = universe[start : start + rng.randint(0, 1000)]
        action = rng.random()
        for cache in (theirs, mine):
            pool = cache.pool("kv")
            if action < 0.4:
                pool.add(chain)
            elif action < 0.5:
                pool.invalidate_beyond(chain, len(chain) // 2)
            elif action < 0.6:
                pool.track_inflight(chain[::3])
        assert theirs.pool("kv").contains_all(chain) == mine.pool("kv").contains_all(chain)
        assert theirs.pool("kv").covered(iter(chain)) == mine.pool("kv").covered(iter(chain))
        assert list(theirs.pool("kv")._entries) == list(mine.pool("kv").lru_keys())
        assert dict(theirs.pool("kv")._inflight) == mine.pool("kv").inflight_refs()
