"""The doctor's figures: the series it reads, aggregated over ranks, per instance.

The series are the package's (every family of ``hicache_existence.exporters.catalog``,
looked up there by name: ``SERIES``) and SGLang's HiCache/L3 storage series
(declared below: they are upstream's).

A series' samples are summed over the labels that tell ranks and processes apart
(counters: the sum, as ``sum by (pool, reason, ...)`` in PromQL; gauges: the
largest value, except ``divergence_active``: the smallest), keeping ``KEPT_LABELS``.
A counter's change between the two reads is taken per raw series; a series whose
value went down was reset (a restart) and counts from 0, as ``increase()`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hicache_existence.doctor.exposition import Exposition, Labels
from hicache_existence.exporters.catalog import CATALOG, FEATURE_CATALOG, PREFIX

#: Every exported family's sample name by its name without the prefix
#: (``queries`` -> ``hicache_existence_queries_total``): the only spelling of the
#: package's series the doctor, the rules and the docs tables use.
SERIES: dict[str, str] = {
    **{spec.name.removeprefix(PREFIX): spec.exposed_name for spec in CATALOG},
    **{
        spec.name.removeprefix(PREFIX): spec.exposed_name
        for spec in FEATURE_CATALOG
        if spec.kind != "histogram"
    },
}

S = "sglang:"
#: L3 (storage) series of SGLang 0.5.23 (``StorageMetricsCollector``): any of them
#: present means the endpoint is a HiCache server with an L3 backend and metrics on.
SGLANG_BACKUPED = S + "backuped_tokens_total"
SGLANG_PREFETCHED = S + "prefetched_tokens_total"
SGLANG_PREFETCH_HIT = S + "storage_prefetch_hit_tokens_total"
SGLANG_UNFULFILLED = S + "storage_prefetch_unfulfilled_tokens_total"
SGLANG_STORAGE_SERIES: tuple[str, ...] = (
    SGLANG_BACKUPED,
    SGLANG_PREFETCHED,
    SGLANG_PREFETCH_HIT,
    SGLANG_UNFULFILLED,
    S + "storage_prefetch_deferred_tokens_total",
    S + "hicache_backup_dropped_tokens_total",
    S + "hicache_prefetch_aux_alloc_failed_tokens_total",
)
#: Host-memory (L2) series of HiCache, read beside the storage series.
SGLANG_HICACHE_SERIES: tuple[str, ...] = (
    S + "hicache_backup_bytes_total",
    S + "hicache_backup_tokens_total",
    S + "hicache_dropped_tokens_total",
    S + "hicache_host_used_tokens",
    S + "hicache_host_total_tokens",
)
SGLANG_SERIES = frozenset(SGLANG_STORAGE_SERIES + SGLANG_HICACHE_SERIES)

#: Labels a figure keeps; every other label (ranks, model, pid, job, instance) is
#: summed over.
KEPT_LABELS = frozenset(
    {"pool", "reason", "result", "kind", "cause", "cap_multiplier"}
    | {"host_memory_mode", "write_policy", "cache_mode_dedup", "capacity_scope"}  # mode_info's
)
#: Gauges aggregated with min instead of max: one stopped rank matters.
MIN_GAUGES = frozenset({SERIES["divergence_active"]})
_SKIPPED_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
RANK_LABELS = ("tp_rank", "dp_rank", "pp_rank")


def series(name: str) -> str:
    """A series' sample name: ``sglang:...`` as given (it must be declared above),
    any other name a catalog family's (a name the catalog lacks fails here)."""
    if name.startswith(S):
        if name not in SGLANG_SERIES:
            raise KeyError(f"{name} is not an SGLang series the doctor reads")
        return name
    try:
        return SERIES[name]
    except KeyError:
        raise KeyError(f"{PREFIX}{name} is not in hicache_existence.exporters.catalog") from None


@dataclass(frozen=True)
class Reading:
    """One instance: the samples read last and, for rates, those read ``seconds``
    earlier (``first`` None: one read, no rates)."""

    instance: str
    last: Exposition
    first: Exposition | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.first is not None and not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"seconds must be > 0 with two reads, got {self.seconds!r}")


def canonical(name: str) -> str:
    """SGLang's series under their own names: prometheus_client writes the colon of
    ``sglang:x`` as ``sglang_x`` in OpenMetrics, which Prometheus negotiates when it
    scrapes, so Prometheus stores them so."""
    if name.startswith("sglang_"):
        colon = S + name[len("sglang_") :]
        if colon in SGLANG_SERIES:
            return colon
    return name


def is_package(name: str) -> bool:
    return name.startswith(PREFIX) and not name.endswith(_SKIPPED_SUFFIXES)


def is_read(name: str) -> bool:
    """A series the doctor reads (SGLang's under either spelling)."""
    return is_package(name) or canonical(name) in SGLANG_SERIES


def readable(exposition: Exposition) -> str | None:
    """Why the doctor cannot diagnose this body (None: it can)."""
    names = {canonical(s.name) for s in exposition.samples}
    if any(is_package(n) for n in names) or names & set(SGLANG_STORAGE_SERIES):
        return None
    return (
        f"no {PREFIX}* series and no SGLang storage series ({SGLANG_BACKUPED}"
        " ...): is this SGLang's /metrics with --enable-metrics and an L3 backend, or the"
        " package's own endpoint?"
    )


Key = tuple[str, Labels]
#: A label value's escapes, as the exposition format writes them.
_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})


def key_text(key: Key) -> str:
    """``name{label="value",...}``: a figure's name in the output."""
    name, labels = key
    if not labels:
        return name
    inner = ",".join(f'{k}="{v.translate(_ESCAPES)}"' for k, v in labels)
    return f"{name}{{{inner}}}"


@dataclass(frozen=True)
class Figure:
    """One series of one instance: its value at the last read, and (two reads) its
    change and rate; ``reset`` when one of its counters went down in between."""

    value: float
    delta: float | None = None
    rate_per_s: float | None = None
    reset: bool = False


def figures_of(reading: Reading) -> dict[Key, Figure]:
    """Every series the doctor reads, aggregated over ranks (module docstring)."""
    first = () if reading.first is None else reading.first.samples
    before = {(canonical(s.name), s.labels): s.value for s in first if is_read(s.name)}
    values: dict[Key, float] = {}
    deltas: dict[Key, float] = {}
    resets: set[Key] = set()
    for s in reading.last.samples:
        if not is_read(s.name):
            continue
        name = canonical(s.name)
        key = (name, tuple((k, v) for k, v in s.labels if k in KEPT_LABELS))
        counter = name.endswith("_total")
        if key not in values:
            values[key] = s.value
        elif counter:
            values[key] += s.value
        else:
            values[key] = (min if name in MIN_GAUGES else max)(values[key], s.value)
        if reading.first is None or not counter:
            continue
        prior = before.get((name, s.labels))
        if prior is not None and s.value < prior:
            resets.add(key)  # a restart
        # A new series, or a reset one, counts from 0.
        d = s.value if prior is None or s.value < prior else s.value - prior
        deltas[key] = deltas.get(key, 0.0) + d
    return {
        k: Figure(v, deltas[k], deltas[k] / reading.seconds, k in resets)
        if k in deltas
        else Figure(v)
        for k, v in sorted(values.items())
    }


def ranks_of(exposition: Exposition) -> int:
    """Distinct (tp, dp, pp) rank label sets among the package's series."""
    ranks = (dict(s.labels) for s in exposition.samples if is_package(s.name))
    return len({tuple(labels.get(r) for r in RANK_LABELS) for labels in ranks})


def _sum_or_none(values: list[float | None]) -> float | None:
    """The sum, None when there is nothing to sum or one of them is unknown."""
    known = [v for v in values if v is not None]
    return sum(known) if values and len(known) == len(values) else None


#: A label filter: one value, or several whose figures are summed.
Match = str | tuple[str, ...]


class View:
    """Read access to one instance's figures by series (``series()``: a catalog
    family's short name or an SGLang series) and label filter."""

    def __init__(self, instance: str, figures: Mapping[Key, Figure], seconds: float | None):
        self.instance = instance
        self.figures = figures
        self.seconds = seconds
        # Figures by name and by (name, pool): the rules look figures up per pool, so a
        # scan of every figure per lookup would be quadratic in the pools a body has.
        self._by_name: dict[str, list[tuple[Key, Figure]]] = {}
        self._by_pool: dict[tuple[str, str | None], list[tuple[Key, Figure]]] = {}
        for k, f in figures.items():
            self._by_name.setdefault(k[0], []).append((k, f))
            self._by_pool.setdefault((k[0], dict(k[1]).get("pool")), []).append((k, f))

    def _matching(self, name: str, labels: Mapping[str, Match]) -> list[tuple[Key, Figure]]:
        full = series(name)
        want = {k: (v,) if isinstance(v, str) else v for k, v in labels.items()}
        pool = labels.get("pool")
        candidates = (
            self._by_pool.get((full, pool), [])
            if isinstance(pool, str)
            else self._by_name.get(full, [])
        )
        return [
            (k, f) for k, f in candidates if all(dict(k[1]).get(a) in b for a, b in want.items())
        ]

    def has(self, name: str) -> bool:
        return series(name) in self._by_name

    def value(self, name: str, **labels: Match) -> float:
        """Sum of the matching figures (0 when none)."""
        return sum(f.value for _, f in self._matching(name, labels))

    def rate(self, name: str, **labels: Match) -> float | None:
        """Sum of the matching figures' rates (None without two reads or a match)."""
        return _sum_or_none([f.rate_per_s for _, f in self._matching(name, labels)])

    def delta(self, name: str, **labels: Match) -> float | None:
        return _sum_or_none([f.delta for _, f in self._matching(name, labels)])

    def values_by(self, name: str, label: str, **labels: Match) -> dict[str, float]:
        """{label value: summed value} of the matching figures."""
        out: dict[str, float] = {}
        for k, f in self._matching(name, labels):
            v = dict(k[1]).get(label)
            if v is not None:
                out[v] = out.get(v, 0.0) + f.value
        return out

    def pools(self) -> tuple[str, ...]:
        pools = {dict(k[1]).get("pool") for k in self.figures if is_package(k[0])}
        return tuple(sorted(p for p in pools if p is not None))

    def mode_labels(self) -> Labels:
        """The labels of ``mode_info`` (empty when not exported)."""
        # By name, not a scan of every figure: the per-pool rules ask once per pool.
        found = self._by_name.get(series("mode_info"), ())
        return next((k[1] for k, f in found if f.value >= 1), ())

    def mode(self) -> tuple[str | None, str | None, bool | None]:
        """(host_memory_mode, write_policy, cache_mode_dedup) from ``mode_info``."""
        labels = dict(self.mode_labels())
        dedup = labels.get("cache_mode_dedup")
        return (
            labels.get("host_memory_mode"),
            labels.get("write_policy"),
            # "upstream": sglang deduplicates itself (the package only counts).
            None if dedup is None else dedup in ("true", "upstream"),
        )
