"""The doctor's report as text (``--json`` prints ``Report.as_dict()`` instead).

Headline figures per instance and pool, then the findings in rank order, each with
its evidence (exact values, and their rates with two reads) and its fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache_existence.doctor.figures import (
    SGLANG_BACKUPED,
    SGLANG_PREFETCH_HIT,
    SGLANG_PREFETCHED,
    SGLANG_STORAGE_SERIES,
    View,
)
from hicache_existence.doctor.judgements import SEVERITIES
from hicache_existence.doctor.model import Finding, InstanceReport, Report, human_bytes, number
from hicache_existence.reconcile.counters import ANSWERED_RESULTS as ANSWERED
from hicache_existence.reconcile.counters import FAILED_RESULTS


def _exact(value: float | None) -> str:
    shown = number(value)
    if shown is None:
        return "-"
    return f"{shown:,}" if isinstance(shown, int) else str(shown)


def _rate(value: float | None) -> str:
    return "" if value is None else f" ({value:,.4g}/s)"


def _source(source: Mapping[str, Any], n: int) -> str:
    what = f"{n} instance{'s' if n != 1 else ''}"
    if source.get("mode") == "prometheus":
        return (
            f"doctor's report: {what} from Prometheus {source.get('prometheus')} "
            f"{source.get('selector') or '{}'}, read {source.get('window')} apart"
        )
    interval = source.get("interval_s")
    if interval:
        return f"doctor's report: {what}, each read twice {interval:g} s apart"
    return f"doctor's report: {what}, each read once (no rates)"


#: The families of each pool's headline line.
_HEADLINE = (
    "queries pages_checked page_hits written_pages written_bytes redundant_written_pages "
    "write_avoided_pages entries capacity_entries"
)


def _instance(inst: InstanceReport) -> list[str]:
    view = View(inst.instance, inst.figures, inst.seconds)
    mode = inst.host_memory_mode or "host memory mode not exported"
    if inst.write_policy:
        mode += f", {inst.write_policy}"
    if inst.cache_mode_dedup is not None and inst.host_memory_mode == "cache":
        mode += f", dedup {'on' if inst.cache_mode_dedup else 'off'}"
    lines = [
        f"{inst.instance}: {mode}; {inst.ranks} rank{'s' if inst.ranks != 1 else ''}; "
        f"pools: {', '.join(inst.pools) or 'none'}"
    ]
    resets = sum(1 for f in inst.figures.values() if f.reset)
    if resets:
        lines.append(f"  counters went down between the reads (a restart): {resets} series")
    for pool in inst.pools:
        v = {n: view.value(n, pool=pool) for n in _HEADLINE.split()}
        w, r, checked = v["written_pages"], v["redundant_written_pages"], v["pages_checked"]
        share = f" ({100 * r / w:.1f}%)" if w else ""
        hit = f" (page hits {100 * v['page_hits'] / checked:.1f}%)" if checked else ""
        lines.append(
            f"  {pool}: lookups {_exact(v['queries'])}{hit}; written {_exact(w)} pages "
            f"({human_bytes(v['written_bytes'])}), redundant {_exact(r)}{share}, avoided "
            f"{_exact(v['write_avoided_pages'])}; entries {_exact(v['entries'])} of cap "
            f"{_exact(v['capacity_entries'])}"
        )
    if any(k[0] in SGLANG_STORAGE_SERIES for k in inst.figures):
        lines.append(
            f"  L3 by SGLang's count: written {_exact(view.value(SGLANG_BACKUPED))} tokens, read "
            f"back {_exact(view.value(SGLANG_PREFETCHED))}, prefetch hits "
            f"{_exact(view.value(SGLANG_PREFETCH_HIT))}"
        )
    if view.has("reconciler_queries"):
        answered = view.value("reconciler_queries", result=ANSWERED)
        failed = view.value("reconciler_queries", result=FAILED_RESULTS)
        breaker = "open" if view.value("reconciler_circuit_open") >= 1 else "closed"
        lines.append(
            f"  reconciler: answered {_exact(answered)}, failed {_exact(failed)}, stale "
            f"positives {_exact(view.value('reconciler_stale_positives'))}, breaker {breaker}"
        )
    return lines


def _finding(i: int, f: Finding) -> list[str]:
    where = "fleet" if f.instance is None else f.instance
    if f.pool:
        where += f", {f.pool}"
    lines = [f"{i}. [{f.severity}] {f.id} ({where})", f"   {f.summary}"]
    if f.wasted_bytes is not None:
        lines.append(
            f"   L3 bytes explained: {human_bytes(f.wasted_bytes)} "
            f"({_exact(f.wasted_bytes)} B){_rate(f.wasted_bytes_per_s)}"
        )
    lines.append("   evidence:")
    several = len({e.instance for e in f.evidence}) > 1
    for e in f.evidence:
        at = f"{e.instance}  " if several else ""
        lines.append(f"     {at}{e.series} = {_exact(e.value)}{_rate(e.rate_per_s)}")
    lines.append("   fix:")
    lines += [f"     - {x}" for x in f.fix]
    return lines


def render_text(report: Report) -> str:
    lines = [_source(report.source, len(report.instances)), ""]
    for inst in report.instances:
        lines += _instance(inst)
    lines.append("")
    if not report.findings:
        lines.append("no findings")
    else:
        lines.append("findings (by severity, then L3 bytes explained):")
        for i, f in enumerate(report.findings, 1):
            lines += _finding(i, f)
    counts = (f"{sum(f.severity == s for f in report.findings)} {s}" for s in SEVERITIES[::-1])
    lines += ["", f"{', '.join(counts)}: exit {report.exit_code}"]
    return "\n".join(lines)
