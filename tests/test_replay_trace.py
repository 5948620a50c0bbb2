"""Trace reading and page expansion: valid traces load, every kind of bad line is
refused with its line number, the CLI writes nothing for a bad trace, and page
hashes are chained, deterministic and shared exactly along common prefixes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache_existence.cli import main
from hicache_existence.replay.pages import expand
from hicache_existence.replay.trace import FORMAT_TAG, TraceError, read_trace

#: The Mooncake trace kept in the repository (tests/data/traces, with its licence).
MOONCAKE_TRACE = Path(
    os.environ.get(
        "HICACHE_EXISTENCE_MOONCAKE_TRACE",
        Path(__file__).resolve().parent / "data/traces/mooncake_synthetic_trace.jsonl",
    )
)


def mooncake_trace() -> Path:
    """The repository's Mooncake trace; a missing file is a failure, never a skip."""
    if not MOONCAKE_TRACE.is_file():
        pytest.fail(f"Mooncake trace not found at {MOONCAKE_TRACE}")
    return MOONCAKE_TRACE


def write_lines(path: Path, lines: list[str]) -> Path:
    """Write ``lines`` as a JSONL file."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def mooncake(ts: float = 0, inp: int = 600, out: int = 4, ids: list[int] | None = None) -> str:
    """One Mooncake line."""
    ids = [1, 2] if ids is None else ids
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


GOOD = mooncake()

# (second line of a two-line trace, the problem the message must mention)
BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "NaN"),
    ('{"input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "'timestamp'"),
    ('{"timestamp": 1, "output_length": 1, "hash_ids": [1, 2]}', "'input_length'"),
    ('{"timestamp": 1, "input_length": 600, "hash_ids": [1, 2]}', "'output_length'"),
    ('{"timestamp": 1, "input_length": 600, "output_length": 1}', "'hash_ids'"),
    (mooncake(1, inp=-5), "'input_length' must be >= 0"),
    (mooncake(1, out=-1), "'output_length' must be >= 0"),
    (mooncake(-1), "'timestamp' must be a finite number >= 0"),
    (mooncake(1, inp=10**20), "'input_length' is too large"),
    (mooncake(1, out=2**40), "'output_length' is too large"),
    (mooncake(1e300), "'timestamp' is too large"),
    (mooncake(1, ids=[1, 2**64]), "hash_ids[1] must be within"),
    (mooncake(1, ids=[1, -2]), "hash_ids[1] must be within"),
    (mooncake(1, ids=[1, True]), "hash_ids[1] must be an integer"),
    (mooncake(1, ids=[1, "2"]), "hash_ids[1] must be an integer"),
    (
        '{"timestamp": 1, "input_length": 600.0, "output_length": 1, "hash_ids": [1, 2]}',
        "'input_length' must be an integer",
    ),
    (
        '{"timestamp": "1", "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
        "'timestamp' must be a number",
    ),
    (
        '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": 7}',
        "'hash_ids' must be an array",
    ),
    (mooncake(1, inp=2000, ids=[1, 2]), "does not match 2 hash_ids"),
    (mooncake(1, inp=512, ids=[1, 2]), "does not match 2 hash_ids"),
    (mooncake(1, inp=5, ids=[]), "does not match 0 hash_ids"),
    ("1" * 5000, "invalid JSON"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_mooncake_line_names_its_line(tmp_path: Path, line: str, problem: str) -> None:
    """A bad second line raises TraceError with line 2 and a message naming the problem."""
    path = write_lines(tmp_path / "t.jsonl", [GOOD, line])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == 2
    assert problem in str(info.value)
    assert str(info.value).startswith(f"{path}:2: ")


def test_decreasing_timestamp_is_refused(tmp_path: Path) -> None:
    """Timestamps must not go backwards; the offending line is named."""
    path = write_lines(tmp_path / "t.jsonl", [mooncake(5), mooncake(6), mooncake(4)])
    with pytest.raises(TraceError, match="must not decrease") as info:
        read_trace(path)
    assert info.value.line == 3


def test_not_utf8_is_refused_with_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are reported with their line."""
    path = tmp_path / "t.jsonl"
    path.write_bytes((GOOD + "\n").encode() + b'{"timestamp": "\xff"}\n')
    with pytest.raises(TraceError, match="not UTF-8") as info:
        read_trace(path)
    assert info.value.line == 2


def test_empty_and_missing_traces_are_refused(tmp_path: Path) -> None:
    """A trace with no requests, or no file at all, is a clear error."""
    empty = write_lines(tmp_path / "e.jsonl", ["", "   "])
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_valid_mooncake_trace_loads(tmp_path: Path) -> None:
    """Fields are read as given; blank lines and extra fields are ignored."""
    path = write_lines(
        tmp_path / "t.jsonl",
        [mooncake(0, 600, 3, [7, 8]), "", json.dumps({**json.loads(mooncake(2.5)), "x": 1})],
    )
    trace = read_trace(path)
    assert trace.format == "mooncake"
    assert [r.line for r in trace.requests] == [1, 3]
    first = trace.requests[0]
    assert (first.timestamp_ms, first.input_length, first.output_length) == (0.0, 600, 3)
    assert first.hash_ids == (7, 8)
    assert first.pool == "kv"


def page_header(**extra: object) -> str:
    """The page-format header line."""
    return json.dumps({"format": FORMAT_TAG, "version": 1, **extra})


def test_page_trace_loads_with_pools(tmp_path: Path) -> None:
    """The project's page format: header, then pages with an optional pool."""
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            page_header(page_size=64),
            json.dumps({"timestamp": 1, "pages": ["a", "b"]}),
            json.dumps({"timestamp": 2, "pages": ["a"], "pool": "swa"}),
        ],
    )
    trace = read_trace(path)
    assert trace.format == "pages"
    assert trace.page_size == 64
    assert [(r.pool, r.pages) for r in trace.requests] == [("kv", ("a", "b")), ("swa", ("a",))]


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        ([json.dumps({"format": FORMAT_TAG, "version": 3})], 1, "unsupported trace version"),
        ([json.dumps({"format": "other", "version": 1})], 1, "header 'format'"),
        ([page_header(), json.dumps({"timestamp": 1, "pages": ["a", 5]})], 2, "pages[1]"),
        ([page_header(), json.dumps({"timestamp": 1, "pages": [""]})], 2, "pages[0]"),
        ([page_header(), json.dumps({"timestamp": 1, "pages": ["a"], "pool": ""})], 2, "'pool'"),
        ([page_header(), json.dumps({"timestamp": 1})], 2, "missing field 'pages'"),
        ([page_header(), page_header()], 2, "only allowed as the first line"),
    ],
)
def test_bad_page_trace_names_its_line(
    tmp_path: Path, lines: list[str], line: int, problem: str
) -> None:
    """Page-format errors name the line and the problem."""
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == line
    assert problem in str(info.value)


def test_forced_format_mismatch_is_refused(tmp_path: Path) -> None:
    """--format pages on a Mooncake trace (and the reverse) is an error, not a guess."""
    moon = write_lines(tmp_path / "m.jsonl", [GOOD])
    pages = write_lines(
        tmp_path / "p.jsonl", [page_header(), json.dumps({"timestamp": 0, "pages": ["a"]})]
    )
    with pytest.raises(TraceError, match="header line"):
        read_trace(moon, "pages")
    with pytest.raises(TraceError, match="format was given as mooncake"):
        read_trace(pages, "mooncake")


@pytest.mark.parametrize("bad_line_number", [1, 3])
def test_cli_writes_nothing_for_a_bad_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad_line_number: int
) -> None:
    """replay on a bad trace exits 2 with the line number and writes no output files."""
    lines = [mooncake(0), mooncake(1), mooncake(2)]
    lines[bad_line_number - 1] = mooncake(3, inp=-1)
    path = write_lines(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out"
    code = main(["replay", str(path), "--out", str(out), "--model", "belief-only", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{path}:{bad_line_number}:" in err
    assert "input_length" in err
    assert not out.exists()


# ---------------------------------------------------------------------------
# page expansion


def test_pages_are_chained_and_shared_along_prefixes(tmp_path: Path) -> None:
    """Equal block prefixes give identical page hashes; a different block diverges from there on."""
    path = write_lines(
        tmp_path / "t.jsonl",
        [mooncake(0, 1024, 1, [1, 2]), mooncake(1, 1024, 1, [1, 3]), mooncake(2, 1024, 1, [1, 2])],
    )
    pages = expand(read_trace(path))
    a, b, c = (r.pages for r in pages.requests)
    assert len(a) == 16
    assert a == c
    assert a[:8] == b[:8]
    assert not set(a[8:]) & set(b[8:])
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in a)
    assert len(set(a)) == 16
    assert pages.requests[0].node_ends == (8, 16)


def test_expansion_is_deterministic_and_salted(tmp_path: Path) -> None:
    """The same trace expands to the same hashes; a salt changes every hash, not the sharing."""
    path = write_lines(
        tmp_path / "t.jsonl", [mooncake(0, 1024, 1, [1, 2]), mooncake(1, 600, 1, [1, 2])]
    )
    trace = read_trace(path)
    one = expand(trace)
    two = expand(trace)
    salted = expand(trace, salt=b"x")
    assert [r.pages for r in one.requests] == [r.pages for r in two.requests]
    assert not set(one.requests[0].pages) & set(salted.requests[0].pages)
    assert salted.requests[1].pages == salted.requests[0].pages[: len(salted.requests[1].pages)]


@pytest.mark.parametrize(
    ("input_length", "partial", "expected"),
    [(600, "ceil", 10), (600, "floor", 9), (513, "ceil", 9), (513, "floor", 8), (1024, "ceil", 16)],
)
def test_partial_last_block(tmp_path: Path, input_length: int, partial: str, expected: int) -> None:
    """The last block gives ceil (default) or floor of its remaining tokens / page size pages."""
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, input_length, 1, [4, 5])])
    pages = expand(read_trace(path), 64, partial_pages=partial)  # type: ignore[arg-type]
    request = pages.requests[0]
    assert len(request.pages) == expected
    assert request.node_ends[-1] == expected


def test_page_size_must_divide_the_block(tmp_path: Path) -> None:
    """A page size that does not divide 512 is refused with a message naming it."""
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [GOOD]))
    with pytest.raises(ValueError, match="page_size 96 must divide"):
        expand(trace, 96)
    assert len(expand(trace, 128).requests[0].pages) == 5


def test_mooncake_trace_has_the_published_shape() -> None:
    """The trace reads whole: 3,993 requests, 121,877 block refs, 43,924 distinct blocks."""
    trace = read_trace(mooncake_trace())
    assert len(trace.requests) == 3993
    assert sum(len(r.hash_ids) for r in trace.requests) == 121877
    assert len({b for r in trace.requests for b in r.hash_ids}) == 43924


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_json_error_reports_the_column_on_its_own_line(tmp_path: Path, ending: str) -> None:
    """A truncated line reports the column where it ends, a stray character its own
    column, whatever the line ending (never column 1 of a following line)."""
    truncated = mooncake()[:-7]
    stray = '{"timestamp": 0 x}'
    for bad, column in ((truncated, len(truncated) + 1), (stray, stray.index("x") + 1)):
        path = tmp_path / "t.jsonl"
        path.write_bytes((GOOD + "\n" + bad + ending).encode())
        with pytest.raises(TraceError) as info:
            read_trace(path)
        assert info.value.line == 2
        assert f"(column {column})" in str(info.value), str(info.value)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_line_past_the_limit_is_refused_before_it_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compressed: bool
) -> None:
    """A few kB of gzip can inflate to one line of gigabytes: the reader refuses a
    line longer than MAX_LINE_BYTES, naming it, without holding more than about
    that much of it (plain files likewise)."""
    import gzip
    import tracemalloc

    from hicache_existence.replay import trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_LINE_BYTES", 1 << 20)
    long_line = b'{"timestamp": 1, "x": "' + b"a" * (40 << 20)
    path = tmp_path / ("t.jsonl.gz" if compressed else "t.jsonl")
    path.write_bytes(
        gzip.compress(GOOD.encode() + b"\n" + long_line, 9)
        if compressed
        else GOOD.encode() + b"\n" + long_line
    )
    del long_line
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=r":2: line longer than 1048576 bytes"):
            read_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, f"{peak / 2**20:.0f} MiB held"
