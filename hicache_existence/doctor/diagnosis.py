"""The doctor's judgement, without I/O: readings in, a ranked ``Report`` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hicache_existence.doctor import rules
from hicache_existence.doctor.figures import Reading, View, figures_of, ranks_of
from hicache_existence.doctor.model import Finding, InstanceReport, Report, rank


def diagnose(readings: Sequence[Reading], source: Mapping[str, Any] | None = None) -> Report:
    """Figures and ranked findings for these instances (named distinctly by both
    readers)."""
    instances: list[InstanceReport] = []
    views: list[View] = []
    findings: list[Finding] = []
    for reading in readings:
        figures = figures_of(reading)
        view = View(reading.instance, figures, reading.seconds if reading.first else None)
        views.append(view)
        modes = view.mode()
        mode, _, dedup = modes
        pools, ranks = view.pools(), ranks_of(reading.last)
        instances.append(InstanceReport(view.instance, view.seconds, ranks, pools, *modes, figures))
        findings += rules.liveness(view, mode, dedup)
        findings += rules.divergence(view)
        findings += rules.reconciler_health(view)
        findings += rules.l3_read_back(view)
        for pool in pools:
            findings += rules.redundant(view, pool, mode, dedup)
            findings += rules.dedup_off(view, pool, mode, dedup)
            findings += rules.cap(view, pool, mode, dedup)
            findings += rules.stale(view, pool)
            findings += rules.write_failures(view, pool)
    findings += rules.fleet(views)
    return Report(dict(source or {}), tuple(instances), tuple(rank(findings)))
