"""Feature metrics from snapshots: TP-divergence checks, the reconciler, the advisor,
the recorder.

Like the cache metrics, these are read from immutable snapshots at export time
(``DivergenceChecker.stats()``, ``Reconciler.snapshot()``, ``CapacityAdvisor.snapshot()``),
never recorded per operation.  ``FeatureSources`` holds the callables that take
those snapshots; a feature without a source exports nothing.  Series that can
be enumerated up front (result and error labels, known pools) exist at 0 from
the first sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache_existence.exporters.catalog import FEATURE_CATALOG, OTHER_POOL, FeatureSpec
from hicache_existence.reconcile.counters import ERROR_KINDS, RESULTS

#: metric name -> series (label values after the deployment labels) -> value.
FeatureSamples = dict[str, dict[tuple[str, ...], float]]
#: metric name -> series -> (bucket upper bounds, cumulative counts incl. +Inf, sum).
HistogramSamples = dict[
    str, dict[tuple[str, ...], tuple[tuple[float, ...], tuple[int, ...], float]]
]


@dataclass(frozen=True)
class FeatureSources:
    """Snapshot callables of the optional features (``None``: feature off)."""

    divergence: Callable[[], Any] | None = None
    reconciler: Callable[[], Any] | None = None
    advisor: Callable[[], Any] | None = None
    #: The host memory mode served: ``(host_memory_mode, write_policy, dedup)``.
    mode: Callable[[], tuple[str, str, bool | str]] | None = None
    #: The trace recorder's counters (``Recorder.snapshot``).
    recorder: Callable[[], Any] | None = None
    #: The storage-tier KV events' counters (``KvEvents.snapshot``).
    events: Callable[[], Any] | None = None

    def specs(self) -> tuple[FeatureSpec, ...]:
        """The feature metric families these sources export."""
        on = {
            "mode": self.mode is not None,
            "divergence": self.divergence is not None,
            "reconciler": self.reconciler is not None,
            "advisor": self.advisor is not None,
            "recorder": self.recorder is not None,
            "events": self.events is not None,
        }
        return tuple(spec for spec in FEATURE_CATALOG if on[spec.source])


def sample_features(
    sources: FeatureSources, label: Callable[[str], str], pool_labels: tuple[str, ...]
) -> tuple[FeatureSamples, HistogramSamples]:
    """Every feature series' value now; ``label`` folds pool names into bounded
    labels and ``pool_labels`` lists the labels handed out so far."""
    scalars: FeatureSamples = {}
    histograms: HistogramSamples = {}
    if sources.mode is not None:
        host_mode, policy, dedup = sources.mode()
        dedup_text = dedup if isinstance(dedup, str) else "true" if dedup else "false"
        scalars[_name("mode_info")] = {(host_mode, policy, dedup_text): 1.0}
    if sources.divergence is not None:
        _divergence(scalars, sources.divergence())
    if sources.reconciler is not None:
        _reconciler(scalars, histograms, sources.reconciler(), label, pool_labels)
    if sources.advisor is not None:
        _advisor(scalars, sources.advisor(), label)
    if sources.recorder is not None:
        _recorder(scalars, sources.recorder())
    if sources.events is not None:
        _events(scalars, sources.events())
    return scalars, histograms


def _name(short: str) -> str:
    return "hicache_existence_" + short


def _divergence(out: FeatureSamples, stats: Any) -> None:
    failures = int(stats.failures)
    timeouts = int(stats.timeouts)
    out[_name("divergence_checks")] = {(): float(stats.checks)}
    out[_name("divergences")] = {(): float(stats.divergences)}
    out[_name("divergence_heals")] = {(): float(stats.heals)}
    out[_name("divergence_check_failures")] = {
        ("timeout",): float(timeouts),
        ("error",): float(max(0, failures - timeouts)),
    }
    out[_name("divergence_config_mismatches")] = {(): float(stats.config_mismatches)}
    out[_name("divergence_check_seconds")] = {(): float(stats.check_seconds)}
    out[_name("divergence_last_check_step")] = {(): float(stats.last_check_step)}
    out[_name("divergence_last_detected_step")] = {(): float(stats.last_divergence_step)}
    out[_name("divergence_active")] = {(): 1.0 if stats.active else 0.0}


def _per_pool(
    values: Mapping[str, int], label: Callable[[str], str], pool_labels: tuple[str, ...]
) -> dict[tuple[str, ...], float]:
    series: dict[tuple[str, ...], float] = {(p,): 0.0 for p in pool_labels}
    for pool, n in values.items():
        key = (label(pool),)
        series[key] = series.get(key, 0.0) + float(n)
    return series


def _reconciler(
    out: FeatureSamples,
    hist: HistogramSamples,
    snap: Any,
    label: Callable[[str], str],
    pool_labels: tuple[str, ...],
) -> None:
    for pool, _result in snap.queries:
        label(pool)
    queries: dict[tuple[str, ...], float] = {(p, r): 0.0 for p in pool_labels for r in RESULTS}
    for (pool, result), n in snap.queries.items():
        key = (label(pool), str(result))
        queries[key] = queries.get(key, 0.0) + float(n)
    out[_name("reconciler_queries")] = queries
    out[_name("reconciler_stale_positives")] = _per_pool(snap.stale_positives, label, pool_labels)
    out[_name("reconciler_pages_invalidated")] = _per_pool(
        snap.pages_invalidated, label, pool_labels
    )
    out[_name("reconciler_pages_learnt")] = _per_pool(snap.pages_learnt, label, pool_labels)
    out[_name("reconciler_verdicts_withheld")] = _per_pool(
        snap.invalidations_withheld, label, pool_labels
    )
    errors: dict[tuple[str, ...], float] = {(k,): 0.0 for k in ERROR_KINDS}
    for kind, n in snap.errors.items():
        errors[(str(kind),)] = errors.get((str(kind),), 0.0) + float(n)
    out[_name("reconciler_errors")] = errors
    out[_name("reconciler_circuit_open")] = {(): 0.0 if snap.circuit_state == 0 else 1.0}
    out[_name("reconciler_outstanding_queries")] = {(): float(snap.outstanding)}
    out[_name("reconciler_objects_leased")] = {(): float(snap.objects_leased)}
    q = snap.query_seconds
    hist[_name("reconciler_query_seconds")] = {
        (): (tuple(q.bounds), tuple(q.cumulative), float(q.sum))
    }


def _advisor(out: FeatureSamples, snap: Any, label: Callable[[str], str]) -> None:
    for name, lookups in (
        ("advisor_estimated_hit_ratio", False),
        ("advisor_estimated_lookup_hit_ratio", True),
    ):
        series: dict[tuple[str, ...], float] = {}
        for labels, value in snap.gauge_samples(lookups=lookups):
            pool_label = label(labels["pool"])
            if pool_label == OTHER_POOL:
                continue  # an estimate of several folded pools would mean nothing
            series[(pool_label, labels["cap_multiplier"])] = float(value)
        out[_name(name)] = series
    out[_name("advisor_dropped_references")] = {(): float(snap.dropped_references)}


def _recorder(out: FeatureSamples, snap: Any) -> None:
    out[_name("recorder_records")] = {(str(k),): float(n) for k, n in snap.records.items()}
    out[_name("recorder_dropped_records")] = {(str(k),): float(n) for k, n in snap.dropped.items()}
    out[_name("recorder_written_bytes")] = {(): float(snap.written_bytes)}
    out[_name("recorder_disk_bytes")] = {(): float(snap.disk_bytes)}


def _events(out: FeatureSamples, snap: Any) -> None:
    out[_name("events_published_blocks")] = {(k,): float(n) for k, n in snap.published.items()}
    out[_name("events_dropped_blocks")] = {(k,): float(n) for k, n in snap.dropped.items()}
    out[_name("events_removals")] = {(k,): float(n) for k, n in snap.removals.items()}
    out[_name("events_unknown_blocks")] = {(): float(snap.unknown)}
    out[_name("events_oldest_unverified_store_seconds")] = {(): float(snap.oldest_unverified_s)}
