"""The pytest legs of ``tests/run-all.sh``, read from the script itself.

CONTRIBUTING's "What CI runs" table is generated from them by
``dashboards/build.py`` (``--check`` and ``tests/test_dashboards.py`` fail when the
committed table differs), so the table cannot promise a leg, a Python or a test
selection that the script does not run.

What is read (the script's own forms; anything else that runs pytest is an
error here, so a new kind of leg cannot be left out of the table silently):

* ``NAME="$(env_for FLAVOUR X.Y EXTRAS)"``: a Python variable, its interpreter
  version and its environment flavour (``tests/envs/ensure-env.sh``; the
  flavour's sglang and torch pins come from ``tests/envs/sglang-requirements.txt``);
* ``NAME=( ... )`` and ``NAME+=( ... )`` (also inside ``for V in ...; do ... done``):
  the argument lists legs use as ``"${NAME[@]}"`` (or leave out, each path as
  ``--ignore=``, as ``"${NAME[@]/#/--ignore=}"``);
* ``[VAR=value ...] one NAME "$PY" ARGS...``, and ``both NAME NAME 'leg ...' 'leg ...'``
  (side by side) or ``beside NAME... 'leg ...'...`` (N names, then N legs one after the
  other, beside the main pass): one leg each;
* ``"$PY" -m pytest ARGS...`` at top level: the main pass, named by the
  ``log "pytest [NAME]"`` line before it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = ROOT / "tests" / "run-all.sh"
ENSURE_ENV = ROOT / "tests" / "envs" / "ensure-env.sh"
REQUIREMENTS = ROOT / "tests" / "envs" / "sglang-requirements.txt"

_ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_ARRAY_REF = re.compile(r"^\$\{(\w+)\[@\]\}$")
#: ``"${NAME[@]/#/--ignore=}"``: every path of an argument list left out.
_ARRAY_IGNORE = re.compile(r"^\$\{(\w+)\[@\]/#/--ignore=\}$")
_DEFAULT = re.compile(r"^\$\{\w+:-([^}]*)\}$")
_QUOTED = r"(?:[^()\"']|\"[^\"]*\"|'[^']*')*"


@dataclass(frozen=True)
class Leg:
    """One pytest process of run-all.sh."""

    name: str
    python: str
    flavour: str
    #: ``VAR=value`` set for this leg only.
    env: tuple[str, ...]
    #: pytest's arguments as written (``${NAME[@]}`` for an argument list).
    args: tuple[str, ...]


@dataclass(frozen=True)
class RunAll:
    """Everything the table needs from run-all.sh."""

    legs: tuple[Leg, ...]
    #: Argument lists by name (loops expanded).
    arrays: dict[str, tuple[str, ...]]
    #: ``VAR=value`` exported for every leg.
    exported: tuple[str, ...]


def _joined(text: str) -> str:
    """The script with continuation lines joined and comment lines dropped."""
    lines = [ln for ln in text.replace("\\\n", " ").splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines)


def _arrays(text: str) -> dict[str, tuple[str, ...]]:
    arrays: dict[str, list[str]] = {}
    for m in re.finditer(rf"^\s*(\w+)=\(({_QUOTED})\)", text, re.M):
        arrays[m.group(1)] = shlex.split(m.group(2), comments=True)
    loops = [
        (m.start(), m.end(), m.group(1), m.group(2).split())
        for m in re.finditer(r"^\s*for (\w+) in ([^;\n]+); do\n(?s:.*?)\n\s*done", text, re.M)
    ]
    for m in re.finditer(rf"^\s*(\w+)\+=\(({_QUOTED})\)", text, re.M):
        items = shlex.split(m.group(2), comments=True)
        loop = next((lp for lp in loops if lp[0] <= m.start() < lp[1]), None)
        if loop is None:
            arrays.setdefault(m.group(1), []).extend(items)
            continue
        _, _, var, words = loop
        for word in words:
            arrays.setdefault(m.group(1), []).extend(
                item.replace(f"${{{var}}}", word).replace(f"${var}", word) for item in items
            )
    return {name: tuple(items) for name, items in arrays.items()}


def _pythons(text: str) -> dict[str, tuple[str, str]]:
    """Python variable -> (X.Y, flavour)."""
    out = {}
    for m in re.finditer(r'^\s*(\w+)="\$\(env_for (\S+) ([\d.]+) \S+\)"', text, re.M):
        flavour = m.group(2).strip('"')
        default = _DEFAULT.match(flavour)
        out[m.group(1)] = (m.group(3), default.group(1) if default else flavour)
    return out


def _split_env(tokens: list[str]) -> tuple[tuple[str, ...], list[str]]:
    i = 0
    while i < len(tokens) and _ENV_ASSIGN.match(tokens[i]):
        i += 1
    return tuple(tokens[:i]), tokens[i:]


def parse(text: str) -> RunAll:
    """The legs of a run-all.sh script (``ValueError`` for one it cannot read)."""
    joined = _joined(text)
    pythons = _pythons(joined)
    arrays = _arrays(joined)

    def leg(tokens: list[str], env: tuple[str, ...] = ()) -> Leg:
        more_env, tokens = _split_env(tokens)
        if len(tokens) < 3 or tokens[0] not in ("one", "leg"):
            raise ValueError(f"run-all.sh: not a leg: {shlex.join(tokens)}")
        var = tokens[2].lstrip("$").strip("{}")
        if var not in pythons:
            raise ValueError(f"run-all.sh: leg {tokens[1]!r} runs ${var}, not an env_for Python")
        version, flavour = pythons[var]
        return Leg(tokens[1], version, flavour, env + more_env, tuple(tokens[3:]))

    legs: list[Leg] = []
    exported: list[str] = []
    last_log: str | None = None
    for line in joined.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            if "pytest" in line or re.match(r"\s*(one|both)\s", line):
                raise ValueError(f"run-all.sh: cannot read the leg {line.strip()}") from None
            continue
        env, words = _split_env(tokens)
        if not words:
            continue
        head = words[0]
        if head == "export":
            exported.extend(w for w in words[1:] if w.startswith("HICACHE_EXISTENCE_"))
        elif head == "log" and len(words) > 1:
            m = re.match(r"pytest \[([^\]$]+)\]$", words[1])
            last_log = m.group(1) if m else last_log
        elif head == "one":
            legs.append(leg(words, env))
        elif head == "both":
            if len(words) != 5:
                raise ValueError(f"run-all.sh: both takes two names and two legs: {line.strip()}")
            legs.extend(leg(shlex.split(cmd)) for cmd in words[3:])
        elif head == "beside":
            n = (len(words) - 1) // 2
            if n < 1 or len(words) != 2 * n + 1:
                raise ValueError(f"run-all.sh: beside takes N names and N legs: {line.strip()}")
            for name, cmd in zip(words[1 : n + 1], words[n + 1 :]):
                lg = leg(shlex.split(cmd))
                if lg.name != name:
                    raise ValueError(f"run-all.sh: beside names {name!r} for the leg {lg.name!r}")
                legs.append(lg)
        elif "pytest" in words and head.startswith("$") and head[1:] in pythons:
            if last_log is None:
                raise ValueError(f"run-all.sh: a pytest pass with no log line naming it: {line}")
            i = words.index("pytest")
            version, flavour = pythons[head[1:]]
            legs.append(Leg(last_log, version, flavour, env, tuple(words[i + 1 :])))
        elif "pytest" in words and not head.endswith("()") and head not in ("local", "$py"):
            raise ValueError(f"run-all.sh: a pytest call this reader does not know: {line}")
    if not legs:
        raise ValueError("run-all.sh: no legs found")
    for lg in legs:
        for arg in lg.args:
            ref = _ARRAY_REF.match(arg) or _ARRAY_IGNORE.match(arg)
            if ref and ref.group(1) not in arrays:
                raise ValueError(f"run-all.sh: leg {lg.name!r} uses an unknown list {arg}")
    return RunAll(tuple(legs), arrays, tuple(exported))


# -- the environments: flavour -> pins ---------------------------------------------


def flavour_sections(ensure_env: str) -> dict[str, tuple[str, ...]]:
    """Flavour -> its sections of sglang-requirements.txt (ensure-env.sh's case)."""
    return {
        m.group(1): tuple(m.group(2).split())
        for m in re.finditer(r'^\s*(\w+)\) SECTIONS="([^"]*)"', ensure_env, re.M)
    }


def pins(requirements: str, sections: Sequence[str]) -> dict[str, str]:
    """Package -> version over ``sections`` (a later section's pin wins)."""
    out: dict[str, str] = {}
    section = ""
    for raw in requirements.splitlines():
        if raw.startswith("#@ "):
            section = raw[3:].strip()
            continue
        line = raw.split("#", 1)[0].strip()
        if section in sections and "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.strip()
    return out


def environment(flavour: str) -> str:
    """What a flavour's environment holds, in words, from the pins."""
    sections = flavour_sections(ENSURE_ENV.read_text(encoding="utf-8"))
    if flavour not in sections:
        raise ValueError(f"ensure-env.sh has no flavour {flavour!r}")
    versions = pins(REQUIREMENTS.read_text(encoding="utf-8"), sections[flavour])
    if "sglang" not in versions:
        return f"`{flavour}`: no sglang, no torch"
    return f"`{flavour}`: sglang {versions['sglang']}, torch {versions['torch']}"


# -- the table --------------------------------------------------------------------


def describe(args: Sequence[str]) -> str:
    """pytest arguments in words: what is selected, then what is left out."""
    chosen: list[str] = []
    left_out: list[str] = []
    extra: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        ref = _ARRAY_REF.match(a)
        if a == "-p" and i + 1 < len(args):
            i += 1  # plugin switches (no:cacheprovider) select nothing
        elif a in ("-m", "-k") and i + 1 < len(args):
            extra.append(f"{'marks' if a == '-m' else 'names'} `{args[i + 1]}`")
            i += 1
        elif a == "--deselect" and i + 1 < len(args):
            left_out.append(f"`{args[i + 1]}`")
            i += 1
        elif a.startswith("--ignore="):
            left_out.append(f"`{a.split('=', 1)[1]}`")
        elif ignored := _ARRAY_IGNORE.match(a):
            left_out.append(f"`{ignored.group(1)}`")
        elif a == "$@":
            extra.append("run-all.sh's own arguments")
        elif ref:
            chosen.append(f"`{ref.group(1)}`")
        elif a.startswith("-"):
            extra.append(f"`{a}`")
        else:
            chosen.append(f"`{a}`")
        i += 1
    text = ", ".join(chosen) if chosen else "every test under `tests/`"
    if left_out:
        text += " but " + ", ".join(left_out)
    if extra:
        text += "; " + ", ".join(extra)
    return text


def table(run_all: RunAll | None = None) -> str:
    """CONTRIBUTING's generated block: the legs, the lists they use, the exports."""
    run = run_all or parse(RUN_ALL.read_text(encoding="utf-8"))
    lines = [
        "| leg | Python | environment | tests |",
        "| --- | --- | --- | --- |",
    ]
    used: list[str] = []
    for leg in run.legs:
        env = environment(leg.flavour)
        if leg.env:
            env += "; " + ", ".join(f"`{e}`" for e in leg.env)
        lines.append(f"| {leg.name} | {leg.python} | {env} | {describe(leg.args)} |")
        for arg in leg.args:
            ref = _ARRAY_REF.match(arg) or _ARRAY_IGNORE.match(arg)
            if ref and ref.group(1) not in used:
                used.append(ref.group(1))
    lines.append("")
    for name in used:
        lines.append(f"- `{name}`: {describe(run.arrays[name])}")
    if run.exported:
        lines.append("")
        lines.append(
            "Every leg runs with " + " ".join(f"`{e}`" for e in run.exported) + " (a skip fails)."
        )
    return "\n".join(lines)
