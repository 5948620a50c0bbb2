"""The trace recorder: spatial sampling, the writer thread, rotation, the disk bound,
drops, and the replay of what it wrote (``hicache_existence.accounting.recorder``)."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gzip
import hashlib
import importlib
import io
import json
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence import cli
from hicache_existence.accounting import recorder as rec
from hicache_existence.accounting.advisor import MULTIPLIERS
from hicache_existence.config import Config, ConfigError, RecorderSection
from hicache_existence.core import lru
from hicache_existence.replay.recorded import recorded_curves
from hicache_existence.replay.trace import TraceError, read_trace
from hicache_existence.runtime import ExistenceRuntime


def page(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}{i}".encode()).hexdigest()


def section(tmp_path: Path, **kw: Any) -> RecorderSection:
    base = {"enabled": True, "path": str(tmp_path / "trace"), "flush_interval_s": 0.05}
    return Config.from_mapping({"recorder": {**base, **kw}}).recorder


#: The taps: the Python twin and, where built, the compiled one.
TAPS = [rec.PyTap] + ([rec.Tap] if rec.Tap is not rec.PyTap else [])


def drain(r: rec.Recorder) -> list[tuple[Any, ...]]:
    """Every record the writer would write now (request ends among them)."""
    return r.tap.take(1 << 30)  # type: ignore[no-any-return]


# -- sampling --------------------------------------------------------------------------------


def test_bound_is_the_rate_as_eight_hex_digits() -> None:
    """The bound is rate x 2^32 in 8 lowercase hex digits; rate 1 records every page."""
    assert rec.bound(0.5) == "80000000"
    assert rec.bound(0.02) == "051eb851"
    assert rec.bound(2.0**-32) == "00000001"
    assert rec.bound(1.0) is None
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sample_rate"):
            rec.bound(bad)
    with pytest.raises(TypeError, match="sample_rate"):
        rec.bound(True)


def test_share_of_sha256_pages_recorded_is_the_rate() -> None:
    """Over 20,000 SHA-256 page hashes the recorded share is the rate (these exact
    hashes: a deterministic count)."""
    pages = [page(i) for i in range(20000)]
    counts = {rate: len(rec.py_below(pages, rec.bound(rate) or "")) for rate in (0.02, 0.25, 0.5)}
    assert counts == {0.02: 398, 0.25: 5006, 0.5: 9995}
    for rate, n in counts.items():  # the first 32 bits of the hash, below rate x 2^32
        assert n == sum(int(p[:8], 16) < int(rate * 2**32) for p in pages)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(min_size=0, max_size=12), max_size=40),
    st.text(min_size=0, max_size=10),
    st.booleans(),
)
def test_compiled_page_test_equals_the_python_twin(
    keys: list[str], bound: str, as_tuple: bool
) -> None:
    """``below`` (compiled) answers exactly as ``[i for i, k in enumerate(keys) if k <
    bound]`` for any strings (non-ASCII ones included), lists and tuples alike."""
    native = lru.compiled("accounting._recorder")
    seq = tuple(keys) if as_tuple else keys
    expected = [i for i, k in enumerate(keys) if k < bound]
    assert rec.py_below(seq, bound) == expected
    if native is not None:
        assert native.below(seq, bound) == expected


BELOWS = [rec.py_below] + (
    [lru.compiled("accounting._recorder").below]  # type: ignore[union-attr]
    if lru.compiled("accounting._recorder") is not None
    else []
)


# -- the writer's encoder ---------------------------------------------------------------


def _built_encoder() -> Any:
    """The compiled module as built, whatever backend the package was told to use (the
    pure-Python legs still test the C encoder against ``_encode``)."""
    try:
        return importlib.import_module("hicache_existence.accounting._recorder")
    except ImportError:
        return None


NATIVE = _built_encoder()
KIND_NAMES = ["lookup", "add", "invalidate", "clear", "write", "prefetch", "request"]
#: Pools and pages the compiled encoder takes (exact ASCII, escapes included) and
#: ones it hands back to ``_encode`` (non-ASCII, a str subclass).
ASCII_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=127), max_size=10)


class Tagged(str):
    pass


@st.composite
def records(draw: Any, plain: bool) -> tuple[Any, ...]:
    """A record as the taps and ``Recorder._put`` queue it; ``plain``: only what the
    compiled encoder must take itself (no hand-back)."""
    kind = draw(st.sampled_from(KIND_NAMES))
    text = ASCII_TEXT if plain else st.one_of(ASCII_TEXT, st.text(max_size=6))
    pool = draw(text if not plain else st.one_of(st.just("kv"), ASCII_TEXT))
    if not plain and draw(st.booleans()):
        pool = Tagged(pool)
    n = draw(st.integers(0, 8))
    pages = tuple(draw(st.one_of(st.just(page(i)), text)) for i in range(n))
    idx = None
    if draw(st.booleans()):
        idx = sorted(draw(st.sets(st.integers(0, 3 * n + 3), min_size=n, max_size=n)))
    big = st.integers(-(2**70), 2**70) if not plain else st.integers(-(2**40), 2**40)
    extra: Any = {
        "lookup": draw(st.integers(0, 3 * n + 4)),
        "invalidate": draw(st.integers(0, 3 * n + 4)),
        "prefetch": draw(st.integers(0, n)),
        "request": draw(st.integers(1, 2**40)),
    }.get(kind)
    odd = st.one_of(big, st.booleans(), st.none(), st.floats(allow_nan=False))
    if not plain and draw(st.integers(0, 3)) == 0:
        extra = draw(odd)
    if not plain and idx and draw(st.integers(0, 3)) == 0:
        idx[draw(st.integers(0, len(idx) - 1))] = draw(st.one_of(big, st.booleans(), st.floats()))
    t = draw(st.floats(-1e12, 1e12, allow_nan=False))
    if not plain and draw(st.integers(0, 9)) == 0:
        t = draw(st.one_of(st.integers(-10, 10), st.floats()))
    request = draw(st.one_of(st.just(0), st.integers(1, 2**40)))
    return (t, kind, pool, pages, idx, extra, request)


def python_line(record: tuple[Any, ...], t0: float) -> Any:
    r = rec.Recorder.__new__(rec.Recorder)
    r._t0 = t0
    try:
        return r._encode(record)
    except Exception as exc:  # the writer counts it as a write error
        return type(exc)


@pytest.mark.skipif(NATIVE is None, reason="compiled recorder not built")
@settings(max_examples=400, deadline=None)
@given(records(plain=True), st.floats(-1e6, 1e6, allow_nan=False))
def test_compiled_encoder_writes_the_python_line(record: tuple[Any, ...], t0: float) -> None:
    """For every record the taps and ``_put`` make (exact ASCII pools and pages, control
    characters and quotes included; float times; any indices, stops, keep_pages and
    request numbers) the compiled encoder takes the record itself and writes exactly
    ``_encode``'s JSON line, or ``None`` where it does."""
    assert NATIVE is not None
    assert NATIVE.encode(record, t0) == python_line(record, t0)


@pytest.mark.skipif(NATIVE is None, reason="compiled recorder not built")
@settings(max_examples=200, deadline=None)
@given(records(plain=False), st.one_of(st.floats(-1e6, 1e6), st.integers(-5, 5)))
def test_compiled_encoder_hands_back_what_it_does_not_take(record: Any, t0: Any) -> None:
    """Anything else (a non-ASCII or subclassed pool or page, an int or non-finite
    time, a stop that is not an int, an int past 64 bits) raises TypeError and no
    other error; what it does encode is ``_encode``'s line."""
    assert NATIVE is not None
    try:
        line = NATIVE.encode(record, t0)
    except TypeError:
        return
    assert line == python_line(record, t0)


ODD_NUMBERS = [
    ("lookup", None, 2**70),
    ("lookup", None, 1.5),
    ("lookup", None, True),
    ("lookup", None, None),
    ("lookup", [0, 2**70], 1),
    ("lookup", [0, 1.5], 1),
    ("lookup", [True, 3], 3),
    ("invalidate", None, 2**70),
    ("invalidate", [2**70], 0),
    ("invalidate", None, -1),
    ("request", None, 2**70),
    ("request", None, True),
    ("prefetch", None, 2**70),
    ("prefetch", None, 0.5),
]


@pytest.mark.skipif(NATIVE is None, reason="compiled recorder not built")
@pytest.mark.parametrize(("kind", "idx", "extra"), ODD_NUMBERS)
def test_compiled_encoder_hands_back_numbers_it_cannot_take(
    kind: str, idx: Any, extra: Any
) -> None:
    """A stop, keep_pages, index, request or hit that is not an int fitting 64 bits
    (a bool, a float, None, 2**70, a negative keep) is handed back with TypeError,
    never another error (the drain would count that record as lost)."""
    assert NATIVE is not None
    record = (5.0, kind, "kv", (page(0), page(1)), idx, extra, 0)
    with pytest.raises(TypeError):
        NATIVE.encode(record, 1.0)


def test_the_writer_encodes_in_c_where_built_and_falls_back_per_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain uses the compiled encoder (CI: it must be built); a record it hands
    back is written by ``_encode``, and the file holds every record either way."""
    if os.environ.get("HICACHE_EXISTENCE_REQUIRE_ALL") == "1" and lru._choice() != "python":
        assert rec._native_encode is not None
    calls = {"c": 0, "python": 0}
    real_c, real_py = rec._native_encode, rec.Recorder._encode

    def c_encode(record: Any, t0: float) -> Any:
        calls["c"] += 1
        if real_c is None:
            raise TypeError("not built")
        return real_c(record, t0)

    def py_encode(self: rec.Recorder, record: Any) -> Any:
        calls["python"] += 1
        return real_py(self, record)

    monkeypatch.setattr(rec, "_native_encode", c_encode)
    monkeypatch.setattr(rec.Recorder, "_encode", py_encode)
    r = rec.Recorder(section(tmp_path, sample_rate=1.0), instance="enc")
    chain = [page(i) for i in range(4)]
    r.tap.added("kv", chain)
    r.tap.added("p\u00e9", chain)  # non-ASCII pool: handed back
    r.tap.touched("kv", chain, 2)
    r.close()
    assert calls == {"c": 3, "python": 1 if real_c is not None else 3}
    lines = []
    for f in sorted((tmp_path / "trace").glob("*" + rec.SUFFIX)):
        lines += gzip.decompress(f.read_bytes()).decode().splitlines()[1:]
    assert [json.loads(x)["pool"] for x in lines] == ["kv", "p\u00e9", "kv"]


@pytest.mark.parametrize("below", BELOWS)
def test_the_page_test_refuses_bad_input(below: Any) -> None:
    """Bad arguments raise TypeError naming them (both implementations alike)."""
    with pytest.raises(TypeError, match="keys"):
        below({"a"}, "b")
    with pytest.raises(TypeError, match="bound"):
        below(["a"], 5)
    with pytest.raises(TypeError):
        below(["a", 5], "b")


def test_sampling_is_spatial_a_page_is_always_or_never_recorded(tmp_path: Path) -> None:
    """Over random overlapping operations of every kind, each operation records exactly
    its pages below the bound, in order: a page is recorded at every reference or
    never, and two recorders (two ranks, or a restart) record the same pages."""
    rng = random.Random(7)
    universe = [page(i, "u") for i in range(400)]
    rate = 0.25
    b = rec.bound(rate)
    assert b is not None
    a, other = (
        rec.Recorder(section(tmp_path, sample_rate=rate)),
        rec.Recorder(section(tmp_path / "x", sample_rate=rate)),
    )
    ops = []
    for _ in range(500):
        start = rng.randrange(len(universe))
        chain = universe[start : start + rng.randint(1, 60)]
        kind = rng.choice(["touched", "added", "written", "prefetch"])
        ops.append((kind, chain, rng.randint(0, len(chain))))
    for r in (a, other):
        for kind, chain, stop in ops:
            if kind == "touched":
                r.touched("kv", chain, stop)
            elif kind == "added":
                r.added("kv", chain)
            elif kind == "written":
                r.written("kv", chain)
            else:
                r.prefetch("kv", chain, stop)
    got_a, got_other = drain(a), drain(other)
    assert [x[1:6] for x in got_a] == [x[1:6] for x in got_other]
    expected = [[p for p in chain if p < b] for _, chain, _ in ops]
    assert [list(x[3]) for x in got_a] == [e for e in expected if e]
    recorded = {p for x in got_a for p in x[3]}
    referenced = {p for _, chain, _ in ops for p in chain}
    assert recorded == {p for p in referenced if rec.sampled(p, rate)}


def encoded(r: rec.Recorder) -> list[dict[str, Any]]:
    """The queued records as the writer would write them (timestamps left out)."""
    out = []
    for record in drain(r):
        line = r._encode(record)
        if line is not None:
            obj = json.loads(line)
            del obj["timestamp"]
            out.append(obj)
    return out


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_lookup_record_says_how_far_it_walked_and_where_it_missed(
    tmp_path: Path, rate: float
) -> None:
    """A lookup keeps its recorded pages, how many of them it walked, and whether it
    stopped at a recorded page; an invalidation keeps its recorded pages from
    keep_pages on (none left: no record); an in-flight-only clear is not recorded."""
    b = rec.bound(rate)
    chain = [page(i) for i in range(12)]
    kept = [p for p in chain if b is None or p < b]
    r = rec.Recorder(section(tmp_path, sample_rate=rate))
    stop = chain.index(kept[2])  # the lookup misses at a recorded page
    r.touched("kv", chain, stop)
    r.touched("kv", chain, 12)
    r.invalidated("kv", chain, chain.index(kept[-1]))
    r.invalidated("kv", chain, 12)
    r.cleared("kv", True)
    r.cleared("kv", False)
    assert encoded(r) == [
        {"kind": "lookup", "pool": "kv", "pages": kept, "walked": 2, "miss": True},
        {"kind": "lookup", "pool": "kv", "pages": kept, "walked": len(kept)},
        {"kind": "invalidate", "pool": "kv", "pages": kept[-1:]},
        {"kind": "clear", "pool": "kv"},
    ]
    assert 0 < len(kept) < 12 or rate == 1.0


def test_lookups_inside_an_insert_carry_its_request_number(tmp_path: Path) -> None:
    """begin/end_request number the inserts; lookups in between carry the number and
    the request record closes it."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    chain = [page(i) for i in range(3)]
    r.touched("kv", chain, 3)
    r.begin_request()
    r.touched("kv", chain, 3)
    r.end_request()
    r.begin_request()
    r.end_request()
    got = encoded(r)
    assert [x.get("request", 0) for x in got if x["kind"] == "lookup"] == [0, 1]
    assert [x for x in got if x["kind"] == "request"] == [
        {"kind": "request", "request": 1},
        {"kind": "request", "request": 2},
    ]


def test_the_insert_hook_brackets_each_insert_of_the_tree_it_is_installed_on(
    tmp_path: Path,
) -> None:
    """``recorder_hooks.install_on``: on a ``UnifiedRadixCache`` (or a subclass), once,
    each insert is one request of the recorder (the lookups inside it carry its
    number, closed even when upstream raises); another class is left alone."""
    from hicache_existence.integrations.sglang import recorder_hooks

    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    chain = [page(i) for i in range(3)]
    seen: list[int] = []

    class UnifiedRadixCache:
        def insert(self, key: str, *, value: int = 0) -> str:
            seen.append(r.tap.request)
            r.touched("kv", chain, 3)
            if key == "fail":
                raise RuntimeError("upstream")
            return f"{key}{value}"

    class Tree(UnifiedRadixCache):
        pass

    class Other:
        def insert(self, key: str) -> str:
            return key

    other = Other()
    assert not recorder_hooks.install_on(other, r) and "insert" not in vars(other)
    tree = Tree()
    assert recorder_hooks.install_on(tree, r) and recorder_hooks.install_on(tree, r)  # once
    r.touched("kv", chain, 3)  # outside any insert
    assert tree.insert("d", value=2) == "d2"
    with pytest.raises(RuntimeError, match="upstream"):
        tree.insert("fail")
    assert seen == [1, 2] and r.tap.request == 0
    got = encoded(r)
    assert [x.get("request", 0) for x in got if x["kind"] == "lookup"] == [0, 1, 2]
    assert [x for x in got if x["kind"] == "request"] == [
        {"kind": "request", "request": 1},
        {"kind": "request", "request": 2},
    ]


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=12),
    capacity=st.integers(1, 6),
    python_tap=st.booleans(),
)
def test_bracket_records_what_begin_and_end_request_record(
    tmp_path_factory: pytest.TempPathFactory,
    calls: list[tuple[bool, int]],
    capacity: int,
    python_tap: bool,
) -> None:
    """``Recorder.bracket`` (the compiled ``Bracket``, or ``PyTap``'s twin) is
    ``begin_request``, the call, ``end_request``: the same records, numbers, tap
    state and queue-full drops, whether the call raises or not, at any queue
    capacity (the writer not draining)."""
    tmp = tmp_path_factory.mktemp("bracket")
    chain = [page(i) for i in range(3)]
    recorders = [
        rec.Recorder(section(tmp / name, sample_rate=1.0, queue_records=capacity))
        for name in ("bracket", "methods")
    ]
    if python_tap:
        for r in recorders:
            r.tap = rec.PyTap(r._bound, r.capacity, r._clock)

    def work(r: rec.Recorder, fail: bool, lookups: int) -> str:
        for _ in range(lookups):
            r.touched("kv", chain, 3)
        if fail:
            raise ValueError("insert")
        return "ok"

    a, b = recorders
    bracketed = a.bracket(lambda fail, lookups: work(a, fail, lookups))
    for fail, lookups in calls:
        with contextlib.suppress(ValueError):
            bracketed(fail, lookups)
        b.begin_request()
        try:
            with contextlib.suppress(ValueError):
                work(b, fail, lookups)
        finally:
            b.end_request()
    assert [x[1:] for x in drain(a)] == [x[1:] for x in drain(b)]  # timestamps aside
    assert a.tap.request == b.tap.request == 0
    assert a.tap.numbered == b.tap.numbered == len(calls)
    assert a.snapshot().dropped == b.snapshot().dropped
    assert python_tap or rec.Tap is rec.PyTap or type(bracketed).__name__ == "Bracket"


@pytest.mark.parametrize("tap_type", TAPS)
def test_records_and_request_ends_are_taken_in_the_order_they_happened(
    tmp_path: Path, tap_type: Any
) -> None:
    """A request's end is one more record of the tap's (no Python object made at an
    insert), so the writer takes a request's lookups before its end, whatever the
    clock reads (here it steps back); ``take(limit)`` takes the oldest, the rest wait."""
    now = [0.0]
    r = rec.Recorder(section(tmp_path, sample_rate=1.0), clock=lambda: now[0])
    r.tap = tap_type(r._bound, r.capacity, r._clock)
    chain = [page(0)]
    bracketed = r.bracket(lambda: r.touched("kv", chain, 1))
    for t in (1.0, 3.0, 2.5):  # the lookup and its request's end read the same time
        now[0] = t
        bracketed()
        now[0] = t + 1
        r.touched("kv", chain, 1)  # outside any request
    assert r.tap.waiting == 9
    first = r.tap.take(4)
    got = [(x[0], x[1], x[6] if x[1] == "lookup" else x[5]) for x in first + r.tap.take(100)]
    assert got == [
        (1.0, "lookup", 1),
        (1.0, "request", 1),
        (2.0, "lookup", 0),
        (3.0, "lookup", 2),
        (3.0, "request", 2),
        (4.0, "lookup", 0),
        (2.5, "lookup", 3),
        (2.5, "request", 3),
        (3.5, "lookup", 0),
    ]
    assert len(first) == 4 and r.tap.waiting == 0 and r.tap.take(100) == []
    with pytest.raises(TypeError):
        r.tap.ended("7")
    with pytest.raises(TypeError):
        r.tap.take("all")
    r.touched("kv", chain, 1)
    assert r.tap.take(-1) == [] and len(r.tap.take(2**70)) == 1  # a limit is clipped


@pytest.mark.parametrize("tap_type", TAPS)
def test_a_clock_that_logs_records_never_overfills_the_tap(tap_type: Any) -> None:
    """A clock that is Python code may log another record while the tap reads it
    (another thread, re-entry): the records stay within ``capacity``, the rest dropped
    and counted (the time is read before the capacity test and the store)."""
    inner = [True]

    def clock() -> float:
        if inner[0]:
            inner[0] = False
            tap.ended(999)
        return 1.0

    tap = tap_type(None, 64, clock)
    inner[0] = False
    for number in range(1, 63):
        tap.ended(number)
    tap.touched("kv", [page(0)], 1)
    inner[0] = True
    tap.touched("kv", [page(1)], 1)  # its clock logs 999 into the last slot first
    taken = tap.take(1000)
    assert len(taken) == 64 and tap.dropped == 1
    assert [x[5] for x in taken][-2:] == [1, 999]


def test_a_clock_that_changes_the_chain_or_the_request_records_them_as_called() -> None:
    """A clock that is Python code runs between the page test and the store: both taps
    record the chain as it was tested and the request of the call, whatever the clock
    changes (the compiled tap tests a copy first when its clock is not the direct one)."""
    seen = []
    for tap_type in TAPS:
        chain: list[Any] = []
        change: list[Any] = [None]
        taps: list[Any] = []

        def clock(chain: list[Any] = chain, change: list[Any] = change, taps: Any = taps) -> float:
            if change[0] is not None:
                chain[:] = change[0]
                taps[0].request += 1
            return 1.0

        tap = tap_type(rec.bound(0.5), 64, clock)
        taps.append(tap)
        for changed in ([], [0, 1, 2], [page(2)] * 100, ["00", "f0", "10"]):
            chain[:] = [page(i) for i in range(40)]
            change[0] = changed
            assert tap.touched("kv", chain, 1) is None
            assert tap.cleared("kv", False) is None
        seen.append((tap.take(100), tap.errors))
    for records, errors in seen:
        assert [(r[1:]) for r in records] == [(r[1:]) for r in seen[0][0]] and errors == 0
        assert [r[6] for r in records] == [0, 1, 2, 3, 4, 5, 6, 7]
        assert all(
            r[3] == tuple(p for p in (page(i) for i in range(40)) if p < rec.bound(0.5))
            for r in records
            if r[1] == "lookup"
        )


@pytest.mark.parametrize("tap_type", TAPS)
def test_keys_the_c_test_cannot_take_anywhere_in_a_chain_are_compared_as_python_does(
    tap_type: Any,
) -> None:
    """A non-ASCII str, a str subclass or a non-str after the first recorded page is
    compared as Python compares (not counted as a failure); a key that cannot be
    compared at all is counted, nothing recorded, no clock read."""

    class S(str):
        pass

    ticks = iter(range(100))
    tap = tap_type("80000000", 64, lambda: float(next(ticks)))
    tap.touched("kv", ["0abc", "é"], 1)
    tap.touched("kv", ("0abc", "ffff", S("1")), 2)
    tap.touched("kv", ["0", 5], 1)
    got = tap.take(10)
    assert [(r[0], r[3], r[4]) for r in got] == [
        (0.0, ("0abc",), [0]),
        (1.0, ("0abc", "1"), [0, 2]),
    ]
    assert tap.errors == 1


@pytest.mark.parametrize("tap_type", TAPS)
def test_a_cycle_through_a_record_is_collected(tap_type: Any) -> None:
    """A record holds what the caller passed (a pool, an extra): a cycle through it
    and the tap is collected."""
    import gc
    import weakref

    class Pool(str):
        pass

    tap = tap_type(None, 64, time.monotonic)
    pool = Pool("kv")
    pool.tap = tap  # type: ignore[attr-defined]
    tap.touched(pool, ["a"], 1)
    gone = weakref.ref(pool)
    del pool, tap
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("tap_type", TAPS)
def test_records_logged_or_taken_while_the_writer_takes_them_are_kept(tap_type: Any) -> None:
    """Taking may run Python code (a collection's callbacks, inside an allocation) that
    logs more and takes: every record is taken once,
    none lost, each take in the order they were logged."""
    import gc

    tap = tap_type(None, 10_000, time.monotonic)
    for number in range(1, 501):
        tap.ended(number)
        tap.touched("kv", [page(number)], 1)
    pending = list(range(501, 541))
    takes: list[list[Any]] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and pending:
            tap.ended(pending.pop(0))
            takes.append(tap.take(5))

    threshold = gc.get_threshold()
    gc.callbacks.append(note)
    try:
        gc.set_threshold(1)
        takes.append(tap.take(10_000))
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(note)
    takes.append(tap.take(10_000))
    numbers = sorted(x[5] for got in takes for x in got if x[1] == "request") + pending
    assert numbers == list(range(1, 541))
    assert sum(len(got) for got in takes) == 1000 + 40 - len(pending)
    for got in takes:
        times = [x[0] for x in got]
        assert times == sorted(times)
    assert tap.dropped == 0 and tap.errors == 0


def test_comparisons_that_change_the_chain_or_the_request_change_no_record() -> None:
    """Keys the C test cannot take are compared as Python does, on a copy and with the
    request of the call: a comparison (Python code) that changes the chain or the
    request changes neither tap's record."""

    class Key(str):
        def __lt__(self, other: object) -> bool:
            chain.clear()
            taps[0].request += 10
            return str.__lt__(self, other)  # type: ignore[operator]

    seen = []
    for tap_type in TAPS:
        taps = [tap_type("8", 64, time.monotonic)]
        chain: list[Any] = [Key("00a"), "00b", "ffc"]
        taps[0].request = 1
        taps[0].touched("kv", chain, 1)
        seen.append([(r[1], r[3], r[4], r[6]) for r in taps[0].take(10)])
    assert seen[0] == [("lookup", ("00a", "00b"), [0, 1], 1)]
    assert all(s == seen[0] for s in seen)


@pytest.mark.parametrize("tap_type", TAPS)
def test_a_collection_listing_objects_during_a_take_sees_no_half_made_record(
    tap_type: Any,
) -> None:
    """A take's list and tuples are filled before a collection's callbacks can list
    them (on 3.10/3.11 the allocations inside a take may run one): every container a
    callback finds is whole."""
    import gc

    tap = tap_type("8", 1000, time.monotonic)
    for i in range(50):
        tap.touched("kv", [f"0{i}", "f", f"1{i}"], 2)
    found = [0]

    def look(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            for o in gc.get_objects(0):
                if type(o) in (list, tuple):
                    found[0] += sum(1 for _ in o)

    threshold = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(look)
    try:
        gc.set_threshold(1)
        got = tap.take(100)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(look)
    assert len(got) == 50 and all(r[3] == (f"0{i}", f"1{i}") for i, r in enumerate(got))


@pytest.mark.skipif(NATIVE is None, reason="compiled recorder not built")
def test_a_burst_frees_its_memory_with_its_last_take() -> None:
    """A burst of long records grows the compiled tap's arrays; the take that drains
    them frees what is past the kept size, not the next record's take."""
    import tracemalloc

    tap = NATIVE.Tap(None, 100_000, time.monotonic)
    chain = [page(i) for i in range(20)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            tap.touched("kv", chain, 20)
        grown = tracemalloc.get_traced_memory()[0]
        while tap.take(4096):
            pass
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert grown - before > 5_000_000 and after - before < 1_000_000


@pytest.mark.parametrize("tap_type", TAPS)
def test_a_patched_monotonic_clock_is_called(tap_type: Any) -> None:
    """The compiled tap reads CLOCK_MONOTONIC itself only for the real
    ``time.monotonic``: one patched since (a test's) is called, as PyTap calls it."""
    from unittest import mock

    with mock.patch("time.monotonic", lambda: 42.0):
        tap = tap_type(None, 10, time.monotonic)
        tap.ended(1)
    assert [r[0] for r in tap.take(10)] == [42.0]


def test_records_are_read_by_the_monotonic_clock_without_calling_it(tmp_path: Path) -> None:
    """The compiled tap reads CLOCK_MONOTONIC itself when its clock is
    ``time.monotonic``: the time base of the writer's own readings."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    before = time.monotonic()
    r.bracket(lambda: r.touched("kv", [page(0)], 1))()
    after = time.monotonic()
    lookup, end = r.tap.take(10)
    assert before <= lookup[0] <= end[0] <= after
    assert (lookup[1], lookup[6], end[1], end[5]) == ("lookup", 1, "request", 1)


def test_a_busy_scheduler_and_the_writer_write_a_readable_trace(tmp_path: Path) -> None:
    """A scheduler thread bracketing inserts (lookups inside and outside them) while
    the writer drains every few milliseconds: the trace reads back (its times never
    decrease), with one request per insert and every lookup in it."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0, flush_interval_s=0.002)).start()
    chain = [page(i) for i in range(4)]
    bracketed = r.bracket(lambda: r.touched("kv", chain, 4))
    inserts = 3000
    for i in range(inserts):
        bracketed()
        if i % 3 == 0:
            r.added("kv", chain)
    r.close()
    trace = read_trace(tmp_path / "trace")
    assert len(trace.requests) == inserts
    assert all(q.pages == tuple(chain) for q in trace.requests)
    assert r.snapshot().dropped == {"queue_full": 0, "write_error": 0}


# -- the writer: files, rotation, bound, drops ------------------------------------------------


def test_records_reach_a_readable_compressed_file_with_its_header(tmp_path: Path) -> None:
    """The writer thread writes gzip JSON lines with a version-2 header naming the
    instance, the rate and the page size; replay reads them back as events."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0), instance="h:30000-dp0-tp0-pp0")
    r.set_page_size(16)
    r.start()
    chain = [page(i) for i in range(4)]
    r.added("kv", chain)
    r.touched("kv", chain, 2)
    r.close()
    (path,) = sorted((tmp_path / "trace").iterdir())
    assert path.name.startswith("h_30000-dp0-tp0-pp0-") and path.name.endswith(".jsonl.gz")
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
    assert (header["version"], header["sample_rate"], header["page_size"]) == (2, 1.0, 16)
    assert header["instance"] == "h:30000-dp0-tp0-pp0"
    trace = read_trace(path)
    assert [(e.kind, e.pages, e.walked, e.miss) for e in trace.events] == [
        ("add", tuple(chain), 0, False),
        ("lookup", tuple(chain), 2, True),
    ]
    snap = r.snapshot()
    assert snap.records["add"] == 1 and snap.records["lookup"] == 1
    assert snap.dropped == {"queue_full": 0, "write_error": 0}
    assert snap.disk_bytes == path.stat().st_size


def test_rotation_keeps_the_newest_files_within_max_bytes(tmp_path: Path) -> None:
    """Past file_bytes a new file starts; the oldest are deleted so that the files on
    disk never exceed max_bytes; the newest records survive and every kept file reads."""
    minimum = 128 * 1024
    s = section(tmp_path, sample_rate=1.0, max_bytes=4 * minimum, file_bytes=minimum)
    r = rec.Recorder(s, instance="rot")
    biggest = 0
    for i in range(60):
        for j in range(40):
            r.added("kv", [page(i * 1000 + j * 20 + k, "rot") for k in range(20)])
        r._drain()
        total = sum(p.stat().st_size for p in (tmp_path / "trace").iterdir())
        biggest = max(biggest, total)
    r.close()
    files = sorted((tmp_path / "trace").iterdir())
    assert len(files) >= 2
    assert biggest <= s.max_bytes
    assert r.files_deleted > 0
    last = read_trace(files[-1]).events[-1]
    assert last.pages[-1] == page(59 * 1000 + 39 * 20 + 19, "rot")
    for f in files:
        read_trace(f)
    parts = [int(f.name.rsplit("-", 1)[1].split(".")[0]) for f in files]
    assert parts == list(range(parts[0], parts[0] + len(parts)))


def test_earlier_runs_files_count_against_the_bound(tmp_path: Path) -> None:
    """A restarted instance deletes its own older files first to stay within max_bytes."""
    minimum = 128 * 1024
    s = section(tmp_path, sample_rate=1.0, max_bytes=2 * minimum, file_bytes=minimum)
    deleted = []
    for run in range(3):
        r = rec.Recorder(s, instance="again")
        r.start()
        for j in range(300):
            r.added("kv", [page(run * 100000 + j * 20 + k, "again") for k in range(20)])
        r.close()
        assert r.snapshot().dropped == {"queue_full": 0, "write_error": 0}
        assert r.snapshot().records["add"] == 300
        deleted.append(r.files_deleted)
    total = sum(p.stat().st_size for p in (tmp_path / "trace").iterdir())
    assert total <= s.max_bytes
    assert deleted[1] > 0 and deleted[2] > 0  # the earlier runs' files went first


def test_an_unwritable_path_drops_and_counts_never_raises(tmp_path: Path) -> None:
    """A path that cannot be a directory (a file is in the way): every record is
    dropped as write_error, the scheduler-side calls return normally."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = dataclasses.replace(section(tmp_path), path=str(blocker / "trace"), sample_rate=1.0)
    r = rec.Recorder(s).start()
    for i in range(25):
        r.added("kv", [page(i)])
    r.close()
    snap = r.snapshot()
    assert snap.dropped == {"queue_full": 0, "write_error": 25}
    assert sum(snap.records.values()) == 0


def test_a_full_queue_drops_and_the_scheduler_never_waits(tmp_path: Path) -> None:
    """With the writer stuck in I/O, scheduler-side calls keep returning at once; past
    queue_records records are dropped as queue_full."""
    s = section(tmp_path, sample_rate=1.0, queue_records=8)
    stuck = threading.Event()
    release = threading.Event()

    class Stuck(rec.Recorder):
        @staticmethod
        def _member(raw: Any, text: str) -> None:
            stuck.set()
            release.wait(30)
            rec.Recorder._member(raw, text)

    r = Stuck(s).start()
    r.added("kv", [page(0)])
    assert stuck.wait(10)

    def hammer() -> None:
        for i in range(1, 101):
            r.added("kv", [page(i)])
            r.touched("kv", [page(i)], 1)

    worker = threading.Thread(target=hammer)
    t0 = time.monotonic()
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert time.monotonic() - t0 < 5
    assert r.snapshot().dropped["queue_full"] == 200 - 8
    release.set()
    r.close()
    assert r.snapshot().dropped["queue_full"] == 192


def test_a_write_error_drops_that_chunk_and_keeps_the_file_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails (a full disk: ENOSPC) after part of a member drops that
    chunk's records, cuts the partial member off, and the writer carries on later."""
    monkeypatch.setattr(rec, "RETRY_S", 0.0)
    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    calls = {"n": 0}
    real = rec.Recorder._member

    def member(raw: Any, text: str) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raw.write(b"\x1f\x8b\x08partial")
            raise OSError(28, "No space left on device")
        real(raw, text)

    monkeypatch.setattr(rec.Recorder, "_member", staticmethod(member))
    r.added("kv", [page(1)])
    r._drain()  # header + chunk 1
    r.added("kv", [page(2)])
    r.added("kv", [page(3)])
    r._drain()  # fails: 2 records dropped
    r.added("kv", [page(4)])
    r._drain()  # a new file
    r.close()
    assert r.snapshot().dropped["write_error"] == 2
    files = sorted((tmp_path / "trace").iterdir())
    assert len(files) == 2
    kept = [e.pages[0] for f in files for e in read_trace(f).events]
    assert kept == [page(1), page(4)]


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"sample_rate": 0}, "recorder.sample_rate"),
        ({"sample_rate": 1.5}, "recorder.sample_rate"),
        ({"max_bytes": 1000}, "recorder.max_bytes"),
        ({"file_bytes": 10}, "recorder.file_bytes"),
        ({"queue_records": 0}, "recorder.queue_records"),
        ({"flush_interval_s": 0}, "recorder.flush_interval_s"),
        ({"path": ""}, "recorder.path"),
        ({"ranks": "some"}, "recorder.ranks"),
    ],
)
def test_bad_recorder_settings_are_refused_by_name(values: dict[str, Any], key: str) -> None:
    """Out-of-range recorder settings raise ConfigError naming the key."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.from_mapping({"recorder": values})


def test_only_the_first_rank_records_unless_all_are_asked_for(tmp_path: Path) -> None:
    """``ranks: first`` records on TP and PP rank 0 only; ``all`` everywhere; off: none."""
    from hicache_existence.exporters.catalog import DeploymentLabels

    s = section(tmp_path)
    assert rec.Recorder.from_config(s, DeploymentLabels(tp_rank=0, dp_rank=3)) is not None
    assert rec.Recorder.from_config(s, DeploymentLabels(tp_rank=1)) is None
    assert rec.Recorder.from_config(s, DeploymentLabels(pp_rank=1)) is None
    every = dataclasses.replace(s, ranks="all")
    assert rec.Recorder.from_config(every, DeploymentLabels(tp_rank=1)) is not None
    off = dataclasses.replace(s, enabled=False)
    assert rec.Recorder.from_config(off, DeploymentLabels()) is None


# -- replay of a recorded trace --------------------------------------------------------------


def _workload(rt: ExistenceRuntime, seed: int = 1) -> None:
    kv = rt.cache.pool("kv")
    rng = random.Random(seed)
    docs = [[page(i, f"d{d}") for i in range(rng.randint(10, 80))] for d in range(120)]
    recorder = rt.recorder
    assert recorder is not None
    for step in range(1500):
        d = docs[min(int(rng.paretovariate(0.8)) - 1, len(docs) - 1)]
        n = rng.randint(1, len(d))
        recorder.begin_request()
        kv.covered(d[:n])
        recorder.end_request()
        kv.add(d[:n])
        if rng.random() < 0.03:
            kv.invalidate_beyond(d, n // 2)
        if step == 700:
            kv.clear()


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_replayed_curves_match_the_advisor(tmp_path: Path, rate: float) -> None:
    """A runtime with the advisor at rate 1: the recorded trace replays to its curves
    exactly at recorder rate 1 (same stack, same stream), within 0.02 at 0.5."""
    config = Config.from_mapping(
        {
            "cache": {"max_entries": 600},
            "advisor": {"sampling_rate": 1.0},
            "metrics": {"enabled": False},
            "recorder": {"enabled": True, "path": str(tmp_path / "t"), "sample_rate": rate},
        }
    )
    rt = ExistenceRuntime(config).start()
    _workload(rt)
    advice = rt._advice().pools["kv"]
    rt.close()
    caps = [int(600 * m) for m in MULTIPLIERS]
    (curve,) = recorded_curves(read_trace(tmp_path / "t"), caps)
    stream = [advice.estimates[m] for m in MULTIPLIERS]
    lookups = [advice.lookup_estimates[m] for m in MULTIPLIERS]
    if rate == 1.0:
        assert list(curve.stream) == stream
        assert list(curve.lookups) == lookups
    else:
        assert max(abs(a - b) for a, b in zip(curve.stream, stream)) <= 0.02  # type: ignore[operator]
        assert max(abs(a - b) for a, b in zip(curve.lookups, lookups)) <= 0.02  # type: ignore[operator]
    assert curve.events["clear"] > 0 and curve.events["invalidate"] > 0


def test_requests_are_rebuilt_from_their_insert_walks(tmp_path: Path) -> None:
    """Each request record becomes a request whose pages are its lookups' recorded
    pages, in order, each once; lookups outside an insert belong to no request."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    a = [page(i, "a") for i in range(4)]
    r.begin_request()
    r.touched("kv", a[:2], 2)
    r.touched("kv", a[1:], 1)
    r.end_request()
    r.touched("kv", a, 4)
    r.begin_request()
    r.end_request()
    r.close()
    trace = read_trace(tmp_path / "trace")
    assert [(q.pool, q.pages) for q in trace.requests] == [("kv", tuple(a)), ("kv", ())]


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _recorded_file(tmp_path: Path) -> Path:
    r = rec.Recorder(section(tmp_path, sample_rate=1.0))
    for i in range(50):
        r.begin_request()
        r.touched("kv", [page(j) for j in range(i % 7 + 1)], 0)
        r.end_request()
        r.added("kv", [page(j) for j in range(i % 7 + 1)])
    r.close()
    (path,) = sorted((tmp_path / "trace").iterdir())
    return path


def test_replay_reads_a_recorded_directory(tmp_path: Path) -> None:
    """``replay DIR`` prints the recorded-stream table and runs the model on its requests."""
    _recorded_file(tmp_path)
    code, out, err = run_cli(
        "replay", str(tmp_path / "trace"), "--caps", "4,8", "--quiet", "--no-plot",
        "--jobs", "1", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 0, err
    assert "recorded stream" in out and "buffer-mode write path" in out
    report = json.loads((tmp_path / "o" / "replay.json").read_text())
    assert report["sweep"]["trace"]["requests"] == 50


def _gz(lines: list[str]) -> bytes:
    return gzip.compress("".join(line + "\n" for line in lines).encode())


HEADER = json.dumps({"format": "hicache-existence-trace", "version": 2, "sample_rate": 0.5})


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda good: good[: len(good) - 9], "truncated"),
        (lambda good: good[:30] + b"\xff" * 40 + good[70:], "gzip"),
        (lambda good: _gz([HEADER, '{"timestamp": 1, "kind": "evict", "pool": "kv"}']), "'kind'"),
        (
            lambda good: _gz([HEADER, '{"timestamp":1,"kind":"lookup","pages":["a"],"walked":2}']),
            "'walked'",
        ),
        (
            lambda good: _gz(
                [HEADER, '{"timestamp":1,"kind":"lookup","pages":["a"],"walked":1,"miss":true}']
            ),
            "walked < len(pages)",
        ),
        (
            lambda good: _gz([json.dumps({"format": "hicache-existence-trace", "version": 2})]),
            "sample_rate",
        ),
        (lambda good: _gz([HEADER, '{"timestamp":1,"kind":"add","pages":["a"]']), "invalid JSON"),
    ],
)
def test_a_bad_recorded_trace_is_a_clear_error(tmp_path: Path, make: Any, problem: str) -> None:
    """Truncated or corrupt compression and malformed events: replay exits 2 with a
    one-line error naming the file (and line), no traceback, no output files."""
    good = _recorded_file(tmp_path).read_bytes()
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(make(good))
    code, _, err = run_cli("replay", str(bad), "--quiet", "--out", str(tmp_path / "o"))
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith(f"error: {bad}:") and problem in err, err
    assert not (tmp_path / "o").exists()
    with pytest.raises(TraceError):
        read_trace(bad)


def _two_flushes(tmp_path: Path, instance: str = "cut") -> tuple[Path, int]:
    """A recorder file of two flushes (two gzip members after the header's), the
    second with 300 adds: ``(file, bytes of the file after the first flush)``."""
    r = rec.Recorder(section(tmp_path, sample_rate=1.0), instance=instance)
    r.added("kv", [page(i, instance) for i in range(4)])
    r._drain()
    (path,) = (tmp_path / "trace").glob(f"*{instance}*")
    first = path.stat().st_size
    for i in range(300):
        r.added("kv", [page(1000 + i, instance)])
    r._drain()
    r.close()
    assert path.stat().st_size > first + 100
    return path, first


def test_a_file_cut_in_its_last_flush_reads_up_to_the_flush_before(tmp_path: Path) -> None:
    """docs/replay.md: a file cut short by a killed server (or read while the recorder
    writes it) stays readable up to its last complete flush; replay says what it left
    out.  Every cut inside the last member gives exactly the first flush's events."""
    path, first = _two_flushes(tmp_path)
    whole = path.read_bytes()
    assert [len(e.pages) for e in read_trace(path).events] == [4] + [1] * 300
    for cut in (first + 1, first + 20, (first + len(whole)) // 2, len(whole) - 1):
        path.write_bytes(whole[:cut])
        for trace in (read_trace(path), read_trace(tmp_path / "trace")):
            assert [e.pages for e in trace.events] == [tuple(page(i, "cut") for i in range(4))]
            (note,) = trace.notes
            assert "ends early" in note and str(path) in note
    code, out, err = run_cli(
        "replay", str(tmp_path / "trace"), "--caps", "4", "--quiet", "--no-plot",
        "--jobs", "1", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 0, err
    assert "recorded stream" in out
    assert err.startswith(f"warning: {path}: the compressed file ends early"), err


def test_a_cut_member_larger_than_the_hold_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member is held until its end only up to HOLD_BYTES; one that streamed lines
    before the cut cannot be left out whole, so the read fails, naming the line."""
    from hicache_existence.replay import trace as trace_mod

    path, _ = _two_flushes(tmp_path)
    path.write_bytes(path.read_bytes()[:-30])
    assert read_trace(path).notes
    monkeypatch.setattr(trace_mod, "HOLD_BYTES", 1024)
    with pytest.raises(TraceError, match="ends early after line"):
        read_trace(path)


def test_a_directory_skips_a_file_with_no_complete_flush(tmp_path: Path) -> None:
    """A file whose first flush was cut (a rotation's first write, killed) has
    nothing whole: a directory read skips it with a note; alone it is an error."""
    _two_flushes(tmp_path, "keep")
    broken = tmp_path / "trace" / f"zz-broken-00001{rec.SUFFIX}"
    line = '{"timestamp": 1, "kind": "add", "pool": "kv", "pages": ["a"]}'
    broken.write_bytes(_gz([HEADER, line])[:-5])
    trace = read_trace(tmp_path / "trace")
    assert len(trace.events) == 301 and trace.instances == ("keep",)
    (note,) = trace.notes
    assert str(broken) in note and note.endswith("skipped")
    with pytest.raises(TraceError, match="ends early after line 0"):
        read_trace(broken)
    for f in (tmp_path / "trace").iterdir():
        if f != broken:
            f.unlink()
    with pytest.raises(TraceError, match="no recorder file has a complete flush"):
        read_trace(tmp_path / "trace")


def test_gzip_members_padding_and_garbage(tmp_path: Path) -> None:
    """Zero padding between members reads as gzip allows it; garbage after a whole
    member is an error naming the line after the member's last one."""
    one = _gz([HEADER, '{"timestamp": 1, "kind": "add", "pool": "kv", "pages": ["a"]}'])
    two = _gz(['{"timestamp": 2, "kind": "add", "pool": "kv", "pages": ["b"]}'])
    f = tmp_path / "t.jsonl.gz"
    f.write_bytes(one + b"\0" * 700 + two + b"\0" * 9)
    assert [e.pages for e in read_trace(f).events] == [("a",), ("b",)]
    f.write_bytes(one + b"not gzip at all")
    with pytest.raises(TraceError, match=r":3: not a readable gzip stream after line 2"):
        read_trace(f)


def test_version_one_traces_still_read_compressed_or_not(tmp_path: Path) -> None:
    """A version-1 page trace reads as before, plain or gzip-compressed."""
    lines = [
        json.dumps({"format": "hicache-existence-trace", "version": 1, "page_size": 64}),
        json.dumps({"timestamp": 0, "pages": ["a", "b"]}),
        json.dumps({"timestamp": 5, "pages": ["a"], "pool": "swa"}),
    ]
    plain = tmp_path / "v1.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    packed = tmp_path / "v1.jsonl.gz"
    packed.write_bytes(_gz(lines))
    for path in (plain, packed):
        trace = read_trace(path)
        assert (trace.version, trace.page_size, trace.events) == (1, 64, ())
        assert [(q.pool, q.pages) for q in trace.requests] == [("kv", ("a", "b")), ("swa", ("a",))]


def test_the_runtime_exports_the_recorder_series(tmp_path: Path) -> None:
    """A standalone scrape shows the recorder's records by kind, its drops by reason
    (both reasons from the start), written and on-disk bytes, equal to its snapshot."""
    import urllib.request

    config = Config.from_mapping(
        {
            "metrics": {"mode": "standalone", "port": 0, "flush_interval_s": 0},
            "recorder": {"enabled": True, "path": str(tmp_path / "t"), "sample_rate": 1.0},
        }
    )
    rt = ExistenceRuntime(config).start()
    try:
        kv = rt.cache.pool("kv")
        kv.add([page(i) for i in range(5)])
        kv.covered([page(i) for i in range(7)])
        recorder = rt.recorder
        assert recorder is not None
        with recorder._lock:
            recorder._drain()
        rt.telemetry.step()
        with urllib.request.urlopen(rt.telemetry.server.url, timeout=10) as response:
            text = response.read().decode()
        snap = recorder.snapshot()
    finally:
        rt.close()
    lines = [line for line in text.splitlines() if line.startswith("hicache_existence_recorder")]

    def value(name: str, label: str = "") -> float:
        (found,) = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name) and label in x]
        return found

    assert value("hicache_existence_recorder_records_total", 'kind="add"') == 1
    assert value("hicache_existence_recorder_records_total", 'kind="lookup"') == 1
    assert value("hicache_existence_recorder_dropped_records_total", 'reason="queue_full"') == 0
    assert value("hicache_existence_recorder_dropped_records_total", 'reason="write_error"') == 0
    assert value("hicache_existence_recorder_written_bytes_total") == snap.written_bytes > 0
    assert value("hicache_existence_recorder_disk_bytes") == snap.disk_bytes > 0


def test_a_restarted_instance_starts_from_an_empty_cache(tmp_path: Path) -> None:
    """Two processes of one instance in one directory: the second's lookups of the
    first's pages are cold (its cache started empty), and both runs' request 1 stay
    two requests."""
    s = section(tmp_path, sample_rate=1.0)
    chain = [page(i, "restart") for i in range(4)]
    first = rec.Recorder(s, instance="same", wall=lambda: 1_000_000.0)
    first.begin_request()
    first.touched("kv", chain, 0)
    first.end_request()
    first.added("kv", chain)
    first.close()
    second = rec.Recorder(s, instance="same", wall=lambda: 1_000_060.0)
    second.begin_request()
    second.touched("kv", chain, 0)
    second.end_request()
    second.close()
    trace = read_trace(tmp_path / "trace")
    assert trace.instances == ("same",)
    assert [q.pages for q in trace.requests] == [tuple(chain), tuple(chain)]
    (curve,) = recorded_curves(trace, [1000])
    assert curve.lookups == (0.0,)  # both lookups missed: the second cache was empty
    assert curve.events["clear"] == 1


#: The observer's calls, a request number set, the write path's calls.
TAP_CALLS: tuple[str, ...] = ("touched", "added", "invalidated", "inflight", "cleared", "req")
TAP_CALLS += ("written", "prefetch")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(TAP_CALLS),
            st.lists(st.sampled_from([page(i) for i in range(12)]), max_size=8),
            st.integers(0, 8),
            st.booleans(),
        ),
        max_size=30,
    ),
    st.sampled_from([None, "40000000", "c0000000"]),
    st.integers(1, 40),
)
def test_compiled_tap_logs_what_the_twin_does(ops: list[Any], bound: Any, capacity: int) -> None:
    """For any operation stream both taps log the same records (only operations
    with a recorded page, every one with bound None; clears that are not
    in-flight-only; the request number of the moment, none for the write path's
    writes and prefetch queries, a query's held pages counted among the recorded
    ones) and drop the same ones once ``capacity`` records wait."""
    seen = []
    for tap_type in TAPS:
        ticks = iter(range(10**6))
        tap = tap_type(bound, capacity, lambda ticks=ticks: float(next(ticks)))
        for name, hashes, n, flag in ops:
            if name == "touched":
                tap.touched("kv", hashes, n)
            elif name == "added":
                tap.added("kv", hashes if flag else tuple(hashes))
            elif name == "invalidated":
                tap.invalidated("kv", hashes, n)
            elif name == "inflight":
                tap.inflight("kv", hashes, 1)
            elif name == "req":
                tap.request = n
            elif name == "written":
                tap.written("kv", hashes if flag else tuple(hashes))
            elif name == "prefetch":
                tap.prefetch("kv", hashes, n - 2)
            else:
                tap.cleared("kv", flag)
        seen.append((tap.take(1000), tap.dropped, tap.errors))
    expected = []
    request = 0
    for name, hashes, n, flag in ops:
        if name == "req":
            request = n
            continue
        idx = None if bound is None else [i for i, h in enumerate(hashes) if h < bound]
        kind = {"touched": "lookup", "added": "add", "invalidated": "invalidate"}.get(name)
        if kind is not None and (idx is None or idx):
            pages = tuple(hashes) if idx is None else tuple(hashes[i] for i in idx)
            extra = None if name == "added" else n
            expected.append((kind, "kv", pages, idx, extra, request))
        elif name == "cleared" and not flag:
            expected.append(("clear", "kv", (), None, None, request))
        elif name in ("written", "prefetch") and hashes and (idx is None or idx):
            pages = tuple(hashes) if idx is None else tuple(hashes[i] for i in idx)
            held = bisect.bisect_left(range(len(hashes)) if idx is None else idx, n - 2)
            if name == "written":
                expected.append(("write", "kv", pages, None, None, 0))
            else:
                expected.append(("prefetch", "kv", pages, None, held, 0))
    for queue_seen, dropped, errors in seen:
        assert [r[1:] for r in queue_seen] == expected[:capacity]
        assert dropped == max(0, len(expected) - capacity) and errors == 0


@pytest.mark.parametrize("tap_type", TAPS)
def test_a_failing_clock_never_reaches_the_cache(tap_type: Any) -> None:
    """A clock that raises is counted in the tap's errors; the call returns None.
    Bad constructor arguments raise TypeError/ValueError naming them."""

    def broken() -> float:
        raise OSError("clock")

    tap = tap_type(None, 10, broken)
    assert tap.touched("kv", ["a"], 1) is None
    assert tap.added("kv", ["a"]) is None
    assert tap.cleared("kv", False) is None
    assert tap.written("kv", ["a"]) is None
    assert tap.prefetch("kv", ["a"], 1) is None
    assert tap.ended(3) is None
    assert tap.errors == 6 and tap.waiting == 0
    assert tap.written("kv", []) is None and tap.prefetch("kv", (), 0) is None  # no clock read
    assert tap.errors == 6
    tap = tap_type("8", 10, time.monotonic)
    assert tap.prefetch("kv", ["0"], "one") is None  # not an index: counted, not logged
    assert tap.written("kv", [0]) is None  # a page the test cannot compare
    assert tap.errors == 2 and tap.waiting == 0
    tap.added("kv", {"0", "9"})  # not a list or tuple: tested as a tuple
    assert [x[3] for x in tap.take(10)] == [("0",)]
    with pytest.raises(TypeError, match="bound"):
        tap_type(5, 10, time.monotonic)
    with pytest.raises(ValueError, match="capacity"):
        tap_type("8", 0, time.monotonic)
    with pytest.raises(TypeError, match="clock"):
        tap_type("8", 10, None)


def test_a_cache_operation_survives_a_broken_recorder(tmp_path: Path) -> None:
    """A recorder whose clock fails after start-up never makes a cache operation
    raise; the lost records are counted as write errors."""
    calls = iter([0.0])

    def clock() -> float:
        return next(calls)  # StopIteration after the first call

    rt = ExistenceRuntime(Config.from_mapping({"metrics": {"enabled": False}}))
    r = rec.Recorder(section(tmp_path, sample_rate=1.0), clock=clock)
    rt.tee.append(r.tap)
    kv = rt.cache.pool("kv")
    kv.add([page(1)])
    assert kv.covered([page(1)]) is True
    assert r.snapshot().dropped["write_error"] == 2


def test_a_relative_path_writes_where_it_was_loaded_and_is_logged_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``recorder.path: "trace"`` loaded in one directory: the start-up line names
    the absolute directory, and the files land there although the process's working
    directory changed before the writer opened them."""
    loaded_in = tmp_path / "loaded-in"
    loaded_in.mkdir()
    monkeypatch.chdir(loaded_in)
    config = Config.from_mapping(
        {"recorder": {"enabled": True, "path": "trace", "sample_rate": 1.0}}
    )
    moved = tmp_path / "moved"
    moved.mkdir()
    monkeypatch.chdir(moved)
    r = rec.Recorder(config.recorder, instance="rel")
    with caplog.at_level(logging.INFO, logger="hicache_existence.recorder"):
        r.start()
    r.added("kv", [page(1)])
    r.close()
    (line,) = [m for m in caplog.messages if "recording a trace" in m]
    assert f"to {loaded_in / 'trace'}/rel-*.jsonl.gz" in line, line
    assert len(list((loaded_in / "trace").glob("rel-*" + rec.SUFFIX))) == 1
    assert not list(moved.iterdir())
