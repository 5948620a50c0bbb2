"""Shared helpers of the differential tests in this directory.

A plain module rather than a conftest: the tests import these names, and two
``conftest`` modules (tests/ and tests/upstream/) cannot both be imported by name.

The upstream classes come from the installed sglang wheel (the environment of
``tests/envs/ensure-env.sh``), never from a copy in this repository: a copy could
drift from what sglang ships and the differential test would then prove nothing.

``require_upstream()`` is called from inside each test (not from a fixture) so that a
missing wheel shows up as a *failed* test under ``HICACHE_EXISTENCE_REQUIRE_SGLANG=1``
(CI) and as a skip with the reason everywhere else.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIRE_SGLANG = os.environ.get("HICACHE_EXISTENCE_REQUIRE_SGLANG") == "1"


@dataclass(frozen=True)
class Upstream:
    """The upstream names the differential tests drive."""

    module: ModuleType
    StorageExistenceCache: Any
    PoolExistenceBeliefs: Any
    ChainPagesPolicy: Any
    TrailingWindowPolicy: Any
    default_belief_policy: Any
    PoolHitPolicy: Any
    PoolName: Any
    version: str


@functools.cache
def _load_upstream() -> Upstream | str:
    """Import sglang once per session; the failure reason is cached as a string."""
    try:
        import sglang
        from sglang.srt.mem_cache.buffer_mode import storage_existence_cache as sec
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName
    except Exception as exc:  # sglang's __init__ can fail with more than ImportError
        return (
            f"the sglang wheel is not importable ({type(exc).__name__}: {exc}); "
            "run the tests with the python printed by tests/envs/ensure-env.sh"
        )
    return Upstream(
        module=sec,
        StorageExistenceCache=sec.StorageExistenceCache,
        PoolExistenceBeliefs=sec.PoolExistenceBeliefs,
        ChainPagesPolicy=sec.ChainPagesPolicy,
        TrailingWindowPolicy=sec.TrailingWindowPolicy,
        default_belief_policy=sec.default_belief_policy,
        PoolHitPolicy=PoolHitPolicy,
        PoolName=PoolName,
        version=getattr(sglang, "__version__", "?"),
    )


def require_upstream() -> Upstream:
    """The upstream classes, or fail (CI) / skip (elsewhere) with the reason."""
    loaded = _load_upstream()
    if isinstance(loaded, str):
        if REQUIRE_SGLANG:
            pytest.fail(f"HICACHE_EXISTENCE_REQUIRE_SGLANG=1: {loaded}", pytrace=False)
        pytest.skip(loaded)
    return loaded


@functools.cache
def seed_baseline() -> ModuleType:
    """The seed's code as the benchmarks run it (``hicache_existence_bench.seed``):
    the one baseline every benchmark compares against, so the differential test
    also proves the benchmark's baseline behaves like the seed."""
    import hicache_existence_bench.seed as seed

    return seed


# -- programs and divergences, shared by the differential tests -------------------------
Op = tuple[Any, ...]

#: Small alphabet of real-looking page hashes (64-char lowercase hex, like sglang's);
#: programs name pages by index so a divergence prints short.
ALPHABET: tuple[str, ...] = tuple(
    hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(10)
)
_INDEX = {h: i for i, h in enumerate(ALPHABET)}


def pages(idx: Sequence[int]) -> list[str]:
    """The page hashes named by alphabet indexes."""
    return [ALPHABET[i] for i in idx]


def page_ids(value: Any) -> Any:
    """``value`` with every alphabet hash inside it replaced by its index (for messages)."""
    if isinstance(value, str):
        return _INDEX.get(value, value)
    if isinstance(value, dict):
        return {page_ids(k): page_ids(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(page_ids(v) for v in value)
    return value


def fresh_iterable(kind: str, idx: Sequence[int]) -> Iterable[str]:
    """A new iterable of the pages on each call: each cache gets its own one-shot
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


class Divergence(AssertionError):
    """The implementation under test and its reference disagree.  Carries how both
    caches were built (``setup``: constructor keyword arguments) and the program up
    to and including the diverging step, so it can be replayed and minimized."""

    def __init__(self, what: str, cls: str, setup: dict[str, Any], program: Sequence[Op]) -> None:
        self.what = what
        self.cls = cls
        self.setup = dict(setup)
        self.program = list(program)
        args = ", ".join(f"{k}={v!r}" for k, v in self.setup.items())
        lines = [what, f"  both = {cls}({args})"]
        lines += [f"  [{i}] {op!r}" for i, op in enumerate(self.program)]
        super().__init__("\n".join(lines))


def minimized(
    replay: Callable[[list[Op]], object], found: Divergence, budget_s: float = 30.0
) -> Divergence:
    """The shortest program (greedy chunk deletion within ``budget_s``) that still
    diverges when ``replay``ed on fresh caches: a human needs two or three steps,
    not the 25,000 random ones that happened to find the bug."""
    program = found.program
    last = found
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(program) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        while i < len(program) and time.monotonic() < deadline:
            candidate = program[:i] + program[i + chunk :]
            try:
                replay(candidate)
            except Divergence as still:
                program, last = still.program, still
            else:
                i += chunk
        chunk //= 2
    return last


def fail_with(replay: Callable[[list[Op]], object], found: Divergence, against: str) -> None:
    """Fail the test with the minimized divergence (pages shown as alphabet indexes)."""
    small = minimized(replay, found)
    pytest.fail(
        f"hicache_existence diverges from {against}.\n"
        f"Minimized ({len(small.program)} of {len(found.program)} steps; "
        f"page i = ALPHABET[i]):\n{small}",
        pytrace=False,
    )


def raised(outcome: object) -> bool:
    """Whether a differential outcome is ``("raised", exception type name)``."""
    return isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] == "raised"


def assert_every_kind_ran(ran: Counter[str], kinds: Iterable[str]) -> None:
    """Agreement by raising the same exception proves little: every kind of
    operation in the program must also have run on both caches without raising."""
    missing = sorted(k for k in set(kinds) if ran[k] == 0)
    assert not missing, f"operations that never ran without raising on both: {missing}"
