"""The doctor's I/O: metrics endpoints read twice, or a Prometheus server's HTTP API.

Everything that can go wrong on the way (no connection, a timeout, an HTTP error,
a body that is not the format, an answer that is not Prometheus' JSON, a body
larger than ``MAX_BODY_BYTES``) is a ``ReadError`` whose message is one line naming
the URL (credentials masked).  Nothing here is unpickled or evaluated: bodies are
parsed by ``exposition.parse`` and ``json.loads`` only.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from hicache_existence.config import redact_url
from hicache_existence.doctor.diagnosis import (
    SGLANG_SERIES,
    Reading,
    is_read,
    readable,
)
from hicache_existence.doctor.exposition import (
    MAX_BODY_BYTES,
    Exposition,
    ExpositionError,
    Sample,
    parse,
)

#: What a metrics endpoint is asked for: the text format (prometheus_client and
#: SGLang answer OpenMetrics only when asked).
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"
USER_AGENT = "hicache-existence-doctor"


class ReadError(Exception):
    """A URL could not be read as what the doctor needs; the message is one line."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def endpoint_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/metrics``; other paths are kept.
    ``ReadError`` for anything that is not an http(s) URL with a host."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ReadError(f"{redact_url(url)}: not a URL ({_one_line(exc)})") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ReadError(f"{redact_url(url)}: not an http(s) URL")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def fetch(url: str, timeout_s: float, accept: str = ACCEPT) -> tuple[bytes, str]:
    """GET ``url``: (body, content type).  Reads at most ``MAX_BODY_BYTES``."""
    shown = redact_url(url)
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_BODY_BYTES + 1)
            ctype = response.headers.get("Content-Type", "") or ""
    except urllib.error.HTTPError as exc:
        raise ReadError(f"{shown}: HTTP {exc.code} {_one_line(exc.reason)}{_detail(exc)}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ReadError(f"{shown}: no answer within {timeout_s:g} s") from None
        raise ReadError(f"{shown}: cannot connect ({_one_line(reason)})") from None
    except TimeoutError:
        raise ReadError(f"{shown}: no answer within {timeout_s:g} s") from None
    except (http.client.HTTPException, OSError, ValueError) as exc:
        raise ReadError(f"{shown}: {type(exc).__name__}: {_one_line(exc)}") from None
    if len(body) > MAX_BODY_BYTES:
        raise ReadError(f"{shown}: answer larger than {MAX_BODY_BYTES} bytes")
    return body, ctype


def _detail(exc: urllib.error.HTTPError) -> str:
    """The ``error`` of a JSON error answer (Prometheus explains a bad query so)."""
    try:
        doc = json.loads(exc.read(65536))
    except Exception:  # any body at all: the status line is what counts
        return ""
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return f": {_one_line(doc['error'])[:300]}"
    return ""


def read_endpoint(url: str, timeout_s: float) -> Exposition:
    """One read of a metrics endpoint, parsed."""
    body, ctype = fetch(url, timeout_s)
    shown = redact_url(url)
    try:
        exposition = parse(body)
    except ExpositionError as exc:
        what = "an HTML page" if "html" in ctype.lower() else "not Prometheus text"
        raise ReadError(f"{shown}: {what} ({exc})") from None
    return exposition


def read_direct(
    urls: Sequence[str],
    interval_s: float,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[Reading]:
    """Each endpoint read, then (``interval_s`` > 0) read again ``interval_s`` later."""
    targets = [endpoint_url(u) for u in urls]
    names = [redact_url(u) for u in targets]
    if len(set(names)) != len(names):
        raise ReadError("the same URL was given twice")
    first: list[tuple[Exposition, float]] = []
    for url in targets:
        exposition = read_endpoint(url, timeout_s)
        _check(url, exposition)
        first.append((exposition, clock()))
    if interval_s <= 0:
        return [Reading(name, e) for name, (e, _) in zip(names, first)]
    sleep(interval_s)
    out = []
    for url, name, (before, t0) in zip(targets, names, first):
        exposition = read_endpoint(url, timeout_s)
        _check(url, exposition)
        out.append(Reading(name, exposition, before, max(clock() - t0, 1e-6)))
    return out


def _check(url: str, exposition: Exposition) -> None:
    problem = readable(exposition)
    if problem is not None:
        raise ReadError(f"{redact_url(url)}: {problem}")


# -- Prometheus -----------------------------------------------------------------------

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def parse_duration(text: str) -> float:
    """A Prometheus duration (``15m``, ``1h30m``, ``90s``) in seconds; ValueError else."""
    pos, total = 0, 0.0
    text = text.strip()
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if m is None:
            raise ValueError(f"not a duration like 15m or 1h30m: {text!r}")
        total += int(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text or total <= 0:
        raise ValueError(f"a duration must be > 0, got {text!r}")
    return total


def series_selector(selector: str) -> str:
    """The PromQL selector of every series the doctor reads, narrowed by the user's
    ``{...}`` (``ValueError`` if it is not one)."""
    text = selector.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f'a selector is written {{label="value", ...}}, got {selector!r}')
    inner = text[1:-1].strip().rstrip(",")
    # Both spellings: Prometheus stores sglang:x as sglang_x when it scraped
    # OpenMetrics (diagnosis.canonical).
    sglang = "|".join(sorted(SGLANG_SERIES | {n.replace(":", "_", 1) for n in SGLANG_SERIES}))
    names = f'__name__=~"hicache_existence_.+|{sglang}"'
    return "{" + names + (", " + inner if inner else "") + "}"


def _api_query(base: str, query: str, at: float, timeout_s: float) -> list[Any]:
    url = (
        base.rstrip("/")
        + "/api/v1/query?"
        + urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"})
    )
    shown = redact_url(base)
    try:
        body, _ = fetch(url, timeout_s, accept="application/json")
    except ReadError as exc:
        text = str(exc)
        # Prometheus answers a bad query with HTTP 400 and a JSON error: say which.
        raise ReadError(text.replace(redact_url(url), shown + " (query API)")) from None
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        raise ReadError(f"{shown}: the query API did not answer JSON") from None
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ReadError(
            f"{shown}: the query failed: {_one_line(error or 'not a Prometheus answer')}"
        )
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise ReadError(f"{shown}: not a Prometheus instant-vector answer")
    result = data.get("result")
    if not isinstance(result, list):
        raise ReadError(f"{shown}: not a Prometheus instant-vector answer")
    return result


_VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN")


def _samples(base: str, result: list[Any]) -> dict[tuple[str, str], list[Sample]]:
    """Instant-vector results grouped by (job, instance)."""
    out: dict[tuple[str, str], list[Sample]] = {}
    for item in result:
        metric = item.get("metric") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        if (
            not isinstance(metric, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items())
            or not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[1], str)
            or not _VALUE.fullmatch(value[1])
        ):
            raise ReadError(f"{redact_url(base)}: a malformed sample in the query answer")
        name = metric.get("__name__", "")
        if not is_read(name):
            continue
        text = value[1]
        number = (
            (-math.inf if text.startswith("-") else math.inf)
            if text.endswith("Inf")
            else float(text)
        )
        labels = tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))
        where = (metric.get("job", ""), metric.get("instance", ""))
        out.setdefault(where, []).append(Sample(name, labels, number))
    return out


def read_prometheus(
    base: str,
    selector: str,
    window_s: float,
    timeout_s: float,
    now: Callable[[], float] = time.time,
) -> list[Reading]:
    """The same series read from Prometheus at ``now - window_s`` and ``now``: one
    ``Reading`` per (job, instance), as two scrapes ``window_s`` apart would give."""
    endpoint_url(base)  # validates the scheme
    try:
        query = series_selector(selector)
    except ValueError as exc:
        raise ReadError(f"--selector: {exc}") from None
    t1 = now()
    t0 = t1 - window_s
    last = _samples(base, _api_query(base, query, t1, timeout_s))
    first = _samples(base, _api_query(base, query, t0, timeout_s))
    # Instances without the package's or SGLang's storage series (a decode server,
    # an unrelated job the selector caught) are not what the doctor diagnoses.
    last = {where: s for where, s in last.items() if readable(Exposition(tuple(s))) is None}
    if not last:
        raise ReadError(
            f"{redact_url(base)}: no instance has hicache_existence_* or SGLang storage "
            f"series matching {query}"
        )
    jobs_per_instance: dict[str, set[str]] = {}
    for job, instance in last:
        jobs_per_instance.setdefault(instance, set()).add(job)
    readings = []
    for (job, instance), samples in sorted(last.items()):
        name = instance or "(no instance label)"
        if len(jobs_per_instance[instance]) > 1:
            name = f"{job}/{name}"
        exposition = Exposition(tuple(samples))
        before = first.get((job, instance))
        readings.append(
            Reading(
                name,
                exposition,
                Exposition(tuple(before or ())),
                window_s,
            )
        )
    return readings
