"""Feature metrics (the mode served, TP-divergence checks, the reconciler, the
advisor, the recorder, KV events), read like the cache metrics from immutable
snapshots at export time, never recorded per operation.

``FeatureSources`` holds the callables that take those snapshots; a feature
without a source exports nothing.  Series that can be enumerated up front
(result and error labels, known pools) exist at 0 from the first sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache_existence.exporters.catalog import FEATURE_CATALOG, OTHER_POOL, MetricSpec
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

    def specs(self) -> tuple[MetricSpec, ...]:
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
    for source, read in _READERS.items():
        take = getattr(sources, source)
        if take is not None:
            by_source[source] = read(take(), label, pool_labels)
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


def _read(snap: Any, source: str, **derived: Any) -> _Values:
    """``source``'s fields read off ``snap`` by name (a mapping: one series per
    key; a number: one series), except those ``derived`` gives."""
    out: _Values = dict(derived)
    for spec in FEATURE_CATALOG:
        if spec.source == source and spec.field not in derived:
            value = getattr(snap, spec.field)
            if isinstance(value, Mapping):
                out[spec.field] = {(str(k),): float(n) for k, n in value.items()}
            else:
                out[spec.field] = _scalar(value)
    return out


def _divergence(stats: Any, *_: Any) -> _Values:
    failures = {("timeout",): float(stats.timeouts), ("error",): float(stats.errors)}
    return _read(stats, "divergence", failures=failures)


def _folded(
    values: Mapping[Any, int], key: Callable[[Any], tuple[str, ...]], zeros: Iterable[Any]
) -> dict[tuple[str, ...], float]:
    """``values`` summed by series ``key`` (pools folded into one label add up),
    after every series of ``zeros`` at 0."""
    series: dict[tuple[str, ...], float] = dict.fromkeys(zeros, 0.0)
    for name, n in values.items():
        k = key(name)
        series[k] = series.get(k, 0.0) + float(n)
    return series


def _reconciler(snap: Any, label: Callable[[str], str], pool_labels: tuple[str, ...]) -> _Values:
    def by_pool(values: Mapping[str, int]) -> dict[tuple[str, ...], float]:
        return _folded(values, lambda pool: (label(pool),), [(p,) for p in pool_labels])

    q = snap.query_seconds
    return _read(
        snap,
        "reconciler",
        queries=_folded(
            snap.queries,
            lambda key: (label(key[0]), str(key[1])),
            [(p, r) for p in pool_labels for r in RESULTS],
        ),
        stale_positives=by_pool(snap.stale_positives),
        pages_invalidated=by_pool(snap.pages_invalidated),
        pages_learnt=by_pool(snap.pages_learnt),
        invalidations_withheld=by_pool(snap.invalidations_withheld),
        errors=_folded(snap.errors, lambda kind: (str(kind),), [(k,) for k in ERROR_KINDS]),
        circuit_state=_scalar(0.0 if snap.circuit_state == 0 else 1.0),
        query_seconds={(): (tuple(q.bounds), tuple(q.cumulative), float(q.sum))},
    )


def _advisor(snap: Any, label: Callable[[str], str], *_: Any) -> _Values:
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


#: How each feature's snapshot becomes its values: (snapshot, label, pool labels).
_READERS: dict[str, Callable[[Any, Callable[[str], str], tuple[str, ...]], _Values]] = {
    "divergence": _divergence,
    "reconciler": _reconciler,
    "advisor": _advisor,
    "recorder": lambda snap, *_: _read(snap, "recorder"),
    "events": lambda snap, *_: _read(snap, "events"),
}
