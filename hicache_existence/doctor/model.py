"""The doctor's report: findings with their evidence, per-instance figures, ranked.

``Report.as_dict()`` is the ``--json`` document (docs/doctor.md, "JSON"): the
dataclasses' fields in declaration order, numbers through ``number()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from hicache_existence.doctor.figures import Figure, Key, key_text
from hicache_existence.doctor.judgements import SEVERITIES, Severity

#: Version of the ``--json`` document (docs/doctor.md, "JSON").
SCHEMA_VERSION = 1
#: Integral values below this are exact in a float, so JSON writes them as ints.
_EXACT = 2**53


def number(value: float | None) -> int | float | str | None:
    """A figure for JSON: integral values as ints (exact below 2**53), NaN and the
    infinities as the exposition format writes them."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < _EXACT:
        return int(value)
    return value


def _json(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, float):
        return number(value)
    return value


@dataclass(frozen=True)
class Evidence:
    """A figure a finding rests on (or one it derived, ``series`` naming how)."""

    instance: str
    series: str
    value: float
    rate_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Finding:
    id: str
    severity: Severity
    #: None: the fleet.
    instance: str | None = None
    pool: str | None = None
    summary: str
    #: L3 bytes this finding explains (written for nothing) and their rate; None where
    #: it costs no bytes or they cannot be told.
    wasted_bytes: float | None = None
    wasted_bytes_per_s: float | None = None
    evidence: tuple[Evidence, ...]
    fix: tuple[str, ...]


@dataclass(frozen=True)
class InstanceReport:
    instance: str
    seconds: float | None
    ranks: int
    pools: tuple[str, ...]
    host_memory_mode: str | None
    write_policy: str | None
    cache_mode_dedup: bool | None
    figures: Mapping[Key, Figure]

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: _json(getattr(self, f.name)) for f in fields(self)[:-1]}
        out["resets"] = [key_text(k) for k, f in self.figures.items() if f.reset]
        out["figures"] = {
            key_text(k): {n: number(getattr(f, n)) for n in ("value", "delta", "rate_per_s")}
            for k, f in self.figures.items()
        }
        return out


@dataclass(frozen=True)
class Report:
    source: Mapping[str, Any]
    instances: tuple[InstanceReport, ...]
    findings: tuple[Finding, ...]

    @property
    def exit_code(self) -> int:
        """0: nothing at warning or above; 1: something is."""
        return 1 if any(f.severity != "info" for f in self.findings) else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "source": dict(self.source),
            "exit_code": self.exit_code,
            "instances": [i.as_dict() for i in self.instances],
            "findings": [_json(f) for f in self.findings],
        }


def rank(findings: Iterable[Finding]) -> list[Finding]:
    """Critical first, then warnings, then info; within each, the most wasted L3
    bytes first (their rate breaks ties; findings that waste no bytes last)."""

    def key(f: Finding) -> tuple[int, float, float]:
        return (
            -SEVERITIES.index(f.severity),
            -(f.wasted_bytes if f.wasted_bytes is not None else -1.0),
            -(f.wasted_bytes_per_s if f.wasted_bytes_per_s is not None else -1.0),
        )

    return sorted(findings, key=key)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
