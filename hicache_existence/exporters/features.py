"""Feature metrics (the mode served, TP-divergence checks, the reconciler, the
advisor, the recorder, KV events), read like the cache metrics from immutable
snapshots at export time, never recorded per operation.

``FeatureSources`` holds the callables that take those snapshots; a feature
without a source exports nothing.  Series that can be enumerated up front
(result and error labels, known pools) exist at 0 from the first sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache_existence.exporters.catalog import FEATURE_CATALOG, OTHER_POOL, FeatureSpec
from hicache_existence.reconcile.counters import ERROR_KINDS, RESULTS

#: metric name -> series (label values after the deployment labels) -> value.
FeatureSamples = dict[str, dict[tuple[str, ...], float]]
#: (bucket upper bounds, cumulative counts incl. +Inf, sum).
HistogramValue = tuple[tuple[float, ...], tuple[int, ...], float]
#: metric name -> series -> histogram.
HistogramSamples = dict[str, dict[tuple[str, ...], HistogramValue]]


@dataclass(frozen=True)
class FeatureSources:
    """Snapshot callables of the optional features (``None``: feature off)."""

    divergence: Callable[[], Any] | None = None
    reconciler: Callable[[], Any] | None = None
    advisor: Callable[[], Any] | None = None
    #: The host memory mode served: ``(host_memory_mode, write_policy, dedup)``.
    mode: Callable[[], tuple[str, str, bool | str]] | None = None
    #: Whether every pool shares one cap (the seed generation): ``mode_info``'s
    #: ``capacity_scope`` (``shared``, else ``pool``), so that a fill can be read right.
    shared_capacity: bool = False
    #: The trace recorder's counters (``Recorder.snapshot``).
    recorder: Callable[[], Any] | None = None
    #: The storage-tier KV events' counters (``KvEvents.snapshot``).
    events: Callable[[], Any] | None = None

    def specs(self) -> tuple[FeatureSpec, ...]:
        """The feature metric families these sources export."""
        return tuple(spec for spec in FEATURE_CATALOG if getattr(self, spec.source) is not None)


#: A source's values: the feature spec's ``field`` -> its series (scalars) or
#: histogram series.
_Values = dict[str, Any]


def sample_features(
    sources: FeatureSources, label: Callable[[str], str], pool_labels: tuple[str, ...]
) -> tuple[FeatureSamples, HistogramSamples]:
    """Every feature series' value now; ``label`` folds pool names into bounded
    labels and ``pool_labels`` lists the labels handed out so far.  Each source's
    values are keyed by the ``field`` its catalog specs read, so the families'
    names are written only in the catalog."""
    by_source: dict[str, _Values] = {}
    if sources.mode is not None:
        host_mode, policy, dedup = sources.mode()
        dedup_text = dedup if isinstance(dedup, str) else "true" if dedup else "false"
        scope = "shared" if sources.shared_capacity else "pool"
        by_source["mode"] = {"mode": {(host_mode, policy, dedup_text, scope): 1.0}}
    if sources.divergence is not None:
        by_source["divergence"] = _divergence(sources.divergence())
    if sources.reconciler is not None:
        by_source["reconciler"] = _reconciler(sources.reconciler(), label, pool_labels)
    if sources.advisor is not None:
        by_source["advisor"] = _advisor(sources.advisor(), label)
    if sources.recorder is not None:
        by_source["recorder"] = _recorder(sources.recorder())
    if sources.events is not None:
        by_source["events"] = _events(sources.events())
    scalars: FeatureSamples = {}
    histograms: HistogramSamples = {}
    for spec in FEATURE_CATALOG:
        values = by_source.get(spec.source)
        if values is not None:
            out: dict[str, Any] = histograms if spec.kind == "histogram" else scalars
            out[spec.name] = values[spec.field]
    return scalars, histograms


def _scalar(value: float) -> dict[tuple[str, ...], float]:
    return {(): float(value)}


def _divergence(stats: Any) -> _Values:
    return {
        "checks": _scalar(stats.checks),
        "divergences": _scalar(stats.divergences),
        "heals": _scalar(stats.heals),
        "failures": {
            ("timeout",): float(stats.timeouts),
            ("error",): float(stats.errors),
        },
        "config_mismatches": _scalar(stats.config_mismatches),
        "check_seconds": _scalar(stats.check_seconds),
        "last_check_step": _scalar(stats.last_check_step),
        "last_divergence_step": _scalar(stats.last_divergence_step),
        "active": _scalar(1.0 if stats.active else 0.0),
    }


def _per_pool(
    values: Mapping[str, int], label: Callable[[str], str], pool_labels: tuple[str, ...]
) -> dict[tuple[str, ...], float]:
    series: dict[tuple[str, ...], float] = {(p,): 0.0 for p in pool_labels}
    for pool, n in values.items():
        key = (label(pool),)
        series[key] = series.get(key, 0.0) + float(n)
    return series


def _reconciler(snap: Any, label: Callable[[str], str], pool_labels: tuple[str, ...]) -> _Values:
    queries: dict[tuple[str, ...], float] = {(p, r): 0.0 for p in pool_labels for r in RESULTS}
    for (pool, result), n in snap.queries.items():
        key = (label(pool), str(result))
        queries[key] = queries.get(key, 0.0) + float(n)
    errors: dict[tuple[str, ...], float] = {(k,): 0.0 for k in ERROR_KINDS}
    for kind, n in snap.errors.items():
        errors[(str(kind),)] = errors.get((str(kind),), 0.0) + float(n)
    q = snap.query_seconds
    return {
        "queries": queries,
        "stale_positives": _per_pool(snap.stale_positives, label, pool_labels),
        "pages_invalidated": _per_pool(snap.pages_invalidated, label, pool_labels),
        "pages_learnt": _per_pool(snap.pages_learnt, label, pool_labels),
        "invalidations_withheld": _per_pool(snap.invalidations_withheld, label, pool_labels),
        "errors": errors,
        "circuit_state": _scalar(0.0 if snap.circuit_state == 0 else 1.0),
        "outstanding": _scalar(snap.outstanding),
        "objects_leased": _scalar(snap.objects_leased),
        "query_seconds": {(): (tuple(q.bounds), tuple(q.cumulative), float(q.sum))},
    }


def _advisor(snap: Any, label: Callable[[str], str]) -> _Values:
    out: _Values = {"dropped_references": _scalar(snap.dropped_references)}
    for field, lookups in (("estimated_hit_ratio", False), ("estimated_lookup_hit_ratio", True)):
        series: dict[tuple[str, ...], float] = {}
        for labels, value in snap.gauge_samples(lookups=lookups):
            pool_label = label(labels["pool"])
            if pool_label == OTHER_POOL:
                continue  # an estimate of several folded pools would mean nothing
            series[(pool_label, labels["cap_multiplier"])] = float(value)
        out[field] = series
    return out


def _recorder(snap: Any) -> _Values:
    return {
        "records": {(str(k),): float(n) for k, n in snap.records.items()},
        "dropped": {(str(k),): float(n) for k, n in snap.dropped.items()},
        "written_bytes": _scalar(snap.written_bytes),
        "disk_bytes": _scalar(snap.disk_bytes),
    }


def _events(snap: Any) -> _Values:
    return {
        "published": {(k,): float(n) for k, n in snap.published.items()},
        "dropped": {(k,): float(n) for k, n in snap.dropped.items()},
        "removals": {(k,): float(n) for k, n in snap.removals.items()},
        "unknown": _scalar(snap.unknown),
        "oldest_unverified_s": _scalar(snap.oldest_unverified_s),
    }
