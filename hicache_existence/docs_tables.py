"""The generated reference tables of docs/, each from the one place its facts live
(CONTRIBUTING.md, "Generated files"): ``dashboards/build.py`` writes them between the
docs' ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->`` markers.  No runtime code imports this.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from itertools import takewhile
from pathlib import Path
from typing import Any

from hicache_existence import config as config_module
from hicache_existence.config import ENV_PREFIX, Config
from hicache_existence.core import stats as stats_module
from hicache_existence.doctor import judgements
from hicache_existence.exporters.catalog import CATALOG, FEATURE_CATALOG, MISS_REASON_LABELS


def _header(*columns: str) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def metrics_table() -> str:
    """The reference table of docs/metrics.md, from the catalog."""
    rows: list[tuple[Any, str]] = []
    for spec in CATALOG:
        labels = ", ".join(("pool", *spec.extra_labels))
        if spec.extra_labels == ("reason",):
            labels += " (" + " / ".join(MISS_REASON_LABELS) + ")"
        rows.append((spec, labels))
    rows += [(f, ", ".join(f.labels) or "-") for f in FEATURE_CATALOG]
    lines = _header("metric", "type", "unit", "labels", "help")
    for s, labels in rows:
        lines.append(f"| `{s.exposed_name}` | {s.kind} | {s.unit or '-'} | {labels} | {s.help} |")
    return "\n".join(lines)


def _field_comments(module: Any = config_module) -> dict[tuple[str, str], str]:
    """(class name, field) -> the ``#:`` comment lines right above the field.  A field
    right below a commented one may share its comment, marked ``~`` (used when
    FALLBACK has nothing better)."""
    source = Path(module.__file__).read_text(encoding="utf-8")
    lines = [line.strip() for line in source.splitlines()]
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        shared, end = "", None  # the field right above: its comment, its last line
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                end = None
                continue
            above = takewhile(
                lambda line: line.startswith("#:"), reversed(lines[: stmt.lineno - 1])
            )
            text = " ".join(reversed([line[2:].strip() for line in above]))
            if not text and shared and end == stmt.lineno - 1:
                text = "~" + shared.lstrip("~")
            out[(node.name, stmt.target.id)] = shared = text
            end = stmt.end_lineno
    return out


#: Meanings of fields that have no ``#:`` comment in config.py.
FALLBACK = {
    "enabled": "turn this feature on (`true`) or off",
    "metrics.host": "address the standalone `/metrics` binds (SGLang without `--enable-metrics`)",
    "metrics.port": "first standalone port; each scheduler process adds its index (0: any port)",
    "metrics.model_name": "`model_name` label; empty: SGLang's served model name",
    "metrics.storage_backend": "`storage_backend` label; empty: `--hicache-storage-backend`",
}


def _md(text: str) -> str:
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " / ".join(f"`{a}`" if a != "" else '`""`' for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def _default(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def config_table() -> str:
    """The markdown table of every key of ``Config``."""
    comments = _field_comments()
    rows = _header("key", "type", "default", "environment variable", "meaning")

    def add(key: str, hint: Any, default: Any, meaning: str) -> None:
        env = ENV_PREFIX + key.upper().replace(".", "__")
        rows.append(f"| `{key}` | {_type_name(hint)} | {_default(default)} | `{env}` | {meaning} |")

    defaults = Config()
    for top, hint in typing.get_type_hints(Config).items():
        value = getattr(defaults, top)
        if not dataclasses.is_dataclass(value):
            add(top, hint, value, "switch the package on")
            continue
        section = type(value)
        doc = _md((section.__doc__ or "").strip().split("\n\n")[0])
        rows.append(f"| **`{top}`** | | | | {doc} |")
        for name, field_hint in typing.get_type_hints(section).items():
            own = comments.get((section.__name__, name), "")
            meaning = _md(
                (own if not own.startswith("~") else "")
                or FALLBACK.get(f"{top}.{name}", "")
                or FALLBACK.get(name, "")
                or own.lstrip("~")
            )
            assert meaning, f"{top}.{name} has no #: comment in config.py"
            add(f"{top}.{name}", field_hint, getattr(value, name), meaning)
    return "\n".join(rows)


def replace_between(text: str, name: str, block: str) -> str:
    """``text`` with the lines between ``<!-- name:begin -->`` and
    ``<!-- name:end -->`` replaced by ``block``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"markers {begin} / {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def stats_table() -> str:
    """The markdown table of every ``PoolStats`` field (``cache.stats()[pool]``):
    its meaning is the help text declared beside it, as /metrics says it."""
    exported = {spec.field: spec.exposed_name for spec in CATALOG if spec.source == "cache"}
    by_reason = next(spec for spec in CATALOG if spec.field == "misses_by_reason")
    rows = _header("field", "kind", "meaning", "exported as")
    for f in dataclasses.fields(stats_module.PoolStats):
        kind = f.metadata.get("kind")
        if kind is None:
            continue  # the pool's name
        meaning = f.metadata.get("help")
        if kind == "miss_reason":
            reason = f.name.removeprefix("misses_")
            meaning = (
                f"Page misses classified `{reason}` (miss-reason memory on; off, this stays 0 "
                'and every miss is exported as `reason="unclassified"`).'
            )
            metric = f'`{by_reason.exposed_name}{{reason="{reason}"}}`'
            kind = "counter"
        elif f.name == "page_misses":
            metric = f"`{by_reason.exposed_name}`, summed over `reason`"
        else:
            metric = f"`{exported[f.name]}`"
        assert meaning, f"PoolStats.{f.name} has no help text in core/stats.py"
        rows.append(f"| `{f.name}` | {kind} | {_md(meaning)} | {metric} |")
    return "\n".join(rows)


def _past(j: judgements.Judgement) -> str:
    """``> `name` = value``: the judgement's threshold ("-" without one)."""
    if j.threshold is None:
        return "-"
    return f"{'>' if j.direction == 'above' else '<'} {_guard(j.threshold)}"


def _guard(name: str | None, unit: str = "") -> str:
    return "-" if name is None else f"`{name}` = {judgements.SETTINGS.value(name):g}{unit}"


def thresholds_table() -> str:
    """docs/doctor.md's thresholds: every finding judged by a ratio."""
    rows = _header("finding", "severity", "ratio", "past", "on at least", "alert")
    for j in judgements.JUDGEMENTS:
        if j.finding is None or j.ratio is None:
            continue
        alert = "-"
        if j.alert is not None:
            alert = f"[{j.alert.name}](runbooks.md#{judgements.runbook_anchor(j.alert.name)})"
        rows.append(
            f"| [`{j.finding}`](#{j.finding}) | {j.severity} | {_md(j.ratio.text())} | "
            f"{_past(j)} | {_guard(j.guard)} | {alert} |"
        )
    return "\n".join(rows)


def alerts_table() -> str:
    """docs/runbooks.md's index: every alert, its thresholds and the doctor's finding."""
    rows = _header("alert", "severity", "threshold", "traffic at least", "for", "doctor's finding")
    for j, a in judgements.alerting():
        for_ = getattr(judgements.SETTINGS, a.for_) if a.for_ else "0m"
        finding = "-" if j.finding is None else f"[`{j.finding}`](doctor.md#{j.finding})"
        rows.append(
            f"| [{a.name}](#{judgements.runbook_anchor(a.name)}) | {j.severity} | {_past(j)} | "
            f"{_guard(j.rate_guard, '/s')} | {for_} | {finding} |"
        )
    return "\n".join(rows)


def settings_table() -> str:
    """docs/runbooks.md's settings: every field of ``judgements.Settings`` with its
    value in ``SETTINGS`` and the ``#:`` comment above it, so that the runbooks'
    prose names a setting and this table alone gives its value."""
    comments = _field_comments(judgements)
    rows = _header("setting", "value", "meaning")
    for f in dataclasses.fields(judgements.Settings):
        value = getattr(judgements.SETTINGS, f.name)
        shown = ", ".join(value) if isinstance(value, tuple) else value
        meaning = comments.get(("Settings", f.name), "")
        rows.append(f"| `{f.name}` | {shown} | {_md(meaning) if meaning[:1] != '~' else '-'} |")
    return "\n".join(rows)
