"""``hicache-existence doctor``: diagnose a live deployment from its series.

Reads each server's metrics endpoint (SGLang's ``/metrics`` under
``--enable-metrics``, or the package's standalone endpoint) twice, ``--interval``
apart, or the same series from a Prometheus server (``--prometheus``), and reports
findings ranked by severity and wasted L3 bytes, each with its evidence and its fix
(docs/doctor.md).  Exit status: 0 nothing at warning or above, 1 something is,
2 nothing could be read (with a one-line message): also refused credentials, a
certificate that does not verify, a missing token file.
"""

from __future__ import annotations

import argparse
import json
import sys

NAME = "doctor"
HELP = "diagnose live servers from their metrics: findings, evidence, fixes"

DEFAULT_INTERVAL_S = 5.0
DEFAULT_WINDOW = "15m"
DEFAULT_TIMEOUT_S = 10.0
#: The longest --interval or --timeout (a week).
MAX_SECONDS = 7 * 86400.0


def _seconds(minimum_inclusive: bool) -> object:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        ok = value >= 0 if minimum_inclusive else value > 0
        if not ok or not value <= MAX_SECONDS:  # NaN too; beyond it timers overflow
            bound = ">= 0" if minimum_inclusive else "> 0"
            raise argparse.ArgumentTypeError(
                f"must be a number {bound} and at most {MAX_SECONDS:g} (a week), got {text}"
            )
        return value

    return parse


#: The options of secured endpoints (``--help``'s group), each with its help; the
#: ``-file`` ones take a PATH, ``--bearer-token-env`` a VAR, ``--insecure`` none.
_AUTH = {
    "--bearer-token-file": "send 'Authorization: Bearer <the file's content>' "
    "(surrounding whitespace dropped)",
    "--bearer-token-env": "send the bearer token held by the environment variable VAR",
    "--ca-file": "verify https servers against this CA bundle (PEM) instead of the system's",
    "--insecure": "do not verify https servers' certificates (testing only)",
    "--cert-file": "client certificate (PEM) for https servers that ask for one",
    "--key-file": "the client certificate's unencrypted private key (PEM), if not in --cert-file",
}
#: The ``_AUTH`` options that configure TLS: for https URLs only.
_TLS = ("--ca-file", "--insecure", "--cert-file", "--key-file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "urls",
        nargs="*",
        metavar="URL",
        help="metrics endpoints, one per server (http://host:port reads /metrics)",
    )
    add(
        "--prometheus",
        metavar="URL",
        help="read the series from this Prometheus server's HTTP API instead",
    )
    add("--selector", help="with --prometheus: narrow the series, e.g. '{job=\"sglang\"}'")
    add(
        "--window",
        help=f"with --prometheus: read the series this long apart (default {DEFAULT_WINDOW})",
    )
    add(
        "--interval",
        type=_seconds(True),  # type: ignore[arg-type]
        help=f"seconds between the two reads of each URL (default {DEFAULT_INTERVAL_S:g}; "
        "0: one read, no rates)",
    )
    add(
        "--timeout",
        type=_seconds(False),  # type: ignore[arg-type]
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for each answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    add("--json", action="store_true", help="print the report as JSON")
    auth = parser.add_argument_group(
        "secured endpoints",
        "for every URL read (metrics endpoints or --prometheus); basic auth is the URL's "
        "user info (https://user:password@host/metrics), masked in every output",
    )
    for flag, text in _AUTH.items():
        if flag == "--insecure":
            auth.add_argument(flag, action="store_true", help=text)
        else:
            metavar = "VAR" if flag.endswith("-env") else "PATH"
            auth.add_argument(flag, metavar=metavar, help=text)


def _fail(text: str) -> int:
    print(f"hicache-existence doctor: {' '.join(text.split())}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from hicache_existence.config import redact_url
    from hicache_existence.doctor import scrape
    from hicache_existence.doctor.diagnosis import diagnose
    from hicache_existence.doctor.report import render_text

    if args.prometheus and args.urls:
        return _fail("give metrics URLs or --prometheus URL, not both")
    if not args.prometheus and not args.urls:
        return _fail("give at least one metrics URL, or --prometheus URL")
    if not args.prometheus and (args.selector is not None or args.window is not None):
        return _fail("--selector and --window read from Prometheus: add --prometheus URL")
    if args.prometheus and args.interval is not None:
        return _fail("--interval is for metrics URLs; with --prometheus use --window")
    urls = [args.prometheus] if args.prometheus else args.urls
    tls = [n for n in _TLS if getattr(args, n[2:].replace("-", "_"))]
    if tls and not any(u.strip().lower().startswith("https://") for u in urls):
        return _fail(f"{', '.join(tls)}: for https URLs, and no URL is https")
    try:
        options = scrape.http_options(args)
        if args.prometheus:
            window = args.window or DEFAULT_WINDOW
            try:
                window_s = scrape.parse_duration(window)
            except ValueError as exc:
                return _fail(f"--window: {exc}")
            selector = args.selector if args.selector is not None else "{}"
            readings = scrape.read_prometheus(
                args.prometheus, selector, window_s, args.timeout, options
            )
            source = {
                "mode": "prometheus",
                "prometheus": redact_url(args.prometheus),
                "selector": selector,
                "window": window,
                "window_s": window_s,
            }
        else:
            interval = DEFAULT_INTERVAL_S if args.interval is None else args.interval
            readings = scrape.read_direct(args.urls, interval, args.timeout, options)
            source = {
                "mode": "direct",
                "urls": [r.instance for r in readings],
                "interval_s": interval,
            }
        report = diagnose(readings, source)
    except scrape.ReadError as exc:
        return _fail(str(exc))
    except Exception as exc:  # never a traceback for an operator: one line, exit 2
        return _fail(f"internal error ({type(exc).__name__}: {exc}); please report it")
    print(json.dumps(report.as_dict(), indent=2) if args.json else render_text(report))
    return report.exit_code
