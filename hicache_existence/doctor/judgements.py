"""Every judgement once: the doctor's findings and the Prometheus alerts, one table.

A ``Judgement`` declares its finding, its alert, its severity, the ratio it judges,
its threshold and guards (``Settings`` fields: every figure lives in ``SETTINGS``
alone) and its fix.  The doctor's rules ask ``exceeds``; ``dashboards/build.py`` and
``docs_tables`` render the alerts and the docs' tables from the same declaration, so
a finding and its alert cannot disagree (kubernetes-mixin's shape).  The doctor
judges totals since the server started, the alerts 5m rates: hence ``guard`` (a
total the denominator must reach) and ``rate_guard`` (its per-second rate).

Alert texts use ``%(name)s`` placeholders (as kubernetes-mixin's ``% $._config``):
every ``Settings`` field, ``<field>_pct`` for fractions, ``threshold``, the catalog's
sample names by family and what dashboards/build.py supplies; an unknown name fails.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from hicache_existence.doctor.figures import SERIES, SGLANG_BACKUPED, SGLANG_PREFETCHED
from hicache_existence.reconcile.counters import ANSWERED_RESULTS

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")


@dataclass(frozen=True)
class Settings:
    """Every threshold of a judgement, and what the rendered rules need besides, in
    one object (docs/doctor.md, "Thresholds"; docs/runbooks.md, "Index")."""

    #: Where each alert's ``runbook_url`` points (``<runbook_url>#<alert name, lower
    #: case>``): by default the runbooks in this repository, a path from its root. A
    #: deployment that serves the docs sets its address here (e.g.
    #: ``https://git.example.com/you/hicache-existence/blob/main/docs/runbooks.md``) and
    #: reruns the build (docs/runbooks.md).
    runbook_url: str = "docs/runbooks.md"
    #: Labels recording rules keep: one deployment's pool, summed over ranks and
    #: instances (level ``pool`` in the rule names).
    keep: tuple[str, ...] = ("job", "model_name", "engine_type", "storage_backend", "pool")
    #: Lookups per second (summed over ranks) below which ratio alerts stay quiet.
    min_queries_per_s: float = 1.0
    #: Lookups below which the doctor reports ratios of lookups at most as info.
    min_queries: int = 32
    #: Capacity (evicted) misses per lookup that count as churn.
    churn_ratio: float = 0.05
    #: How long churn lasts before its alert fires.
    churn_for: str = "15m"
    #: Hit ratio collapse: below this fraction of its value ``collapse_offset`` ago ...
    collapse_fraction: float = 0.5
    #: ... compared with its value this long ago ...
    collapse_offset: str = "1h"
    #: ... when that earlier value was at least this (a tiny ratio halving is noise) ...
    collapse_min_previous: float = 0.1
    #: ... for this long.
    collapse_for: str = "15m"
    #: A divergence found within this window fires at once.
    divergence_window: str = "10m"
    #: A rank not checking its replica for this long (start-up handshake included).
    checks_stopped_for: str = "10m"
    #: The window over which no verification was answered ...
    reconciler_down_window: str = "10m"
    #: ... for this long.
    reconciler_down_for: str = "10m"
    #: How long the reconciler's circuit breaker stays open before its alert fires.
    circuit_open_for: str = "5m"
    #: Verifications that found a stale positive, over answered verifications.
    stale_ratio: float = 0.1
    #: Answered verifications per second below which the stale ratio is noise.
    stale_min_answered_per_s: float = 0.05
    #: Answered verifications below which the doctor reports the stale share as info.
    min_answered: int = 10
    #: How long the stale share stays past its threshold before its alert fires.
    stale_for: str = "15m"
    #: Entries over cap that count as "at cap".
    at_cap_fill: float = 0.99
    #: Redundant written pages over written pages that count as significant.
    redundant_ratio: float = 0.05
    #: At cap, the redundant share must be higher than this long ago ...
    redundant_offset: str = "1h"
    #: ... for this long.
    redundant_for: str = "30m"
    #: Written pages below which the doctor reports ratios of writes at most as info.
    min_written_pages: int = 64
    #: Fleet-wide redundant written pages over written pages, below the cap (instances
    #: sharing one L3 rewriting each other's pages), with more than one instance.
    fleet_redundant_ratio: float = 0.1
    #: How long the fleet's share stays past its threshold before its alert fires.
    fleet_redundant_for: str = "30m"
    #: Written pages per second below which the fleet and cache-mode ratios are noise.
    fleet_min_written_per_s: float = 1.0
    #: An instance writing more than this share of the fleet's redundant pages (or
    #: 2/N when that is less) is named: its beliefs were emptied or its cap is smaller.
    lopsided_share: float = 0.9
    #: Cache mode without cache_mode.dedup: redundant written pages over written
    #: pages that make dedup worth turning on.
    cache_mode_redundant_ratio: float = 0.02
    #: How long that share stays past its threshold before its alert fires.
    cache_mode_redundant_for: str = "30m"
    #: L3 tokens read back over tokens written, below which L3 hardly pays.
    read_back_ratio: float = 0.1
    #: Tokens written to L3 below which "not read back" is reported at most as info.
    min_l3_tokens: int = 4096
    #: Failed written pages over written pages.
    failed_ratio: float = 0.01
    #: A miss-reason memory below this share of the beliefs' memory may forget evictions
    #: at a full cap; the doctor proposes twice its share (at least ``miss_memory_floor``).
    miss_memory_small: float = 0.5
    #: The smallest miss-reason memory share the doctor proposes.
    miss_memory_floor: float = 0.2
    #: Estimated gain from doubling the cap (lookup hit ratio points) the
    #: dashboard's "Gain from doubling the cap" shows in orange.
    doubling_gain: float = 0.02

    def value(self, name: str) -> float:
        return float(getattr(self, name))

    def placeholders(self) -> dict[str, str]:
        """Every field as text for ``%(name)s``, and ``<field>_pct`` for fractions."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = ", ".join(v) if isinstance(v, tuple) else str(v)
            if isinstance(v, float) and v < 1:
                out[f.name + "_pct"] = f"{v:.0%}"
        return out


SETTINGS = Settings()


@dataclass(frozen=True)
class Ratio:
    """``num / den`` over two series, each narrowed by label values (a value list
    means their sum); series are catalog families by name, or SGLang's by
    ``sglang:`` name (declared in ``hicache_existence.doctor.figures``)."""

    num: str
    den: str
    num_match: tuple[tuple[str, tuple[str, ...]], ...] = ()
    den_match: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def text(self) -> str:
        """``num{label="value"} / den`` in code font, as the docs write it."""

        def one(name: str, match: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
            inner = ",".join(f'{k}{"=~" if len(v) > 1 else "="}"{"|".join(v)}"' for k, v in match)
            return f"`{name}{{{inner}}}`" if inner else f"`{name}`"

        return f"{one(self.num, self.num_match)} / {one(self.den, self.den_match)}"


@dataclass(frozen=True)
class Alert:
    """The Prometheus side of a judgement (texts with ``%(name)s`` placeholders)."""

    name: str
    expr: str
    #: The ``Settings`` field of the alert's ``for`` ("" for none: ``0m``).
    for_: str
    summary: str
    description: str


@dataclass(frozen=True)
class Judgement:
    #: The doctor's finding id (docs/doctor.md#<finding>); None: an alert alone.
    finding: str | None
    severity: Severity
    alert: Alert | None = None
    ratio: Ratio | None = None
    #: ``above``: the judgement holds when the ratio exceeds the threshold; ``below``:
    #: when it falls short of it.
    direction: Literal["above", "below"] = "above"
    #: ``Settings`` field of the ratio's threshold.
    threshold: str | None = None
    #: ``Settings`` field: the total the ratio's denominator must reach (doctor).
    guard: str | None = None
    #: ``Settings`` field: the denominator's per-second rate the alert needs.
    rate_guard: str | None = None
    #: What to do, most effective first (hooks add the fixes figures decide).
    fix: tuple[str, ...] = ()

    def past(self, num: float, den: float) -> bool:
        """The ratio ``num / den`` (0 when ``den`` is) is past the threshold."""
        assert self.threshold is not None, f"{self.key} has no threshold"
        share = num / den if den > 0 else 0.0
        limit = SETTINGS.value(self.threshold)
        return share > limit if self.direction == "above" else share < limit

    def exceeds(self, num: float, den: float) -> bool:
        """``past``, with ``den`` at least the guard."""
        guarded = self.guard is None or den >= SETTINGS.value(self.guard)
        return guarded and self.past(num, den)

    def severity_if(self, condition: bool) -> Severity:
        return self.severity if condition else "info"

    @property
    def key(self) -> str:
        return self.alert.name if self.alert else str(self.finding)

    def render(self, text: str, names: dict[str, str]) -> str:
        """``text`` with its ``%(name)s`` placeholders filled (module docstring)."""
        values = {**SERIES, **SETTINGS.placeholders(), **names}
        if self.threshold is not None:
            values["threshold"] = str(getattr(SETTINGS, self.threshold))
        return text % values


_WHERE = "pool {{ $labels.pool }} of {{ $labels.model_name }} ({{ $labels.job }})"
_DEPLOYMENT = "{{ $labels.model_name }} ({{ $labels.job }}, engine {{ $labels.engine_type }})"
_MODE_NO_DEDUP = '%(mode_info)s{host_memory_mode="cache", cache_mode_dedup="false"}'
_WRITES = Ratio("redundant_written_pages", "written_pages")

EVICTION_CHURN = Judgement(
    "cap_too_small",
    "warning",
    Alert(
        "HicacheExistenceEvictionChurn",
        "%(churn)s > %(threshold)s\nand\n%(rate_queries)s > %(min_queries_per_s)s",
        "churn_for",
        "Capacity misses are {{ $value | humanizePercentage }} of lookups in " + _WHERE + ".",
        "For %(churn_for)s more than %(churn_ratio_pct)s of existence-cache lookups missed a "
        "page the cap had evicted: the working set does not fit, so pages already in L3 are "
        "copied and written again. Check the capacity advice and raise cache.max_entries.",
    ),
    Ratio("page_misses", "queries", num_match=(("reason", ("evicted",)),)),
    threshold="churn_ratio",
    guard="min_queries",
    rate_guard="min_queries_per_s",
)
#: At-cap redundancy is a warning, as ``redundant_writes`` of the same pages and as
#: ``EVICTION_CHURN``, the cap's other judgement: L3 bytes written twice that a setting
#: (``cache.max_entries``) removes are money lost.  Cache mode without dedup is left
#: out: there the beliefs skip no write, so no cap removes its rewrites
#: (``CACHE_MODE_REWRITES``'s ticket).
AT_CAP_REDUNDANT = Judgement(
    "cap_too_small",
    "warning",
    Alert(
        "HicacheExistenceAtCapRedundantWritesRising",
        "%(redundant)s > %(threshold)s\n"
        "and\n%(redundant)s > (%(redundant)s offset %(redundant_offset)s)\n"
        "and\n%(fill)s >= %(at_cap_fill)s\n"
        "unless on (%(deployment)s)\ncount by (%(deployment)s) (" + _MODE_NO_DEDUP + ") > 0",
        "redundant_for",
        "Redundant writes are {{ $value | humanizePercentage }} of writes and rising in "
        + _WHERE
        + ", at cap.",
        "The cache is at its cap and for %(redundant_for)s more than %(redundant_ratio_pct)s "
        "of written pages were already in L3, a higher share than %(redundant_offset)s "
        "earlier: evictions make the cache forget pages L3 still holds.",
    ),
    _WRITES,
    threshold="redundant_ratio",
    guard="min_written_pages",
)
REDUNDANT_WRITES = Judgement(
    "redundant_writes",
    "warning",
    ratio=_WRITES,
    threshold="redundant_ratio",
    guard="min_written_pages",
    fix=("see docs/doctor.md, redundant_writes",),
)
#: A ticket, not a page: upstream's cache mode rewrites pages by design (3% under
#: write_through, 29% under write_back measured) and only the opt-in
#: cache_mode.dedup removes it.
CACHE_MODE_REWRITES = Judgement(
    "cache_mode_without_dedup",
    "info",
    Alert(
        "HicacheExistenceCacheModeRedundantWrites",
        "%(redundant)s > %(threshold)s\n"
        "and\n%(rate_written)s > %(fleet_min_written_per_s)s\n"
        "and on (%(deployment)s)\ncount by (%(deployment)s) (" + _MODE_NO_DEDUP + ") > 0",
        "cache_mode_redundant_for",
        "{{ $value | humanizePercentage }} of L3 writes in HiCache cache mode were already "
        "stored, in " + _WHERE + " (cache_mode.dedup is off).",
        "For %(cache_mode_redundant_for)s more than %(cache_mode_redundant_ratio_pct)s of "
        "the pages written to L3 by servers in HiCache's cache mode were already there. "
        "Upstream writes every backed-up node whatever L3 holds, by design, so this is a "
        "ticket, not a page. The fix is the opt-in: set cache_mode.dedup=true "
        "(HICACHE_EXISTENCE_CACHE_MODE__DEDUP=1) and restart the server; pages the "
        "existence cache believes stored are then left out of the write.",
    ),
    _WRITES,
    threshold="cache_mode_redundant_ratio",
    guard="min_written_pages",
    rate_guard="fleet_min_written_per_s",
    fix=(
        "turn dedup on: `cache_mode.dedup=true` (`HICACHE_EXISTENCE_CACHE_MODE__DEDUP=1`, "
        "or in the `--hicache-existence-config` JSON) and restart the server",
    ),
)
FLEET_REDUNDANT = Judgement(
    "fleet_redundant_writes",
    "warning",
    Alert(
        "HicacheExistenceFleetRedundantWrites",
        "%(redundant)s > %(threshold)s\n"
        "and\n%(fill)s < %(at_cap_fill)s\n"
        "and\n%(rate_written)s > %(fleet_min_written_per_s)s\n"
        "and\ncount by (%(keep)s) "
        "(count by (%(keep)s, instance) (%(written_pages)s)) > 1",
        "fleet_redundant_for",
        "{{ $value | humanizePercentage }} of the fleet's L3 writes were already stored, "
        "below the cap, in " + _WHERE + ".",
        "For %(fleet_redundant_for)s more than %(fleet_redundant_ratio_pct)s of the pages "
        "the prefill instances sharing this L3 wrote were already there, while no instance "
        "is at its cap: instances are writing each other's pages again (requests of one "
        "conversation spread over instances that do not learn what the others stored).",
    ),
    _WRITES,
    threshold="fleet_redundant_ratio",
    guard="min_written_pages",
    rate_guard="fleet_min_written_per_s",
    fix=(
        "route by prefix: the router's `cache_aware` policy (`--prefill-policy cache_aware` "
        "in PD, `--policy cache_aware` otherwise; `PREFILL_POLICY` in "
        "integrations/sglang/router.sh) keeps a conversation on the instance that holds it",
        "estimate a policy on your own traffic offline: `hicache-existence replay TRACE "
        "--fleet N --router both` (docs/replay.md); the reconciler's ledger learning does not "
        "remove these writes",
    ),
)
STALE_POSITIVES = Judgement(
    "stale_beliefs",
    "warning",
    Alert(
        "HicacheExistenceStalePositivesHigh",
        "%(stale)s > %(threshold)s\nand\n%(answered_rate)s > %(stale_min_answered_per_s)s",
        "stale_for",
        "{{ $value | humanizePercentage }} of verifications find stale positives in "
        + _WHERE
        + ".",
        "For %(stale_for)s more than %(stale_ratio_pct)s of answered ground-truth "
        "verifications found pages believed stored that L3 no longer holds: L3 drops pages "
        "sooner than the beliefs forget them, so write-backs are skipped for missing pages.",
    ),
    Ratio(
        "reconciler_stale_positives",
        "reconciler_queries",
        den_match=(("result", ANSWERED_RESULTS),),
    ),
    threshold="stale_ratio",
    guard="min_answered",
    rate_guard="stale_min_answered_per_s",
    fix=(
        "L3 dropped pages the beliefs still hold (its capacity or retention, a "
        "restart, or pages deleted): give L3 room, or keep `cache.max_entries` at "
        "most what L3 retains; set `reconciler.ttl_s` to L3's retention",
        "the reconciler heals what it samples; a higher `reconciler.sampling_rate` "
        "finds them sooner",
    ),
)
_RECONCILER_FIX = (
    "restore ground truth: the Redis at `reconciler.redis_url` must answer PING "
    "from the prefill hosts; the breaker closes by itself after a probe (at most "
    "`reconciler.breaker_backoff_max_s` later)",
    "timeouts only: raise `reconciler.timeout_ms` or lower `reconciler.verifications_per_s`",
)
RECONCILER_DOWN = Judgement(
    "reconciler_unhealthy",
    "warning",
    Alert(
        "HicacheExistenceReconcilerDown",
        'sum by (%(deployment)s) (rate(%(reconciler_queries)s{result=~"%(failed)s"}'
        "[%(reconciler_down_window)s])) > 0\n"
        'unless\nsum by (%(deployment)s) (rate(%(reconciler_queries)s{result=~"%(answered)s"}'
        "[%(reconciler_down_window)s])) > 0",
        "reconciler_down_for",
        "The reconciler of " + _DEPLOYMENT + " gets no answers from ground truth.",
        "For %(reconciler_down_for)s ground-truth verifications failed (error, timeout, or "
        "rejected by the open circuit) and none was answered (present, absent or untrusted): "
        "beliefs are not being verified or healed.",
    ),
    fix=_RECONCILER_FIX,
)
CIRCUIT_OPEN = Judgement(
    "reconciler_unhealthy",
    "warning",
    Alert(
        "HicacheExistenceReconcilerCircuitOpen",
        "max by (%(deployment)s) (%(reconciler_circuit_open)s) == 1",
        "circuit_open_for",
        "The reconciler circuit breaker of " + _DEPLOYMENT + " is open.",
        "The circuit breaker has been open for %(circuit_open_for)s: ground truth kept "
        "failing, so verifications are skipped and retried with exponential backoff.",
    ),
    fix=_RECONCILER_FIX,
)
TP_DIVERGENCE = Judgement(
    "tp_divergence",
    "critical",
    Alert(
        "HicacheExistenceTPDivergence",
        "sum by (%(deployment)s, dp_rank, pp_rank) "
        "(increase(%(divergences)s[%(divergence_window)s])) > 0",
        "",
        "Existence-cache replicas diverged across TP ranks of " + _DEPLOYMENT + ".",
        "A divergence check found cache replicas that differ between ranks of dp_rank "
        "{{ $labels.dp_rank }}, pp_rank {{ $labels.pp_rank }} in the last "
        "%(divergence_window)s. Replicas must stay identical; a divergence precedes "
        "collective hangs and silently lowers prefetch hits.",
    ),
    fix=(
        "with `divergence.policy=heal` the pools are cleared on every rank at "
        "once; with `log`, drain and restart the server (every rank)",
        "keep every rank's logs around the step of "
        "`hicache_existence.replicas.divergence.detected` and report it with the "
        "versions (docs/tp-divergence.md)",
    ),
)
TP_CHECKS_STOPPED = Judgement(
    "tp_checks_stopped",
    "warning",
    Alert(
        "HicacheExistenceTPChecksStopped",
        "min by (%(deployment)s, dp_rank, pp_rank) (%(divergence_active)s) == 0",
        "checks_stopped_for",
        "TP-replica divergence checks stopped in " + _DEPLOYMENT + ".",
        "A rank of dp_rank {{ $labels.dp_rank }}, pp_rank {{ $labels.pp_rank }} has not "
        "been comparing its replica with the other TP ranks for %(checks_stopped_for)s: a "
        "check's collective failed (timeout or error) or the ranks are configured "
        "differently. A divergence would now go unnoticed.",
    ),
)
#: An alert alone: the doctor's two reads cannot see a ratio fall against its
#: value an hour earlier (its findings name the causes: cap_too_small,
#: stale_beliefs, a reset counter).
HIT_RATIO_COLLAPSE = Judgement(
    None,
    "warning",
    Alert(
        "HicacheExistenceHitRatioCollapse",
        "%(hit_ratio)s\n  < %(collapse_fraction)s * (%(hit_ratio)s offset %(collapse_offset)s)\n"
        "and\n(%(hit_ratio)s offset %(collapse_offset)s) > %(collapse_min_previous)s\n"
        "and\n%(rate_queries)s > %(min_queries_per_s)s",
        "collapse_for",
        "Page hit ratio fell to {{ $value | humanizePercentage }} in " + _WHERE + ".",
        "The page hit ratio has been below %(collapse_fraction_pct)s of its value "
        "%(collapse_offset)s earlier for %(collapse_for)s while lookups continue: beliefs "
        "were lost (clear, restart, heal storm) or the workload changed.",
    ),
)
L3_NOT_READ_BACK = Judgement(
    "l3_not_read_back",
    "warning",
    ratio=Ratio(SGLANG_PREFETCHED, SGLANG_BACKUPED),
    direction="below",
    threshold="read_back_ratio",
    guard="min_l3_tokens",
    fix=(
        "if the traffic does not come back to its prefixes after they leave device and host "
        "memory, L3 costs writes for nothing: `--hicache-write-policy write_through_selective` "
        "writes only prefixes that are hit again",
    ),
)
WRITE_FAILURES = Judgement(
    "write_failures",
    "warning",
    ratio=Ratio("write_failed_pages", "written_pages"),
    threshold="failed_ratio",
    guard="min_written_pages",
    fix=(
        "the L3 backend rejected or failed writes: check its capacity and errors "
        "(SGLang's log around the backups, the `storage_backend` label names it)",
    ),
)
PLUGIN_NOT_LOADED = Judgement(
    "plugin_not_loaded",
    "warning",
    fix=(
        "install the package in the server's environment (a wheel built from the checkout: "
        "docs/enable.md, section 1) and start SGLang with `--enable-hicache-existence` (and "
        "`--enable-metrics`, so its series are on this endpoint)",
    ),
)
PLUGIN_NOT_LIVE = Judgement(
    "plugin_not_live",
    "warning",
    fix=(
        "the plugin's cache hooks did not take: look for the `hicache_existence."
        "startup` event and plugin warnings in the scheduler log, and check that "
        "SGLang is 0.5.19-0.5.23 (docs/enable.md)",
    ),
)
WRITE_ACCOUNTING_NOT_FED = Judgement(
    "write_accounting_not_fed",
    "warning",
    fix=(
        "look for the plugin's warning naming the missing write-path target (\"... "
        'write counters ... are off") or "write accounting hooks not registered" in '
        "the server log; run a SGLang version the package supports (docs/enable.md) "
        "and a package version that accounts this host memory mode",
    ),
)

#: The table, in the order the alerts are rendered and the docs list them.
JUDGEMENTS: tuple[Judgement, ...] = (
    EVICTION_CHURN,
    HIT_RATIO_COLLAPSE,
    TP_DIVERGENCE,
    TP_CHECKS_STOPPED,
    RECONCILER_DOWN,
    CIRCUIT_OPEN,
    STALE_POSITIVES,
    AT_CAP_REDUNDANT,
    CACHE_MODE_REWRITES,
    FLEET_REDUNDANT,
    REDUNDANT_WRITES,
    L3_NOT_READ_BACK,
    WRITE_FAILURES,
    PLUGIN_NOT_LOADED,
    PLUGIN_NOT_LIVE,
    WRITE_ACCOUNTING_NOT_FED,
)


def runbook_anchor(alert_name: str) -> str:
    """GitHub's anchor of the alert's ``## <name>`` heading in docs/runbooks.md."""
    return alert_name.lower()


def alerting() -> tuple[tuple[Judgement, Alert], ...]:
    return tuple((j, j.alert) for j in JUDGEMENTS if j.alert is not None)


def worst(*severities: Severity) -> Severity:
    return max(severities, key=SEVERITIES.index)
