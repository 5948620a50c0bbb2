"""Every generated file of the repository, from the one place each fact lives.

    python dashboards/build.py          # regenerates every file below
    python dashboards/build.py --check  # exits 1 when a committed file differs

Outputs: ``dashboards/hicache-existence-dashboard.json`` (Grafana classic model,
schemaVersion 41, like SGLang's own dashboard), ``integrations/prometheus/rules.yml``
(recording and alerting rules) and ``tests.yml`` beside it (their promtool unit tests,
``dashboards/rule_tests.py``), ``integrations/kubernetes/prometheusrule.yaml``
(the same rules as a PrometheusRule), the generated tables of
``docs/metrics.md`` (every metric), ``docs/enable.md`` (every configuration
key), ``docs/design.md`` (every ``PoolStats`` field), ``docs/doctor.md`` (the
findings' thresholds) and ``docs/runbooks.md`` (the alerts' index), and CONTRIBUTING.md's
table of CI legs (read from ``tests/run-all.sh`` by ``tests/run_all_legs.py``).
All are committed; the test suite runs ``--check``, as kubernetes-mixin does, so
none of them can drift from its source.

Metric names, kinds and labels are spelt once, in
``hicache_existence.exporters.catalog``: ``family(name)`` looks a family up and
fails the build for a name the catalog does not export.  Panel ids derive from
each panel's key (its title unless given), so adding or moving a panel leaves
every other id, and so every ``viewPanel=`` link, unchanged.  Thresholds, the
runbook location and every alert live in ``hicache_existence.doctor.judgements``
(with the doctor's findings): ``alerts()`` renders its table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from hicache_existence import docs_tables  # noqa: E402
from hicache_existence.accounting import advisor  # noqa: E402
from hicache_existence.doctor import judgements  # noqa: E402
from hicache_existence.exporters import catalog  # noqa: E402

# Reconciler results: answered (stale positives come from ``absent``) and failed.
from hicache_existence.reconcile.counters import ANSWERED_RESULTS, FAILED_RESULTS  # noqa: E402

DASHBOARD_PATH = ROOT / "dashboards" / "hicache-existence-dashboard.json"
METRICS_DOC_PATH = ROOT / "docs" / "metrics.md"
CONFIG_DOC_PATH = ROOT / "docs" / "enable.md"
CONTRIBUTING_PATH = ROOT / "CONTRIBUTING.md"
DESIGN_DOC_PATH = ROOT / "docs" / "design.md"
DOCTOR_DOC_PATH = ROOT / "docs" / "doctor.md"
RUNBOOKS_PATH = ROOT / "docs" / "runbooks.md"
RULES_PATH = ROOT / "integrations" / "prometheus" / "rules.yml"
RULE_TESTS_PATH = ROOT / "integrations" / "prometheus" / "tests.yml"
PROMETHEUSRULE_PATH = ROOT / "integrations" / "kubernetes" / "prometheusrule.yaml"
#: The renderer of the PrometheusRule (located from this file, not ``ROOT``).
_RENDER_SCRIPT = (
    Path(__file__).resolve().parents[1] / "integrations" / "kubernetes" / "render_prometheusrule.py"
)
#: The renderer of the rules' promtool unit tests (located from this file, not ``ROOT``).
_RULE_TESTS_SCRIPT = Path(__file__).resolve().parent / "rule_tests.py"
#: The reader of tests/run-all.sh's legs (located from this file, not ``ROOT``).
_LEGS_SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "run_all_legs.py"

Kind = Literal["counter", "gauge", "histogram"]

# -- metrics: looked up in the catalog, where their names are spelt ---------------


@dataclass(frozen=True)
class Metric:
    """One metric family as the catalog names it (counters without ``_total``)."""

    name: str
    kind: Kind
    #: Labels after the deployment labels (which every series carries).
    labels: tuple[str, ...] = ()

    @property
    def sample(self) -> str:
        """The sample name queried: ``_total`` for counters."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def bucket(self) -> str:
        if self.kind != "histogram":
            raise ValueError(f"{self.name} is not a histogram")
        return f"{self.name}_bucket"

    def sample_names(self) -> tuple[str, ...]:
        """Every sample name this family exposes."""
        if self.kind == "histogram":
            return tuple(f"{self.name}{s}" for s in ("_bucket", "_count", "_sum"))
        return (self.sample,)


P = catalog.PREFIX

#: Every family the package exports, in catalog order, with kind and labels as the
#: catalog declares them.
METRICS: tuple[Metric, ...] = (
    *(Metric(s.name, s.kind, ("pool", *s.extra_labels)) for s in catalog.CATALOG),
    *(Metric(s.name, s.kind, s.labels) for s in catalog.FEATURE_CATALOG),
)
_BY_NAME = {m.name: m for m in METRICS}


def family(name: str) -> Metric:
    """The exported family ``hicache_existence_<name>``; a name the catalog does not
    export fails the build here (names, kinds and labels are spelt only there)."""
    try:
        return _BY_NAME[P + name]
    except KeyError:
        raise KeyError(f"{P + name} is not in hicache_existence.exporters.catalog") from None


# The families the expressions below use (references into the catalog).
QUERIES = family("queries")
PAGES_CHECKED = family("pages_checked")
PAGE_HITS = family("page_hits")
PAGE_MISSES = family("page_misses")
EVICTIONS = family("evictions")
ENTRIES = family("entries")
CAPACITY = family("capacity_entries")
MODE = family("mode_info")
WRITTEN_PAGES = family("written_pages")
AVOIDED_PAGES = family("write_avoided_pages")
REDUNDANT_PAGES = family("redundant_written_pages")
REDUNDANT_CAUSES = family("redundant_cause_pages")
DIV_CHECKS = family("divergence_checks")
#: A counter of seconds: with DIV_CHECKS it gives the mean check duration.
DIV_SECONDS = family("divergence_check_seconds")
REC_QUERIES = family("reconciler_queries")
REC_STALE = family("reconciler_stale_positives")
REC_LEARNT = family("reconciler_pages_learnt")
REC_CIRCUIT = family("reconciler_circuit_open")
REC_SECONDS = family("reconciler_query_seconds")
# Capacity advisor: the reference-stream curve, and the lookup curve (the one to
# size the cap by in buffer mode, docs/capacity.md).
ADVISOR = family("advisor_estimated_hit_ratio")
ADVISOR_LOOKUP = family("advisor_estimated_lookup_hit_ratio")

#: Label values the expressions rely on (one place, like the names;
#: tests/test_dashboards.py checks them against the package's own tuples).
REASON_EVICTED = "evicted"
#: ``cap_multiplier`` label values of the advisor gauge, ascending.
CAP_MULTIPLIERS: tuple[str, ...] = tuple(
    advisor.multiplier_label(m) for m in sorted(advisor.MULTIPLIERS)
)
#: ``cap_multiplier`` label values compared by the "gain from doubling" panel.
CAP_NOW, CAP_DOUBLE = "1", "2"

_SAMPLE_TO_METRIC = {s: m for m in METRICS for s in m.sample_names()}
_NAME = re.compile(r"\b(?:[a-z_]+:)?" + P + r"[a-zA-Z0-9_:]*")


def metric_of(sample: str) -> Metric | None:
    """The family a sample name (``..._total``, ``..._bucket``) belongs to."""
    return _SAMPLE_TO_METRIC.get(sample)


def names_in(expr: str) -> set[str]:
    """Metric and recording-rule names an expression mentions."""
    return set(_NAME.findall(expr))


# -- settings: thresholds and the runbook location ------------------------------

#: Every threshold and the runbook location: ``judgements.SETTINGS``, the one
#: object the doctor's findings read too (the build reads it at call time).
SETTINGS = judgements.SETTINGS

# -- PromQL helpers ---------------------------------------------------------------

DASHBOARD_VARIABLES = ("job", "instance", "model_name", "pool", "tp_rank")


def selector(metric: Metric, sample: str | None = None, **matchers: str) -> str:
    """``sample{...}`` filtered by the dashboard variables the family carries,
    plus exact ``matchers`` (a value starting with ``~`` is a regex)."""
    parts = [f'{v}=~"${v}"' for v in ("job", "instance", "model_name", "tp_rank")]
    if "pool" in metric.labels:
        parts.append('pool=~"$pool"')
    for label, value in matchers.items():
        if label not in metric.labels:
            raise ValueError(f"{metric.name} has no label {label!r}")
        op, value = ("=~", value[1:]) if value.startswith("~") else ("=", value)
        parts.append(f'{label}{op}"{value}"')
    return f"{sample or metric.sample}{{{', '.join(parts)}}}"


def by(labels: Sequence[str]) -> str:
    return f"by ({', '.join(labels)}) " if labels else ""


#: The labels that name one scheduler process's series (its ``mode_info`` among them).
PROCESS_LABELS = ("job", "instance", "tp_rank", "dp_rank", "pp_rank")


def fill(entries: str, capacity: str, mode: str) -> str:
    """Each pool's fill, series by series: its entries over its cap, or, where every
    pool shares one cap (``mode_info{capacity_scope="shared"}``: sglang
    0.5.19-0.5.21), all pools' entries over it, which they fill together."""
    shared = (
        f'{mode[:-1]}, capacity_scope="shared"}}'
        if mode.endswith("}")
        else (f'{mode}{{capacity_scope="shared"}}')
    )
    on = f"on ({', '.join(PROCESS_LABELS)})"
    # A shared cap is filled by every pool: a pool filter narrows the series shown
    # (the carrier), never the entries summed into the shared fill.
    every_entries, every_capacity = (s.replace(', pool=~"$pool"', "") for s in (entries, capacity))
    return (
        f"({entries} / {capacity} unless {on} {shared})\n"
        f"or\n({capacity} * 0 + ignoring (pool) group_left ()\n"
        f" (sum without (pool) ({every_entries}) / max without (pool) ({every_capacity})))"
    )


def rate(metric: Metric, group: Sequence[str] = ("pool",), **matchers: str) -> str:
    """Per-second rate over ``$__rate_interval``, summed by ``group``."""
    return f"sum {by(group)}(rate({selector(metric, **matchers)}[$__rate_interval]))"


def increase(metric: Metric, group: Sequence[str] = (), **matchers: str) -> str:
    return f"sum {by(group)}(increase({selector(metric, **matchers)}[$__rate_interval]))"


def quantile(q: float, metric: Metric) -> str:
    bucket = selector(metric, metric.bucket)
    return f"histogram_quantile({q}, sum by (le) (rate({bucket}[$__rate_interval])))"


def regex(values: Iterable[str]) -> str:
    return "~" + "|".join(values)


def advisor_at(multiplier: str, metric: Metric | None = None) -> str:
    """An advisor curve (default: the lookup curve) per pool at ``multiplier`` x the cap."""
    metric = metric or ADVISOR_LOOKUP
    return f"max by (pool) ({selector(metric, cap_multiplier=multiplier)})"


def recommended(value: Callable[[str], str]) -> str:
    """``value(m)`` per pool at the smallest cap multiple ``m`` whose lookup-curve
    estimate is within ``ADVICE_TOLERANCE`` of the pool's best estimate: the rule of
    ``hicache_existence.accounting.advisor.recommended_multiple``, in PromQL.

    PromQL cannot read a label as a number, so each multiple is one term, kept
    only where it qualifies, and the terms are joined with ``or`` in ascending
    order: ``or`` keeps the first term per pool, i.e. the smallest multiple."""
    best = f"max by (pool) ({selector(ADVISOR_LOOKUP)})"
    tolerance = advisor.ADVICE_TOLERANCE
    return "\nor\n".join(
        f"(\n  {value(m)}\n  and on (pool)\n  ({advisor_at(m)} >= {best} - {tolerance})\n)"
        for m in CAP_MULTIPLIERS
    )


# -- dashboard model ---------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Grafana's grid: 24 columns.
GRID_WIDTH = 24
PanelType = Literal["timeseries", "stat", "bargauge"]


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    type: PanelType = "timeseries"
    width: int = 8
    height: int = 8
    #: Fixed axis range for ratios.
    ratio: bool = False
    #: A dashed threshold line (the matching alert's threshold).
    threshold: float | None = None
    mappings: tuple[dict[str, Any], ...] = ()
    #: Threshold steps (value, colour) for stat panels.
    steps: tuple[tuple[float | None, str], ...] = ()
    #: What the panel id derives from (default: the title).  Give the old title
    #: here when renaming a panel, to keep its id and the links to it.
    key: str = ""

    @property
    def id(self) -> int:
        return stable_id("panel:" + (self.key or self.title))


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)

    @property
    def id(self) -> int:
        return stable_id("row:" + self.title)


def stable_id(key: str) -> int:
    """A panel id from a stable key (CRC-32, 24 bits: small JSON numbers; the
    tests check that no two panels collide)."""
    return 1 + (zlib.crc32(key.encode("utf-8")) & 0xFFFFFF)


def _t(expr: str, legend: str) -> Target:
    return Target(expr, legend)


def _ratio(num: str, den: str) -> str:
    return f"{num}\n/\n{den}"


def rows() -> tuple[Row, ...]:
    """Every row and panel of the dashboard."""
    s = judgements.SETTINGS
    overview = Row(
        "Overview",
        (
            Panel(
                "Page hit ratio",
                "Examined pages found believed stored over pages examined, per pool "
                "(page_hits / pages_checked rates). A hit skips a redundant device-to-host "
                "copy and L3 write.",
                "percentunit",
                (_t(_ratio(rate(PAGE_HITS), rate(PAGES_CHECKED)), "{{pool}}"),),
                ratio=True,
            ),
            Panel(
                "Lookup hit ratio",
                "Lookups (contains / contains_all / covered) that answered True over all "
                "lookups, per pool.",
                "percentunit",
                (_t(_ratio(rate(family("query_hits")), rate(QUERIES)), "{{pool}}"),),
                ratio=True,
            ),
            Panel(
                "Writes avoided vs redundant (pages/s)",
                "Pages admitted without an L3 write because they were believed stored "
                "(avoided), pages written, and written pages that ground truth says were "
                "already stored (redundant: what a larger or better-healed cache would save).",
                "ops",
                (
                    _t(rate(AVOIDED_PAGES), "{{pool}} avoided"),
                    _t(rate(WRITTEN_PAGES), "{{pool}} written"),
                    _t(rate(REDUNDANT_PAGES), "{{pool}} redundant"),
                ),
            ),
            Panel(
                "Writes avoided vs redundant (bytes/s)",
                "The same as bytes per second (pages x the configured page size; zero when "
                "metrics.page_size_bytes is not set).",
                "binBps",
                (
                    _t(rate(family("write_avoided_bytes")), "{{pool}} avoided"),
                    _t(rate(family("written_bytes")), "{{pool}} written"),
                    _t(rate(family("redundant_written_bytes")), "{{pool}} redundant"),
                ),
            ),
            Panel(
                "Entries vs cap",
                "Page hashes believed stored and the cap, per pool, on the fullest selected "
                "replica (seed generation: the cap is shared by every pool).",
                "short",
                (
                    _t(f"max by (pool) ({selector(ENTRIES)})", "{{pool}} entries"),
                    _t(f"max by (pool) ({selector(CAPACITY)})", "{{pool}} cap"),
                ),
            ),
            Panel(
                "Fill",
                "Entries over cap per pool, on the fullest selected replica (where the pools "
                "share one cap, sglang 0.5.19-0.5.21: all pools' entries over it). At 100% "
                "every insert evicts the least recently used entry.",
                "percentunit",
                (
                    _t(
                        "max by (pool) "
                        f"({fill(selector(ENTRIES), selector(CAPACITY), selector(MODE))})",
                        "{{pool}}",
                    ),
                ),
                type="stat",
                ratio=True,
                steps=((None, "green"), (s.at_cap_fill, "orange")),
            ),
            Panel(
                "Memory",
                "Estimated memory of the beliefs (entries x measured bytes per entry, plus "
                "the miss-reason memory) and of the miss-reason memory alone, summed over the "
                "selected ranks.",
                "bytes",
                (
                    _t(f"sum by (pool) ({selector(family('memory_bytes'))})", "{{pool}} total"),
                    _t(
                        f"sum by (pool) ({selector(family('miss_memory_bytes'))})",
                        "{{pool}} miss-reason memory",
                    ),
                ),
            ),
            Panel(
                "In-flight pages",
                "Distinct pages with in-flight writes (D2H launched, storage ack pending), "
                "summed over the selected ranks.",
                "short",
                (_t(f"sum by (pool) ({selector(family('inflight_pages'))})", "{{pool}}"),),
            ),
            Panel(
                "Rescues (pages/s)",
                "Examined pages not believed but covered by an in-flight write: lookups the "
                "in-flight refs saved from a redundant write.",
                "ops",
                (_t(rate(family("page_rescues")), "{{pool}}"),),
            ),
            Panel(
                "Redundant writes by cause (pages/s)",
                "Why pages L3 already held were written again (docs/metrics.md, causes): a "
                "prefetch that fell short or was below the threshold, a recompute, a node "
                "whose host copy was reclaimed (write_back), another instance's page, or a "
                "node written whole around believed pages. The causes add up to the redundant "
                "pages; 'believed' beside them are the pages the existence cache believed "
                "stored (in cache mode without cache_mode.dedup: what dedup would save).",
                "ops",
                (
                    _t(rate(REDUNDANT_CAUSES, ("cause",)), "{{cause}}"),
                    _t(rate(family("redundant_believed_pages"), ()), "believed (dedup would save)"),
                ),
                width=12,
            ),
            Panel(
                "Host memory mode",
                "Instances by HiCache host memory mode (buffer_only or cache), write policy "
                "and cache_mode.dedup: the write panels count L3 writes in both modes; in "
                "cache mode with dedup on, believed pages are left out of the write (avoided).",
                "short",
                (
                    _t(
                        f"count by (host_memory_mode, write_policy, cache_mode_dedup) "
                        f"({selector(family('mode_info'))})",
                        "{{host_memory_mode}} {{write_policy}} dedup={{cache_mode_dedup}}",
                    ),
                ),
                type="bargauge",
                width=12,
            ),
        ),
    )
    churn = Row(
        "Churn",
        (
            Panel(
                "Evictions per second",
                "Entries dropped by the cap (least recently used first), per pool.",
                "ops",
                (_t(rate(EVICTIONS), "{{pool}}"),),
            ),
            Panel(
                "Misses by reason (pages/s)",
                "Page misses by reason: cold (never believed), evicted (dropped by the cap: "
                "capacity misses), invalidated (heals), cleared, unclassified (no miss-reason "
                "memory).",
                "ops",
                (_t(rate(PAGE_MISSES, ("pool", "reason")), "{{pool}} {{reason}}"),),
            ),
            Panel(
                "Capacity misses per lookup",
                "Evicted-reason misses over lookups, per pool: the eviction-churn signal. The "
                f"line is the alert threshold ({s.churn_ratio:.0%} for {s.churn_for}); when it "
                "stays above, a larger cap would turn these misses into hits (see capacity "
                "advice).",
                "percentunit",
                (
                    _t(
                        _ratio(rate(PAGE_MISSES, reason=REASON_EVICTED), rate(QUERIES)),
                        "{{pool}}",
                    ),
                ),
                ratio=True,
                threshold=s.churn_ratio,
            ),
            Panel(
                "Inserts vs refreshes (pages/s)",
                "Pages added that were not believed (inserts: new or re-learnt after an "
                "eviction) and pages added that were already believed (refreshes).",
                "ops",
                (
                    _t(rate(family("page_inserts")), "{{pool}} inserts"),
                    _t(rate(family("page_refreshes")), "{{pool}} refreshes"),
                ),
                width=12,
            ),
            Panel(
                "Invalidations and clears (entries/s)",
                "Entries dropped by invalidate_beyond (heals after a prefetch shortfall) and "
                "by clears.",
                "ops",
                (
                    _t(rate(family("invalidations")), "{{pool}} invalidated"),
                    _t(rate(family("cleared_pages")), "{{pool}} cleared"),
                ),
                width=12,
            ),
        ),
    )
    tp = Row(
        "TP health",
        (
            Panel(
                "Divergence checks per second",
                "Cross-rank replica checks completed, per TP rank. Every rank of a group "
                "checks at the same steps (every divergence.interval_steps scheduler steps).",
                "ops",
                (_t(rate(DIV_CHECKS, ("tp_rank",)), "tp {{tp_rank}}"),),
            ),
            Panel(
                "Divergences and heals",
                "Checks that found replicas differing, and heals (diverged pools cleared on "
                "every rank at the same step), per interval. Any divergence pages (critical).",
                "short",
                (
                    _t(increase(family("divergences"), ("tp_rank",)), "tp {{tp_rank}} divergences"),
                    _t(increase(family("divergence_heals"), ("tp_rank",)), "tp {{tp_rank}} heals"),
                ),
            ),
            Panel(
                "Checking",
                "Whether each rank still compares its replica with the others: stopped after "
                "a failed check collective or a start-up configuration mismatch (it stays "
                "stopped until restart; a warning alert fires after "
                f"{s.checks_stopped_for}).",
                "short",
                (
                    _t(
                        f"min by (tp_rank) ({selector(family('divergence_active'))})",
                        "tp {{tp_rank}}",
                    ),
                ),
                type="stat",
                mappings=(
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "stopped", "color": "red", "index": 0},
                            "1": {"text": "checking", "color": "green", "index": 1},
                        },
                    },
                ),
                steps=((None, "red"), (1, "green")),
            ),
            Panel(
                "Check failures and config mismatches",
                "Checks whose collective failed, by reason (timeout: a peer did not arrive "
                "within divergence.timeout_s; error), and start-up handshakes that found the "
                "ranks configured differently, per interval. Either stops the checks.",
                "short",
                (
                    _t(
                        increase(family("divergence_check_failures"), ("tp_rank", "reason")),
                        "tp {{tp_rank}} {{reason}}",
                    ),
                    _t(
                        increase(family("divergence_config_mismatches"), ("tp_rank",)),
                        "tp {{tp_rank}} config mismatch",
                    ),
                ),
            ),
            Panel(
                "Last checked and detected step",
                "Scheduler step of each rank's last completed check (ranks of one group move "
                "together) and of its last detected divergence (0: none).",
                "short",
                (
                    _t(
                        f"max by (tp_rank) ({selector(family('divergence_last_check_step'))})",
                        "tp {{tp_rank}} checked",
                    ),
                    _t(
                        f"max by (tp_rank) ({selector(family('divergence_last_detected_step'))})",
                        "tp {{tp_rank}} detected",
                    ),
                ),
            ),
            Panel(
                "Mean check duration",
                "Seconds spent in checks over checks completed, per rank (the gloo "
                "all-reduce, waiting for peers included): a rising line means a peer "
                "arrives late.",
                "s",
                (
                    _t(
                        _ratio(rate(DIV_SECONDS, ("tp_rank",)), rate(DIV_CHECKS, ("tp_rank",))),
                        "tp {{tp_rank}}",
                    ),
                ),
            ),
        ),
    )
    answered = regex(ANSWERED_RESULTS)
    reconciler = Row(
        "Reconciler",
        (
            Panel(
                "Verifications by result",
                "Ground-truth verifications per second by result. Answered: present (every "
                "page in L3), absent (a page is missing: stale positives come from these), "
                "untrusted (short while the ledger cannot prove absence). Failed: error, "
                "timeout, rejected (circuit open). void: discarded, the pool was cleared.",
                "ops",
                (_t(rate(REC_QUERIES, ("result",)), "{{result}}"),),
            ),
            Panel(
                "Stale positives per answered verification",
                "Verifications that removed a belief L3 lacks, over answered verifications "
                "(present + absent + untrusted), per pool. The line is the alert threshold "
                f"({s.stale_ratio:.0%} for {s.stale_for}).",
                "percentunit",
                (
                    _t(
                        _ratio(rate(REC_STALE), rate(REC_QUERIES, result=answered)),
                        "{{pool}}",
                    ),
                ),
                ratio=True,
                threshold=s.stale_ratio,
            ),
            Panel(
                "Pages invalidated and learnt (pages/s)",
                "Beliefs dropped because L3 lacks the page, and pages added because L3 holds "
                "them (written by another instance, or evicted from the beliefs). Withheld: "
                "absence verdicts not acted on because the page the answer stopped at was "
                "being written (in flight, or acknowledged since the query), so the answer was "
                "stale and the beliefs past it are kept (verifications/s, docs/reconciler.md).",
                "ops",
                (
                    _t(rate(family("reconciler_pages_invalidated")), "{{pool}} invalidated"),
                    _t(rate(REC_LEARNT), "{{pool}} learnt"),
                    _t(rate(family("reconciler_verdicts_withheld")), "{{pool}} withheld"),
                ),
            ),
            Panel(
                "Query latency",
                "Time one ground-truth query takes, from the latency histogram over the "
                "selected ranks (worker thread; the scheduler never waits). Near "
                "reconciler.timeout_ms: ground truth is slow.",
                "s",
                (
                    _t(quantile(0.5, REC_SECONDS), "p50"),
                    _t(quantile(0.99, REC_SECONDS), "p99"),
                ),
                width=6,
            ),
            Panel(
                "Errors by kind",
                "Ground-truth errors per second by kind (connection, timeout, garbage, "
                "ledger_empty, ...). An error is never evidence of absence.",
                "ops",
                (_t(rate(family("reconciler_errors"), ("kind",)), "{{kind}}"),),
                width=6,
            ),
            Panel(
                "Outstanding verifications",
                "Verifications queued or in flight, per rank (bounded by reconciler.queue_size).",
                "short",
                (
                    _t(
                        f"max by (tp_rank) ({selector(family('reconciler_outstanding_queries'))})",
                        "tp {{tp_rank}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Circuit",
                "Circuit breaker on the selected ranks: open (or half-open) means ground "
                "truth kept failing and verifications are rejected until a probe succeeds.",
                "short",
                (_t(f"max({selector(REC_CIRCUIT)})", "circuit"),),
                type="stat",
                width=6,
                mappings=(
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "closed", "color": "green", "index": 0},
                            "1": {"text": "open", "color": "red", "index": 1},
                        },
                    },
                ),
                steps=((None, "green"), (1, "red")),
            ),
        ),
    )
    fleet = Row(
        "Fleet",
        (
            Panel(
                "Fleet L3 writes (pages/s)",
                "Summed over the selected instances and ranks (the instance variable at All: "
                "every prefill instance of the deployment): pages written to the shared L3, the "
                "redundant ones among them (L3 already held the page: another instance, or "
                "this one, wrote it before) and the writes the beliefs avoided.",
                "ops",
                (
                    _t(rate(WRITTEN_PAGES, ()), "written"),
                    _t(rate(REDUNDANT_PAGES, ()), "redundant"),
                    _t(rate(AVOIDED_PAGES, ()), "avoided"),
                ),
            ),
            Panel(
                "Fleet redundant write ratio",
                "Redundant written pages over written pages, fleet-wide. Instances sharing one "
                "L3 write each other's pages again when a request lands on an instance that "
                "does not believe them stored (round-robin routing spreads a conversation over "
                "instances). The line is the alert threshold "
                f"({s.fleet_redundant_ratio:.0%} for {s.fleet_redundant_for}).",
                "percentunit",
                (_t(_ratio(rate(REDUNDANT_PAGES, ()), rate(WRITTEN_PAGES, ())), "fleet"),),
                ratio=True,
                threshold=s.fleet_redundant_ratio,
            ),
            Panel(
                "Share of the fleet's redundant writes by instance",
                "Each instance's redundant written pages over the fleet's: an even split means "
                "the cause is fleet-wide (routing); one instance "
                "far above 1/N points at that instance (a small cap, restarts, a cleared cache).",
                "percentunit",
                (
                    _t(
                        f"{rate(REDUNDANT_PAGES, ('instance',))}\n"
                        f"/ ignoring (instance) group_left\n{rate(REDUNDANT_PAGES, ())}",
                        "{{instance}}",
                    ),
                ),
                ratio=True,
            ),
            Panel(
                "Pages learnt from the shared ledger by instance (pages/s)",
                "Pages the reconciler added to an instance's beliefs because L3 (the ledger) "
                "holds them: with reconciler.learn on, what other instances wrote.",
                "ops",
                (_t(rate(REC_LEARNT, ("instance",)), "{{instance}}"),),
                width=24,
            ),
        ),
    )
    advice = Row(
        "Capacity advice",
        (
            Panel(
                "Estimated lookup hit ratio by cap",
                "The advisor's live estimate (SHARDS) of the hit ratio lookups alone would have "
                "had with an LRU of each multiple of the current cap (cap_multiplier 0.25x to "
                "8x), per pool. In buffer mode size the cap by this curve: a lookup miss is what "
                "triggers an L3 write (docs/capacity.md).",
                "percentunit",
                (
                    _t(
                        f"max by (pool, cap_multiplier) ({selector(ADVISOR_LOOKUP)})",
                        "{{pool}} x{{cap_multiplier}}",
                    ),
                ),
                ratio=True,
            ),
            Panel(
                "Estimated hit ratio by cap (reference stream)",
                "The same estimate over the cache's whole reference stream (lookups and adds, "
                "prefetch healing included), per pool. It rises with the cap partly by turning "
                "healing adds into refreshes, which save nothing: read it with the lookup curve.",
                "percentunit",
                (
                    _t(
                        f"max by (pool, cap_multiplier) ({selector(ADVISOR)})",
                        "{{pool}} x{{cap_multiplier}}",
                    ),
                ),
                ratio=True,
            ),
            Panel(
                "Advisor dropped references (pages/s)",
                "Sampled page references the advisor could not record, per rank (its sampler "
                "could not allocate memory): while this is above zero the estimates are biased "
                "low (lower advisor.max_sampled_pages or advisor.sampling_rate, or give the "
                "scheduler process more memory).",
                "ops",
                (_t(rate(family("advisor_dropped_references"), ("tp_rank",)), "tp {{tp_rank}}"),),
            ),
            Panel(
                "Estimated lookup hit ratio now, by cap",
                "The latest lookup-curve estimate per cap multiple: still rising at 2x or 4x "
                "means a larger cap pays; flat means the cap already holds the reuse.",
                "percentunit",
                (
                    _t(
                        f"max by (pool, cap_multiplier) ({selector(ADVISOR_LOOKUP)})",
                        "{{pool}} x{{cap_multiplier}}",
                    ),
                ),
                type="bargauge",
                width=6,
                ratio=True,
            ),
            Panel(
                "Gain from doubling the cap",
                "Estimated lookup hit ratio at 2x the cap minus at 1x, per pool (percentage "
                "points; above 1x the estimate understates the gain, docs/capacity.md).",
                "percentunit",
                (
                    _t(
                        f"{advisor_at(CAP_DOUBLE)}\n-\n{advisor_at(CAP_NOW)}",
                        "{{pool}}",
                    ),
                ),
                type="stat",
                width=6,
                steps=((None, "green"), (s.doubling_gain, "orange")),
            ),
            Panel(
                "Recommended cap (entries)",
                "Per pool: the current cap, and the smallest multiple of it (0.25x to 8x) "
                "whose estimated lookup hit ratio is within "
                f"{advisor.ADVICE_TOLERANCE * 100:g} percentage point(s) of the best estimate. At "
                "8x the curve may still rise beyond; below 1x the cap could shrink.",
                "short",
                (
                    _t(f"max by (pool) ({selector(CAPACITY)})", "{{pool}} now"),
                    _t(
                        recommended(lambda m: f"{m} * max by (pool) ({selector(CAPACITY)})"),
                        "{{pool}} recommended",
                    ),
                ),
                type="stat",
                width=6,
            ),
            Panel(
                "Estimated lookup hit ratio at the recommended cap",
                "Per pool: the estimated lookup hit ratio at the current cap and at the "
                "recommended cap (the panel to the left).",
                "percentunit",
                (
                    _t(advisor_at(CAP_NOW), "{{pool}} now"),
                    _t(recommended(advisor_at), "{{pool}} recommended"),
                ),
                type="stat",
                width=6,
                ratio=True,
            ),
        ),
    )
    return (overview, churn, tp, reconciler, fleet, advice, every_family())


def every_family() -> Row:
    """One small panel per exported family, built from the catalog alone: a new
    metric is on the dashboard the moment it is declared (its curated panels, if
    any, live in the rows above)."""
    helps = {s.name: s.help for s in (*catalog.CATALOG, *catalog.FEATURE_CATALOG)}
    panels = []
    for m in METRICS:
        group = tuple(label for label in m.labels)
        if m.kind == "counter":
            expr = rate(m, group)
            unit = "binBps" if m.name.endswith("_bytes") else "short"
            if m.name.endswith("_seconds"):
                unit = "percentunit"  # seconds per second: the share of time spent
            what = "per-second rate"
        elif m.kind == "gauge":
            expr = f"max {by(group)}({selector(m)})"
            unit = "bytes" if m.name.endswith("_bytes") else "short"
            what = "value (max over ranks)"
        else:
            expr = quantile(0.99, m)
            unit, what = "s", "99th percentile"
        legend = " ".join("{{" + label + "}}" for label in group) or m.name
        # Four to a line; the last line's panels share its width (no stray panel).
        last = len(METRICS) % 4 or 4
        width = 6 if len(panels) < len(METRICS) - last else 24 // last
        panels.append(
            Panel(
                m.sample,
                f"{helps[m.name]} ({what}; generated from the catalog)",
                unit,
                (_t(expr, legend),),
                width=width,
                height=6,
            )
        )
    return Row("Every exported family", tuple(panels))


# -- dashboard JSON --------------------------------------------------------------


def _variable(name: str, metric: Metric, parents: Sequence[str]) -> dict[str, Any]:
    filters = ", ".join(f'{p}=~"${p}"' for p in parents)
    query = f"label_values({metric.sample}{{{filters}}}, {name})" if filters else None
    query = query or f"label_values({metric.sample}, {name})"
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": query,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
        "skipUrlSync": False,
    }


def templating() -> list[dict[str, Any]]:
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "options": [],
        "refresh": 1,
        "regex": "",
        "hide": 0,
        "skipUrlSync": False,
    }
    out: list[dict[str, Any]] = [datasource]
    for i, name in enumerate(DASHBOARD_VARIABLES):
        out.append(_variable(name, QUERIES, DASHBOARD_VARIABLES[:i]))
    return out


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.ratio:
        defaults.update(min=0, max=1)
    if panel.type == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "fillOpacity": 10, "lineWidth": 1}
        if panel.threshold is not None:
            defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
            defaults["thresholds"] = {
                "mode": "absolute",
                "steps": [
                    {"color": "green", "value": None},
                    {"color": "red", "value": panel.threshold},
                ],
            }
    if panel.steps:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for v, c in panel.steps],
        }
    if panel.mappings:
        defaults["mappings"] = list(panel.mappings)
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.type == "stat":
        return {
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": reduce,
            "textMode": "auto",
        }
    if panel.type == "bargauge":
        return {
            "displayMode": "gradient",
            "orientation": "horizontal",
            "reduceOptions": reduce,
            "showUnfilled": True,
        }
    return {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    instant = panel.type != "timeseries"
    targets = [
        {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": t.expr,
            "legendFormat": t.legend,
            "range": not instant,
            "instant": instant,
            "refId": chr(ord("A") + i),
        }
        for i, t in enumerate(panel.targets)
    ]
    return {
        "id": pid,
        "type": panel.type,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": _field_config(panel),
        "options": _options(panel),
        "targets": targets,
    }


def _layout(all_rows: Sequence[Row]) -> Iterator[dict[str, Any]]:
    y = 0
    for row in all_rows:
        yield {
            "id": row.id,
            "type": "row",
            "title": row.title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
            "panels": [],
        }
        y, x, line = y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + line
                line = 0
            yield _panel_json(panel, panel.id, x, y)
            x, line = x + panel.width, max(line, panel.height)
        y += line


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's classic JSON model."""
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "SGLang HiCache storage-existence cache: hit ratio, churn, TP-replica "
        "health, ground-truth reconciliation and capacity advice (hicache-existence).",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": list(_layout(rows())),
        "refresh": "30s",
        "schemaVersion": 41,
        "tags": ["sglang", "hicache", "hicache-existence"],
        "templating": {"list": templating()},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "SGLang HiCache existence cache",
        "uid": "hicache-existence",
        "version": 1,
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


# -- Prometheus rules -------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: Literal["critical", "warning", "info"]
    summary: str
    description: str


def _sum_rate(metric: Metric, keep: Sequence[str], window: str = "5m", **matchers: str) -> str:
    inner = metric.sample
    if matchers:
        inner += "{" + ", ".join(f'{k}="{v}"' for k, v in matchers.items()) + "}"
    return f"sum by ({', '.join(keep)}) (rate({inner}[{window}]))"


def _rec(metric: Metric, level: str = "pool") -> str:
    """The name of the 5m-rate recording of ``metric`` at ``level``."""
    return f"{level}:{metric.name}:rate5m"


HIT_RATIO = f"pool:{PAGE_HITS.name}_per_{PAGES_CHECKED.name.removeprefix(P)}:ratio_rate5m"
CHURN_RATIO = f"pool:{P}capacity_misses_per_query:ratio_rate5m"
REDUNDANT_RATIO = (
    f"pool:{REDUNDANT_PAGES.name}_per_{WRITTEN_PAGES.name.removeprefix(P)}:ratio_rate5m"
)
ANSWERED_RATE = f"pool:{P}reconciler_answered_queries:rate5m"
STALE_RATIO = f"pool:{REC_STALE.name}_per_answered_query:ratio_rate5m"
FILL_RATIO = f"pool:{ENTRIES.name}_per_{CAPACITY.name.removeprefix(P)}:ratio"


def recordings() -> tuple[Recording, ...]:
    """Per-pool 5m rates and ratios, summed over ranks and instances."""
    keep = judgements.SETTINGS.keep
    rated = (
        QUERIES,
        PAGES_CHECKED,
        PAGE_HITS,
        EVICTIONS,
        WRITTEN_PAGES,
        AVOIDED_PAGES,
        REDUNDANT_PAGES,
        REC_STALE,
    )
    out = [Recording(_rec(m), _sum_rate(m, keep)) for m in rated]
    out.append(
        Recording(_rec(PAGE_MISSES, "pool_reason"), _sum_rate(PAGE_MISSES, (*keep, "reason")))
    )
    out.append(
        Recording(_rec(REC_QUERIES, "pool_result"), _sum_rate(REC_QUERIES, (*keep, "result")))
    )
    out.append(
        Recording(
            _rec(REDUNDANT_CAUSES, "pool_cause"), _sum_rate(REDUNDANT_CAUSES, (*keep, "cause"))
        )
    )
    answered = "|".join(ANSWERED_RESULTS)
    out += [
        Recording(
            ANSWERED_RATE,
            f'sum without (result) ({_rec(REC_QUERIES, "pool_result")}{{result=~"{answered}"}})',
        ),
        Recording(HIT_RATIO, f"{_rec(PAGE_HITS)}\n/\n{_rec(PAGES_CHECKED)}"),
        Recording(
            CHURN_RATIO,
            f"sum without (reason) ({_rec(PAGE_MISSES, 'pool_reason')}"
            f'{{reason="{REASON_EVICTED}"}})\n/\n{_rec(QUERIES)}',
        ),
        Recording(REDUNDANT_RATIO, f"{_rec(REDUNDANT_PAGES)}\n/\n{_rec(WRITTEN_PAGES)}"),
        Recording(STALE_RATIO, f"{_rec(REC_STALE)}\n/\n{ANSWERED_RATE}"),
        Recording(
            FILL_RATIO,
            f"max by ({', '.join(keep)}) "
            f"(\n{fill(ENTRIES.sample, CAPACITY.sample, MODE.sample)}\n)",
        ),
    ]
    return tuple(out)


def placeholders() -> dict[str, str]:
    """The recording rules and label sets the alerts' texts name (``%(name)s``)."""
    s = judgements.SETTINGS
    return {
        "churn": CHURN_RATIO,
        "hit_ratio": HIT_RATIO,
        "redundant": REDUNDANT_RATIO,
        "stale": STALE_RATIO,
        "answered_rate": ANSWERED_RATE,
        "fill": FILL_RATIO,
        "rate_queries": _rec(QUERIES),
        "rate_written": _rec(WRITTEN_PAGES),
        "deployment": ", ".join(k for k in s.keep if k != "pool"),
        "failed": "|".join(FAILED_RESULTS),
        "answered": "|".join(ANSWERED_RESULTS),
    }


def alerts() -> tuple[Alert, ...]:
    """Every alert of the judgements' table (``hicache_existence.doctor.judgements``),
    its texts filled from ``SETTINGS`` and the recording rules and label sets here."""
    names = placeholders()
    out = []
    for j, a in judgements.alerting():
        out.append(
            Alert(
                a.name,
                j.render(a.expr, names),
                j.render(f"%({a.for_})s", names) if a.for_ else "0m",
                j.severity,
                j.render(a.summary, names),
                j.render(a.description, names),
            )
        )
    return tuple(out)


runbook_anchor = judgements.runbook_anchor


def rules() -> dict[str, Any]:
    """The rule groups as Prometheus loads them."""
    base = judgements.SETTINGS.runbook_url
    return {
        "groups": [
            {
                "name": "hicache-existence.rules",
                "rules": [{"record": r.record, "expr": r.expr} for r in recordings()],
            },
            {
                "name": "hicache-existence.alerts",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": {
                            "summary": a.summary,
                            "description": a.description,
                            "runbook_url": f"{base}#{runbook_anchor(a.name)}",
                        },
                    }
                    for a in alerts()
                ],
            },
        ]
    }


RULES_HEADER = (
    "# Generated by dashboards/build.py (edit it there, then run `python dashboards/build.py`).\n"
    "# tests/test_dashboards.py fails when this file differs from the build output.\n"
    "# Recording rules: level:metric:operations; level `pool` keeps "
    + ", ".join(SETTINGS.keep)
    + "\n# and sums over ranks and instances. Alerts: docs/runbooks.md.\n"
)


def _yaml(data: Any) -> str:
    """``data`` as YAML, multi-line strings as literal blocks, keys in order."""
    import yaml  # a dev dependency; only the build needs it

    class Dumper(yaml.SafeDumper):  # type: ignore[misc]  # untyped without stubs
        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            super().increase_indent(flow, False)

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return str(yaml.dump(data, Dumper=Dumper, sort_keys=False, width=1000, allow_unicode=True))


def rules_text() -> str:
    return RULES_HEADER + _yaml(rules())


def rule_tests_text() -> str:
    """integrations/prometheus/tests.yml: the rules' promtool unit tests, every figure
    placed against ``SETTINGS`` (dashboards/rule_tests.py)."""
    tests = _script(_RULE_TESTS_SCRIPT)
    return str(tests.HEADER) + _yaml(tests.suite(rules(), placeholders()))


# -- command line -------------------------------------------------------------------


def outputs() -> dict[Path, str]:
    """Every generated file and its content as built now."""
    rules = rules_text()
    return {
        DASHBOARD_PATH: dashboard_text(),
        RULES_PATH: rules,
        RULE_TESTS_PATH: rule_tests_text(),
        PROMETHEUSRULE_PATH: _prometheusrule(rules),
        METRICS_DOC_PATH: docs_tables.replace_between(
            METRICS_DOC_PATH.read_text(encoding="utf-8"), "catalog", docs_tables.metrics_table()
        ),
        CONFIG_DOC_PATH: docs_tables.replace_between(
            CONFIG_DOC_PATH.read_text(encoding="utf-8"), "config", docs_tables.config_table()
        ),
        DESIGN_DOC_PATH: docs_tables.replace_between(
            DESIGN_DOC_PATH.read_text(encoding="utf-8"), "stats", docs_tables.stats_table()
        ),
        DOCTOR_DOC_PATH: docs_tables.replace_between(
            DOCTOR_DOC_PATH.read_text(encoding="utf-8"),
            "thresholds",
            docs_tables.thresholds_table(),
        ),
        RUNBOOKS_PATH: docs_tables.replace_between(
            docs_tables.replace_between(
                RUNBOOKS_PATH.read_text(encoding="utf-8"), "alerts", docs_tables.alerts_table()
            ),
            "settings",
            docs_tables.settings_table(),
        ),
        CONTRIBUTING_PATH: docs_tables.replace_between(
            CONTRIBUTING_PATH.read_text(encoding="utf-8"), "ci-legs", _script(_LEGS_SCRIPT).table()
        ),
    }


def _script(path: Path) -> Any:
    """A helper script of the repository, loaded as a module."""
    import importlib.util

    name = f"hx_build_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _prometheusrule(rules: str) -> str:
    """The Kubernetes PrometheusRule embedding ``rules`` (one source for both)."""
    return str(_script(_RENDER_SCRIPT).render(rules))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} differs from its sources; run python dashboards/build.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
