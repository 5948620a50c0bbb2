"""CONTRIBUTING's "What CI runs" table is read from tests/run-all.sh's own legs
(tests/run_all_legs.py; the committed table is checked by
tests/test_dashboards.py::test_committed_files_equal_the_build_output)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_all_legs  # noqa: E402

SCRIPT = run_all_legs.RUN_ALL.read_text(encoding="utf-8")


def _selects(leg: run_all_legs.Leg, arrays: dict[str, tuple[str, ...]], path: str) -> bool:
    """Whether pytest with ``leg``'s arguments collects the test file ``path``
    (file level: marks and node ids narrow it further)."""
    args: list[str] = []
    for arg in leg.args:
        ref = re.match(r"^\$\{(\w+)\[@\]\}$", arg)
        left_out = re.match(r"^\$\{(\w+)\[@\]/#/--ignore=\}$", arg)
        if left_out:
            args.extend(f"--ignore={a}" for a in arrays[left_out.group(1)])
        else:
            args.extend(arrays[ref.group(1)] if ref else [arg])
    chosen, ignored = [], []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in ("-p", "-m", "-k", "--deselect"):
            skip_next = True
        elif arg.startswith("--ignore="):
            ignored.append(arg.split("=", 1)[1])
        elif not arg.startswith("-") and arg != "$@":
            chosen.append(arg.split("::", 1)[0])

    def under(p: str, root: str) -> bool:
        return p == root or p.startswith(root.rstrip("/") + "/")

    in_scope = any(under(path, c) for c in chosen) if chosen else under(path, "tests")
    return in_scope and not any(under(path, i) for i in ignored)


def test_every_pytest_call_of_run_all_is_a_leg_of_the_table() -> None:
    """The reader finds as many legs as the script has pytest runs (``one`` calls,
    ``leg`` calls inside ``both``, top-level ``-m pytest`` passes), each once and
    in the table under its own name."""
    body = run_all_legs._joined(SCRIPT)
    calls = len(re.findall(r"^\s*(?:\w+=\S+\s+)*one\s", body, re.M))
    calls += len(re.findall(r"(?:^|')\s*(?:\w+=\S+\s+)*leg\s", body, re.M))
    calls += len(re.findall(r'^\s*"\$PY\w*" -m pytest', body, re.M))
    run = run_all_legs.parse(SCRIPT)
    assert len(run.legs) == calls
    names = [leg.name for leg in run.legs]
    assert len(set(names)) == len(names)
    rows = [line for line in run_all_legs.table(run).splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0][2:] for row in rows[2:]] == names


def test_every_test_module_runs_in_some_leg() -> None:
    """Each tests/**/test_*.py is collected by at least one leg of run-all.sh, so
    no module (a real-server one added later, say) is left out of CI."""
    run = run_all_legs.parse(SCRIPT)
    root = HERE.parent
    modules = sorted(str(p.relative_to(root)) for p in HERE.rglob("test_*.py"))
    missing = [m for m in modules if not any(_selects(leg, run.arrays, m) for leg in run.legs)]
    assert modules and missing == []


def test_the_table_follows_the_script() -> None:
    """A leg added to run-all.sh becomes a row, and the main pass's selection is
    the script's: the table is read, not written by hand."""
    added = SCRIPT.replace(
        'log "pytest [3.11]"',
        'one "3.13 extra" "$PY313" tests/real_server/test_new.py -m slow\nlog "pytest [3.11]"',
    )
    assert added != SCRIPT
    table = run_all_legs.table(run_all_legs.parse(added))
    assert (
        "| 3.13 extra | 3.13 | `core`: no sglang, no torch | "
        "`tests/real_server/test_new.py`; marks `slow` |"
    ) in table
    everything = SCRIPT.replace("--ignore=tests/real_server --ignore=tests/sglang_integration ", "")
    assert everything != SCRIPT
    (row,) = [
        ln
        for ln in run_all_legs.table(run_all_legs.parse(everything)).splitlines()
        if ln.startswith("| 3.11 | ")
    ]
    assert row.startswith(
        "| 3.11 | 3.11 | `full`: sglang 0.5.23, torch 2.14.1 | every test under `tests/`"
    )
    assert "tests/real_server" not in row and "tests/sglang_integration" not in row


@pytest.mark.parametrize(
    "line",
    [
        '"$PYNEW" -m pytest tests/x.py',  # a Python that env_for does not define
        "python3 -m pytest tests/x.py",  # pytest outside the script's forms
        'one "x" "$PYNEW" tests/x.py',
    ],
)
def test_a_pytest_run_the_reader_does_not_know_fails_the_build(line: str) -> None:
    """Any other way of running pytest is an error naming the line, never a leg
    silently missing from the table."""
    with pytest.raises(ValueError, match=r"run-all\.sh"):
        run_all_legs.parse(SCRIPT + "\n" + line + "\n")


@pytest.mark.parametrize(
    "line",
    [
        'beside "a" "b" \'leg "a" "$PY" tests/x.py\'',  # two names, one leg
        'beside "b" \'leg "a" "$PY" tests/x.py\'',  # the name is not the leg's
    ],
)
def test_a_beside_chain_whose_names_are_not_its_legs_fails_the_build(line: str) -> None:
    """``beside`` names its legs before running them (the log line, the report):
    a name without its leg, or naming another leg, would mislabel CI's output."""
    with pytest.raises(ValueError, match=r"run-all\.sh: beside"):
        run_all_legs.parse(SCRIPT + "\n" + line + "\n")
