"""Differential test: ``hicache_existence.StorageExistenceCache`` against the REAL
upstream class from the installed sglang wheel.

Why: our cache is a drop-in replacement, so "same results, same LRU order, same
in-flight refcounts after every operation" is the whole contract.  A model written
from the docs could share our misreadings; sglang's own code cannot.  Each program
runs on both caches side by side and after EVERY operation the return value, each
pool's entries in LRU order, its in-flight refs, its length and the caps are
compared.  Caps are tiny (1..8) and the page alphabet is small, so nearly every
``add`` evicts and batches repeat pages.

Operations are tuples of small ints (page ``3`` is ``ALPHABET[3]``); a divergence is
minimized and reported as a short program that replays it.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from upstream_support import (
    ALPHABET,
    Divergence,
    Op,
    Upstream,
    assert_every_kind_ran,
    fail_with,
    fresh_iterable,
    fresh_sequence,
    page_ids,
    pages,
    raised,
    require_upstream,
)

import hicache_existence as ours

pytestmark = pytest.mark.sglang

#: Pool slots; "kv" and PoolName.KV must reach the same pool in both caches.
POOL_SLOTS: tuple[str, ...] = ("kv", "PoolName.KV", "swa", "PoolName.MAMBA", "draft_kv")
ITER_KINDS = ("list", "tuple", "gen", "iter")
SEQ_KINDS = ("list", "tuple")
#: Heal policies: the two classes by name, or default_belief_policy(PoolHitPolicy(x)).
POLICIES = ("chain", "trailing", "all_pages", "trailing_pages", "block_groups")
#: Who heals OUR pool: our policy objects, or upstream's (what sglang code does when it
#: keeps calling its own policies on our pools after a REPLACE hook).
DRIVERS = ("ours", "upstream")


def pool_name(up: Upstream, slot: int) -> str:
    name = POOL_SLOTS[slot]
    if name.startswith("PoolName."):
        return getattr(up.PoolName, name.removeprefix("PoolName."))  # type: ignore[no-any-return]
    return name


def policies(up: Upstream, choice: str, our_spelling: int) -> tuple[Any, Any]:
    """(upstream policy, our policy) for ``choice``.  Ours gets the hit policy as the
    enum member or as its plain string value (``our_spelling``); both are allowed."""
    if choice == "chain":
        return up.ChainPagesPolicy(), ours.ChainPagesPolicy()
    if choice == "trailing":
        return up.TrailingWindowPolicy(), ours.TrailingWindowPolicy()
    member = up.PoolHitPolicy(choice)
    return (
        up.default_belief_policy(member),
        ours.default_belief_policy(member if our_spelling == 0 else member.value),
    )


class BarePool:
    """One directly constructed ``PoolExistenceBeliefs`` dressed as a cache: every pool
    name reaches it.  Code may build the per-pool class on its own (upstream's
    signature is ``PoolExistenceBeliefs(max_entries)``), so that must match too."""

    def __init__(self, pool: Any) -> None:
        self._pools = {"kv": pool}
        self.max_entries = pool.max_entries

    def pool(self, name: str) -> Any:
        return self._pools["kv"]

    def pool_names(self) -> tuple[str, ...]:
        return ("kv",)

    def clear(self) -> None:
        self._pools["kv"].clear()

    def clear_inflight(self) -> None:
        self._pools["kv"].clear_inflight()

    def __len__(self) -> int:
        return len(self._pools["kv"]._entries)


class Pair:
    """Upstream's cache and ours, driven in lockstep and compared after each step."""

    def __init__(self, up: Upstream, cap: int, *, bare_pools: bool = False) -> None:
        self.up = up
        self.cap = cap
        self.label = "PoolExistenceBeliefs" if bare_pools else "StorageExistenceCache"
        #: op kind -> operations of that kind that returned on both sides.
        self.ran: Counter[str] = Counter()
        if bare_pools:
            self.theirs: Any = BarePool(up.PoolExistenceBeliefs(cap))
            self.mine: Any = BarePool(ours.PoolExistenceBeliefs(cap))
        else:
            self.theirs = up.StorageExistenceCache(cap)
            self.mine = ours.StorageExistenceCache(cap)

    def apply(self, op: Op) -> tuple[object, object]:
        """Run ``op`` on both caches; return (upstream outcome, our outcome).  Kinds
        of operation that ran on both without raising are counted in ``ran``."""
        outcomes = (
            _outcome(self._run, self.theirs, op, True),
            _outcome(self._run, self.mine, op, False),
        )
        if not any(raised(o) for o in outcomes):
            self.ran[op[0]] += 1
        return outcomes

    def _run(self, cache: Any, op: Op, upstream: bool) -> object:
        name = op[0]
        if name == "clear":
            return cache.clear()
        if name == "clear_inflight":
            return cache.clear_inflight()
        if name == "cache_cap":
            cache.max_entries = op[1]
            return None
        pool = cache.pool(pool_name(self.up, op[1]))
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
            _, _, choice, chain, keys, hit, evidence, driver, spelling = op
            theirs_policy, our_policy = policies(self.up, choice, spelling)
            policy = theirs_policy if upstream or driver == "upstream" else our_policy
            return policy.heal_from_query(
                pool, fresh_sequence("list", chain), tuple(pages(keys)), hit, evidence=evidence
            )
        if name == "heal_transfer":
            _, _, choice, keys, delivered, driver, spelling = op
            theirs_policy, our_policy = policies(self.up, choice, spelling)
            policy = theirs_policy if upstream or driver == "upstream" else our_policy
            return policy.heal_from_transfer(pool, fresh_sequence("tuple", keys), delivered)
        raise AssertionError(f"unknown op {op!r}")

    def state(self) -> tuple[dict[str, tuple[Any, ...]], dict[str, tuple[Any, ...]]]:
        """Every pool's observable state: upstream's read from its private fields (it
        has no accessors), ours through the public introspection."""
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

    def check(self, program: list[Op], step: int, outcomes: tuple[object, object]) -> None:
        """Compare after ``program[step]``; raise ``Divergence`` on any difference."""
        what = ""
        if outcomes[0] != outcomes[1]:
            what = (
                f"return value differs at step {step}: "
                f"upstream {outcomes[0]!r}, ours {outcomes[1]!r}"
            )
        else:
            theirs, mine = self.state()
            total = sum(len(p._entries) for p in self.theirs._pools.values())
            if theirs != mine:
                what = (
                    f"state differs after step {step} (pool: LRU oldest first, in-flight refs, "
                    f"len, max_entries):\n  upstream {page_ids(theirs)!r}\n"
                    f"  ours     {page_ids(mine)!r}"
                )
            elif self.theirs.max_entries != self.mine.max_entries:
                what = f"cache max_entries differs after step {step}"
            elif len(self.mine) != total:
                what = f"len(cache) is {len(self.mine)}, upstream pools hold {total}"
        if what:
            raise Divergence(what, self.label, {"max_entries": self.cap}, program[: step + 1])


def _outcome(run: Any, cache: Any, op: Op, upstream: bool) -> object:
    """The return value, or the exception's type (messages may differ; types must not)."""
    try:
        return run(cache, op, upstream)
    except Exception as exc:
        return ("raised", type(exc).__name__)


def run_program(up: Upstream, cap: int, program: list[Op], *, bare_pools: bool = False) -> Pair:
    """Replay ``program`` on a fresh pair, comparing after every operation."""
    pair = Pair(up, cap, bare_pools=bare_pools)
    pair.check(program, -1, (None, None))
    for step, op in enumerate(program):
        pair.check(program, step, pair.apply(op))
    return pair


def report(up: Upstream, found: Divergence) -> None:
    cap = found.setup["max_entries"]
    fail_with(lambda p: run_program(up, cap, p), found, f"sglang {up.version}")


# -- hypothesis programs ---------------------------------------------------------------
# Hypothesis draws short lists; so that two operations meet on the same pool and pages
# often enough, it uses 6 pages and mostly the kv pool (slots 0 and 1 are the same pool,
# spelt "kv" and PoolName.KV).  Queries and in-flight refs take short batches: a chain
# walk only gets past its first page, and in-flight cover only decides a result, when
# most of a batch is covered.
_page = st.integers(0, 5)
_batch = st.lists(_page, max_size=10).map(tuple)
_short = st.lists(_page, max_size=3).map(tuple)
_slot = st.sampled_from((0, 1, 0, 1, 2, 3, 4))
_kind = st.sampled_from(ITER_KINDS)
_cap = st.integers(1, 8)
_policy = st.sampled_from(POLICIES)
_driver = st.sampled_from(DRIVERS)
_spelling = st.integers(0, 1)
_upto12 = st.integers(0, 12)

# One strategy per operation family; each is its own rule of the state machine, so
# hypothesis' swarm testing (it switches rules off at random per run) produces runs
# that concentrate on a few families, e.g. only track/untrack/covered.
ADD = st.tuples(st.just("add"), _slot, _batch, _kind)
CONTAINS_ALL = st.tuples(st.just("contains_all"), _slot, _short, _kind)
COVERED = st.tuples(st.just("covered"), _slot, _short, _kind)
TRACK = st.tuples(st.just("track"), _slot, _short, _kind)
UNTRACK = st.tuples(st.just("untrack"), _slot, _short, _kind)
CONTAINS = st.tuples(st.just("contains"), _slot, _page)
INVALIDATE = st.tuples(st.just("invalidate"), _slot, _batch, st.sampled_from(SEQ_KINDS), _upto12)
HEAL_QUERY = st.tuples(
    st.just("heal_query"),
    _slot,
    _policy,
    _batch,
    _batch,
    _upto12,
    st.booleans(),
    _driver,
    _spelling,
)
HEAL_TRANSFER = st.tuples(
    st.just("heal_transfer"), _slot, _policy, _batch, _upto12, _driver, _spelling
)
POOL_CLEAR = st.tuples(st.sampled_from(("pool_clear", "pool_clear_inflight")), _slot)
CLEAR = st.tuples(st.sampled_from(("clear", "clear_inflight")))
CAPS = st.one_of(st.tuples(st.just("pool_cap"), _slot, _cap), st.tuples(st.just("cache_cap"), _cap))


class ProgramMachine(RuleBasedStateMachine):
    """Stateful search: each rule applies one operation family to both caches and
    compares them.

    Why stateful: its runs are long (``stateful_step_count``) where ``st.lists``
    programs average ~5 operations, too few for bugs that need two operations to meet
    on one pool and page, and it shrinks by deleting steps.  Planted bugs (contains
    not touching, untrack dropping every ref, covered ignoring in-flight refs, add
    keeping first occurrences, invalidate off by one) were all found this way."""

    upstream: Upstream | None = None
    #: Across all examples: kinds generated, and kinds that ran without raising.
    kinds: ClassVar[set[str]] = set()
    ran: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.program: list[Op] = []
        self.pair: Pair | None = None

    @initialize(cap=_cap)
    def start(self, cap: int) -> None:
        assert self.upstream is not None
        self.pair = Pair(self.upstream, cap)

    def _step(self, op: Op) -> None:
        assert self.pair is not None
        self.program.append(op)
        self.pair.check(self.program, len(self.program) - 1, self.pair.apply(op))
        ProgramMachine.kinds.add(op[0])
        if self.pair.ran[op[0]]:
            ProgramMachine.ran[op[0]] += 1

    @rule(op=ADD)
    def add(self, op: Op) -> None:
        self._step(op)

    @rule(op=CONTAINS_ALL)
    def contains_all(self, op: Op) -> None:
        self._step(op)

    @rule(op=COVERED)
    def covered(self, op: Op) -> None:
        self._step(op)

    @rule(op=TRACK)
    def track(self, op: Op) -> None:
        self._step(op)

    @rule(op=UNTRACK)
    def untrack(self, op: Op) -> None:
        self._step(op)

    @rule(op=CONTAINS)
    def contains(self, op: Op) -> None:
        self._step(op)

    @rule(op=INVALIDATE)
    def invalidate(self, op: Op) -> None:
        self._step(op)

    @rule(op=HEAL_QUERY)
    def heal_query(self, op: Op) -> None:
        self._step(op)

    @rule(op=HEAL_TRANSFER)
    def heal_transfer(self, op: Op) -> None:
        self._step(op)

    @rule(op=POOL_CLEAR)
    def pool_clear(self, op: Op) -> None:
        self._step(op)

    @rule(op=CLEAR)
    def clear(self, op: Op) -> None:
        self._step(op)

    @rule(op=CAPS)
    def caps(self, op: Op) -> None:
        self._step(op)


def test_random_programs_match_upstream() -> None:
    """Hypothesis programs: after every operation, results and every pool's LRU order,
    in-flight refs, length and caps equal upstream's."""
    up = ProgramMachine.upstream = require_upstream()
    ProgramMachine.kinds, ProgramMachine.ran = set(), Counter()
    try:
        run_state_machine_as_test(
            ProgramMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=60,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    except Divergence as found:
        report(up, found)
    assert len(ProgramMachine.kinds) >= 12, sorted(ProgramMachine.kinds)
    assert_every_kind_ran(ProgramMachine.ran, ProgramMachine.kinds)


# -- a long seeded replay ----------------------------------------------------------------
def random_batch(rng: random.Random, longest: int = 10) -> tuple[int, ...]:
    return tuple(rng.randrange(len(ALPHABET)) for _ in range(rng.randint(0, longest)))


def random_op(rng: random.Random) -> Op:
    """One operation of the seeded replay; the mix favours adds and chain walks."""
    r = rng.random()
    slot = rng.randrange(len(POOL_SLOTS))
    if r < 0.25:
        return ("add", slot, random_batch(rng), rng.choice(ITER_KINDS))
    if r < 0.45:
        kind = rng.choice(("contains_all", "covered"))
        return (kind, slot, random_batch(rng, 4), rng.choice(ITER_KINDS))
    if r < 0.57:
        kind = rng.choice(("track", "untrack"))
        return (kind, slot, random_batch(rng, 4), rng.choice(ITER_KINDS))
    if r < 0.62:
        return ("contains", slot, rng.randrange(len(ALPHABET)))
    if r < 0.70:
        batch = random_batch(rng)
        return ("invalidate", slot, batch, rng.choice(SEQ_KINDS), rng.randint(0, len(batch) + 2))
    if r < 0.82:
        chain = random_batch(rng)
        hit = rng.randint(0, len(chain) + 2)
        return (
            "heal_query",
            slot,
            rng.choice(POLICIES),
            chain,
            random_batch(rng),
            hit,
            rng.random() < 0.5,
            rng.choice(DRIVERS),
            rng.randrange(2),
        )
    if r < 0.88:
        keys = random_batch(rng)
        delivered = rng.randint(0, len(keys) + 2)
        return (
            "heal_transfer",
            slot,
            rng.choice(POLICIES),
            keys,
            delivered,
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
    """25,000 seeded random operations per seed, compared after every one: the
    long-haul complement of the hypothesis search (same op set, wider alphabet)."""
    up = require_upstream()
    rng = random.Random(seed)
    cap = rng.randint(1, 8)
    program = [random_op(rng) for _ in range(SEEDED_OPS)]
    try:
        pair = run_program(up, cap, program)
    except Divergence as found:
        report(up, found)
    # The replay must have exercised what it claims to.
    assert {op[0] for op in program} >= {
        "add",
        "contains",
        "contains_all",
        "covered",
        "track",
        "untrack",
        "invalidate",
        "heal_query",
        "heal_transfer",
        "pool_clear",
        "pool_clear_inflight",
        "clear",
        "clear_inflight",
        "pool_cap",
        "cache_cap",
    }
    assert_every_kind_ran(pair.ran, {op[0] for op in program})
    assert len(pair.mine.pool_names()) == 4  # kv (two spellings), swa, mamba, draft_kv


def test_seeded_replay_on_bare_pools_matches_upstream() -> None:
    """``PoolExistenceBeliefs(cap)`` built directly (no container) behaves like
    upstream's under 10,000 seeded operations, all aimed at that one pool."""
    up = require_upstream()
    rng = random.Random(4242)
    cap = rng.randint(1, 8)
    program = [random_op(rng) for _ in range(10_000)]
    try:
        pair = run_program(up, cap, program, bare_pools=True)
    except Divergence as found:
        fail_with(lambda p: run_program(up, cap, p, bare_pools=True), found, f"sglang {up.version}")
    assert_every_kind_ran(pair.ran, {op[0] for op in program})


# -- smaller contracts ------------------------------------------------------------------
def test_default_policy_choice_matches_upstream() -> None:
    """default_belief_policy picks upstream's policy class for every PoolHitPolicy,
    given as the enum member or as its string value."""
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


def test_long_chains_at_default_cap_match_upstream() -> None:
    """Long chains without eviction pressure (upstream's 512K cap) behave the same:
    our C fast path of the walk is taken here, not only the miss path."""
    up = require_upstream()
    rng = random.Random(99)
    universe = [hashlib.sha256(f"chain-{i}".encode()).hexdigest() for i in range(3000)]
    theirs, mine = up.StorageExistenceCache(), ours.StorageExistenceCache()
    hits = 0
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
            elif action < 0.65:
                pool.untrack_inflight(chain[::3])
        result = theirs.pool("kv").contains_all(chain)
        assert mine.pool("kv").contains_all(chain) == result
        hits += result
        assert theirs.pool("kv").covered(iter(chain)) == mine.pool("kv").covered(iter(chain))
        assert list(theirs.pool("kv")._entries) == list(mine.pool("kv").lru_keys())
        assert dict(theirs.pool("kv")._inflight) == mine.pool("kv").inflight_refs()
    assert 0 < hits < 200  # both outcomes happened
