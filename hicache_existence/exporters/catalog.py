"""Every exported metric, once: name, type, help, labels, unit and source.

The standalone Prometheus collector, the multiprocess feeder, the OpenTelemetry
instruments, ``docs/metrics.md`` and the dashboards all read this table, so a
metric cannot be exported under two names or documented differently from what
is exported (``tests/test_catalog.py`` keeps the doc equal to it).

Conventions (Prometheus naming): one prefix ``hicache_existence_``, base units
(``_bytes``), counters exposed with ``_total``; ratios are left to PromQL.
Every series carries the deployment labels (``DeploymentLabels``) and ``pool``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import partial
from typing import Literal, get_args

from hicache_existence.config import redact_url
from hicache_existence.core import _validate
from hicache_existence.core.stats import MISS_REASONS, PoolStats

PREFIX = "hicache_existence_"

#: Label values of ``page_misses``: the classified reasons, plus ``unclassified``
#: for pools without miss-reason memory (so the reasons always sum to the misses).
MISS_REASON_LABELS: tuple[str, ...] = (*MISS_REASONS, "unclassified")

#: The label of pools beyond ``metrics.max_pools``.
OTHER_POOL = "other"

#: Deployment labels, in label order (SGLang's own metric labels).
DEPLOYMENT_LABELS: tuple[str, ...] = (
    "model_name",
    "engine_type",
    "tp_rank",
    "dp_rank",
    "pp_rank",
    "storage_backend",
)

#: Gauges are per-process values told apart by the rank labels; ``mostrecent``
#: keeps one series per label set (no ``pid`` label) and lets a restarted rank's
#: fresh value replace its dead predecessor's.  See docs/metrics.md.
GAUGE_MULTIPROCESS_MODE: Literal["mostrecent"] = "mostrecent"

Kind = Literal["counter", "gauge", "histogram"]
#: The optional features, each the first word of its families' names.
FeatureSource = Literal["mode", "divergence", "reconciler", "advisor", "recorder", "events"]
Source = Literal["cache", "writes", "memory"] | FeatureSource

_MAX_LABEL_VALUE = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _unit(name: str) -> str:
    """The Prometheus unit a family's name ends in (only base units)."""
    return "seconds" if name.endswith("_seconds") else "bytes" if name.endswith("_bytes") else ""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family, of the cache or of an optional feature."""

    #: Family name without the ``_total`` suffix of counters.
    name: str
    kind: Kind
    help: str
    #: Prometheus unit (a name suffix; only base units) or "".
    unit: str
    #: What it is read from: a ``PoolStats`` field (``cache``), a
    #: ``PoolWriteStats`` attribute (``writes``), the memory estimate, or a
    #: feature's snapshot.
    source: Source
    #: The field or attribute read (for a feature, or the value
    #: ``exporters/features.py`` derives under that key), so the family's name
    #: is written here only.
    field: str
    #: OpenTelemetry unit (UCUM; curly braces for counted things).
    otel_unit: str
    #: Labels after the deployment labels: ``pool`` first where present (every
    #: cache family; bounded by ``metrics.max_pools``), then the others.
    labels: tuple[str, ...] = ()

    @property
    def exposed_name(self) -> str:
        """The sample name on ``/metrics``."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def extra_labels(self) -> tuple[str, ...]:
        """The labels besides the deployment labels and ``pool``."""
        return tuple(label for label in self.labels if label != "pool")

    @property
    def label_names(self) -> tuple[str, ...]:
        return (*DEPLOYMENT_LABELS, *self.labels)


def _spec(
    kind: Kind,
    source: Source,
    name: str,
    field: str,
    otel_unit: str,
    help: str,
    labels: tuple[str, ...] = (),
) -> MetricSpec:
    return MetricSpec(
        PREFIX + name, kind, help, _unit(name), source, field, otel_unit, ("pool", *labels)
    )


_memory = partial(_spec, "gauge", "memory")
_writes = partial(_spec, "counter", "writes")


def _pool_stats_families() -> tuple[MetricSpec, ...]:
    """The cache families, from ``PoolStats``'s declaration: each counter and
    gauge field carries its help text, family name and unit
    (``core/stats.py``), so they are written once, beside the counter."""
    out = []
    for f in fields(PoolStats):
        kind, meta = f.metadata.get("kind"), f.metadata
        if kind in ("counter", "gauge"):
            # ``page_misses`` is split by classified reason (read from ``misses_by_reason``).
            by_reason = f.name == "page_misses"
            field, labels = ("misses_by_reason", ("reason",)) if by_reason else (f.name, ())
            name = meta["family"] or f.name
            out.append(_spec(kind, "cache", name, field, meta["otel_unit"], meta["help"], labels))
    return tuple(out)


# Tables (formatted by hand): name, field read, OpenTelemetry unit, then the help text.
# fmt: off
CATALOG: tuple[MetricSpec, ...] = (
    *_pool_stats_families(),
    _memory("memory_bytes", "memory_bytes", "By",
        "Estimated memory: entries x measured bytes per entry, plus the miss-reason "
        "memory's real size."),
    _memory("miss_memory_bytes", "miss_memory_bytes", "By",
        "Real size of the miss-reason memory (0 when disabled)."),
    _writes("written_pages", "written", "{page}",
        "Pages whose L3 write the write path launched (counted at the D2H launch)."),
    _writes("written_bytes", "written_bytes", "By",
        "Bytes of launched L3 writes (pages x this rank's page size)."),
    _writes("write_avoided_pages", "avoided", "{page}",
        "Pages of a write intent skipped because they were believed stored or in flight (once per "
        "admission decision)."),
    _writes("write_avoided_bytes", "avoided_bytes", "By",
        "Bytes not written because the pages were believed stored or in flight."),
    _writes("redundant_written_pages", "redundant", "{page}",
        "Written pages the L3 already held, by the storage backend's own answer (a subset of "
        "write_acknowledged; see docs/metrics.md for which backends answer)."),
    _writes("redundant_written_bytes", "redundant_bytes", "By",
        "Bytes of redundant writes."),
    _writes("write_acknowledged_pages", "acknowledged", "{page}",
        "Written pages this rank's storage write reported stored (at the storage ack)."),
    _writes("write_acknowledged_bytes", "acknowledged_bytes", "By",
        "Bytes of written pages this rank's storage write reported stored."),
    _writes("write_failed_pages", "failed", "{page}",
        "Written pages this rank's storage write reported not stored (failed or not attempted)."),
    _writes("write_failed_bytes", "failed_bytes", "By",
        "Bytes of written pages this rank's storage write reported not stored."),
    _writes("redundant_believed_pages", "redundant_believed", "{page}",
        "Redundant written pages that were believed stored when the write launched (a node is "
        "written whole when any of its pages is uncovered; in cache mode without "
        "cache_mode.dedup, the pages dedup would have saved)."),
    _writes("redundant_cause_pages", "causes", "{page}",
        "Redundant written pages by cause (why they were written again; the causes add up to "
        "redundant_written_pages; docs/metrics.md lists them).", labels=("cause",)),
)
# fmt: on

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}


# ---------------------------------------------------------------------------
# feature metrics: TP-divergence checks, the reconciler, the capacity advisor, the recorder


def _f(
    name: str,
    kind: Kind,
    field: str,
    otel_unit: str,
    help: str,
    labels: tuple[str, ...] = (),
) -> MetricSpec:
    """A feature family; its source is the feature its name starts with."""
    source = next(s for s in get_args(FeatureSource) if name.startswith(s))
    return MetricSpec(PREFIX + name, kind, help, _unit(name), source, field, otel_unit, labels)


# name, kind, field read, OpenTelemetry unit, then the help text.
# fmt: off
FEATURE_CATALOG: tuple[MetricSpec, ...] = (
    _f("mode_info", "gauge", "mode", "1",
        "1, labelled with the HiCache host memory mode this process serves (buffer_only or "
        "cache), SGLang's write policy, whether cache_mode.dedup is on (true, false, or "
        "upstream: SGLang deduplicates cache-mode writes itself and the package only counts) "
        "and whether each pool has its own cap (capacity_scope: pool) or all share one "
        "(shared: sglang 0.5.19-0.5.21, whose pools fill it together).",
        labels=("host_memory_mode", "write_policy", "cache_mode_dedup", "capacity_scope")),
    _f("divergence_checks", "counter", "checks", "{check}",
        "Cross-rank replica checks completed."),
    _f("divergences", "counter", "divergences", "{check}",
        "Checks that found this rank's replica differing from the others (or others from it)."),
    _f("divergence_heals", "counter", "heals", "{heal}",
        "Heals: pools cleared on every rank at the same step after a divergence."),
    _f("divergence_check_failures", "counter", "failures", "{check}",
        "Checks whose collective failed (reason: timeout, error); the checker stops after one.",
        labels=("reason",)),
    _f("divergence_config_mismatches", "counter", "config_mismatches", "{check}",
        "Start-up handshakes that found ranks configured differently (checks stay off)."),
    _f("divergence_check_seconds", "counter", "check_seconds", "s",
        "Seconds spent in checks (with checks_total: the mean check duration)."),
    _f("divergence_last_check_step", "gauge", "last_check_step", "{step}",
        "Scheduler step of the last completed check (0: none yet)."),
    _f("divergence_last_detected_step", "gauge", "last_divergence_step", "{step}",
        "Scheduler step of the last detected divergence (0: none)."),
    _f("divergence_active", "gauge", "active", "1",
        "1 while checks run (enabled, handshake passed, no failed collective)."),
    _f("reconciler_queries", "counter", "queries", "{query}",
        "Ground-truth verifications by result: present (every page in L3), absent (a page is "
        "missing, trusted), untrusted (a short answer the ledger cannot prove), error, timeout, "
        "rejected (circuit open), void (the pool was cleared meanwhile).",
        labels=("pool", "result")),
    _f("reconciler_stale_positives", "counter", "stale_positives", "{query}",
        "Verifications that found believed pages missing from L3.", labels=("pool",)),
    _f("reconciler_pages_invalidated", "counter", "pages_invalidated", "{page}",
        "Beliefs removed by agreed ground-truth verdicts.", labels=("pool",)),
    _f("reconciler_pages_learnt", "counter", "pages_learnt", "{page}",
        "Pages added to beliefs because L3 holds them (e.g. written by another instance).",
        labels=("pool",)),
    _f("reconciler_verdicts_withheld", "counter", "invalidations_withheld", "{query}",
        "Absence verdicts not acted on because the page the answer stopped at was being written "
        "(in flight, or acknowledged since the query): the answer predates that write, so the "
        "beliefs past it are kept.", labels=("pool",)),
    _f("reconciler_errors", "counter", "errors", "{error}",
        "Ground-truth errors by kind (never evidence of absence).", labels=("kind",)),
    _f("reconciler_circuit_open", "gauge", "circuit_state", "1",
        "1 while the circuit breaker is open or half-open (queries paused), else 0."),
    _f("reconciler_objects_leased", "counter", "objects_leased", "{object}",
        "L3 objects the reconciler's existence probes found and the backend leased for reading: "
        "Mooncake grants a read lease per object an existence query finds, which moves it behind "
        "every object put or read before in the master's eviction order, so the probes keep what "
        "they sample alive longer (docs/reconciler.md); 0 on backends that lease nothing."),
    _f("reconciler_outstanding_queries", "gauge", "outstanding", "{query}",
        "Verifications queued or in flight."),
    _f("reconciler_query_seconds", "histogram", "query_seconds", "s",
        "Ground-truth query latency, worker side."),
    _f("advisor_estimated_hit_ratio", "gauge", "estimated_hit_ratio", "1",
        "Estimated page hit ratio if the pool's cap were cap_multiplier x the current cap (SHARDS "
        "sampling; absent until enough references were seen).", labels=("pool", "cap_multiplier")),
    _f("advisor_estimated_lookup_hit_ratio", "gauge", "estimated_lookup_hit_ratio", "1",
        "Estimated hit ratio of lookups alone (each lookup's walked pages and its miss page) at "
        "cap_multiplier x the current cap: the curve to size the cap by in buffer mode, where "
        "prefetch healing re-teaches beliefs (docs/capacity.md).",
        labels=("pool", "cap_multiplier")),
    _f("advisor_dropped_references", "counter", "dropped_references", "{page}",
        "Sampled page references the advisor could not record (its sampler could not allocate "
        "memory; the estimate is biased low while this grows)."),
    _f("recorder_records", "counter", "records", "{record}",
        "Records the trace recorder wrote to its files, by kind (lookup, add, invalidate, clear, "
        "write, prefetch, request; docs/replay.md).", labels=("kind",)),
    _f("recorder_dropped_records", "counter", "dropped", "{record}",
        "Records the trace recorder dropped: queue_full (the writer thread fell behind; the "
        "scheduler never waits) or write_error (the path could not be opened or written, e.g. a "
        "full disk). A trace with drops under-counts references.", labels=("reason",)),
    _f("recorder_written_bytes", "counter", "written_bytes", "By",
        "Compressed bytes the trace recorder wrote (rotated and deleted files included)."),
    _f("recorder_disk_bytes", "gauge", "disk_bytes", "By",
        "Bytes this instance's trace files take on disk now (bounded by recorder.max_bytes)."),
    _f("events_published_blocks", "counter", "published", "{block}",
        "Storage-tier KV event blocks published (events.enabled; docs/kv-events.md): stored "
        "(BlockStored at an L3 acknowledgement) or removed (BlockRemoved on a verified absence).",
        labels=("kind",)),
    _f("events_dropped_blocks", "counter", "dropped", "{block}",
        "Storage-tier KV event blocks not published: queue_full (the publisher thread fell behind "
        "and an acknowledgement or verdict did not fit in the queue: its pages, counted before "
        "deduplication; the scheduler never waits) or send_error (the socket refused the batch).",
        labels=("reason",)),
    _f("events_removals", "counter", "removals", "{block}",
        "Published blocks removed, by the verdict that proved them absent: reconciler (a "
        "ground-truth query) or hit_query (a prefetch hit query found fewer pages).",
        labels=("source",)),
    _f("events_unknown_blocks", "counter", "unknown", "{block}",
        "L3-acknowledged pages published as no event: their block hash, parent or tokens are not "
        "the ones SGLang's own events carry (a namespaced or bigram key)."),
    _f("events_oldest_unverified_store_seconds", "gauge", "oldest_unverified_s", "s",
        "Seconds since the least recently confirmed published block was last confirmed present in "
        "L3 (by its acknowledgement, a hit query or a reconciler verdict)."),
)
# fmt: on

FEATURE_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in FEATURE_CATALOG}


@dataclass(frozen=True)
class DeploymentLabels:
    """Labels set once per process from configuration and the runtime (the
    ranks are known only inside the scheduler process)."""

    model_name: str = ""
    engine_type: str = "unified"
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    storage_backend: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_rank"):
                _validate.count(value, f.name)
            elif not isinstance(value, str):
                raise TypeError(f"{f.name} must be a str, got {type(value).__name__}")
            elif len(value) > _MAX_LABEL_VALUE or _CONTROL.search(value):
                raise ValueError(
                    f"{f.name} must be at most {_MAX_LABEL_VALUE} printable characters"
                )

    def values(self) -> tuple[str, ...]:
        """Label values in ``DEPLOYMENT_LABELS`` order; credentials in a URL-like
        value (a storage backend address) are masked."""
        return tuple(
            str(getattr(self, name)) if name.endswith("_rank") else redact_url(getattr(self, name))
            for name in DEPLOYMENT_LABELS
        )

    def as_dict(self) -> dict[str, str]:
        return dict(zip(DEPLOYMENT_LABELS, self.values()))
