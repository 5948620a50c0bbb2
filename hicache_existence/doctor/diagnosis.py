"""Figures and findings from parsed series: the doctor's judgement, without I/O.

Input: one ``Reading`` per instance (a server's metrics endpoint, or one
``instance`` of a Prometheus server): the samples read last, and optionally the
samples read ``seconds`` earlier.  Output: a ``Report`` with, per instance, every
series the doctor reads (the package's ``hicache_existence_*`` series and SGLang's
HiCache/L3 storage series) as figures, and the findings, ranked.

Figures: a series' samples are summed over the labels that tell ranks and processes
apart (counters: the sum, as ``sum by (pool, reason, ...)`` in PromQL; gauges: the
largest value, except ``divergence_active``: the smallest), keeping ``pool``,
``reason``, ``result``, ``kind``, ``cause``, ``cap_multiplier`` and the mode labels.
A counter's change between the two reads is taken per raw series; a series whose
value went down was reset (a restart) and counts from 0, as ``increase()`` does.

Findings (docs/doctor.md): each has an id, a severity (info / warning / critical),
a summary, the evidence (figures and the series they came from), the fix, and the
L3 bytes it explains (``wasted_bytes``; ``None`` where it costs no bytes or they
cannot be told).  They are ranked by severity, then by wasted bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hicache_existence.doctor.exposition import Exposition, Labels, Sample
from hicache_existence.exporters.catalog import PREFIX

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")

#: Version of the ``--json`` document (docs/doctor.md, "JSON").
SCHEMA_VERSION = 1

# -- the series ----------------------------------------------------------------------

P = PREFIX
QUERIES = P + "queries_total"
PAGES_CHECKED = P + "pages_checked_total"
PAGE_HITS = P + "page_hits_total"
PAGE_MISSES = P + "page_misses_total"
PAGE_INSERTS = P + "page_inserts_total"
EVICTIONS = P + "evictions_total"
INVALIDATIONS = P + "invalidations_total"
ENTRIES = P + "entries"
CAPACITY = P + "capacity_entries"
MEMORY = P + "memory_bytes"
MISS_MEMORY = P + "miss_memory_bytes"
WRITTEN = P + "written_pages_total"
WRITTEN_BYTES = P + "written_bytes_total"
AVOIDED = P + "write_avoided_pages_total"
AVOIDED_BYTES = P + "write_avoided_bytes_total"
REDUNDANT = P + "redundant_written_pages_total"
REDUNDANT_BYTES = P + "redundant_written_bytes_total"
REDUNDANT_BELIEVED = P + "redundant_believed_pages_total"
ACKNOWLEDGED = P + "write_acknowledged_pages_total"
ACKNOWLEDGED_BYTES = P + "write_acknowledged_bytes_total"
FAILED = P + "write_failed_pages_total"
FAILED_BYTES = P + "write_failed_bytes_total"
#: Redundant written pages by cause (HiCache cache mode and buffer mode; issue 21).
REDUNDANT_CAUSE = P + "redundant_cause_pages_total"
#: = 1, labels host_memory_mode, write_policy, cache_mode_dedup.
MODE_INFO = P + "mode_info"
DIVERGENCES = P + "divergences_total"
DIVERGENCE_HEALS = P + "divergence_heals_total"
DIVERGENCE_CHECKS = P + "divergence_checks_total"
DIVERGENCE_FAILURES = P + "divergence_check_failures_total"
DIVERGENCE_MISMATCHES = P + "divergence_config_mismatches_total"
DIVERGENCE_ACTIVE = P + "divergence_active"
RECONCILER_QUERIES = P + "reconciler_queries_total"
STALE_POSITIVES = P + "reconciler_stale_positives_total"
RECONCILER_INVALIDATED = P + "reconciler_pages_invalidated_total"
RECONCILER_ERRORS = P + "reconciler_errors_total"
CIRCUIT_OPEN = P + "reconciler_circuit_open"
ADVISOR_LOOKUP = P + "advisor_estimated_lookup_hit_ratio"

S = "sglang:"
#: L3 (storage) series of SGLang 0.5.23 (``StorageMetricsCollector``): any of them
#: present means the endpoint is a HiCache server with an L3 backend and metrics on.
SGLANG_BACKUPED = S + "backuped_tokens_total"
SGLANG_PREFETCHED = S + "prefetched_tokens_total"
SGLANG_PREFETCH_HIT = S + "storage_prefetch_hit_tokens_total"
SGLANG_UNFULFILLED = S + "storage_prefetch_unfulfilled_tokens_total"
SGLANG_DEFERRED = S + "storage_prefetch_deferred_tokens_total"
SGLANG_BACKUP_DROPPED = S + "hicache_backup_dropped_tokens_total"
SGLANG_AUX_ALLOC_FAILED = S + "hicache_prefetch_aux_alloc_failed_tokens_total"
SGLANG_STORAGE_SERIES: tuple[str, ...] = (
    SGLANG_BACKUPED,
    SGLANG_PREFETCHED,
    SGLANG_PREFETCH_HIT,
    SGLANG_UNFULFILLED,
    SGLANG_DEFERRED,
    SGLANG_BACKUP_DROPPED,
    SGLANG_AUX_ALLOC_FAILED,
)
#: Host-memory (L2) series of HiCache, read beside the storage series.
SGLANG_HOST_USED = S + "hicache_host_used_tokens"
SGLANG_HOST_TOTAL = S + "hicache_host_total_tokens"
SGLANG_HICACHE_SERIES: tuple[str, ...] = (
    S + "hicache_backup_bytes_total",
    S + "hicache_backup_tokens_total",
    S + "hicache_dropped_tokens_total",
    SGLANG_HOST_USED,
    SGLANG_HOST_TOTAL,
)
SGLANG_SERIES = frozenset(SGLANG_STORAGE_SERIES + SGLANG_HICACHE_SERIES)

#: Labels a figure keeps; every other label (ranks, model, pid, job, instance) is
#: summed over.
KEPT_LABELS = frozenset(
    {
        "pool",
        "reason",
        "result",
        "kind",
        "cause",
        "cap_multiplier",
        "host_memory_mode",
        "write_policy",
        "cache_mode_dedup",
    }
)
#: Gauges aggregated with min instead of max: one stopped rank matters.
MIN_GAUGES = frozenset({DIVERGENCE_ACTIVE})
_SKIPPED_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
RANK_LABELS = ("tp_rank", "dp_rank", "pp_rank")

ANSWERED = ("present", "absent", "untrusted")
FAILED_RESULTS = ("error", "timeout", "rejected")

# -- the alerts' severities: one table for the alerts and the doctor ----------------

#: Every alert's severity (``integrations/prometheus/rules.yml``): dashboards/build.py
#: renders each alert with the severity named here, and a finding that asks an
#: alert's question (``FINDING_ALERTS``) takes the same one, so the two cannot
#: disagree (tests/test_dashboards.py and tests/test_doctor.py compare them).
ALERT_SEVERITY: dict[str, Severity] = {
    "HicacheExistenceEvictionChurn": "warning",
    "HicacheExistenceHitRatioCollapse": "warning",
    "HicacheExistenceTPDivergence": "critical",
    "HicacheExistenceTPChecksStopped": "warning",
    "HicacheExistenceReconcilerDown": "warning",
    "HicacheExistenceReconcilerCircuitOpen": "warning",
    "HicacheExistenceStalePositivesHigh": "warning",
    # A tuning signal: the cap is a choice, and a growing share a trend to look at.
    "HicacheExistenceAtCapRedundantWritesRising": "info",
    # A ticket, not a page: upstream's cache mode rewrites pages by design (3% under
    # write_through, 29% under write_back measured) and only the opt-in
    # cache_mode.dedup removes it.
    "HicacheExistenceCacheModeRedundantWrites": "info",
    "HicacheExistenceFleetRedundantWrites": "warning",
}

#: The alerts each finding answers to (docs/doctor.md): at its alert's condition a
#: finding is reported with that alert's severity.
FINDING_ALERTS: dict[str, tuple[str, ...]] = {
    "cap_too_small": (
        "HicacheExistenceEvictionChurn",
        "HicacheExistenceAtCapRedundantWritesRising",
    ),
    "cache_mode_without_dedup": ("HicacheExistenceCacheModeRedundantWrites",),
    "fleet_redundant_writes": ("HicacheExistenceFleetRedundantWrites",),
    "stale_beliefs": ("HicacheExistenceStalePositivesHigh",),
    "reconciler_unhealthy": (
        "HicacheExistenceReconcilerDown",
        "HicacheExistenceReconcilerCircuitOpen",
    ),
    "tp_divergence": ("HicacheExistenceTPDivergence",),
    "tp_checks_stopped": ("HicacheExistenceTPChecksStopped",),
}


def alert_severity(finding: str, alert: str) -> Severity:
    """The severity of ``alert``, which ``finding`` must answer to."""
    if alert not in FINDING_ALERTS.get(finding, ()):
        raise ValueError(f"finding {finding!r} does not answer to alert {alert!r}")
    return ALERT_SEVERITY[alert]


def _worst(*severities: Severity) -> Severity:
    return max(severities, key=SEVERITIES.index)


# -- thresholds (docs/doctor.md, "Thresholds"; the alerts' where they overlap) ------

#: Written pages below which ratios of writes are reported at most as info.
MIN_WRITTEN_PAGES = 64
#: Lookups below which ratios of lookups are reported at most as info.
MIN_QUERIES = 32
#: Answered verifications below which the stale share is reported at most as info.
MIN_ANSWERED = 10
#: Tokens written to L3 below which "not read back" is reported at most as info.
MIN_L3_TOKENS = 4096
#: Redundant written pages over written pages (HicacheExistenceAtCapRedundantWritesRising).
REDUNDANT_RATIO = 0.05
#: The same in cache mode without dedup (HicacheExistenceCacheModeRedundantWrites).
CACHE_MODE_REDUNDANT_RATIO = 0.02
#: The same over a fleet of several instances (HicacheExistenceFleetRedundantWrites).
FLEET_REDUNDANT_RATIO = 0.10
#: Evicted misses per lookup (HicacheExistenceEvictionChurn).
CHURN_RATIO = 0.05
#: Stale positives per answered verification (HicacheExistenceStalePositivesHigh).
STALE_RATIO = 0.10
#: L3 tokens read back over tokens written, below which L3 hardly pays.
READ_BACK_RATIO = 0.10
#: Failed written pages over written pages.
FAILED_RATIO = 0.01
#: Entries over cap that count as full.
AT_CAP = 0.99
#: The recommended cap: the smallest multiple whose estimate is within this of the
#: best (the dashboard's and ``hicache-existence demo``'s rule).
ADVICE_TOLERANCE = 0.01

# -- input ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One instance: the samples read last and, for rates, those read ``seconds``
    earlier (``first`` None: one read, no rates)."""

    instance: str
    last: Exposition
    first: Exposition | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.instance, str) or not self.instance:
            raise ValueError("instance must be a non-empty str")
        if self.first is not None and not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"seconds must be > 0 with two reads, got {self.seconds!r}")


def canonical(name: str) -> str:
    """SGLang's series under their own names: prometheus_client writes the colon of
    ``sglang:x`` as ``sglang_x`` in OpenMetrics, which Prometheus negotiates when it
    scrapes, so Prometheus stores them so."""
    if name.startswith("sglang_"):
        colon = "sglang:" + name[len("sglang_") :]
        if colon in SGLANG_SERIES:
            return colon
    return name


def is_package(name: str) -> bool:
    return name.startswith(PREFIX) and not name.endswith(_SKIPPED_SUFFIXES)


def is_read(name: str) -> bool:
    """A series the doctor reads (the package's counters and gauges, SGLang's HiCache
    storage and host series, under either spelling)."""
    return is_package(name) or canonical(name) in SGLANG_SERIES


def readable(exposition: Exposition) -> str | None:
    """Why the doctor cannot diagnose this body (None: it can)."""
    names = {canonical(n) for n in exposition.names()}
    if any(is_package(n) for n in names) or names & set(SGLANG_STORAGE_SERIES):
        return None
    return (
        "no hicache_existence_* series and no SGLang storage series (sglang:backuped_tokens_total"
        " ...): is this SGLang's /metrics with --enable-metrics and an L3 backend, or the"
        " package's own endpoint?"
    )


# -- figures -------------------------------------------------------------------------

Key = tuple[str, Labels]


def key_text(key: Key) -> str:
    """``name{label="value",...}``: a figure's name in the output."""
    name, labels = key
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    """A label value as the exposition format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _kept(labels: Labels) -> Labels:
    return tuple((k, v) for k, v in labels if k in KEPT_LABELS)


def _is_counter(name: str) -> bool:
    return name.endswith("_total")


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
    last = _aggregate(reading.last.samples)
    if reading.first is None:
        return {k: Figure(v) for k, v in sorted(last.items())}
    before = {
        (canonical(s.name), s.labels): s.value for s in reading.first.samples if is_read(s.name)
    }
    deltas: dict[Key, float] = {}
    resets: set[Key] = set()
    for s in reading.last.samples:
        if not is_read(s.name) or not _is_counter(s.name):
            continue
        name = canonical(s.name)
        key = (name, _kept(s.labels))
        prior = before.get((name, s.labels))
        if prior is None:
            d = s.value  # a new series: counted from 0
        elif s.value < prior:
            d = s.value  # reset (a restart): counted from 0
            resets.add(key)
        else:
            d = s.value - prior
        deltas[key] = deltas.get(key, 0.0) + d
    out: dict[Key, Figure] = {}
    for k, v in sorted(last.items()):
        if k in deltas:
            d = deltas[k]
            out[k] = Figure(v, d, d / reading.seconds, k in resets)
        else:
            out[k] = Figure(v)
    return out


def _aggregate(samples: Iterable[Sample]) -> dict[Key, float]:
    sums: dict[Key, float] = {}
    for s in samples:
        if not is_read(s.name):
            continue
        name = canonical(s.name)
        key = (name, _kept(s.labels))
        if key not in sums:
            sums[key] = s.value
        elif _is_counter(name):
            sums[key] += s.value
        elif name in MIN_GAUGES:
            sums[key] = min(sums[key], s.value)
        else:
            sums[key] = max(sums[key], s.value)
    return sums


def ranks_of(exposition: Exposition) -> int:
    """Distinct (tp, dp, pp) rank label sets among the package's series."""
    seen = {
        tuple(s.label(r) for r in RANK_LABELS) for s in exposition.samples if is_package(s.name)
    }
    return len(seen)


# -- output --------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """A figure a finding rests on (or one it derived, ``series`` naming how)."""

    instance: str
    series: str
    value: float
    rate_per_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "series": self.series,
            "value": number(self.value),
            "rate_per_s": number(self.rate_per_s),
        }


@dataclass(frozen=True)
class Finding:
    id: str
    severity: Severity
    summary: str
    evidence: tuple[Evidence, ...]
    fix: tuple[str, ...]
    #: None: the fleet.
    instance: str | None = None
    pool: str | None = None
    #: L3 bytes this finding explains (written for nothing) and their rate.
    wasted_bytes: float | None = None
    wasted_bytes_per_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "instance": self.instance,
            "pool": self.pool,
            "summary": self.summary,
            "wasted_bytes": number(self.wasted_bytes),
            "wasted_bytes_per_s": number(self.wasted_bytes_per_s),
            "evidence": [e.as_dict() for e in self.evidence],
            "fix": list(self.fix),
        }


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
        return {
            "instance": self.instance,
            "seconds": number(self.seconds),
            "ranks": self.ranks,
            "pools": list(self.pools),
            "host_memory_mode": self.host_memory_mode,
            "write_policy": self.write_policy,
            "cache_mode_dedup": self.cache_mode_dedup,
            "resets": [key_text(k) for k, f in self.figures.items() if f.reset],
            "figures": {
                key_text(k): {
                    "value": number(f.value),
                    "delta": number(f.delta),
                    "rate_per_s": number(f.rate_per_s),
                }
                for k, f in self.figures.items()
            },
        }


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
            "findings": [f.as_dict() for f in self.findings],
        }


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
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


# -- one instance's view --------------------------------------------------------------


class View:
    """Read access to one instance's figures by name and label filter."""

    def __init__(self, instance: str, figures: Mapping[Key, Figure], seconds: float | None):
        self.instance = instance
        self.figures = figures
        self.seconds = seconds

    def _matching(self, name: str, labels: Mapping[str, str]) -> list[tuple[Key, Figure]]:
        return [
            (k, f)
            for k, f in self.figures.items()
            if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items())
        ]

    def has(self, name: str) -> bool:
        return any(k[0] == name for k in self.figures)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the matching figures (0 when none)."""
        return sum(f.value for _, f in self._matching(name, labels))

    def rate(self, name: str, **labels: str) -> float | None:
        """Sum of the matching figures' rates (None without two reads or a match)."""
        rates = [f.rate_per_s for _, f in self._matching(name, labels)]
        if not rates or any(r is None for r in rates):
            return None
        return sum(r for r in rates if r is not None)

    def delta(self, name: str, **labels: str) -> float | None:
        deltas = [f.delta for _, f in self._matching(name, labels)]
        if not deltas or any(d is None for d in deltas):
            return None
        return sum(d for d in deltas if d is not None)

    def values_by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """{label value: summed value} of the matching figures."""
        out: dict[str, float] = {}
        for k, f in self._matching(name, labels):
            v = dict(k[1]).get(label)
            if v is not None:
                out[v] = out.get(v, 0.0) + f.value
        return out

    def evidence(self, name: str, **labels: str) -> Evidence:
        """The figure ``name{labels}`` (summed over the labels not given)."""
        key = (name, tuple(sorted(labels.items())))
        return Evidence(
            self.instance, key_text(key), self.value(name, **labels), self.rate(name, **labels)
        )

    def pools(self) -> tuple[str, ...]:
        return tuple(
            sorted(
                {
                    dict(k[1])["pool"]
                    for k in self.figures
                    if is_package(k[0]) and "pool" in dict(k[1])
                }
            )
        )

    def mode(self) -> tuple[str | None, str | None, bool | None]:
        """(host_memory_mode, write_policy, cache_mode_dedup) from ``mode_info``."""
        for k, f in self.figures.items():
            if k[0] == MODE_INFO and f.value >= 1:
                labels = dict(k[1])
                dedup = labels.get("cache_mode_dedup")
                return (
                    labels.get("host_memory_mode"),
                    labels.get("write_policy"),
                    # "upstream": sglang deduplicates itself (the package only counts).
                    None if dedup is None else dedup in ("true", "upstream"),
                )
        return None, None, None

    def bytes_per_page(self, pool: str) -> float | None:
        """This instance's bytes per written page of ``pool``, summed over ranks as
        the byte counters are (None before anything was written)."""
        for pages, nbytes in ((WRITTEN, WRITTEN_BYTES), (ACKNOWLEDGED, ACKNOWLEDGED_BYTES)):
            n = self.value(pages, pool=pool)
            if n > 0:
                return self.value(nbytes, pool=pool) / n
        return None


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.3g}"


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- findings ------------------------------------------------------------------------

#: What to do about redundant writes of each cause (an unknown cause is reported as is).
CAUSE_FIXES: dict[str, str] = {
    "recompute": (
        "stored pages left host and device memory and were computed and written again: give "
        "host memory more room (`--hicache-ratio` or `--hicache-size`); in cache mode "
        "`cache_mode.dedup=true` skips the rewrite"
    ),
    "below_prefetch_threshold": (
        "stored prefixes shorter than the prefetch threshold were recomputed and written again: "
        "lower the threshold, e.g. `--hicache-storage-backend-extra-config "
        "'{\"prefetch_threshold\": 64}'` (SGLang's default is 256 tokens)"
    ),
    "prefetch_shortfall": (
        "prefetches stopped short (a deadline, a failed transfer, no host memory for them) "
        "and the rest was written again: more host memory (`--hicache-ratio`), raise "
        "`prefetch_timeout_base` / `prefetch_timeout_per_ki_token` in "
        "`--hicache-storage-backend-extra-config`, or `--hicache-storage-prefetch-policy "
        "wait_complete`"
    ),
    "host_copy_reclaimed": (
        "under `write_back`, host pressure reclaimed the host copy of a node also on the "
        "device, and its next eviction backed it up again: "
        "`SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1` in the server's environment keeps "
        "those copies; in cache mode `cache_mode.dedup=true` skips the rewrite"
    ),
    "other_instance": (
        "pages another instance had stored (no local record): route requests by prefix "
        "(the router's `cache_aware` policy), see the fleet view"
    ),
    "believed_node": (
        "buffer mode writes a node whole when any of its pages is new (SGLang's write rule; "
        "no setting removes it)"
    ),
    "unclassified": (
        "the pool has no miss-reason memory, so a page not believed now cannot be told "
        "`recompute` or `other_instance`: `miss_reasons.enabled=true`"
    ),
}


#: ``recompute`` outside cache mode: buffer mode keeps no host copy, so a page this
#: instance stored is written again when its belief was dropped (the cap, a heal).
RECOMPUTE_BUFFER_FIX = (
    "pages this instance had stored, computed again after its belief was dropped (mostly by "
    "the cap): see cap_too_small (`cache.max_entries`)"
)


def cause_fix(cause: str, mode: str | None) -> str:
    """What to do about redundant writes of ``cause`` in host memory ``mode``."""
    if cause == "recompute" and mode != "cache":
        return RECOMPUTE_BUFFER_FIX
    return CAUSE_FIXES.get(cause, "a cause this doctor does not know")


def _redundant(view: View, pool: str, mode: str | None, dedup: bool | None) -> list[Finding]:
    r = view.value(REDUNDANT, pool=pool)
    if r <= 0:
        return []
    w = view.value(WRITTEN, pool=pool)
    rb = view.value(REDUNDANT_BYTES, pool=pool)
    share = _ratio(r, w)
    # In cache mode without dedup the pages dedup would have saved (believed when
    # written) are cache_mode_without_dedup's, a ticket as its alert: only the rest
    # can make this a warning, or installing cache mode would page.
    counted = r
    if mode == "cache" and dedup is False:
        counted = max(0.0, r - view.value(REDUNDANT_BELIEVED, pool=pool))
    high = _ratio(counted, w) > REDUNDANT_RATIO and w >= MIN_WRITTEN_PAGES
    evidence = [
        view.evidence(REDUNDANT, pool=pool),
        view.evidence(REDUNDANT_BYTES, pool=pool),
        view.evidence(WRITTEN, pool=pool),
        view.evidence(REDUNDANT_BELIEVED, pool=pool),
    ]
    causes = view.values_by(REDUNDANT_CAUSE, "cause", pool=pool)
    fixes: list[str] = []
    cause_text = ""
    if causes:
        ranked = sorted(((n, c) for c, n in causes.items() if n > 0), reverse=True)
        evidence += [view.evidence(REDUNDANT_CAUSE, pool=pool, cause=c) for _, c in ranked]
        cause_text = "; by cause: " + ", ".join(f"{c} {_n(n)}" for n, c in ranked)
        fixes += [f"{c} ({_n(n)} pages): {cause_fix(c, mode)}" for n, c in ranked]
    else:
        believed = view.value(REDUNDANT_BELIEVED, pool=pool)
        misses = view.values_by(PAGE_MISSES, "reason", pool=pool)
        evidence += [
            view.evidence(PAGE_MISSES, pool=pool, reason=m) for m in sorted(misses) if misses[m] > 0
        ]
        if believed > 0:
            cause_text = f"; {_n(believed)} were believed stored (their node was written whole)"
            fixes.append(f"believed pages ({_n(believed)}): {CAUSE_FIXES['believed_node']}")
        if misses.get("evicted", 0) > 0:
            fixes.append(
                "pages whose belief the cap evicted: see cap_too_small (`cache.max_entries`)"
            )
        if misses.get("cold", 0) > 0 and r > believed:
            fixes.append(
                "pages this instance did not believe (`cold`: written by another instance or "
                "before a restart, or evicted longer ago than the miss-reason memory remembers): "
                "route by prefix (the router's `cache_aware` policy); see cap_too_small if the "
                "pool is full"
            )
    if mode == "cache" and dedup is False:
        fixes.append(
            "cache mode without dedup: `cache_mode.dedup=true` (see cache_mode_without_dedup)"
        )
    summary = (
        f"{pool}: {_n(r)} of {_n(w)} written pages ({_pct(share)}) were already in L3, "
        f"{human_bytes(rb)} written twice{cause_text}"
    )
    return [
        Finding(
            "redundant_writes",
            "warning" if high else "info",
            summary,
            tuple(evidence),
            tuple(fixes) or ("see docs/doctor.md, redundant_writes",),
            view.instance,
            pool,
            rb,
            view.rate(REDUNDANT_BYTES, pool=pool),
        )
    ]


def _dedup_off(view: View, pool: str, mode: str | None, dedup: bool | None) -> list[Finding]:
    if mode != "cache" or dedup is not False:
        return []
    r = view.value(REDUNDANT, pool=pool)
    w = view.value(WRITTEN, pool=pool)
    share = _ratio(r, w)
    if not (share > CACHE_MODE_REDUNDANT_RATIO and w >= MIN_WRITTEN_PAGES):
        return []
    saved = view.value(REDUNDANT_BELIEVED, pool=pool)
    per_page = _ratio(view.value(REDUNDANT_BYTES, pool=pool), r)
    rate = view.rate(REDUNDANT_BELIEVED, pool=pool)
    return [
        Finding(
            "cache_mode_without_dedup",
            alert_severity("cache_mode_without_dedup", "HicacheExistenceCacheModeRedundantWrites"),
            f"{pool}: cache mode writes {_pct(share)} of its L3 pages twice and dedup is off; "
            f"dedup would have saved {_n(saved)} pages ({human_bytes(saved * per_page)})",
            (
                Evidence(view.instance, key_text((MODE_INFO, _mode_labels(view))), 1.0),
                view.evidence(REDUNDANT, pool=pool),
                view.evidence(WRITTEN, pool=pool),
                view.evidence(REDUNDANT_BELIEVED, pool=pool),
            ),
            (
                "turn dedup on: `cache_mode.dedup=true` (`HICACHE_EXISTENCE_CACHE_MODE__DEDUP=1`, "
                "or in the `--hicache-existence-config` JSON) and restart the server",
            ),
            view.instance,
            pool,
            saved * per_page,
            None if rate is None else rate * per_page,
        )
    ]


def _mode_labels(view: View) -> Labels:
    for k, f in view.figures.items():
        if k[0] == MODE_INFO and f.value >= 1:
            return k[1]
    return ()


def advisor_curve(view: View, pool: str) -> dict[float, float]:
    """{cap multiplier: estimated lookup hit ratio} (the largest over ranks)."""
    out: dict[float, float] = {}
    for m, v in view.values_by(ADVISOR_LOOKUP, "cap_multiplier", pool=pool).items():
        try:
            multiplier = float(m)
        except ValueError:
            continue
        if math.isfinite(multiplier) and multiplier > 0 and math.isfinite(v):
            out[multiplier] = v
    return out


def miss_memory_fraction(view: View, pool: str) -> float | None:
    """The miss-reason memory's size over the beliefs' (``miss_reasons.memory_fraction``
    as configured, measured), None without the memory gauges."""
    miss = view.value(MISS_MEMORY, pool=pool)
    beliefs = view.value(MEMORY, pool=pool) - miss
    if not view.has(MISS_MEMORY) or beliefs <= 0:
        return None
    return miss / beliefs


def stored_pages(view: View, pool: str) -> float:
    """Distinct pages this instance stored in L3: its written pages that L3 did not
    hold yet and that it acknowledged (each new page counts once)."""
    written = view.value(WRITTEN, pool=pool)
    return max(
        0.0,
        written - view.value(REDUNDANT, pool=pool) - view.value(FAILED, pool=pool),
    )


def cap_covering(pages: float) -> int:
    """The smallest power of two of at least ``pages`` entries."""
    if not (math.isfinite(pages) and pages >= 0):
        raise ValueError(f"pages must be a finite number >= 0, got {pages!r}")
    return 1 << max(0, math.ceil(pages) - 1).bit_length()


def recommended_multiple(curve: Mapping[float, float]) -> float | None:
    """The smallest multiple whose estimate is within ``ADVICE_TOLERANCE`` of the best."""
    if not curve:
        return None
    best = max(curve.values())
    return min(m for m, v in curve.items() if v >= best - ADVICE_TOLERANCE)


def _cap(view: View, pool: str) -> list[Finding]:
    evicted = view.value(PAGE_MISSES, pool=pool, reason="evicted")
    evictions = view.value(EVICTIONS, pool=pool)
    q = view.value(QUERIES, pool=pool)
    cap = view.value(CAPACITY, pool=pool)
    entries = view.value(ENTRIES, pool=pool)
    r = view.value(REDUNDANT, pool=pool)
    w = view.value(WRITTEN, pool=pool)
    at_cap = cap > 0 and entries >= AT_CAP * cap
    # Redundant pages not believed at their launch: the cap's share of them is at
    # most this (the rest: another instance, heals, clears).
    not_believed = max(0.0, r - view.value(REDUNDANT_BELIEVED, pool=pool))
    if evicted <= 0 and not (at_cap and evictions > 0 and not_believed > 0):
        return []
    churn = _ratio(evicted, q)
    evidence = [
        view.evidence(PAGE_MISSES, pool=pool, reason="evicted"),
        view.evidence(PAGE_MISSES, pool=pool, reason="cold"),
        view.evidence(QUERIES, pool=pool),
        view.evidence(EVICTIONS, pool=pool),
        view.evidence(ENTRIES, pool=pool),
        view.evidence(CAPACITY, pool=pool),
        view.evidence(REDUNDANT, pool=pool),
        view.evidence(REDUNDANT_BELIEVED, pool=pool),
        view.evidence(WRITTEN, pool=pool),
    ]
    curve = advisor_curve(view, pool)
    multiple = recommended_multiple(curve)
    fixes: list[str] = []
    flat = False
    if curve:
        evidence += [
            view.evidence(ADVISOR_LOOKUP, pool=pool, cap_multiplier=m)
            for m in sorted(view.values_by(ADVISOR_LOOKUP, "cap_multiplier", pool=pool), key=float)
        ]
    # The advisor's curve ends at its largest multiple: below what the pool stored it
    # cannot tell a flat curve from a working set beyond its range.
    stored = stored_pages(view, pool)
    top = max(curve) * cap if curve else 0.0
    beyond = (
        multiple is not None
        and cap > 0
        and stored > top
        and (multiple <= 1 or multiple == max(curve))
    )
    if beyond:
        covering = cap_covering(stored)
        evidence.append(
            Evidence(view.instance, "distinct pages stored (written - redundant - failed)", stored)
        )
        fixes.append(
            f"`cache.max_entries={covering}` (`HICACHE_EXISTENCE_CACHE__MAX_ENTRIES={covering}`)"
            f": this instance stored {_n(stored)} distinct pages, more than the advisor's "
            f"largest cap ({max(curve):g}x = {_n(top)} entries), so its curve says nothing "
            f"about a cap that holds them; a cap of {covering} covers them (about 40 B per "
            "entry per rank), then read the curve again"
        )
    elif multiple is not None and multiple > 1 and cap > 0:
        here = curve.get(1.0)
        now = "" if here is None else f" from {here:.3f}"
        fixes.append(
            f"`cache.max_entries={int(cap * multiple)}` ({multiple:g}x the cap): the advisor "
            f"estimates the lookup hit ratio rises{now} to {curve[multiple]:.3f} "
            f"(`HICACHE_EXISTENCE_CACHE__MAX_ENTRIES={int(cap * multiple)}`); about 40 B per "
            "entry per rank"
        )
    elif multiple is not None:
        flat = True
        fixes.append(
            "the advisor's curve is flat: a larger cap would not raise the hit ratio on this "
            "traffic; leave `cache.max_entries` as it is"
        )
    elif cap > 0:
        fixes.append(
            f"`cache.max_entries={int(cap * 2)}` (twice the cap), then read the advisor's "
            "curve (`advisor.enabled=true`) to size it"
        )
    cold = view.value(PAGE_MISSES, pool=pool, reason="cold")
    fraction = miss_memory_fraction(view, pool)
    if at_cap and cold > evicted and fraction is not None and fraction < 0.5:
        fixes.append(
            "cold misses at a full cap may be evictions older than the miss-reason memory "
            f"remembers (it is {_pct(fraction)} of the cache's memory): "
            f"`miss_reasons.memory_fraction={min(1.0, max(0.2, 2 * fraction)):.2g}` "
            "classifies more of them"
        )
    churn_high = churn > CHURN_RATIO and q >= MIN_QUERIES
    # As HicacheExistenceAtCapRedundantWritesRising: full, and writing pages twice.
    redundant_high = at_cap and _ratio(r, w) > REDUNDANT_RATIO and w >= MIN_WRITTEN_PAGES
    severity: Severity = "info"
    if churn_high and not flat:
        severity = alert_severity("cap_too_small", "HicacheExistenceEvictionChurn")
    if redundant_high and not flat:
        severity = _worst(
            severity,
            alert_severity("cap_too_small", "HicacheExistenceAtCapRedundantWritesRising"),
        )
    if beyond:
        severity = _worst(severity, "warning")
    per_page = _ratio(view.value(REDUNDANT_BYTES, pool=pool), r)
    wasted = not_believed * per_page if per_page else None
    full = f", full ({_n(entries)} of {_n(cap)} entries)" if at_cap else ""
    summary = (
        f"{pool}: {_n(evicted)} lookups ({_pct(churn)} of {_n(q)}) missed a page the cap had "
        f"evicted while L3 kept it; {_n(evictions)} evictions{full}"
    )
    if at_cap and r > 0:
        summary += f"; {_n(r)} of {_n(w)} written pages ({_pct(_ratio(r, w))}) were already in L3"
    if wasted is not None:
        summary += f"; at most {human_bytes(wasted)} rewritten for it"
    return [
        Finding(
            "cap_too_small",
            severity,
            summary,
            tuple(evidence),
            tuple(fixes),
            view.instance,
            pool,
            wasted,
            None,
        )
    ]


def _l3_read_back(view: View, bytes_per_token: float | None) -> list[Finding]:
    written = view.value(SGLANG_BACKUPED)
    if written <= 0:
        return []
    read = view.value(SGLANG_PREFETCHED)
    hit = view.value(SGLANG_PREFETCH_HIT)
    share = _ratio(read, written)
    if share >= READ_BACK_RATIO:
        return []
    never = read <= 0 and hit <= 0
    severity: Severity = "warning" if never and written >= MIN_L3_TOKENS else "info"
    unfulfilled = view.values_by(SGLANG_UNFULFILLED, "reason")
    evidence = [
        view.evidence(SGLANG_BACKUPED),
        view.evidence(SGLANG_PREFETCHED),
        view.evidence(SGLANG_PREFETCH_HIT),
    ]
    ranked = sorted(((n, r) for r, n in unfulfilled.items() if n > 0), reverse=True)
    evidence += [view.evidence(SGLANG_UNFULFILLED, reason=r) for _, r in ranked]
    fixes: list[str] = []
    if ranked and ranked[0][1] == "below_threshold":
        fixes.append(
            "L3 holds the prefixes but they are shorter than the prefetch threshold: lower it, "
            "e.g. `--hicache-storage-backend-extra-config '{\"prefetch_threshold\": 64}'`"
        )
    elif ranked and ranked[0][1] in ("deadline", "storage_transfer"):
        fixes.append(
            "prefetches run out of time or fail: raise `prefetch_timeout_base` in "
            "`--hicache-storage-backend-extra-config`, or `--hicache-storage-prefetch-policy "
            "wait_complete`"
        )
    fixes.append(
        "if the traffic does not come back to its prefixes after they leave device and host "
        "memory, L3 costs writes for nothing: `--hicache-write-policy write_through_selective` "
        "writes only prefixes that are hit again"
    )
    wasted = None if bytes_per_token is None else (written - read) * bytes_per_token
    rate = view.rate(SGLANG_BACKUPED)
    rate_read = view.rate(SGLANG_PREFETCHED)
    wasted_rate = None
    if bytes_per_token is not None and rate is not None and rate_read is not None:
        wasted_rate = max(0.0, rate - rate_read) * bytes_per_token
    return [
        Finding(
            "l3_not_read_back",
            severity,
            f"L3 was written {_n(written)} tokens and read back "
            + (
                "none (no prefetch hit either)"
                if never
                else f"{_n(read)} ({_pct(share)}; {_n(hit)} tokens hit in L3 queries)"
            ),
            tuple(evidence),
            tuple(fixes),
            view.instance,
            None,
            wasted,
            wasted_rate,
        )
    ]


def _stale(view: View, pool: str) -> list[Finding]:
    stale = view.value(STALE_POSITIVES, pool=pool)
    if stale > 0:
        answered = sum(view.value(RECONCILER_QUERIES, pool=pool, result=r) for r in ANSWERED)
        share = _ratio(stale, answered)
        high = share > STALE_RATIO and answered >= MIN_ANSWERED
        return [
            Finding(
                "stale_beliefs",
                alert_severity("stale_beliefs", "HicacheExistenceStalePositivesHigh")
                if high
                else "info",
                f"{pool}: {_n(stale)} of {_n(answered)} answered verifications ({_pct(share)}) "
                f"found believed pages missing from L3; "
                f"{_n(view.value(RECONCILER_INVALIDATED, pool=pool))} beliefs removed",
                (
                    view.evidence(STALE_POSITIVES, pool=pool),
                    *(view.evidence(RECONCILER_QUERIES, pool=pool, result=r) for r in ANSWERED),
                    view.evidence(RECONCILER_INVALIDATED, pool=pool),
                    view.evidence(PAGE_MISSES, pool=pool, reason="invalidated"),
                ),
                (
                    "L3 dropped pages the beliefs still hold (its capacity or retention, a "
                    "restart, or pages deleted): give L3 room, or keep `cache.max_entries` at "
                    "most what L3 retains; set `reconciler.ttl_s` to L3's retention",
                    "the reconciler heals what it samples; a higher `reconciler.sampling_rate` "
                    "finds them sooner",
                ),
                view.instance,
                pool,
                None,
                None,
            )
        ]
    if view.has(RECONCILER_QUERIES):
        return []
    healed = view.value(INVALIDATIONS, pool=pool)
    if healed <= 0:
        return []
    return [
        Finding(
            "stale_beliefs",
            "info",
            f"{pool}: {_n(healed)} beliefs were dropped by heals after prefetch shortfalls "
            "(L3 lacked pages believed stored); no reconciler looks for the others",
            (
                view.evidence(INVALIDATIONS, pool=pool),
                view.evidence(PAGE_MISSES, pool=pool, reason="invalidated"),
            ),
            (
                "turn the reconciler on to find stale beliefs before a prefetch trips on them: "
                "`reconciler.enabled=true` with `reconciler.redis_url` (docs/reconciler.md)",
            ),
            view.instance,
            pool,
            None,
            None,
        )
    ]


def _reconciler_health(view: View) -> list[Finding]:
    if not view.has(RECONCILER_QUERIES) and not view.has(CIRCUIT_OPEN):
        return []
    failed = sum(view.value(RECONCILER_QUERIES, result=r) for r in FAILED_RESULTS)
    answered = sum(view.value(RECONCILER_QUERIES, result=r) for r in ANSWERED)
    errors = view.values_by(RECONCILER_ERRORS, "kind")
    open_ = view.value(CIRCUIT_OPEN) >= 1
    d_failed = [view.delta(RECONCILER_QUERIES, result=r) for r in FAILED_RESULTS]
    d_answered = [view.delta(RECONCILER_QUERIES, result=r) for r in ANSWERED]
    two_reads = view.seconds is not None
    if two_reads and view.has(RECONCILER_QUERIES):
        down = sum(d or 0.0 for d in d_failed) > 0 and sum(d or 0.0 for d in d_answered) == 0
    else:
        down = failed > 0 and answered == 0
    total_errors = sum(errors.values())
    if not (open_ or down or failed > 0 or total_errors > 0):
        return []
    severity: Severity = "info"
    if open_:
        severity = alert_severity("reconciler_unhealthy", "HicacheExistenceReconcilerCircuitOpen")
    if down:
        severity = _worst(
            severity, alert_severity("reconciler_unhealthy", "HicacheExistenceReconcilerDown")
        )
    kinds = ", ".join(f"{k} {_n(n)}" for k, n in sorted(errors.items()) if n > 0) or "none"
    state = "circuit breaker open" if open_ else ("no answers" if down else "answering")
    evidence = [
        view.evidence(CIRCUIT_OPEN),
        *(view.evidence(RECONCILER_QUERIES, result=r) for r in (*FAILED_RESULTS, *ANSWERED)),
        *(view.evidence(RECONCILER_ERRORS, kind=k) for k in sorted(errors) if errors[k] > 0),
    ]
    return [
        Finding(
            "reconciler_unhealthy",
            severity,
            f"reconciler: {state}; {_n(failed)} verifications failed and {_n(answered)} were "
            f"answered; errors by kind: {kinds}",
            tuple(evidence),
            (
                "restore ground truth: the Redis at `reconciler.redis_url` must answer PING "
                "from the prefill hosts; the breaker closes by itself after a probe (at most "
                "`reconciler.breaker_backoff_max_s` later)",
                "timeouts only: raise `reconciler.timeout_ms` or lower "
                "`reconciler.verifications_per_s`",
            ),
            view.instance,
            None,
            None,
            None,
        )
    ]


def _divergence(view: View) -> list[Finding]:
    out: list[Finding] = []
    diverged = view.value(DIVERGENCES)
    if diverged > 0:
        out.append(
            Finding(
                "tp_divergence",
                alert_severity("tp_divergence", "HicacheExistenceTPDivergence"),
                f"{_n(diverged)} checks found TP replicas of the beliefs differing "
                f"({_n(view.value(DIVERGENCE_HEALS))} heals)",
                (
                    view.evidence(DIVERGENCES),
                    view.evidence(DIVERGENCE_HEALS),
                    view.evidence(DIVERGENCE_CHECKS),
                ),
                (
                    "with `divergence.policy=heal` the pools are cleared on every rank at "
                    "once; with `log`, drain and restart the server (every rank)",
                    "keep every rank's logs around the step of "
                    "`hicache_existence.replicas.divergence.detected` and report it with the "
                    "versions (docs/tp-divergence.md)",
                ),
                view.instance,
            )
        )
    failures = view.values_by(DIVERGENCE_FAILURES, "reason")
    mismatches = view.value(DIVERGENCE_MISMATCHES)
    stopped = view.has(DIVERGENCE_ACTIVE) and view.value(DIVERGENCE_ACTIVE) < 1
    if mismatches > 0 or sum(failures.values()) > 0 or stopped:
        fixes = []
        if mismatches > 0:
            fixes.append(
                "ranks run different `divergence.*` settings: make every rank's configuration "
                "identical and restart the server"
            )
        if failures.get("timeout", 0) > 0:
            fixes.append(
                "a peer did not arrive in time: find the slow rank, or raise "
                "`divergence.timeout_s`; restart the server to resume checks"
            )
        if failures.get("error", 0) > 0 or not fixes:
            fixes.append("restart the server (every rank) to resume checks")
        out.append(
            Finding(
                "tp_checks_stopped",
                alert_severity("tp_checks_stopped", "HicacheExistenceTPChecksStopped"),
                "TP divergence checks stopped on at least one rank "
                f"({_n(sum(failures.values()))} failed checks, {_n(mismatches)} config "
                "mismatches): a divergence would go unnoticed",
                (
                    view.evidence(DIVERGENCE_ACTIVE),
                    *(view.evidence(DIVERGENCE_FAILURES, reason=r) for r in sorted(failures)),
                    view.evidence(DIVERGENCE_MISMATCHES),
                ),
                tuple(fixes),
                view.instance,
            )
        )
    return out


def _liveness(view: View, mode: str | None, dedup: bool | None) -> list[Finding]:
    package = any(is_package(k[0]) for k in view.figures)
    backuped = view.value(SGLANG_BACKUPED)
    if not package:
        return [
            Finding(
                "plugin_not_loaded",
                "warning",
                "SGLang reports L3 storage activity but exports no hicache_existence_* series: "
                "the package is not enabled on this server",
                (view.evidence(SGLANG_BACKUPED), view.evidence(SGLANG_PREFETCH_HIT)),
                (
                    "install the package in the server's environment (a wheel built from the "
                    "checkout: docs/enable.md, section 1) and start "
                    "SGLang with `--enable-hicache-existence` (and `--enable-metrics`, so its "
                    "series are on this endpoint); docs/enable.md",
                ),
                view.instance,
            )
        ]
    out: list[Finding] = []
    queries = view.value(QUERIES)
    expects_queries = mode != "cache" or dedup is True
    active = backuped > 0 or view.value(WRITTEN) > 0 or view.value(PAGE_INSERTS) > 0
    if expects_queries and queries == 0 and active:
        out.append(
            Finding(
                "plugin_not_live",
                "warning",
                "the existence cache is never consulted: 0 lookups while L3 is written "
                f"({_n(backuped)} tokens by SGLang's count)",
                (
                    view.evidence(QUERIES),
                    view.evidence(PAGE_INSERTS),
                    view.evidence(WRITTEN),
                    view.evidence(SGLANG_BACKUPED),
                ),
                (
                    "the plugin's cache hooks did not take: look for the `hicache_existence."
                    "startup` event and plugin warnings in the scheduler log, and check that "
                    "SGLang is 0.5.19-0.5.23 (docs/enable.md)",
                ),
                view.instance,
            )
        )
    if backuped > 0 and view.value(WRITTEN) == 0 and view.value(ACKNOWLEDGED) == 0:
        out.append(
            Finding(
                "write_accounting_not_fed",
                "warning",
                f"SGLang wrote {_n(backuped)} tokens to L3 but the package's write counters "
                "are absent or 0: the write-path hooks are missing, so redundant writes go "
                "uncounted",
                (
                    view.evidence(SGLANG_BACKUPED),
                    view.evidence(WRITTEN),
                    view.evidence(ACKNOWLEDGED),
                ),
                (
                    "look for the plugin's warning naming the missing write-path target (\"... "
                    'write counters ... are off") or "write accounting hooks not registered" in '
                    "the server log; run a SGLang version the package supports (docs/enable.md) "
                    "and a package version that accounts this host memory mode"
                    + (f" ({mode})" if mode else ""),
                ),
                view.instance,
            )
        )
    return out


def _write_failures(view: View, pool: str) -> list[Finding]:
    failed = view.value(FAILED, pool=pool)
    if failed <= 0:
        return []
    w = view.value(WRITTEN, pool=pool)
    share = _ratio(failed, w)
    high = share > FAILED_RATIO and w >= MIN_WRITTEN_PAGES
    return [
        Finding(
            "write_failures",
            "warning" if high else "info",
            f"{pool}: L3 did not store {_n(failed)} of {_n(w)} written pages ({_pct(share)})",
            (
                view.evidence(FAILED, pool=pool),
                view.evidence(FAILED_BYTES, pool=pool),
                view.evidence(WRITTEN, pool=pool),
            ),
            (
                "the L3 backend rejected or failed writes: check its capacity and errors "
                "(SGLang's log around the backups, the `storage_backend` label names it)",
            ),
            view.instance,
            pool,
            view.value(FAILED_BYTES, pool=pool),
            view.rate(FAILED_BYTES, pool=pool),
        )
    ]


def _fleet(views: Sequence[View]) -> list[Finding]:
    if len(views) < 2:
        return []
    written = {v.instance: v.value(WRITTEN) for v in views}
    redundant = {v.instance: v.value(REDUNDANT) for v in views}
    total_w, total_r = sum(written.values()), sum(redundant.values())
    share = _ratio(total_r, total_w)
    writers = sum(1 for w in written.values() if w > 0)
    # What the routing costs, per instance.  Below its cap (no eviction) a cache
    # forgets nothing it stored, so its redundant pages that were not believed when
    # written came from elsewhere: another instance (or a previous process).  At
    # its cap that cannot be told apart from its own forgotten pages: there only
    # the cause series' other_instance pages count, an estimate both ways: a page
    # another instance stored may be classified below_prefetch_threshold or
    # prefetch_shortfall first (missed), and an own page whose eviction the
    # miss-reason memory forgot is other_instance too (over-counted).
    cost_bytes = 0.0
    cost_rate: float | None = 0.0
    evidence: list[Evidence] = []
    methods: set[str] = set()
    for v in views:
        per_page = _ratio(v.value(REDUNDANT_BYTES), v.value(REDUNDANT))
        rate: float | None = 0.0
        evidence += [
            v.evidence(WRITTEN),
            v.evidence(REDUNDANT),
            v.evidence(REDUNDANT_BELIEVED),
            v.evidence(EVICTIONS),
        ]
        if v.value(EVICTIONS) == 0:
            methods.add("not believed below the cap")
            pages = max(0.0, v.value(REDUNDANT) - v.value(REDUNDANT_BELIEVED))
            r_rate, b_rate = v.rate(REDUNDANT), v.rate(REDUNDANT_BELIEVED)
            rate = None if r_rate is None or b_rate is None else max(0.0, r_rate - b_rate)
        elif v.has(REDUNDANT_CAUSE):
            methods.add("other_instance at the cap")
            pages = v.value(REDUNDANT_CAUSE, cause="other_instance")
            rate = v.rate(REDUNDANT_CAUSE, cause="other_instance")
            evidence.append(v.evidence(REDUNDANT_CAUSE, cause="other_instance"))
        else:
            methods.add("none counted at the cap without the cause series")
            pages = 0.0
        cost_bytes += pages * per_page
        cost_rate = None if cost_rate is None or rate is None else cost_rate + rate * per_page
        evidence.append(
            Evidence(
                v.instance,
                "share of the fleet's redundant pages",
                _ratio(redundant[v.instance], total_r),
            )
        )
    high = share > FLEET_REDUNDANT_RATIO and total_w >= MIN_WRITTEN_PAGES and writers > 1
    shares = ", ".join(
        f"{name} {_pct(_ratio(redundant[name], total_r))}" for name in sorted(redundant)
    )
    fixes = [
        "route by prefix: the router's `cache_aware` policy (`--prefill-policy cache_aware` "
        "in PD, `--policy cache_aware` otherwise; `PREFILL_POLICY` in "
        "integrations/sglang/router.sh) keeps a conversation on the instance that holds it",
        "estimate a policy on your own traffic offline: `hicache-existence replay TRACE "
        "--fleet N --router both` (docs/replay.md); the reconciler's ledger learning does not "
        "remove these writes",
    ]
    n = len(views)
    lopsided = [
        name for name in redundant if total_r > 0 and redundant[name] / total_r > min(0.9, 2 / n)
    ]
    if lopsided:
        fixes.append(
            f"{', '.join(sorted(lopsided))} writes far more than 1/{n} of the redundant pages: "
            "its beliefs were emptied (a restart, /flush_cache) or its cap is smaller"
        )
    how = "; ".join(sorted(methods))
    return [
        Finding(
            "fleet_redundant_writes",
            alert_severity("fleet_redundant_writes", "HicacheExistenceFleetRedundantWrites")
            if high
            else "info",
            f"fleet of {n}: {_n(total_r)} of {_n(total_w)} written pages ({_pct(share)}) were "
            f"already in L3; share of the redundant pages: {shares}; the routing costs "
            f"{human_bytes(cost_bytes)} ({how})",
            tuple(evidence),
            tuple(fixes),
            None,
            None,
            cost_bytes,
            cost_rate,
        )
    ]


def _bytes_per_token(view: View) -> float | None:
    """L3 bytes per token this instance writes: the package's acknowledged bytes over
    SGLang's backed-up tokens, counted at the same storage ack (docs/metrics.md)."""
    tokens = view.value(SGLANG_BACKUPED)
    acked = view.value(ACKNOWLEDGED_BYTES) + view.value(FAILED_BYTES)
    if tokens > 0 and acked > 0:
        return acked / tokens
    return None


def diagnose(readings: Sequence[Reading], source: Mapping[str, Any] | None = None) -> Report:
    """Figures and ranked findings for these instances."""
    if not readings:
        raise ValueError("readings must not be empty")
    names = [r.instance for r in readings]
    if len(set(names)) != len(names):
        raise ValueError(f"instances must be distinct, got {names}")
    instances: list[InstanceReport] = []
    views: list[View] = []
    findings: list[Finding] = []
    for reading in readings:
        figures = figures_of(reading)
        view = View(reading.instance, figures, reading.seconds if reading.first else None)
        views.append(view)
        mode, policy, dedup = view.mode()
        pools = view.pools()
        instances.append(
            InstanceReport(
                reading.instance,
                view.seconds,
                ranks_of(reading.last),
                pools,
                mode,
                policy,
                dedup,
                figures,
            )
        )
        findings += _liveness(view, mode, dedup)
        findings += _divergence(view)
        findings += _reconciler_health(view)
        findings += _l3_read_back(view, _bytes_per_token(view))
        for pool in pools:
            findings += _redundant(view, pool, mode, dedup)
            findings += _dedup_off(view, pool, mode, dedup)
            findings += _cap(view, pool)
            findings += _stale(view, pool)
            findings += _write_failures(view, pool)
    findings += _fleet(views)
    return Report(dict(source or {}), tuple(instances), tuple(rank(findings)))


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
