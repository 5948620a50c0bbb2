"""The findings (docs/doctor.md, "Findings"): each judges one instance's figures (or
the fleet's) by its declaration in ``judgements``; what needs code is here: each
finding's evidence, the causes, the cap's advice, the fleet's routing cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hicache_existence.accounting.advisor import recommended_multiple
from hicache_existence.doctor import judgements as J
from hicache_existence.doctor.figures import (
    SGLANG_BACKUPED,
    SGLANG_PREFETCH_HIT,
    SGLANG_PREFETCHED,
    SGLANG_UNFULFILLED,
    View,
    is_package,
    key_text,
    series,
)
from hicache_existence.doctor.judgements import Judgement, Severity, worst
from hicache_existence.doctor.model import Evidence, Finding, human_bytes
from hicache_existence.reconcile.counters import ANSWERED_RESULTS as ANSWERED
from hicache_existence.reconcile.counters import FAILED_RESULTS

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


def cause_fix(cause: str, mode: str | None) -> str:
    """What to do about redundant writes of ``cause`` in host memory ``mode``: outside
    cache mode no host copy is kept, so a ``recompute`` page this instance stored is
    written again when its belief was dropped (the cap, a heal)."""
    if cause == "recompute" and mode != "cache":
        return (
            "pages this instance had stored, computed again after its belief was dropped (mostly "
            "by the cap): see cap_too_small (`cache.max_entries`)"
        )
    return CAUSE_FIXES.get(cause, "a cause this doctor does not know")


def _number(text: str) -> bool:
    """Whether a label value is a finite number (``cap_multiplier``)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.3g}"


def _ranked(by: Mapping[str, float]) -> list[tuple[float, str]]:
    """(figure, label value) of the positive figures, largest first."""
    return sorted(((n, c) for c, n in by.items() if n > 0), reverse=True)


def _positive(by: Mapping[str, float]) -> list[str]:
    return [k for k in sorted(by) if by[k] > 0]


def evidence(view: View, name: str, **labels: str) -> Evidence:
    """The figure ``name{labels}`` (summed over the labels not given)."""
    key = (series(name), tuple(sorted(labels.items())))
    return Evidence(
        view.instance, key_text(key), view.value(name, **labels), view.rate(name, **labels)
    )


def evidences(view: View, names: str, **labels: str) -> list[Evidence]:
    return [evidence(view, name, **labels) for name in names.split()]


def _each(
    view: View, name: str, label: str, values: Sequence[str], **labels: str
) -> list[Evidence]:
    return [evidence(view, name, **labels, **{label: v}) for v in values]


def found(
    j: Judgement,
    view: View | None,
    summary: str,
    evidence: Sequence[Evidence],
    fix: Sequence[str] | None = None,
    pool: str | None = None,
    wasted: float | None = None,
    wasted_rate: float | None = None,
    *,
    severity: Severity | None = None,
    over: tuple[float, float] | None = None,
) -> list[Finding]:
    """``j``'s finding as a rule returns it (a list), with ``j``'s fix unless given, at
    ``j``'s severity, or info where ``over`` (a ratio's numerator and denominator) is
    not past ``j``'s threshold on enough traffic; ``severity`` overrides both."""
    if severity is None:
        severity = j.severity if over is None else j.severity_if(j.exceeds(*over))
    finding = Finding(
        id=str(j.finding),
        severity=severity,
        instance=None if view is None else view.instance,
        pool=pool,
        summary=summary,
        wasted_bytes=wasted,
        wasted_bytes_per_s=wasted_rate,
        evidence=tuple(evidence),
        fix=tuple(j.fix if fix is None else fix),
    )
    return [finding]


def redundant(view: View, pool: str, mode: str | None, dedup: bool | None) -> list[Finding]:
    r = view.value("redundant_written_pages", pool=pool)
    if r <= 0:
        return []
    w = view.value("written_pages", pool=pool)
    rb = view.value("redundant_written_bytes", pool=pool)
    believed = view.value("redundant_believed_pages", pool=pool)
    no_dedup = mode == "cache" and dedup is False
    # In cache mode without dedup the pages dedup would have saved (believed when
    # written) are cache_mode_without_dedup's, a ticket as its alert: only the rest
    # can make this a warning, or installing cache mode would page.
    counted = max(0.0, r - believed) if no_dedup else r
    names = "redundant_written_pages redundant_written_bytes written_pages redundant_believed_pages"
    ev = evidences(view, names, pool=pool)
    causes = view.values_by("redundant_cause_pages", "cause", pool=pool)
    fixes: list[str] = []
    cause_text = ""
    if causes:
        ranked = _ranked(causes)
        ev += _each(view, "redundant_cause_pages", "cause", [c for _, c in ranked], pool=pool)
        cause_text = "; by cause: " + ", ".join(f"{c} {_n(n)}" for n, c in ranked)
        fixes += [f"{c} ({_n(n)} pages): {cause_fix(c, mode)}" for n, c in ranked]
    else:
        misses = view.values_by("page_misses", "reason", pool=pool)
        ev += _each(view, "page_misses", "reason", _positive(misses), pool=pool)
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
    if no_dedup:
        fixes.append(
            "cache mode without dedup: `cache_mode.dedup=true` (see cache_mode_without_dedup)"
        )
    summary = (
        f"{pool}: {_n(r)} of {_n(w)} written pages ({_pct(_ratio(r, w))}) were already in "
        f"L3, {human_bytes(rb)} written twice{cause_text}"
    )
    rate = view.rate("redundant_written_bytes", pool=pool)
    return found(
        J.REDUNDANT_WRITES, view, summary, ev, fixes or None, pool, rb, rate, over=(counted, w)
    )


def dedup_off(view: View, pool: str, mode: str | None, dedup: bool | None) -> list[Finding]:
    j = J.CACHE_MODE_REWRITES
    r = view.value("redundant_written_pages", pool=pool)
    w = view.value("written_pages", pool=pool)
    if mode != "cache" or dedup is not False or not j.exceeds(r, w):
        return []
    saved = view.value("redundant_believed_pages", pool=pool)
    per_page = _ratio(view.value("redundant_written_bytes", pool=pool), r)
    rate = view.rate("redundant_believed_pages", pool=pool)
    mode_info = key_text((series("mode_info"), view.mode_labels()))
    names = "redundant_written_pages written_pages redundant_believed_pages"
    ev = [Evidence(view.instance, mode_info, 1.0), *evidences(view, names, pool=pool)]
    summary = (
        f"{pool}: cache mode writes {_pct(_ratio(r, w))} of its L3 pages twice and dedup "
        f"is off; dedup would have saved {_n(saved)} pages ({human_bytes(saved * per_page)})"
    )
    wasted_rate = None if rate is None else rate * per_page
    return found(j, view, summary, ev, None, pool, saved * per_page, wasted_rate)


def advisor_curve(view: View, pool: str) -> dict[float, float]:
    """{cap multiplier: estimated lookup hit ratio} (the largest over ranks)."""
    by = view.values_by("advisor_estimated_lookup_hit_ratio", "cap_multiplier", pool=pool)
    return {float(m): v for m, v in by.items() if _number(m) and float(m) > 0 and math.isfinite(v)}


def cap_covering(pages: float) -> int:
    """The smallest power of two of at least ``pages`` entries."""
    if not (math.isfinite(pages) and pages >= 0):
        raise ValueError(f"pages must be a finite number >= 0, got {pages!r}")
    return 1 << max(0, math.ceil(pages) - 1).bit_length()


def _cap_fix(
    view: View, curve: Mapping[float, float], cap: float, stored: float, ev: list[Evidence]
) -> tuple[str | None, bool, bool]:
    """The cap's advice from the advisor's curve: (the fix, the curve is flat, the
    curve's range is below the distinct pages the pool ``stored``)."""
    multiple = recommended_multiple(curve)
    if not math.isfinite(cap * max([2, *curve])):
        return None, False, False  # figures no server exports (a crafted body): no advice
    # The advisor's curve ends at its largest multiple: below what the pool stored it
    # cannot tell a flat curve from a working set beyond its range.
    top = max(curve) * cap if curve else 0.0
    fix: str | None = None
    flat = beyond = False
    if multiple is None:
        if cap > 0:
            fix = (
                f"`cache.max_entries={int(cap * 2)}` (twice the cap), then read the advisor's "
                "curve (`advisor.enabled=true`) to size it"
            )
    elif (
        cap > 0
        and stored > top
        and math.isfinite(stored)
        and (multiple <= 1 or multiple == max(curve))
    ):
        beyond = True
        covering = cap_covering(stored)
        what = "distinct pages stored (written - redundant - failed)"
        ev.append(Evidence(view.instance, what, stored))
        fix = (
            f"`cache.max_entries={covering}` (`HICACHE_EXISTENCE_CACHE__MAX_ENTRIES={covering}`)"
            f": this instance stored {_n(stored)} distinct pages, more than the advisor's "
            f"largest cap ({max(curve):g}x = {_n(top)} entries), so its curve says nothing "
            f"about a cap that holds them; a cap of {covering} covers them (about 40 B per "
            "entry per rank), then read the curve again"
        )
    elif multiple > 1 and cap > 0:
        here = curve.get(1.0)
        now = "" if here is None else f" from {here:.3f}"
        entries = int(cap * multiple)
        fix = (
            f"`cache.max_entries={entries}` ({multiple:g}x the cap): the advisor estimates the "
            f"lookup hit ratio rises{now} to {curve[multiple]:.3f} "
            f"(`HICACHE_EXISTENCE_CACHE__MAX_ENTRIES={entries}`); about 40 B per entry per rank"
        )
    else:
        flat = True
        fix = (
            "the advisor's curve is flat: a larger cap would not raise the hit ratio on this "
            "traffic; leave `cache.max_entries` as it is"
        )
    return fix, flat, beyond


def cap(view: View, pool: str, mode: str | None, dedup: bool | None) -> list[Finding]:
    s = J.SETTINGS
    evicted = view.value("page_misses", pool=pool, reason="evicted")
    evictions = view.value("evictions", pool=pool)
    q = view.value("queries", pool=pool)
    capacity = view.value("capacity_entries", pool=pool)
    entries = _filling(view, pool)
    r = view.value("redundant_written_pages", pool=pool)
    w = view.value("written_pages", pool=pool)
    at_cap = _at_cap(view, pool)
    # Redundant pages not believed at their launch: the cap's share of them is at
    # most this (the rest: another instance, heals, clears).
    not_believed = max(0.0, r - view.value("redundant_believed_pages", pool=pool))
    if evicted <= 0 and not (at_cap and evictions > 0 and not_believed > 0):
        return []
    ev = _each(view, "page_misses", "reason", ("evicted", "cold"), pool=pool)
    ev += evidences(
        view,
        "queries evictions entries capacity_entries redundant_written_pages "
        "redundant_believed_pages written_pages",
        pool=pool,
    )
    curve = advisor_curve(view, pool)
    if curve:
        lookup = "advisor_estimated_lookup_hit_ratio"
        multipliers = sorted(
            (m for m in view.values_by(lookup, "cap_multiplier", pool=pool) if _number(m)),
            key=float,
        )
        ev += _each(view, lookup, "cap_multiplier", multipliers, pool=pool)
    # Distinct pages stored in L3: written pages L3 did not hold yet, acknowledged.
    stored = max(0.0, w - r - view.value("write_failed_pages", pool=pool))
    fix, flat, beyond = _cap_fix(view, curve, capacity, stored, ev)
    fixes = [] if fix is None else [fix]
    cold = view.value("page_misses", pool=pool, reason="cold")
    # The miss-reason memory over the beliefs' (``miss_reasons.memory_fraction``, measured).
    miss = view.value("miss_memory_bytes", pool=pool)
    beliefs = view.value("memory_bytes", pool=pool) - miss
    fraction = miss / beliefs if view.has("miss_memory_bytes") and beliefs > 0 else None
    if at_cap and cold > evicted and fraction is not None and fraction < s.miss_memory_small:
        proposed = min(1.0, max(s.miss_memory_floor, 2 * fraction))
        fixes.append(
            "cold misses at a full cap may be evictions older than the miss-reason memory "
            f"remembers (it is {_pct(fraction)} of the cache's memory): "
            f"`miss_reasons.memory_fraction={proposed:.2g}` classifies more of them"
        )
    churn_high = J.EVICTION_CHURN.exceeds(evicted, q)
    # As HicacheExistenceAtCapRedundantWritesRising: full, writing pages twice, and
    # not in cache mode without dedup (no cap removes those rewrites).
    rewrites_by_design = mode == "cache" and dedup is False
    redundant_high = at_cap and not rewrites_by_design and J.AT_CAP_REDUNDANT.exceeds(r, w)
    severity = worst(
        J.EVICTION_CHURN.severity_if(churn_high and not flat),
        J.AT_CAP_REDUNDANT.severity_if(redundant_high and not flat),
        "warning" if beyond else "info",
    )
    per_page = _ratio(view.value("redundant_written_bytes", pool=pool), r)
    wasted = not_believed * per_page if per_page else None
    full = f", full ({_n(entries)} of {_n(capacity)} entries)" if at_cap else ""
    summary = (
        f"{pool}: {_n(evicted)} lookups ({_pct(_ratio(evicted, q))} of {_n(q)}) missed a page "
        f"the cap had evicted while L3 kept it; {_n(evictions)} evictions{full}"
    )
    if at_cap and r > 0:
        summary += f"; {_n(r)} of {_n(w)} written pages ({_pct(_ratio(r, w))}) were already in L3"
    if wasted is not None:
        summary += f"; at most {human_bytes(wasted)} rewritten for it"
    return found(J.EVICTION_CHURN, view, summary, ev, fixes, pool, wasted, severity=severity)


def _filling(view: View, pool: str) -> float:
    """The entries that fill ``pool``'s cap: its own, or every pool's where they
    share one cap (``mode_info{capacity_scope="shared"}``, the seed generation), as
    the fill recording rule reads them."""
    if dict(view.mode_labels()).get("capacity_scope") == "shared":
        return sum(view.value("entries", pool=p) for p in view.pools())
    return view.value("entries", pool=pool)


def _at_cap(view: View, pool: str) -> bool:
    capacity = view.value("capacity_entries", pool=pool)
    return capacity > 0 and _filling(view, pool) >= J.SETTINGS.at_cap_fill * capacity


def l3_read_back(view: View) -> list[Finding]:
    j = J.L3_NOT_READ_BACK
    written = view.value(SGLANG_BACKUPED)
    read = view.value(SGLANG_PREFETCHED)
    if written <= 0 or not j.past(read, written):
        return []
    hit = view.value(SGLANG_PREFETCH_HIT)
    never = read <= 0 and hit <= 0
    ranked = [r for _, r in _ranked(view.values_by(SGLANG_UNFULFILLED, "reason"))]
    ev = [
        *evidences(view, f"{SGLANG_BACKUPED} {SGLANG_PREFETCHED} {SGLANG_PREFETCH_HIT}"),
        *_each(view, SGLANG_UNFULFILLED, "reason", ranked),
    ]
    fixes: list[str] = []
    if ranked and ranked[0] == "below_threshold":
        fixes.append(
            "L3 holds the prefixes but they are shorter than the prefetch threshold: lower it, "
            "e.g. `--hicache-storage-backend-extra-config '{\"prefetch_threshold\": 64}'`"
        )
    elif ranked and ranked[0] in ("deadline", "storage_transfer"):
        fixes.append(
            "prefetches run out of time or fail: raise `prefetch_timeout_base` in "
            "`--hicache-storage-backend-extra-config`, or `--hicache-storage-prefetch-policy "
            "wait_complete`"
        )
    wasted = wasted_rate = None
    rate, rate_read = view.rate(SGLANG_BACKUPED), view.rate(SGLANG_PREFETCHED)
    per_token = bytes_per_token(view)
    if per_token is not None:
        wasted = (written - read) * per_token
        if rate is not None and rate_read is not None:
            wasted_rate = max(0.0, rate - rate_read) * per_token
    hits = f"{_pct(_ratio(read, written))}; {_n(hit)} tokens hit in L3 queries"
    back = "none (no prefetch hit either)" if never else f"{_n(read)} ({hits})"
    summary = f"L3 was written {_n(written)} tokens and read back {back}"
    severity = j.severity_if(never and j.exceeds(read, written))
    return found(
        j, view, summary, ev, [*fixes, *j.fix], None, wasted, wasted_rate, severity=severity
    )


def stale(view: View, pool: str) -> list[Finding]:
    positives = view.value("reconciler_stale_positives", pool=pool)
    if positives > 0:
        answered = view.value("reconciler_queries", pool=pool, result=ANSWERED)
        invalidated = view.value("reconciler_pages_invalidated", pool=pool)
        summary = (
            f"{pool}: {_n(positives)} of {_n(answered)} answered verifications "
            f"({_pct(_ratio(positives, answered))}) found believed pages missing from L3; "
            f"{_n(invalidated)} beliefs removed"
        )
        ev = [
            evidence(view, "reconciler_stale_positives", pool=pool),
            *_each(view, "reconciler_queries", "result", ANSWERED, pool=pool),
            evidence(view, "reconciler_pages_invalidated", pool=pool),
            evidence(view, "page_misses", pool=pool, reason="invalidated"),
        ]
        return found(J.STALE_POSITIVES, view, summary, ev, pool=pool, over=(positives, answered))
    healed = view.value("invalidations", pool=pool)
    if view.has("reconciler_queries") or healed <= 0:
        return []
    summary = (
        f"{pool}: {_n(healed)} beliefs were dropped by heals after prefetch shortfalls "
        "(L3 lacked pages believed stored); no reconciler looks for the others"
    )
    ev = [
        evidence(view, "invalidations", pool=pool),
        evidence(view, "page_misses", pool=pool, reason="invalidated"),
    ]
    fix = (
        "turn the reconciler on to find stale beliefs before a prefetch trips on them: "
        "`reconciler.enabled=true` with `reconciler.redis_url` (docs/reconciler.md)"
    )
    return found(J.STALE_POSITIVES, view, summary, ev, [fix], pool, severity="info")


def reconciler_health(view: View) -> list[Finding]:
    if not view.has("reconciler_queries") and not view.has("reconciler_circuit_open"):
        return []
    failed = view.value("reconciler_queries", result=FAILED_RESULTS)
    answered = view.value("reconciler_queries", result=ANSWERED)
    errors = view.values_by("reconciler_errors", "kind")
    open_ = view.value("reconciler_circuit_open") >= 1
    if view.seconds is not None and view.has("reconciler_queries"):
        # Between the two reads: every figure of a counter has a change then.
        d_failed = view.delta("reconciler_queries", result=FAILED_RESULTS) or 0.0
        down = d_failed > 0 and not view.delta("reconciler_queries", result=ANSWERED)
    else:
        down = failed > 0 and answered == 0
    if not (open_ or down or failed > 0 or sum(errors.values()) > 0):
        return []
    severity = worst(J.CIRCUIT_OPEN.severity_if(open_), J.RECONCILER_DOWN.severity_if(down))
    kinds = ", ".join(f"{k} {_n(errors[k])}" for k in _positive(errors)) or "none"
    state = "circuit breaker open" if open_ else ("no answers" if down else "answering")
    summary = (
        f"reconciler: {state}; {_n(failed)} verifications failed and {_n(answered)} were "
        f"answered; errors by kind: {kinds}"
    )
    ev = [
        evidence(view, "reconciler_circuit_open"),
        *_each(view, "reconciler_queries", "result", (*FAILED_RESULTS, *ANSWERED)),
        *_each(view, "reconciler_errors", "kind", _positive(errors)),
    ]
    return found(J.RECONCILER_DOWN, view, summary, ev, severity=severity)


def divergence(view: View) -> list[Finding]:
    out: list[Finding] = []
    diverged = view.value("divergences")
    if diverged > 0:
        out += found(
            J.TP_DIVERGENCE,
            view,
            f"{_n(diverged)} checks found TP replicas of the beliefs differing "
            f"({_n(view.value('divergence_heals'))} heals)",
            evidences(view, "divergences divergence_heals divergence_checks"),
        )
    failures = view.values_by("divergence_check_failures", "reason")
    mismatches = view.value("divergence_config_mismatches")
    stopped = view.has("divergence_active") and view.value("divergence_active") < 1
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
        out += found(
            J.TP_CHECKS_STOPPED,
            view,
            "TP divergence checks stopped on at least one rank "
            f"({_n(sum(failures.values()))} failed checks, {_n(mismatches)} config "
            "mismatches): a divergence would go unnoticed",
            [
                evidence(view, "divergence_active"),
                *_each(view, "divergence_check_failures", "reason", sorted(failures)),
                evidence(view, "divergence_config_mismatches"),
            ],
            fixes,
        )
    return out


def liveness(view: View, mode: str | None, dedup: bool | None) -> list[Finding]:
    backuped = view.value(SGLANG_BACKUPED)
    if not any(is_package(k[0]) for k in view.figures):
        return found(
            J.PLUGIN_NOT_LOADED,
            view,
            "SGLang reports L3 storage activity but exports no hicache_existence_* series: "
            "the package is not enabled on this server",
            evidences(view, f"{SGLANG_BACKUPED} {SGLANG_PREFETCH_HIT}"),
        )
    out: list[Finding] = []
    written = view.value("written_pages")
    expects_queries = mode != "cache" or dedup is True
    active = backuped > 0 or written > 0 or view.value("page_inserts") > 0
    if expects_queries and view.value("queries") == 0 and active:
        out += found(
            J.PLUGIN_NOT_LIVE,
            view,
            "the existence cache is never consulted: 0 lookups while L3 is written "
            f"({_n(backuped)} tokens by SGLang's count)",
            evidences(view, f"queries page_inserts written_pages {SGLANG_BACKUPED}"),
        )
    if backuped > 0 and written == 0 and view.value("write_acknowledged_pages") == 0:
        j = J.WRITE_ACCOUNTING_NOT_FED
        out += found(
            j,
            view,
            f"SGLang wrote {_n(backuped)} tokens to L3 but the package's write counters "
            "are absent or 0: the write-path hooks are missing, so redundant writes go "
            "uncounted",
            evidences(view, f"{SGLANG_BACKUPED} written_pages write_acknowledged_pages"),
            [j.fix[0] + (f" ({mode})" if mode else "")],
        )
    return out


def write_failures(view: View, pool: str) -> list[Finding]:
    failed = view.value("write_failed_pages", pool=pool)
    if failed <= 0:
        return []
    w = view.value("written_pages", pool=pool)
    share = _pct(_ratio(failed, w))
    summary = f"{pool}: L3 did not store {_n(failed)} of {_n(w)} written pages ({share})"
    ev = evidences(view, "write_failed_pages write_failed_bytes written_pages", pool=pool)
    wasted = view.value("write_failed_bytes", pool=pool)
    rate = view.rate("write_failed_bytes", pool=pool)
    return found(J.WRITE_FAILURES, view, summary, ev, None, pool, wasted, rate, over=(failed, w))


def fleet(views: Sequence[View]) -> list[Finding]:
    if len(views) < 2:
        return []
    redundant = {v.instance: v.value("redundant_written_pages") for v in views}
    total_w = sum(v.value("written_pages") for v in views)
    total_r = sum(redundant.values())
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
    ev: list[Evidence] = []
    methods: set[str] = set()
    for v in views:
        r, b = v.value("redundant_written_pages"), v.value("redundant_believed_pages")
        per_page = _ratio(v.value("redundant_written_bytes"), r)
        ev += evidences(
            v, "written_pages redundant_written_pages redundant_believed_pages evictions"
        )
        if v.value("evictions") == 0:
            methods.add("not believed below the cap")
            pages = max(0.0, r - b)
            r_rate, b_rate = v.rate("redundant_written_pages"), v.rate("redundant_believed_pages")
            rate = None if r_rate is None or b_rate is None else max(0.0, r_rate - b_rate)
        elif v.has("redundant_cause_pages"):
            methods.add("other_instance at the cap")
            pages = v.value("redundant_cause_pages", cause="other_instance")
            rate = v.rate("redundant_cause_pages", cause="other_instance")
            ev.append(evidence(v, "redundant_cause_pages", cause="other_instance"))
        else:
            methods.add("none counted at the cap without the cause series")
            pages = rate = 0.0
        cost_bytes += pages * per_page
        cost_rate = None if cost_rate is None or rate is None else cost_rate + rate * per_page
        ev.append(Evidence(v.instance, "share of the fleet's redundant pages", _ratio(r, total_r)))
    j = J.FLEET_REDUNDANT

    # As HicacheExistenceFleetRedundantWrites: below the cap only (at its cap an
    # instance's own evictions rewrite pages too: cap_too_small's finding).
    # Per pool, as the alert: a pool at its cap on some instance quiets that pool only.
    def pool_high(pool: str) -> bool:
        w = [v.value("written_pages", pool=pool) for v in views]
        r = sum(v.value("redundant_written_pages", pool=pool) for v in views)
        return (
            j.exceeds(r, sum(w))
            and sum(1 for x in w if x > 0) > 1
            and not any(_at_cap(v, pool) for v in views)
        )

    high = any(pool_high(p) for p in sorted({p for v in views for p in v.pools()}))
    shares = ", ".join(
        f"{name} {_pct(_ratio(redundant[name], total_r))}" for name in sorted(redundant)
    )
    n = len(views)
    lopsided_share = min(J.SETTINGS.lopsided_share, 2 / n)
    lopsided = [k for k, r in redundant.items() if total_r > 0 and r / total_r > lopsided_share]
    fixes = list(j.fix)
    if lopsided:
        fixes.append(
            f"{', '.join(sorted(lopsided))} writes far more than 1/{n} of the redundant pages: "
            "its beliefs were emptied (a restart, /flush_cache) or its cap is smaller"
        )
    summary = (
        f"fleet of {n}: {_n(total_r)} of {_n(total_w)} written pages "
        f"({_pct(_ratio(total_r, total_w))}) were already in L3; share of the redundant "
        f"pages: {shares}; the routing costs {human_bytes(cost_bytes)} "
        f"({'; '.join(sorted(methods))})"
    )
    severity = j.severity_if(high)
    return found(j, None, summary, ev, fixes, None, cost_bytes, cost_rate, severity=severity)


def bytes_per_token(view: View) -> float | None:
    """L3 bytes per token this instance writes: the package's acknowledged bytes over
    SGLang's backed-up tokens, counted at the same storage ack (docs/metrics.md)."""
    tokens = view.value(SGLANG_BACKUPED)
    acked = view.value("write_acknowledged_bytes") + view.value("write_failed_bytes")
    return acked / tokens if tokens > 0 and acked > 0 else None
