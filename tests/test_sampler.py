"""The advisor's reference-stream samplers: the compiled ``Sampler`` against its
pure-Python twin (the specification), on random programs and on streams long
enough to compact, grow and trim; attaching to either index; bad input."""

from __future__ import annotations

import gc
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.core import lru
from hicache_existence.core.sampler import PySampler, threshold

C_LRU = pytest.importorskip("hicache_existence.core._lru") if lru.c_index() else None
needs_c = pytest.mark.skipif(C_LRU is None, reason="the compiled index is not built")

KEYS = [f"{random.Random(i).getrandbits(256):064x}" for i in range(40)]


def both(th: int, max_keys: int, half_life: int = 0) -> tuple[object, PySampler]:
    assert C_LRU is not None
    return C_LRU.Sampler(th, max_keys, half_life), PySampler(th, max_keys, half_life)


def same(c: object, p: PySampler) -> None:
    cc, pc = c.counts(), p.counts()  # type: ignore[attr-defined]
    for key in pc:
        if key == "compactions":
            continue
        assert cc[key] == pytest.approx(pc[key], rel=1e-12, abs=1e-9), key
    limits = [*range(64), 10**6]
    for lookups in (False, True):
        assert c.cumulative(limits, lookups) == pytest.approx(  # type: ignore[attr-defined]
            p.cumulative(limits, lookups), rel=1e-12, abs=1e-9
        )


PROGRAM = st.lists(
    st.tuples(
        st.sampled_from(["added", "walked", "removed", "clear"]),
        st.lists(st.integers(0, 39), max_size=12),
        st.integers(0, 14),
        st.sampled_from([0, 0, 0, 3, 2**32 - 1]),
    ),
    max_size=80,
)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([1 << 64, 1 << 63, 1 << 62, 3 << 61]),
    st.integers(1, 12),
    st.sampled_from([0, 0, 5, 40]),
    PROGRAM,
)
def test_compiled_sampler_equals_the_python_twin(
    th: int, max_keys: int, half_life: int, program: list[tuple[str, list[int], int, int]]
) -> None:
    """Same curves, same counters after every call: duplicates within a call, walks
    that stop short (sampled or unsampled missed page), removals, clears, tags,
    trimming beyond max_keys and half-life weights."""
    c, p = both(th, max_keys, half_life)
    for op, pages, stop, tag in program:
        hashes = [KEYS[i] for i in pages]
        if op == "walked":
            c.walked(hashes, stop, tag)  # type: ignore[attr-defined]
            p.walked(hashes, stop, tag)
        elif op == "clear":
            c.clear()  # type: ignore[attr-defined]
            p.clear()
        else:
            getattr(c, op)(hashes, tag)
            getattr(p, op)(hashes, tag)
        same(c, p)


@needs_c
@pytest.mark.parametrize("max_keys", [3, 700, 5000])
def test_long_streams_compact_grow_and_trim_alike(max_keys: int) -> None:
    """200K references over 20K pages: the timestamp bitmap compacts (or doubles)
    many times, the key map grows, and the answers stay the twin's."""
    rng = random.Random(max_keys)
    pages = [f"p{i}" for i in range(20000)]
    c, p = both(1 << 64, max_keys)
    for _ in range(4000):
        start = int(rng.paretovariate(1.2) * 40) % 20000
        chain = pages[start : start + rng.randint(1, 60)]
        if rng.random() < 0.5:
            c.added(chain)  # type: ignore[attr-defined]
            p.added(chain)
        else:
            stop = rng.randint(0, len(chain))
            c.walked(chain, stop)  # type: ignore[attr-defined]
            p.walked(chain, stop)
    same(c, p)
    limits = [1, 2, 10, 100, 1000, 5000, 10**9]
    for lookups in (False, True):
        assert c.cumulative(limits, lookups) == pytest.approx(  # type: ignore[attr-defined]
            p.cumulative(limits, lookups), rel=1e-12
        )
    assert c.counts()["compactions"] > 0  # type: ignore[attr-defined]
    tracked = c.counts()["tracked"]  # type: ignore[attr-defined]
    assert tracked <= max_keys and (tracked == max_keys or max_keys == 5000)


@pytest.mark.parametrize("sampler", ["c", "python"])
def test_sampling_share_and_identity(sampler: str) -> None:
    """A page is sampled iff its str hash (unsigned) is below the threshold: the share
    is the rate, and a str subclass counts as its value."""
    if sampler == "c" and C_LRU is None:
        pytest.skip("the compiled index is not built")
    make = C_LRU.Sampler if sampler == "c" else PySampler  # type: ignore[union-attr]
    s = make(threshold(0.1), 1 << 20)
    pages = [f"page-{i}" for i in range(50000)]
    s.added(pages)
    expected = sum((hash(h) & ((1 << 64) - 1)) < threshold(0.1) for h in pages)
    assert s.counts()["raw_sampled"] == expected
    assert abs(expected - 5000) < 4 * (50000 * 0.1 * 0.9) ** 0.5

    class Sub(str):
        def __hash__(self) -> int:
            return 1

    exact = make(1 << 64, 10)
    exact.added(["a"])
    exact.walked([Sub("a")], 1)
    assert exact.cumulative([1], True) == [1.0]  # the subclass is the same page


@needs_c
def test_attach_feeds_from_inside_the_index_and_detaches() -> None:
    """A compiled index feeds an attached sampler on complete walks, adds, discards
    and clears (not on single touches or partial walks); None detaches; the index
    holds a reference; the wrong sampler type is refused."""
    assert C_LRU is not None
    index, twin = C_LRU.LruIndex(), lru.PyLruIndex()
    s, p = both(1 << 64, 100)
    before = sys.getrefcount(s)
    index.attach(0, s)
    twin.attach(0, p)
    assert sys.getrefcount(s) == before + 1
    for ix in (index, twin):
        ix.add(KEYS[:5])
        ix.touch_prefix(KEYS[:5])
        ix.touch_prefix(KEYS[3:9])  # stops short: the caller reports it
        ix.touch(KEYS[0])
        ix.discard(KEYS[:1])
        ix.add(KEYS[:2], 7)  # another tag: no sampler
    same(s, p)
    assert s.counts()["raw_references"] == 10  # type: ignore[attr-defined]
    assert s.counts()["tracked"] == 4  # type: ignore[attr-defined]
    index.clear()
    twin.clear()
    same(s, p)
    assert s.counts()["tracked"] == 0  # type: ignore[attr-defined]
    index.add(KEYS[:3])  # still attached after clear
    assert s.counts()["tracked"] == 3  # type: ignore[attr-defined]
    index.attach(0, None)
    index.add(KEYS[:3])
    assert s.counts()["raw_references"] == 13  # type: ignore[attr-defined]
    assert sys.getrefcount(s) == before
    with pytest.raises(TypeError, match="Sampler or None"):
        index.attach(0, p)
    with pytest.raises(TypeError, match="PySampler or None"):
        twin.attach(0, s)
    with pytest.raises(ValueError, match="tag"):
        index.attach(-1, s)
    index.attach(3, s)
    del index
    gc.collect()
    assert sys.getrefcount(s) == before


@pytest.mark.parametrize("sampler", ["c", "python"])
def test_bad_input_is_refused_and_changes_nothing(sampler: str) -> None:
    if sampler == "c" and C_LRU is None:
        pytest.skip("the compiled index is not built")
    make = C_LRU.Sampler if sampler == "c" else PySampler  # type: ignore[union-attr]
    for args, exc in [
        ((-1, 10), ValueError),
        (((1 << 64) + 1, 10), ValueError),
        ((1.5, 10), TypeError),
        ((10, 0), ValueError),
        ((10, 1 << 29), ValueError),
        ((10, 5, -1), ValueError),
    ]:
        with pytest.raises(exc):
            make(*args)
    s = make(1 << 64, 10)
    s.added(["a", "b"])
    snapshot = s.counts()
    with pytest.raises(TypeError, match=r"hashes\[1\]"):
        s.added(["c", 3])
    with pytest.raises(TypeError, match="list or tuple"):
        s.added({"c"})
    with pytest.raises(ValueError, match="stop"):
        s.walked(["a"], -1)
    with pytest.raises(TypeError, match="stop"):
        s.walked(["a"], "1")
    with pytest.raises(ValueError, match="tag"):
        s.removed(["a"], 2**32)
    assert s.counts() == snapshot


@needs_c
def test_memory_is_bounded_by_max_keys() -> None:
    """Far more distinct sampled pages than max_keys: the tracked set and the
    structures stay bounded (~100 bytes a tracked page with both histograms)."""
    assert C_LRU is not None
    s = C_LRU.Sampler(1 << 64, 4096)
    for i in range(0, 200000, 100):
        s.added([f"k{j}" for j in range(i, i + 100)])
    assert s.counts()["tracked"] == 4096
    assert s.__sizeof__() < 4096 * 120


@needs_c
def test_a_decay_too_fast_for_a_float_weighs_the_past_zero_alike() -> None:
    """half_life 1 and an 1100-page call: the weight's growth overflows a double
    (C's pow gives inf, Python's raises); both then weigh the past as zero."""
    c, p = both(1 << 64, 50, half_life=1)
    for s in (c, p):
        s.added(KEYS[:5])  # type: ignore[attr-defined]
        s.added([f"x{i}" for i in range(1100)])  # type: ignore[attr-defined]
        s.walked(KEYS[:3], 3)  # type: ignore[attr-defined]
    same(c, p)
