"""``hicache-existence doctor`` from exposition text: the parser, the figures, every
finding, the ranking, the JSON document and the exit status.

Fast: no sglang, no real server (tests/real_server/test_doctor_servers.py runs the
command against real ones).  The CLI tests serve canned bodies from a loopback
``http.server`` in a thread: real HTTP, bodies chosen by the test.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import threading
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hicache_existence.accounting.advisor import recommended_multiple
from hicache_existence.cli import main
from hicache_existence.doctor import diagnosis, model, rules, scrape
from hicache_existence.doctor import figures as fg
from hicache_existence.doctor import judgements as J
from hicache_existence.doctor import report as report_module
from hicache_existence.doctor.exposition import MAX_BODY_BYTES, ExpositionError, parse

DEPLOY = {"model_name": "m", "engine_type": "unified", "dp_rank": "0", "pp_rank": "0"}
P = "hicache_existence_"
Row = tuple[str, Mapping[str, str], float]


def expo(rows: Sequence[Row], ranks: Sequence[int] = (0,)) -> str:
    """Exposition text: every row once per TP rank, with the deployment labels."""
    out = []
    for rank in ranks:
        for name, labels, value in rows:
            if name.startswith("sglang:") and name.startswith(("sglang:backuped", "sglang:pref")):
                lab = {"storage_backend": "file", "tp_rank": str(rank), **labels}
            elif name.startswith("sglang:"):
                lab = {"tp_rank": str(rank), **labels}
            else:
                lab = {**DEPLOY, "tp_rank": str(rank), "storage_backend": "file", **labels}
            inner = ",".join(f'{k}="{v}"' for k, v in lab.items())
            shown = "NaN" if math.isnan(value) else repr(value)
            out.append(f"{name}{{{inner}}} {shown}")
    return "\n".join(out) + "\n"


def healthy_rows(written: float = 1000, redundant: float = 10) -> list[Row]:
    """A busy buffer-mode server with little to say: 1% redundant, L3 read back."""
    kv = {"pool": "kv"}
    return [
        (P + "queries_total", kv, 5000),
        (P + "pages_checked_total", kv, 9000),
        (P + "page_hits_total", kv, 6000),
        (P + "page_misses_total", {**kv, "reason": "cold"}, 3000),
        (P + "page_misses_total", {**kv, "reason": "evicted"}, 0),
        (P + "page_inserts_total", kv, 990),
        (P + "evictions_total", kv, 0),
        (P + "entries", kv, 990),
        (P + "capacity_entries", kv, 65536),
        (P + "written_pages_total", kv, written),
        (P + "written_bytes_total", kv, written * 4096),
        (P + "write_acknowledged_pages_total", kv, written),
        (P + "write_acknowledged_bytes_total", kv, written * 4096),
        (P + "write_failed_pages_total", kv, 0),
        (P + "write_failed_bytes_total", kv, 0),
        (P + "redundant_written_pages_total", kv, redundant),
        (P + "redundant_written_bytes_total", kv, redundant * 4096),
        (P + "redundant_believed_pages_total", kv, redundant),
        (P + "write_avoided_pages_total", kv, 400),
        ("sglang:backuped_tokens_total", {}, written * 16),
        ("sglang:prefetched_tokens_total", {}, written * 8),
        ("sglang:storage_prefetch_hit_tokens_total", {}, written * 8),
    ]


def replace(rows: list[Row], name: str, value: float, **labels: str) -> list[Row]:
    """``rows`` with the row ``name{labels}`` set to ``value`` (added if absent)."""
    out, done = [], False
    for n, lab, v in rows:
        if n == name and all(lab.get(k) == x for k, x in labels.items()):
            out.append((n, lab, value))
            done = True
        else:
            out.append((n, lab, v))
    if not done:
        out.append((name, labels, value))
    return out


def report(*bodies: str, first: Sequence[str | None] | None = None) -> model.Report:
    readings = []
    for i, body in enumerate(bodies):
        before = None if first is None else first[i]
        readings.append(
            fg.Reading(
                f"http://10.0.0.{i + 1}:30000/metrics",
                parse(body),
                None if before is None else parse(before),
                2.0 if before is not None else 0.0,
            )
        )
    return diagnosis.diagnose(readings)


def found(rep: model.Report, fid: str) -> list[model.Finding]:
    return [f for f in rep.findings if f.id == fid]


def evidence(f: model.Finding) -> dict[str, float]:
    return {e.series: e.value for e in f.evidence}


# -- the parser ------------------------------------------------------------------------


def test_parser_agrees_with_prometheus_client_on_its_own_output() -> None:
    """Counters, labelled gauges, a histogram and escaped label values rendered by
    prometheus_client parse to the values prometheus_client's parser reads."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    reg = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("x_pages", "h", ["pool", "odd"], registry=reg)
    c.labels("kv", 'a"b\\c\nd').inc(3)
    c.labels("swa", "").inc(2**40 + 1)
    g = prometheus_client.Gauge("y_entries", "h", registry=reg)
    g.set(float("nan"))
    h = prometheus_client.Histogram("z_seconds", "h", registry=reg)
    h.observe(0.2)
    text = prometheus_client.generate_latest(reg).decode()
    mine = {(s.name, s.labels): s.value for s in parse(text).samples}
    theirs = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert mine[key] == value or (math.isnan(mine[key]) and math.isnan(value)), key
    assert mine[("x_pages_total", (("odd", 'a"b\\c\nd'), ("pool", "kv")))] == 3.0
    assert mine[("x_pages_total", (("odd", ""), ("pool", "swa")))] == 2**40 + 1


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ("<!DOCTYPE html>\n<html><body>hello</body></html>\n", "not a sample"),
        ('{"status": "success"}\n', "not a sample"),
        ('metric{a="b"\n', "expected , or }"),
        ('metric{a="b 1\n', "unterminated"),
        ('metric{a="b"} \n', "no value"),
        ("metric\n", "no value"),
        ("metric abc\n", "bad value"),
        ("metric 1_000\n", "bad value"),
        ("metric 1 2 3\n", "bad value"),
        ("metric 1 1.5\n", "bad timestamp"),
        ('metric{a="\\x"} 1\n', "bad escape"),
        ('metric{a="1",a="2"} 1\n', "twice"),
        ('metric{1a="1"} 1\n', "bad label name"),
        ('metric{a="1" b="2"} 1\n', "expected , or }"),
        ("metric 1\nmetric 2\n", "duplicate sample"),
        ("# TYPE metric counter\n# TYPE metric gauge\n", "second TYPE"),
        ("# TYPE metric banana\n", "bad TYPE"),
        ("metric 1\x00\n", "NUL"),
    ],
)
def test_parser_refuses_what_is_not_the_format(body: str, what: str) -> None:
    """HTML, JSON, truncated or malformed samples, duplicates and bad TYPE lines are
    an ExpositionError naming the problem (never another exception)."""
    with pytest.raises(ExpositionError, match=what):
        parse(body)


def test_parser_refuses_bytes_that_are_not_utf8_and_bodies_too_large() -> None:
    """Bytes that do not decode, and a body over the size bound, are refused."""
    with pytest.raises(ExpositionError, match="UTF-8"):
        parse(b"metric 1\n\xff\xfe\n")
    with pytest.raises(ExpositionError, match="larger"):
        parse(b"#" * (MAX_BODY_BYTES + 1))


def test_parser_reads_values_timestamps_comments_and_openmetrics_eof() -> None:
    """NaN, +Inf, -Inf, exponents, timestamps, CRLF line ends, a trailing comma in
    labels, HELP/other comments and OpenMetrics' '# EOF' are accepted."""
    body = (
        "# HELP a some help\r\n# a free comment\r\n"
        'a{x="1",} +Inf 1700000000000\r\nb -Inf\nc NaN\nd 1.5e3\ne .5\n# EOF\n'
    )
    values = {s.name: s.value for s in parse(body).samples}
    assert values["a"] == math.inf and values["b"] == -math.inf and math.isnan(values["c"])
    assert (values["d"], values["e"]) == (1500.0, 0.5)


def test_empty_body_and_partial_families_parse_and_are_judged_unreadable_or_read() -> None:
    """An empty body parses to nothing and the doctor refuses it (no series); a body
    with half a histogram and a written counter without its bytes still diagnoses."""
    assert parse("").samples == ()
    assert fg.readable(parse("")) is not None
    assert fg.readable(parse("process_cpu_seconds_total 1\n")) is not None
    partial = (
        "# TYPE hicache_existence_reconciler_query_seconds histogram\n"
        'hicache_existence_reconciler_query_seconds_bucket{le="0.1"} 3\n'
        'hicache_existence_written_pages_total{pool="kv"} 100\n'
        'hicache_existence_redundant_written_pages_total{pool="kv"} 50\n'
    )
    rep = report(partial)
    (f,) = found(rep, "redundant_writes")
    assert f.severity == "warning" and f.wasted_bytes == 0.0


# -- figures -----------------------------------------------------------------------------


def test_figures_sum_counters_over_ranks_take_gauges_max_and_active_min() -> None:
    """Two TP ranks: a counter is the sum of both, a gauge the largest, and
    divergence_active the smallest (one stopped rank shows)."""
    text = expo([(P + "written_pages_total", {"pool": "kv"}, 7)], ranks=(0, 1))
    text += expo([(P + "entries", {"pool": "kv"}, 10), (P + "divergence_active", {}, 1)], (0,))
    text += expo([(P + "entries", {"pool": "kv"}, 12), (P + "divergence_active", {}, 0)], (1,))
    figs = fg.figures_of(fg.Reading("a", parse(text)))
    assert figs[(P + "written_pages_total", (("pool", "kv"),))].value == 14
    assert figs[(P + "entries", (("pool", "kv"),))].value == 12
    assert figs[(P + "divergence_active", ())].value == 0
    assert fg.ranks_of(parse(text)) == 2


def test_sglang_series_spelled_with_an_underscore_are_read_as_sglangs() -> None:
    """Prometheus stores sglang:x as sglang_x when it scraped OpenMetrics: both
    spellings are the same figure, and make a body readable."""
    body = 'sglang_backuped_tokens_total{tp_rank="0"} 320\nsglang_other_total 1\n'
    assert fg.readable(parse(body)) is None
    figs = fg.figures_of(fg.Reading("a", parse(body)))
    assert figs == {("sglang:backuped_tokens_total", ()): fg.Figure(320.0)}


def test_counter_that_went_down_between_reads_counts_from_zero() -> None:
    """A restart between the reads: the counter's change is its new value (as
    increase() takes it), the figure is marked reset; a series new in the second
    read counts from 0; rates divide by the seconds between the reads."""
    before = 'hicache_existence_written_pages_total{pool="kv",tp_rank="0"} 500\n'
    after = (
        'hicache_existence_written_pages_total{pool="kv",tp_rank="0"} 30\n'
        'hicache_existence_written_pages_total{pool="swa",tp_rank="0"} 8\n'
    )
    figs = fg.figures_of(fg.Reading("a", parse(after), parse(before), 2.0))
    kv = figs[(P + "written_pages_total", (("pool", "kv"),))]
    assert (kv.value, kv.delta, kv.rate_per_s, kv.reset) == (30, 30, 15.0, True)
    swa = figs[(P + "written_pages_total", (("pool", "swa"),))]
    assert (swa.delta, swa.reset) == (8, False)
    assert report(after, first=[before]).as_dict()["instances"][0]["resets"] == [
        'hicache_existence_written_pages_total{pool="kv"}'
    ]


def test_a_reading_refuses_two_reads_without_time_between() -> None:
    """Two reads need a positive time between them (rates divide by it)."""
    with pytest.raises(ValueError, match="seconds"):
        fg.Reading("a", parse("a 1\n"), parse("a 1\n"), 0.0)


# -- findings ----------------------------------------------------------------------------


def test_a_healthy_server_has_no_warning_and_exits_zero() -> None:
    """1% redundant (believed nodes), L3 read back, no churn, no reconciler trouble:
    nothing at warning or above."""
    rep = report(expo(healthy_rows()))
    assert rep.exit_code == 0
    assert all(f.severity == "info" for f in rep.findings), rep.findings
    assert [f.id for f in rep.findings] == ["redundant_writes"]


def test_redundant_writes_with_causes_ranked_and_figures_exact() -> None:
    """20% redundant of 1000 written pages is a warning; its evidence carries the
    counters' own values and each cause (an unknown one as it is), largest first,
    each with its fix."""
    rows = healthy_rows(1000, 200)
    for cause, n in (("other_instance", 120), ("believed_node", 50), ("frobnicated", 30)):
        rows.append((P + "redundant_cause_pages_total", {"pool": "kv", "cause": cause}, n))
    (f,) = found(report(expo(rows)), "redundant_writes")
    assert f.severity == "warning"
    ev = evidence(f)
    assert ev['hicache_existence_redundant_written_pages_total{pool="kv"}'] == 200
    assert ev['hicache_existence_redundant_written_bytes_total{pool="kv"}'] == 200 * 4096
    assert ev['hicache_existence_redundant_cause_pages_total{cause="frobnicated",pool="kv"}'] == 30
    assert f.wasted_bytes == 200 * 4096
    assert [x.split(" ")[0] for x in f.fix] == ["other_instance", "believed_node", "frobnicated"]
    assert "cache_aware" in f.fix[0] and "does not know" in f.fix[2]
    assert "other_instance 120, believed_node 50, frobnicated 30" in f.summary


def test_recompute_is_the_cap_in_buffer_mode_and_host_memory_in_cache_mode() -> None:
    """A page this instance stored, written again: in buffer mode (no host copy) its
    belief was dropped, so the fix is the cap; in cache mode it left host memory."""
    rows = [
        *healthy_rows(1000, 200),
        (P + "redundant_cause_pages_total", {"pool": "kv", "cause": "recompute"}, 200),
    ]
    (f,) = found(report(expo([*rows, mode_row("buffer_only", "false")])), "redundant_writes")
    assert "cap_too_small" in f.fix[0] and "--hicache-ratio" not in f.fix[0]
    (f,) = found(report(expo([*rows, mode_row("cache", "true")])), "redundant_writes")
    assert "--hicache-ratio" in f.fix[0]


def test_every_cause_fix_is_for_a_cause_the_write_path_gives() -> None:
    """The doctor's fixes are exactly for the causes accounting/causes.py emits (no
    fix for a cause that does not exist, no cause without a fix)."""
    from hicache_existence.accounting.causes import CAUSES

    assert set(rules.CAUSE_FIXES) == set(CAUSES)


def test_redundant_writes_below_the_threshold_or_on_little_traffic_are_info() -> None:
    """5% exactly is not above the threshold; 50% of 20 pages is too little to judge."""
    (f,) = found(report(expo(healthy_rows(1000, 50))), "redundant_writes")
    assert f.severity == "info"
    (f,) = found(report(expo(healthy_rows(20, 10))), "redundant_writes")
    assert f.severity == "info"


def mode_row(mode: str, dedup: str, policy: str = "write_through") -> Row:
    labels = {"host_memory_mode": mode, "write_policy": policy, "cache_mode_dedup": dedup}
    return (P + "mode_info", labels, 1)


def test_cache_mode_without_dedup_while_redundant_writes_are_high() -> None:
    """Cache mode, dedup off, 3% redundant (over the alert's 2%): info, as the alert (a
    ticket: only the opt-in removes it), whose fix is the config key and whose bytes
    are the believed redundant pages (what dedup would have saved)."""
    rows = [*healthy_rows(1000, 30), mode_row("cache", "false")]
    rows = replace(rows, P + "redundant_believed_pages_total", 24, pool="kv")
    rep = report(expo(rows))
    (f,) = found(rep, "cache_mode_without_dedup")
    assert f.severity == "info" and f.wasted_bytes == 24 * 4096
    assert "`cache_mode.dedup=true`" in f.fix[0]
    assert "HICACHE_EXISTENCE_CACHE_MODE__DEDUP=1" in f.fix[0]
    inst = rep.instances[0]
    assert (inst.host_memory_mode, inst.write_policy, inst.cache_mode_dedup) == (
        "cache",
        "write_through",
        False,
    )
    (r,) = found(rep, "redundant_writes")
    assert any("cache_mode.dedup" in x for x in r.fix)


@pytest.mark.parametrize(
    ("mode", "dedup", "redundant"),
    [("cache", "true", 100), ("buffer_only", "false", 100), ("cache", "false", 20)],
)
def test_no_dedup_finding_with_dedup_on_in_buffer_mode_or_few_redundant(
    mode: str, dedup: str, redundant: int
) -> None:
    """Dedup on, buffer mode, or 2% redundant (not above the alert's 2%): no
    cache_mode_without_dedup finding."""
    rows = [*healthy_rows(1000, redundant), mode_row(mode, dedup)]
    assert not found(report(expo(rows)), "cache_mode_without_dedup")


def churn_rows(curve: Mapping[str, float] | None) -> list[Row]:
    rows = healthy_rows(1000, 300)
    rows = replace(rows, P + "page_misses_total", 600, pool="kv", reason="evicted")
    rows = replace(rows, P + "evictions_total", 9000, pool="kv")
    rows = replace(rows, P + "entries", 1024, pool="kv")
    rows = replace(rows, P + "capacity_entries", 1024, pool="kv")
    rows = replace(rows, P + "redundant_believed_pages_total", 100, pool="kv")
    for m, v in (curve or {}).items():
        rows.append(
            (P + "advisor_estimated_lookup_hit_ratio", {"pool": "kv", "cap_multiplier": m}, v)
        )
    return rows


def test_cap_too_small_recommends_the_advisors_cap() -> None:
    """12% of lookups missed an evicted page at a full cap: a warning whose fix is
    the smallest multiple within 0.01 of the best estimate (4x: 0.795 vs 0.80)."""
    curve = {"0.25": 0.1, "0.5": 0.2, "1": 0.4, "2": 0.7, "4": 0.795, "8": 0.80}
    (f,) = found(report(expo(churn_rows(curve))), "cap_too_small")
    assert f.severity == "warning"
    assert f.fix[0].startswith("`cache.max_entries=4096` (4x the cap)")
    assert "from 0.400 to 0.795" in f.fix[0]
    ev = evidence(f)
    assert ev['hicache_existence_page_misses_total{pool="kv",reason="evicted"}'] == 600
    assert (
        ev['hicache_existence_advisor_estimated_lookup_hit_ratio{cap_multiplier="8",pool="kv"}']
        == 0.8
    )
    # at most the redundant pages not believed when written: (300 - 100) x 4096
    assert f.wasted_bytes == 200 * 4096
    assert recommended_multiple({0.5: 0.2, 1.0: 0.305, 2.0: 0.31}) == 1.0
    assert recommended_multiple({0.5: 0.3, 1.0: 0.305, 2.0: 0.31}) == 0.5


def test_cap_too_small_without_a_curve_doubles_and_with_a_flat_curve_is_info() -> None:
    """No advisor series: double the cap and turn the advisor on; a flat curve (a
    bigger cap would not help): info, leave the cap."""
    (f,) = found(report(expo(churn_rows(None))), "cap_too_small")
    assert f.severity == "warning" and f.fix[0].startswith("`cache.max_entries=2048`")
    assert "advisor.enabled=true" in f.fix[0]
    flat = {"0.5": 0.3, "1": 0.305, "2": 0.31, "4": 0.312}
    (f,) = found(report(expo(churn_rows(flat))), "cap_too_small")
    assert f.severity == "info" and "flat" in f.fix[0]


def test_cap_too_small_at_a_full_cap_without_evicted_misses() -> None:
    """A full pool writing 30% of its pages twice, its misses all reported cold (the
    miss-reason memory forgot the evictions): a warning, as the at-cap alert and as
    redundant_writes of the same pages (info in cache mode without dedup, where no cap
    removes the rewrites), with the hint to give the miss-reason memory more room."""
    rows = churn_rows(None)
    rows = replace(rows, P + "page_misses_total", 0, pool="kv", reason="evicted")
    rows += [
        (P + "memory_bytes", {"pool": "kv"}, 44000),
        (P + "miss_memory_bytes", {"pool": "kv"}, 4000),
    ]
    rep = report(expo(rows))
    (f,) = found(rep, "cap_too_small")
    assert f.severity == "warning" == found(rep, "redundant_writes")[0].severity
    (g,) = found(report(expo([*rows, mode_row("cache", "false")])), "cap_too_small")
    assert g.severity == "info"
    assert "30.0%" in f.summary and "`miss_reasons.memory_fraction=0.2`" in f.fix[-1]
    assert "10.0% of the cache's memory" in f.fix[-1]
    rows = replace(rows, P + "miss_memory_bytes", 24000, pool="kv")  # 0.6: already large
    (f,) = found(report(expo(rows)), "cap_too_small")
    assert not any("memory_fraction" in x for x in f.fix)
    rows = replace(rows, P + "entries", 1000, pool="kv")  # below the cap: nothing to say
    assert not found(report(expo(rows)), "cap_too_small")


def buffer_cap_64_rows(curve: Mapping[str, float]) -> list[Row]:
    """The buffer-mode server of issue 28: cap 64, full, 3,900 pages written of which
    4.2% twice (so about 3,700 distinct pages stored), 26 lookups missing an evicted
    page, the advisor's curve up to 8x (512 entries)."""
    rows = healthy_rows(3900, 164)
    rows = replace(rows, P + "page_misses_total", 26, pool="kv", reason="evicted")
    rows = replace(rows, P + "queries_total", 2000, pool="kv")
    rows = replace(rows, P + "evictions_total", 3650, pool="kv")
    rows = replace(rows, P + "entries", 64, pool="kv")
    rows = replace(rows, P + "capacity_entries", 64, pool="kv")
    rows = replace(rows, P + "redundant_believed_pages_total", 40, pool="kv")
    for m, v in curve.items():
        rows.append(
            (P + "advisor_estimated_lookup_hit_ratio", {"pool": "kv", "cap_multiplier": m}, v)
        )
    return rows


@pytest.mark.parametrize(
    "curve",
    [
        {"0.5": 0.30, "1": 0.305, "2": 0.306, "4": 0.307, "8": 0.308},  # flat to 8x
        {"0.5": 0.10, "1": 0.20, "2": 0.30, "4": 0.40, "8": 0.55},  # still rising at 8x
    ],
    ids=["flat", "rising"],
)
def test_cap_advice_never_extrapolates_past_the_advisors_largest_cap(
    curve: Mapping[str, float],
) -> None:
    """Cap 64, 3,736 distinct pages stored, the curve ending at 8x = 512: a warning
    that says the curve's range is below what was stored and recommends a cap that
    covers it (4096), never "leave it" nor the curve's 512."""
    (f,) = found(report(expo(buffer_cap_64_rows(curve))), "cap_too_small")
    assert f.severity == "warning"
    assert f.fix[0].startswith("`cache.max_entries=4096`"), f.fix[0]
    assert "3,736 distinct pages" in f.fix[0] and "8x = 512 entries" in f.fix[0]
    assert not any("leave" in x or "max_entries=512" in x for x in f.fix)
    assert evidence(f)["distinct pages stored (written - redundant - failed)"] == 3736


def test_cap_advice_within_the_advisors_range_is_kept() -> None:
    """When the largest multiple covers what was stored, a flat curve still says
    leave the cap (info) and a plateau inside the range gives its multiple."""
    flat = {"0.5": 0.30, "1": 0.305, "2": 0.306, "4": 0.307, "8": 0.308, "64": 0.309}
    (f,) = found(report(expo(buffer_cap_64_rows(flat))), "cap_too_small")
    assert f.severity == "info" and "flat" in f.fix[0]
    plateau = {"0.5": 0.10, "1": 0.20, "2": 0.60, "4": 0.61, "8": 0.61}
    (f,) = found(report(expo(buffer_cap_64_rows(plateau))), "cap_too_small")
    assert f.fix[0].startswith("`cache.max_entries=128` (2x the cap)")
    assert rules.cap_covering(3736) == 4096 and rules.cap_covering(4096) == 4096
    assert rules.cap_covering(0) == 1
    with pytest.raises(ValueError, match="pages must be a finite number"):
        rules.cap_covering(math.inf)


def rendered_severities() -> dict[str, str]:
    """{alert: severity} of the committed integrations/prometheus/rules.yml."""
    yaml = pytest.importorskip("yaml")
    path = Path(__file__).resolve().parents[1] / "integrations" / "prometheus" / "rules.yml"
    rules = yaml.safe_load(path.read_text(encoding="utf-8"))
    return {
        r["alert"]: r["labels"]["severity"]
        for g in rules["groups"]
        for r in g["rules"]
        if "alert" in r
    }


def test_findings_at_their_alerts_condition_have_the_alerts_severity() -> None:
    """Each finding that answers to an alert, at that alert's condition, has the
    severity of the alert as rules.yml renders it (a change to either side fails)."""
    at_cap = replace(churn_rows(None), P + "page_misses_total", 0, pool="kv", reason="evicted")
    cache_mode = replace(
        [*healthy_rows(1000, 30), mode_row("cache", "false")],
        P + "redundant_believed_pages_total",
        24,
        pool="kv",
    )
    stopped = [*healthy_rows(), (P + "divergence_active", {}, 0)]
    diverged = [*healthy_rows(), (P + "divergences_total", {}, 2)]
    cases: list[tuple[str, str, list[str]]] = [
        ("cap_too_small", "HicacheExistenceEvictionChurn", [expo(churn_rows(None))]),
        ("cap_too_small", "HicacheExistenceAtCapRedundantWritesRising", [expo(at_cap)]),
        (
            "cache_mode_without_dedup",
            "HicacheExistenceCacheModeRedundantWrites",
            [expo(cache_mode)],
        ),
        (
            "fleet_redundant_writes",
            "HicacheExistenceFleetRedundantWrites",
            [expo(healthy_rows(200, 60)), expo(healthy_rows(200, 40))],
        ),
        (
            "stale_beliefs",
            "HicacheExistenceStalePositivesHigh",
            [expo(reconciler_rows(present=70, absent=30, stale=30))],
        ),
        (
            "reconciler_unhealthy",
            "HicacheExistenceReconcilerCircuitOpen",
            [expo(reconciler_rows(present=50, error=5, open=1))],
        ),
        (
            "reconciler_unhealthy",
            "HicacheExistenceReconcilerDown",
            [expo(reconciler_rows(error=5))],
        ),
        ("tp_divergence", "HicacheExistenceTPDivergence", [expo(diverged)]),
        ("tp_checks_stopped", "HicacheExistenceTPChecksStopped", [expo(stopped)]),
    ]
    severity = rendered_severities()
    covered = {(fid, alert) for fid, alert, _ in cases}
    declared = {(j.finding, a.name): j.severity for j, a in J.alerting() if j.finding}
    assert covered == set(declared)
    for fid, alert, bodies in cases:
        (f,) = found(report(*bodies), fid)
        assert (fid, alert, f.severity) == (fid, alert, severity[alert])
        assert declared[fid, alert] == severity[alert]


def test_cache_mode_rewrites_only_dedup_removes_do_not_make_a_warning() -> None:
    """Cache mode without dedup, 28.8% of the pages written twice, all believed when
    written (dedup's to save): redundant_writes and cache_mode_without_dedup are info
    and the doctor exits 0; the same share not believed is still a warning."""
    rows = [*healthy_rows(1000, 288), mode_row("cache", "false", "write_back")]
    rep = report(expo(rows))
    assert {f.id: f.severity for f in rep.findings} == {
        "redundant_writes": "info",
        "cache_mode_without_dedup": "info",
    }
    assert rep.exit_code == 0
    rows = replace(rows, P + "redundant_believed_pages_total", 0, pool="kv")
    (f,) = found(report(expo(rows)), "redundant_writes")
    assert f.severity == "warning"


def test_l3_written_but_not_read_back() -> None:
    """L3 written 16,000 tokens, none read back: a warning; the reason SGLang gives
    (below_threshold) picks the fix; the bytes are the written ones."""
    rows = replace(healthy_rows(), "sglang:prefetched_tokens_total", 0)
    rows = replace(rows, "sglang:storage_prefetch_hit_tokens_total", 0)
    rows.append(
        ("sglang:storage_prefetch_unfulfilled_tokens_total", {"reason": "below_threshold"}, 900)
    )
    rows.append(("sglang:storage_prefetch_unfulfilled_tokens_total", {"reason": "deadline"}, 10))
    (f,) = found(report(expo(rows)), "l3_not_read_back")
    assert f.severity == "warning"
    assert "prefetch_threshold" in f.fix[0]
    assert f.wasted_bytes == 1000 * 4096  # 16,000 tokens x 256 B (ack bytes / tokens)
    ev = evidence(f)
    assert ev["sglang:backuped_tokens_total"] == 16000
    assert ev['sglang:storage_prefetch_unfulfilled_tokens_total{reason="below_threshold"}'] == 900


def test_l3_read_back_a_little_is_info_and_enough_is_nothing() -> None:
    """5% read back: info; 50% (the healthy rows): no finding."""
    rows = replace(healthy_rows(), "sglang:prefetched_tokens_total", 800)
    (f,) = found(report(expo(rows)), "l3_not_read_back")
    assert f.severity == "info"
    assert not found(report(expo(healthy_rows())), "l3_not_read_back")


def reconciler_rows(**results: float) -> list[Row]:
    rows = healthy_rows()
    for result in ("present", "absent", "untrusted", "error", "timeout", "rejected", "void"):
        rows.append(
            (
                P + "reconciler_queries_total",
                {"pool": "kv", "result": result},
                results.get(result, 0),
            )
        )
    rows.append((P + "reconciler_circuit_open", {}, results.get("open", 0)))
    rows.append((P + "reconciler_stale_positives_total", {"pool": "kv"}, results.get("stale", 0)))
    rows.append(
        (P + "reconciler_pages_invalidated_total", {"pool": "kv"}, results.get("stale", 0) * 6)
    )
    rows.append((P + "reconciler_errors_total", {"kind": "connection"}, results.get("conn", 0)))
    return rows


def test_stale_beliefs_with_the_reconciler() -> None:
    """30 stale positives of 100 answered verifications: a warning with the
    reconciler's own counts; 2 of 100: info."""
    rep = report(expo(reconciler_rows(present=70, absent=30, stale=30)))
    (f,) = found(rep, "stale_beliefs")
    assert f.severity == "warning"
    ev = evidence(f)
    assert ev['hicache_existence_reconciler_stale_positives_total{pool="kv"}'] == 30
    assert ev['hicache_existence_reconciler_pages_invalidated_total{pool="kv"}'] == 180
    assert "reconciler.ttl_s" in f.fix[0]
    (f,) = found(report(expo(reconciler_rows(present=98, absent=2, stale=2))), "stale_beliefs")
    assert f.severity == "info"


def test_stale_beliefs_without_the_reconciler_are_the_heals() -> None:
    """No reconciler series, 40 beliefs invalidated by heals: info pointing at the
    reconciler."""
    rows = [*healthy_rows(), (P + "invalidations_total", {"pool": "kv"}, 40)]
    (f,) = found(report(expo(rows)), "stale_beliefs")
    assert f.severity == "info" and "reconciler.enabled=true" in f.fix[0]
    assert evidence(f)['hicache_existence_invalidations_total{pool="kv"}'] == 40


def test_reconciler_breaker_open_is_a_warning() -> None:
    """The breaker open (Redis gone): a warning naming the errors by kind."""
    rep = report(expo(reconciler_rows(present=50, error=5, rejected=20, open=1, conn=5)))
    (f,) = found(rep, "reconciler_unhealthy")
    assert f.severity == "warning" and "circuit breaker open" in f.summary
    assert "connection 5" in f.summary and "reconciler.redis_url" in f.fix[0]
    assert evidence(f)['hicache_existence_reconciler_errors_total{kind="connection"}'] == 5


def test_reconciler_down_is_judged_on_the_window_when_read_twice() -> None:
    """Read twice: failures grew and answers did not is a warning, although answers
    came before; old errors with answers flowing now: info."""
    before = expo(reconciler_rows(present=50, error=1, conn=1))
    now = expo(reconciler_rows(present=50, error=9, conn=9))
    (f,) = found(report(now, first=[before]), "reconciler_unhealthy")
    assert f.severity == "warning" and "no answers" in f.summary
    recovering = expo(reconciler_rows(present=60, error=9, conn=9))
    (f,) = found(report(recovering, first=[now]), "reconciler_unhealthy")
    assert f.severity == "info"
    assert not found(report(expo(reconciler_rows(present=60))), "reconciler_unhealthy")


def test_tp_divergence_is_critical_and_stopped_checks_a_warning() -> None:
    """A divergence: critical, ranked first, exit 1; a rank whose checks stopped
    on a timeout: a warning."""
    rows = [
        *healthy_rows(),
        (P + "divergences_total", {}, 2),
        (P + "divergence_heals_total", {}, 0),
        (P + "divergence_checks_total", {}, 40),
        (P + "divergence_active", {}, 1),
    ]
    rep = report(expo(rows))
    assert rep.findings[0].id == "tp_divergence" and rep.findings[0].severity == "critical"
    assert rep.exit_code == 1
    rows = [
        *healthy_rows(),
        (P + "divergence_active", {}, 0),
        (P + "divergence_check_failures_total", {"reason": "timeout"}, 1),
    ]
    (f,) = found(report(expo(rows)), "tp_checks_stopped")
    assert f.severity == "warning" and "divergence.timeout_s" in f.fix[0]


def test_plugin_not_loaded_not_live_and_accounting_not_fed() -> None:
    """SGLang's storage series only: plugin_not_loaded; package series with 0
    lookups while L3 is written: plugin_not_live; SGLang writes but the package's
    write counters stay 0: write_accounting_not_fed."""
    sglang_only = expo([("sglang:backuped_tokens_total", {}, 3200)])
    (f,) = found(report(sglang_only), "plugin_not_loaded")
    assert f.severity == "warning" and "--enable-hicache-existence" in f.fix[0]
    rows = replace(healthy_rows(), P + "queries_total", 0, pool="kv")
    (f,) = found(report(expo(rows)), "plugin_not_live")
    assert evidence(f)["hicache_existence_queries_total"] == 0
    rows = replace(healthy_rows(), P + "written_pages_total", 0, pool="kv")
    rows = replace(rows, P + "write_acknowledged_pages_total", 0, pool="kv")
    (f,) = found(report(expo(rows)), "write_accounting_not_fed")
    assert evidence(f)["sglang:backuped_tokens_total"] == 16000


def test_no_lookups_in_cache_mode_without_dedup_is_expected() -> None:
    """Cache mode with dedup off consults no cache: 0 lookups is not a finding."""
    rows = [*replace(healthy_rows(), P + "queries_total", 0, pool="kv"), mode_row("cache", "false")]
    assert not found(report(expo(rows)), "plugin_not_live")


def test_write_failures() -> None:
    """30 of 1000 written pages not stored: a warning with the failed bytes."""
    rows = replace(healthy_rows(), P + "write_failed_pages_total", 30, pool="kv")
    rows = replace(rows, P + "write_failed_bytes_total", 30 * 4096, pool="kv")
    (f,) = found(report(expo(rows)), "write_failures")
    assert f.severity == "warning" and f.wasted_bytes == 30 * 4096


def test_fleet_view_shares_and_routing_cost_at_the_cap_from_the_causes() -> None:
    """Two instances at their caps (evicting), 25% of the fleet's writes redundant: a
    warning with each instance's share; the routing cost is what the cause series
    says other instances stored (other_instance pages x page bytes)."""
    cause = P + "redundant_cause_pages_total"
    a = [*healthy_rows(200, 60), (cause, {"pool": "kv", "cause": "other_instance"}, 40)]
    b = [*healthy_rows(200, 40), (cause, {"pool": "kv", "cause": "other_instance"}, 30)]
    a = replace(a, P + "evictions_total", 500, pool="kv")
    b = replace(b, P + "evictions_total", 9, pool="kv")
    rep = report(expo(a), expo(b))
    (f,) = found(rep, "fleet_redundant_writes")
    assert f.severity == "warning" and f.instance is None
    assert f.wasted_bytes == 70 * 4096 and "other_instance at the cap" in f.summary
    shares = [e.value for e in f.evidence if e.series.startswith("share")]
    assert shares == [0.6, 0.4]
    assert "25.0%" in f.summary and "cache_aware" in f.fix[0]


def test_fleet_routing_cost_below_the_cap_is_what_was_not_believed() -> None:
    """An instance that evicted nothing: its redundant pages not believed when
    written came from elsewhere (even when the cause series classifies them
    otherwise); an evicting instance without the cause series counts none."""
    cause = P + "redundant_cause_pages_total"
    a = replace(healthy_rows(200, 60), P + "redundant_believed_pages_total", 10, pool="kv")
    a += [(cause, {"pool": "kv", "cause": "below_prefetch_threshold"}, 50)]
    b = replace(healthy_rows(200, 40), P + "redundant_believed_pages_total", 20, pool="kv")
    b = replace(b, P + "evictions_total", 5, pool="kv")
    (f,) = found(report(expo(a), expo(b)), "fleet_redundant_writes")
    assert f.wasted_bytes == 50 * 4096
    assert "not believed below the cap" in f.summary and "none counted at the cap" in f.summary
    assert f.wasted_bytes_per_s is None  # one read: no rate
    a_before = replace(healthy_rows(100, 20), P + "redundant_believed_pages_total", 6, pool="kv")
    rep = report(expo(a), expo(b), first=[expo(a_before), expo(b)])
    (f,) = found(rep, "fleet_redundant_writes")
    assert f.wasted_bytes_per_s == ((60 - 20) - (10 - 6)) / 2.0 * 4096


def test_one_instance_has_no_fleet_view() -> None:
    """A single URL: no fleet finding."""
    assert not found(report(expo(healthy_rows(200, 60))), "fleet_redundant_writes")


def test_findings_rank_by_severity_then_wasted_bytes() -> None:
    """Critical first; among warnings the most wasted bytes first; findings that
    waste nothing after those that do."""
    rows = churn_rows(None)  # redundant 300 pages of 1000; cap churn
    rows = replace(rows, P + "write_failed_pages_total", 400, pool="kv")
    rows = replace(rows, P + "write_failed_bytes_total", 400 * 4096, pool="kv")
    rows += [(P + "divergences_total", {}, 1)]
    rows += reconciler_rows(present=1, error=5, open=1)[len(healthy_rows()) :]
    rep = report(expo(rows))
    ids = [f.id for f in rep.findings]
    assert ids == [
        "tp_divergence",
        "write_failures",
        "redundant_writes",
        "cap_too_small",
        "reconciler_unhealthy",
    ]


def test_json_document_is_exact_and_complete() -> None:
    """The JSON has the schema's keys; figures keep the counters' own values (2**52+1
    exactly, NaN as "NaN"); each finding has id, severity, summary, evidence, fix."""
    nan_row = (P + "advisor_estimated_hit_ratio", {"pool": "kv", "cap_multiplier": "1"}, math.nan)
    rows = [*healthy_rows(1000, 200), nan_row]
    rows = replace(rows, P + "page_inserts_total", 2**52 + 1, pool="kv")
    doc = json.loads(json.dumps(report(expo(rows)).as_dict()))
    assert set(doc) == {"schema", "source", "exit_code", "instances", "findings"}
    assert doc["schema"] == model.SCHEMA_VERSION and doc["exit_code"] == 1
    figs = doc["instances"][0]["figures"]
    assert figs['hicache_existence_page_inserts_total{pool="kv"}']["value"] == 2**52 + 1
    assert (
        figs['hicache_existence_advisor_estimated_hit_ratio{cap_multiplier="1",pool="kv"}']["value"]
        == "NaN"
    )
    assert figs["sglang:backuped_tokens_total"] == {
        "value": 16000,
        "delta": None,
        "rate_per_s": None,
    }
    f = doc["findings"][0]
    assert set(f) == {
        "id",
        "severity",
        "instance",
        "pool",
        "summary",
        "wasted_bytes",
        "wasted_bytes_per_s",
        "evidence",
        "fix",
    }
    assert f["evidence"][0] == {
        "instance": "http://10.0.0.1:30000/metrics",
        "series": 'hicache_existence_redundant_written_pages_total{pool="kv"}',
        "value": 200,
        "rate_per_s": None,
    }


# -- the command line against HTTP -------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, list[tuple[int, str, bytes]]]] = {}

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        answers = self.routes.get(path) or [(404, "text/plain", b"no such page")]
        status, ctype, body = answers.pop(0) if len(answers) > 1 else answers[0]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(routes: Mapping[str, Sequence[tuple[int, str, bytes]]]) -> Iterator[str]:
    """A loopback HTTP server answering each path with its answers in turn (the
    last one repeated)."""
    handler = type("H", (_Handler,), {"routes": {k: list(v) for k, v in routes.items()}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


TEXT = "text/plain; version=0.0.4"


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exits_0_for_a_healthy_server_and_1_for_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two reads of a healthy endpoint: exit 0 with rates in the text; an endpoint
    with 20% redundant writes: exit 1, and --json prints the document."""
    healthy = expo(healthy_rows()).encode()
    with serve(
        {
            "/metrics": [(200, TEXT, healthy)],
            "/bad": [(200, TEXT, expo(healthy_rows(1000, 200)).encode())],
        }
    ) as url:
        code, out, err = doctor(capsys, url, "--interval", "0.2")
        assert (code, err) == (0, "")
        assert "read twice" in out and "exit 0" in out
        code, out, _ = doctor(capsys, url + "/bad", "--interval", "0", "--json")
        assert code == 1
        doc = json.loads(out)
        assert doc["findings"][0]["id"] == "redundant_writes"
        assert doc["source"] == {"mode": "direct", "urls": [url + "/bad"], "interval_s": 0.0}


def test_cli_rates_come_from_two_reads_across_a_restart(capsys: pytest.CaptureFixture[str]) -> None:
    """The endpoint's counters go down between the two reads: the JSON marks the
    reset and the change counts from 0."""
    first = expo(healthy_rows(1000, 10)).encode()
    second = expo(healthy_rows(100, 1)).encode()
    with serve({"/metrics": [(200, TEXT, first), (200, TEXT, second)]}) as url:
        code, out, _ = doctor(capsys, url + "/metrics", "--interval", "0.1", "--json")
    assert code == 0
    doc = json.loads(out)
    fig = doc["instances"][0]["figures"]['hicache_existence_written_pages_total{pool="kv"}']
    assert fig["value"] == 100 and fig["delta"] == 100
    assert 'hicache_existence_written_pages_total{pool="kv"}' in doc["instances"][0]["resets"]


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ((200, "text/html", b"<!DOCTYPE html><html><body>SGLang</body></html>"), "an HTML page"),
        ((200, TEXT, b'{"text": "hello"}'), "not Prometheus text"),
        ((200, TEXT, b""), "no hicache_existence_* series and no SGLang storage series"),
        ((200, TEXT, b"process_cpu_seconds_total 3\n"), "no hicache_existence_* series"),
        ((500, "text/plain", b"boom"), "HTTP 500"),
        ((200, TEXT, b'hicache_existence_queries_total{pool="kv"'), "expected , or }"),
    ],
)
def test_cli_exits_2_with_one_line_when_it_cannot_read(
    capsys: pytest.CaptureFixture[str], route: tuple[int, str, bytes], message: str
) -> None:
    """An HTML page, JSON, an empty or unrelated body, an HTTP error, a truncated
    body: exit 2, one line on stderr naming the URL, nothing on stdout."""
    with serve({"/metrics": [route]}) as url:
        code, out, err = doctor(capsys, url, "--interval", "0")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and url in err
    assert "Traceback" not in err


def test_cli_unreachable_url_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listening: exit 2 with 'cannot connect' and the URL; the URL's
    password is masked."""
    with serve({}) as url:
        pass  # the port is free again
    target = url.replace("http://", "http://user:secret@")
    code, out, err = doctor(capsys, target, "--interval", "0", "--timeout", "2")
    assert (
        code == 2 and out == "" and "cannot connect" in err and "secret" not in err and "***" in err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["http://a", "--prometheus", "http://b"], "not both"),
        ([], "at least one"),
        (["http://a", "--selector", "{}"], "add --prometheus"),
        (["--prometheus", "http://b", "--interval", "1"], "--interval is for metrics URLs"),
        (["--prometheus", "http://b", "--window", "15 minutes"], "--window"),
        (["--prometheus", "http://b", "--selector", 'job="x"'], "--selector"),
        (["ftp://a"], "not an http(s) URL"),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_argument(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Contradictory or malformed arguments: exit 2 with one line naming them."""
    code, out, err = doctor(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def prom_answer(samples: Sequence[tuple[dict[str, str], str]]) -> bytes:
    return json.dumps(
        {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [{"metric": m, "value": [1700000000.0, v]} for m, v in samples],
            },
        }
    ).encode()


def test_prometheus_route_groups_by_instance_and_reads_two_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The query API's two answers (window start, now) become one reading per
    instance; an instance with only unrelated series is left out."""

    def s(name: str, instance: str, value: str, **labels: str) -> tuple[dict[str, str], str]:
        return ({"__name__": name, "job": "sglang", "instance": instance, **labels}, value)

    now = prom_answer(
        [
            s(P + "written_pages_total", "a:1", "300", pool="kv"),
            s(P + "redundant_written_pages_total", "a:1", "90", pool="kv"),
            s(P + "redundant_written_bytes_total", "a:1", "368640", pool="kv"),
            s(P + "written_pages_total", "b:1", "100", pool="kv"),
            s("sglang_backuped_tokens_total", "b:1", "1600"),
            s("sglang:hicache_host_used_tokens", "decode:1", "5"),
        ]
    )
    before = prom_answer([s(P + "written_pages_total", "a:1", "100", pool="kv")])
    answers = [(200, "application/json", now), (200, "application/json", before)]
    with serve({"/api/v1/query": answers}) as url:
        code, out, err = doctor(
            capsys, "--prometheus", url, "--window", "5m", "--selector", '{job="sglang"}', "--json"
        )
    assert code == 1, err
    doc = json.loads(out)
    assert [i["instance"] for i in doc["instances"]] == ["a:1", "b:1"]
    fig = doc["instances"][0]["figures"]['hicache_existence_written_pages_total{pool="kv"}']
    assert fig == {"value": 300, "delta": 200, "rate_per_s": 200 / 300}
    assert doc["source"]["window_s"] == 300.0
    assert doc["instances"][1]["figures"]["sglang:backuped_tokens_total"]["value"] == 1600


def _named(capsys: pytest.CaptureFixture[str], targets: Sequence[tuple[str, str]]) -> Any:
    """Run the Prometheus route over one written-pages series per (job, instance)."""
    rows = [
        ({"__name__": P + "written_pages_total", "job": j, "instance": i, "pool": "kv"}, "10")
        for j, i in targets
    ]
    answers = [(200, "application/json", prom_answer(rows))] * 2
    with serve({"/api/v1/query": answers}) as url:
        code, out, err = doctor(capsys, "--prometheus", url, "--json")
    return [i["instance"] for i in json.loads(out)["instances"]] if out else (code, err)


def test_prometheus_route_names_every_target_apart(capsys: pytest.CaptureFixture[str]) -> None:
    """An instance label shared by two jobs is prefixed with the job, so is the
    placeholder of a target without one when a target's label spells it; names still
    shared (crafted labels) are refused with exit 2 rather than merged: the fleet's
    figures are keyed by name, and one target would hide another's."""
    assert _named(capsys, [("j1", "a"), ("j2", "a"), ("j3", "b")]) == ["j1/a", "j2/a", "b"]
    none = "(no instance label)"
    assert _named(capsys, [("j1", ""), ("j2", none)]) == [f"j1/{none}", f"j2/{none}"]
    code, err = _named(capsys, [("j1", "a"), ("j2", "a"), ("j3", "j1/a")])
    assert code == 2 and "share the name 'j1/a'" in err and "--selector" in err


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ((200, "application/json", b"not json"), "did not answer JSON"),
        ((200, "application/json", b'{"status": "error", "error": "parse error"}'), "parse error"),
        (
            (400, "application/json", b'{"status": "error", "error": "bad selector"}'),
            "bad selector",
        ),
        ((200, "application/json", prom_answer([])), "no instance has"),
        (
            (
                200,
                "application/json",
                b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,2]}]}}',
            ),
            "malformed",
        ),
    ],
)
def test_prometheus_route_exits_2_on_errors_and_garbage(
    capsys: pytest.CaptureFixture[str], answer: tuple[int, str, bytes], message: str
) -> None:
    """Not JSON, a failed or refused query, no matching series, a malformed sample:
    exit 2 with one line."""
    with serve({"/api/v1/query": [answer]}) as url:
        code, out, err = doctor(capsys, "--prometheus", url)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_durations_and_selectors() -> None:
    """Prometheus durations parse to seconds; the selector keeps the user's matchers."""
    assert scrape.parse_duration("15m") == 900 and scrape.parse_duration("1h30m") == 5400
    for bad in ("", "0s", "15", "m", "-5m"):
        with pytest.raises(ValueError):
            scrape.parse_duration(bad)
    sel = scrape.series_selector('{job="sglang", instance=~"p.*"}')
    assert sel.startswith('{__name__=~"hicache_existence_.+|sglang:backuped_tokens_total|')
    assert sel.endswith(', job="sglang", instance=~"p.*"}')
    assert scrape.endpoint_url("http://h:1") == "http://h:1/metrics"
    assert scrape.endpoint_url("http://h:1/other") == "http://h:1/other"


def test_every_package_series_the_doctor_reads_is_in_the_catalog() -> None:
    """Every family the doctor's findings and report name (a string handed to a
    ``View`` read or to ``evidence``) is a catalog family, looked up as the code
    does: a renamed metric fails here, not on the one server whose figures reach
    that line."""
    import ast

    names: set[str] = set()
    for module in (rules, report_module):
        tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = node.args[1:2] if called in ("evidence", "evidences") else node.args[:1]
            if called in {"value", "has", "rate", "delta", "values_by", "evidence", "evidences"}:
                names |= {a.value for a in args if isinstance(a, ast.Constant)}
        for node in ast.walk(tree):  # the report's headline families
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_HEADLINE":
                names.add(str(ast.literal_eval(node.value)))
    names = {n for text in names for n in text.split()}
    assert len(names) > 25
    for name in names:
        fg.series(name)  # raises for a name the catalog does not export
    with pytest.raises(KeyError, match="hicache_existence_no_such_family is not in"):
        fg.series("no_such_family")


def test_figure_names_escape_label_values_as_the_format_does() -> None:
    """A label value with a quote, a backslash and a newline is named as the
    exposition format writes it, so a figure's name reads back unambiguously."""
    key = (P + "entries", (("pool", 'a"b\\c\nd'),))
    assert fg.key_text(key) == P + 'entries{pool="a\\"b\\\\c\\nd"}'
    assert parse(fg.key_text(key) + " 1\n").samples[0].labels == key[1]


@pytest.mark.parametrize("slow", ["headers", "body"])
def test_timeout_bounds_the_whole_answer_not_each_read(slow: str) -> None:
    """docs/doctor.md: ``--timeout`` bounds each HTTP answer. The socket's timeout
    bounds one read; an endpoint that sends a byte at a time, each within it,
    would hold the doctor (and the health check running it) for as long as it
    likes, in its status line and headers as in its body."""
    import socket
    import time

    head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 16\r\n\r\n"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def drip() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            with contextlib.suppress(OSError):
                if slow == "body":
                    conn.sendall(head)
                for byte in head if slow == "headers" else b"#" * 16:
                    conn.sendall(bytes([byte]))  # 0.4 s apart: each read within the timeout
                    time.sleep(0.4)
        srv.close()

    threading.Thread(target=drip, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(scrape.ReadError, match="no answer within 1 s"):
        scrape.fetch(f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", 1.0, scrape.HTTPOptions())
    assert time.monotonic() - t0 < 3.0


def _diagnose_seconds(pools: int) -> float:
    """Wall seconds of one diagnosis of a body with ``pools`` pools."""
    import time

    lines = []
    for i in range(pools):
        p = f'pool="p{i}"'
        lines += [
            f"hicache_existence_queries_total{{{p}}} 10",
            f"hicache_existence_written_pages_total{{{p}}} 10",
            f"hicache_existence_redundant_written_pages_total{{{p}}} 5",
        ]
    reading = fg.Reading("x", parse("\n".join(lines) + "\n"))
    t0 = time.perf_counter()
    diagnosis.diagnose([reading])
    return time.perf_counter() - t0


def test_many_pools_cost_linear_time() -> None:
    """A body with thousands of ``pool`` values (hostile, or a mislabelled exporter):
    the per-pool rules look figures up by name and pool, not by scanning every
    figure per lookup (2,000 pools took 35-49 s that way; ``mode_labels`` still scanned
    them once per pool).  Judged by how the time grows, not by a wall-clock bound (a
    loaded CI machine is several times slower): 4x the pools take about 4.5x the time
    here, 10x with ``mode_labels`` scanning, more with every lookup scanning."""
    small: list[float] = []
    large: list[float] = []
    for _ in range(3):  # interleaved: a load spike slows both sizes alike
        small.append(_diagnose_seconds(400))
        large.append(_diagnose_seconds(1600))
    assert min(large) / min(small) < 7.0, (small, large)


def test_fleet_at_the_cap_is_info_as_its_alert_is_quiet() -> None:
    """HicacheExistenceFleetRedundantWrites fires only below the cap (promtool case
    "fleet of two instances at the cap stays quiet"); the doctor agrees: at the cap
    the instances' own evictions rewrite pages (cap_too_small's finding)."""

    def rows(entries: int) -> list[Row]:
        r = replace(healthy_rows(200, 60), P + "capacity_entries", 1000, pool="kv")
        return replace(r, P + "entries", entries, pool="kv")

    (f,) = found(report(expo(rows(1000)), expo(rows(1000))), "fleet_redundant_writes")
    assert f.severity == "info"
    (f,) = found(report(expo(rows(495)), expo(rows(495))), "fleet_redundant_writes")
    assert f.severity == "warning"


_CRAFTED = {
    "cap_multiplier not a number": [
        ("advisor_estimated_lookup_hit_ratio", "2", 0.5),
        ("advisor_estimated_lookup_hit_ratio", "x", 0.5),
    ],
    "huge cap_multiplier": [
        ("advisor_estimated_lookup_hit_ratio", "1e308", 0.9),
        ("advisor_estimated_lookup_hit_ratio", "1", 0.1),
    ],
    "inf capacity": [("capacity_entries", None, math.inf)],
    "huge capacity": [("capacity_entries", None, 1e308)],
    "inf written": [
        ("written_pages_total", None, math.inf),
        ("advisor_estimated_lookup_hit_ratio", "1", 0.5),
        ("advisor_estimated_lookup_hit_ratio", "2", 0.5),
    ],
}


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_figures_give_a_report_not_an_internal_error(case: str) -> None:
    """Values the exposition parser accepts (any endpoint can answer them) never
    break the diagnosis: no cap advice where its arithmetic is not finite."""
    rows = churn_rows(None)
    for name, mult, value in _CRAFTED[case]:
        if mult is None:
            rows = replace(rows, P + name, value, pool="kv")
        else:
            rows.append((P + name, {"pool": "kv", "cap_multiplier": mult}, value))
    rep = report(expo(rows).replace(" inf\n", " +Inf\n"))
    report_module.render_text(rep)
    json.dumps(rep.as_dict(), allow_nan=False)


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--window", "9" * 400 + "y"], "--window"),
        (["--timeout", "1e10"], "--timeout"),
        (["--interval", "1e10"], "--interval"),
    ],
)
def test_huge_durations_are_a_clear_error(flags: list[str], name: str, capsys) -> None:
    """A window past Prometheus' int64 milliseconds or a timeout or interval past
    a week would overflow a float or a timer: a usage error naming the flag."""
    try:
        code = main(["doctor", "--prometheus", "http://127.0.0.1:1", *flags])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert name in err and "internal error" not in err and "Traceback" not in err


def test_a_doctor_url_with_a_raw_password_is_masked(capsys) -> None:
    """The URL parser's error would quote a piece of an unencoded password."""
    assert (
        main(
            [
                "doctor",
                "--interval",
                "0",
                "--timeout",
                "1",
                "http://user:s3cr/et@127.0.0.1:1/metrics",
            ]
        )
        == 2
    )
    assert "s3cr" not in capsys.readouterr().err


def test_another_pool_at_its_cap_does_not_quiet_the_fleet_finding() -> None:
    """Per pool, as HicacheExistenceFleetRedundantWrites: kv 40% full with 30% of
    the fleet's kv writes redundant warns, whatever a full swa window pool does."""

    def rows() -> list[Row]:
        r = replace(healthy_rows(200, 60), P + "capacity_entries", 1000, pool="kv")
        r = replace(r, P + "entries", 400, pool="kv")
        r = replace(r, P + "capacity_entries", 100, pool="swa")
        return replace(r, P + "entries", 100, pool="swa")

    (f,) = found(report(expo(rows()), expo(rows())), "fleet_redundant_writes")
    assert f.severity == "warning"


def test_pools_filling_their_shared_cap_together_are_at_the_cap() -> None:
    """sglang 0.5.19-0.5.21: kv and swa share one cap (mode_info's capacity_scope
    "shared") and fill it together (600 + 400 of 1000): at the cap, as the fill
    recording rule reads it, so the fleet finding is info as its alert is quiet."""

    def rows(scope: str) -> list[Row]:
        r = replace(healthy_rows(200, 60), P + "capacity_entries", 1000, pool="kv")
        r = replace(r, P + "entries", 600, pool="kv")
        r = replace(r, P + "capacity_entries", 1000, pool="swa")
        r = replace(r, P + "entries", 400, pool="swa")
        mode = {"host_memory_mode": "cache", "write_policy": "write_through"}
        return [
            *r,
            (P + "mode_info", {**mode, "cache_mode_dedup": "false", "capacity_scope": scope}, 1),
        ]

    (f,) = found(report(expo(rows("shared")), expo(rows("shared"))), "fleet_redundant_writes")
    assert f.severity == "info"
    (f,) = found(report(expo(rows("pool")), expo(rows("pool"))), "fleet_redundant_writes")
    assert f.severity == "warning"
