"""Catalog values from snapshots: the one computation every exporter shares.

``SeriesReader.sample()`` takes one ``stats()`` snapshot of the cache (and of the
write accounting), folds pools into bounded labels and returns, for every
catalog metric, the value of every series.  The standalone collector renders
it, the multiprocess feeder turns it into deltas and gauge sets, the OTel
callbacks observe it: same names, same values.  Cost: O(pools x metrics).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

from hicache_existence.accounting.causes import CAUSES
from hicache_existence.accounting.ghosts import CACHE_BYTES_PER_ENTRY, GhostFactory
from hicache_existence.accounting.writes import PoolWriteStats, WriteAccounting, WriteStats
from hicache_existence.core.stats import MISS_REASONS, CacheStats, PoolStats
from hicache_existence.exporters.catalog import (
    CATALOG,
    MISS_REASON_LABELS,
    OTHER_POOL,
    MetricSpec,
)
from hicache_existence.exporters.features import (
    FeatureSources,
    HistogramSamples,
    sample_features,
)

#: Series key: (pool label, *extra label values).
SeriesKey = tuple[str, ...]
#: metric name -> series -> value.
Samples = dict[str, dict[SeriesKey, float]]


class StatsSource(Protocol):
    """Either cache generation."""

    def stats(self) -> CacheStats: ...


class PoolLabeler:
    """Bounded ``pool`` label values: the first ``max_pools`` names seen keep
    their own label, later ones become ``other``.  Assignment is sticky, so a
    pool's series never move between labels and counters never go backwards."""

    def __init__(self, max_pools: int = 16, initial: Iterable[str] = ("kv",)) -> None:
        self.max_pools = max_pools  # metrics.max_pools, >= 1 (Config checks it)
        self._labels: dict[str, str] = {}
        for pool in initial:
            self.label(pool)

    def label(self, pool: str) -> str:
        label = self._labels.get(pool)
        if label is None:
            own = sum(1 for v in self._labels.values() if v != OTHER_POOL)
            label = pool if own < self.max_pools and pool != OTHER_POOL else OTHER_POOL
            self._labels[pool] = label
        return label

    def labels(self) -> tuple[str, ...]:
        """Every label value handed out, in first-use order."""
        return tuple(dict.fromkeys(self._labels.values()))


#: The values of each extra label, so every series exists at 0 from the start.
_LABEL_VALUES = {"reason": MISS_REASON_LABELS, "cause": CAUSES}


def _series_of(spec: MetricSpec, pool_label: str) -> list[SeriesKey]:
    if spec.extra_labels:
        return [(pool_label, value) for value in _LABEL_VALUES[spec.extra_labels[0]]]
    return [(pool_label,)]


class SeriesReader:
    """Computes ``Samples`` from a cache, optional write accounting and optional
    miss-reason memories.  Thread-safe (one lock around the labeler)."""

    def __init__(
        self,
        cache: StatsSource,
        *,
        writes: WriteAccounting | None = None,
        ghosts: GhostFactory | None = None,
        max_pools: int = 16,
        initial_pools: Iterable[str] = ("kv",),
        features: FeatureSources | None = None,
        write_families: bool = True,
    ) -> None:
        # Internal and typed: the settings come from a validated ``Config``.
        self.cache = cache
        # Without ``write_families`` (a host memory mode whose write path could not
        # be hooked) the write families are left out: absent rather than 0 while L3
        # is written.
        self.writes = writes if write_families else None
        self.ghosts = ghosts
        self.labeler = PoolLabeler(max_pools, initial_pools)
        self.features = features or FeatureSources()
        self.specs: tuple[MetricSpec, ...] = (
            CATALOG if write_families else tuple(s for s in CATALOG if s.source != "writes")
        )
        self._lock = threading.Lock()
        self._zeros_for: tuple[str, ...] | None = None
        self._zeros_of: dict[str, dict[SeriesKey, float]] = {}
        #: The cache snapshot of the latest ``sample_all`` (the per-step flush hands
        #: it to the log monitor instead of taking another).
        self.last_cache_stats: CacheStats | None = None

    def _zeros(self) -> dict[str, dict[SeriesKey, float]]:
        """Every series of every scalar family at 0, for the labels handed out so
        far (rebuilt only when a label is added: a pool seen for the first time)."""
        labels = self.labeler.labels()
        if self._zeros_for != labels:
            self._zeros_of = {
                spec.name: {key: 0.0 for label in labels for key in _series_of(spec, label)}
                for spec in self.specs
            }
            self._zeros_for = labels
        return self._zeros_of

    def feature_specs(self) -> tuple[MetricSpec, ...]:
        """Feature metric families exported (those whose source is set)."""
        return self.features.specs()

    def settle(self) -> None:
        """Classify the cache's pending misses (scheduler thread only)."""
        settle = getattr(self.cache, "settle", None)
        if settle is not None:
            settle()

    def sample(self) -> Samples:
        """Every scalar metric's series values now (cache, writes, features)."""
        return self.sample_all()[0]

    def sample_all(self) -> tuple[Samples, HistogramSamples]:
        """Scalar samples plus the feature histograms, from one set of snapshots."""
        cache_stats = self.last_cache_stats = self.cache.stats()
        write_stats = self.writes.stats() if self.writes is not None else None
        memory = self.ghosts.nbytes_by_pool() if self.ghosts is not None else {}
        with self._lock:
            out = self._fold(cache_stats, write_stats, memory)
            scalars, histograms = sample_features(
                self.features, self.labeler.label, self.labeler.labels()
            )
        out.update(scalars)
        return out, histograms

    def _fold(
        self,
        cache_stats: CacheStats,
        write_stats: WriteStats | None,
        memory: Mapping[str, int],
    ) -> Samples:
        label = self.labeler.label
        # Every pool labelled first, so that the zeros cover them all.
        pools = [(label(pool), pool, stats) for pool, stats in cache_stats.items()]
        writes = [(label(p), s) for p, s in (write_stats.items() if write_stats else ())]
        out: Samples = {name: dict(zeros) for name, zeros in self._zeros().items()}
        for pool_label, pool, stats in pools:
            _add_pool(out, pool_label, stats, memory.get(pool), cache_stats.shared_capacity)
        for pool_label, wstats in writes:
            _add_writes(out, pool_label, wstats)
        return out


def _add_pool(
    out: Samples, pool_label: str, stats: PoolStats, miss_memory: int | None, shared: bool
) -> None:
    key = (pool_label,)
    mem = float(miss_memory or 0)
    memory = {"memory_bytes": stats.entries * CACHE_BYTES_PER_ENTRY + mem, "miss_memory_bytes": mem}
    for spec in _POOL_SPECS:
        series = out[spec.name]
        if spec.source == "memory":
            series[key] += memory[spec.field]
        elif spec.field == "misses_by_reason":
            if miss_memory is None:
                # No classification for this pool: every miss is unclassified
                # (the reason counters are all zero, so this stays monotonic).
                series[(pool_label, "unclassified")] += stats.page_misses
            else:
                for reason in MISS_REASONS:
                    series[(pool_label, reason)] += getattr(stats, f"misses_{reason}")
        elif spec.field == "capacity" and shared:
            series[key] = max(series[key], float(stats.capacity))
        else:
            series[key] += getattr(stats, spec.field)


def _add_writes(out: Samples, pool_label: str, stats: PoolWriteStats) -> None:
    for spec in _WRITE_SPECS:
        if spec.field == "causes":
            for cause, n in stats.causes.items():
                out[spec.name][(pool_label, cause)] += n
        else:
            out[spec.name][(pool_label,)] += getattr(stats, spec.field)


#: A pool's families (the cache's and the memory estimate's) and its write families.
_POOL_SPECS = tuple(spec for spec in CATALOG if spec.source in ("cache", "memory"))
_WRITE_SPECS = tuple(spec for spec in CATALOG if spec.source == "writes")
