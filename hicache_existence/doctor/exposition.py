"""A strict parser of the Prometheus text exposition format (version 0.0.4).

The doctor reads bodies from the network, so everything that is not the format
(an HTML page, a JSON answer, a truncated line, a stray byte) is refused with an
``ExpositionError`` naming the line, never another exception.  What is accepted:
``# HELP``/``# TYPE`` lines and other comments, blank lines, and samples
``name{label="value",...} value [timestamp]`` with the format's escapes in label
values (``\\\\``, ``\\"``, ``\\n``) and its float values (``NaN``, ``+Inf``, ``-Inf``).
OpenMetrics bodies (``# EOF`` is a comment here) parse the same way.  A sample that
appears twice, or a second ``# TYPE`` line for one name, is an error, as it is for
Prometheus.  prometheus_client is not needed (it is an optional extra).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: The largest body the doctor parses (a server with every feature on exports a few
#: hundred KiB at most).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Labels per sample beyond which a body is refused (SGLang's series carry < 12).
MAX_LABELS = 64

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN")
_TIMESTAMP = re.compile(r"-?\d+")
_TYPES = frozenset(
    {"counter", "gauge", "histogram", "summary", "untyped", "unknown", "info", "stateset"}
)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
#: A label value up to its closing quote: characters and valid escapes only (it stops
#: at the quote, a bad escape or the line's end: the three cases told apart).
_QUOTED = re.compile(r'(?:[^"\\]|\\[\\"n])*')
_ESCAPED = re.compile(r"\\(.)")

#: A sample's labels: sorted (name, value) pairs.
Labels = tuple[tuple[str, str], ...]


class ExpositionError(ValueError):
    """The body is not Prometheus text exposition; the message names the line."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float


@dataclass(frozen=True)
class Exposition:
    """One parsed body: its samples, in body order."""

    samples: tuple[Sample, ...]


def _show(line: str) -> str:
    return repr(line if len(line) <= 60 else line[:57] + "...")


def _labels(text: str, start: int, number: int, line: str) -> tuple[Labels, int]:
    """Parse ``{...}`` beginning at ``text[start] == "{"``; returns the labels and the
    index after ``}``."""
    out: dict[str, str] = {}
    i = start + 1
    n = len(text)
    while True:
        i = n - len(text[i:].lstrip(" \t"))
        if i < n and text[i] == "}":
            return tuple(sorted(out.items())), i + 1
        m = _LABEL.match(text, i)
        if m is None:
            raise ExpositionError(f"line {number}: bad label name in {_show(line)}")
        name = m.group(0)
        i = m.end()
        i = n - len(text[i:].lstrip(" \t"))
        if i + 1 >= n or text[i] != "=" or text[i + 1] != '"':
            raise ExpositionError(f'line {number}: expected ="value" after {name} in {_show(line)}')
        value = _QUOTED.match(text, i + 2)
        assert value is not None  # it matches the empty string too
        i = value.end()
        if i >= n:
            raise ExpositionError(f"line {number}: unterminated label value in {_show(line)}")
        if text[i] == "\\":
            raise ExpositionError(f"line {number}: bad escape in {_show(line)}")
        i += 1
        if name in out:
            raise ExpositionError(f"line {number}: label {name} given twice in {_show(line)}")
        out[name] = _ESCAPED.sub(lambda m: _ESCAPES[m.group(1)], value.group(0))
        if len(out) > MAX_LABELS:
            raise ExpositionError(f"line {number}: more than {MAX_LABELS} labels")
        i = n - len(text[i:].lstrip(" \t"))
        if i < n and text[i] == ",":
            i += 1
        elif i >= n or text[i] != "}":
            raise ExpositionError(f"line {number}: expected , or }} in {_show(line)}")


def value_of(token: str) -> float | None:
    """A sample value as the format writes it (``NaN``, ``+Inf``, ``-Inf`` too),
    None for anything else (the Prometheus API's values are written the same way)."""
    if not _VALUE.fullmatch(token):
        return None
    if token.endswith("Inf"):
        return -math.inf if token.startswith("-") else math.inf
    return float(token)


def parse(body: str | bytes) -> Exposition:
    """Parse one exposition body; ``ExpositionError`` for anything else."""
    if isinstance(body, bytes):
        if len(body) > MAX_BODY_BYTES:
            raise ExpositionError(f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ExpositionError(f"not UTF-8 text (byte {exc.start})") from None
    samples: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    typed: set[str] = set()
    for number, raw in enumerate(body.split("\n"), 1):
        line = raw.removesuffix("\r")
        stripped = line.strip(" \t")
        if not stripped:
            continue
        if "\x00" in line:
            raise ExpositionError(f"line {number}: NUL byte")
        if stripped.startswith("#"):
            words = stripped[1:].split(None, 3)
            if words and words[0] == "TYPE":
                if len(words) != 3 or not _NAME.fullmatch(words[1]) or words[2] not in _TYPES:
                    raise ExpositionError(f"line {number}: bad TYPE line {_show(line)}")
                if words[1] in typed:
                    raise ExpositionError(f"line {number}: second TYPE line for {words[1]}")
                typed.add(words[1])
            elif words and words[0] == "HELP" and (len(words) < 2 or not _NAME.fullmatch(words[1])):
                raise ExpositionError(f"line {number}: bad HELP line {_show(line)}")
            continue
        m = _NAME.match(stripped)
        if m is None:
            raise ExpositionError(
                f"line {number}: not a sample, comment or blank line: {_show(line)}"
            )
        name = m.group(0)
        i = m.end()
        labels: Labels = ()
        if i < len(stripped) and stripped[i] == "{":
            labels, i = _labels(stripped, i, number, line)
        rest = stripped[i:]
        if not rest or rest[0] not in " \t":
            raise ExpositionError(f"line {number}: no value in {_show(line)}")
        parts = rest.split()
        value = value_of(parts[0]) if 1 <= len(parts) <= 2 else None
        if value is None:
            raise ExpositionError(f"line {number}: bad value in {_show(line)}")
        if len(parts) == 2 and not _TIMESTAMP.fullmatch(parts[1]):
            raise ExpositionError(f"line {number}: bad timestamp in {_show(line)}")
        key = (name, labels)
        if key in seen:
            raise ExpositionError(f"line {number}: duplicate sample {name}")
        seen.add(key)
        samples.append(Sample(name, labels, value))
    return Exposition(tuple(samples))
