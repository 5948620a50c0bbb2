"""The doctor's I/O: metrics endpoints read twice, or a Prometheus server's HTTP API.

Everything that can go wrong on the way is a ``ReadError`` whose message is one line
naming the URL (credentials masked).  Nothing here is unpickled or evaluated: bodies
are parsed by ``exposition.parse`` and ``json.loads`` only.  Every read goes through
``fetch``; credentials (the URL's user info, sent as a header, or a bearer token) are
never in a message or a ``repr``, and never follow a redirect to another origin.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.request import Request

from hicache_existence.config import URL_PARSE_ERROR, redact_url, split_url
from hicache_existence.doctor.exposition import (
    MAX_BODY_BYTES,
    Exposition,
    ExpositionError,
    Sample,
    parse,
    value_of,
)
from hicache_existence.doctor.figures import (
    SGLANG_SERIES,
    Reading,
    is_read,
    readable,
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
    parts = split_url(url)
    if parts is None:
        raise ReadError(f"{redact_url(url)}: not a URL ({URL_PARSE_ERROR})")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ReadError(f"{redact_url(url)}: not an http(s) URL")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


@dataclass(frozen=True)
class HTTPOptions:
    """How every URL is read (``ssl_context`` None: the system's CAs, verified)."""

    bearer_token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None
    client_certificate: bool = False


#: A bearer token is sent as a header: visible ASCII only (RFC 6750's b64token and
#: more), so that no byte of it can end the header or reach an error message.
_TOKEN = re.compile(r"[\x21-\x7e]+")


def _read_token(path: str | None, env_var: str | None) -> str | None:
    if path is not None and env_var is not None:
        raise ReadError("give --bearer-token-file or --bearer-token-env, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read(65537).strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ReadError(f"--bearer-token-file: cannot read {path} ({why})") from None
        where = f"--bearer-token-file {path}"
    elif env_var is not None:
        if not env_var or "=" in env_var:
            raise ReadError(f"--bearer-token-env: not an environment variable name: {env_var!r}")
        token = os.environ.get(env_var, "").strip()
        where = f"--bearer-token-env {env_var}"
    else:
        return None
    if not token:
        if path is not None:
            raise ReadError(f"{where}: the file is empty")
        raise ReadError(f"--bearer-token-env: the environment variable {env_var} is unset or empty")
    if len(token) > 65536 or not _TOKEN.fullmatch(token):
        raise ReadError(f"{where}: not a bearer token (one line of visible ASCII, at most 64 KiB)")
    return token


def _no_passphrase() -> str:
    raise ReadError("--key-file: the key is encrypted; give an unencrypted key file")


def http_options(args: argparse.Namespace) -> HTTPOptions:
    """The command line's options checked and loaded: ``ReadError`` (one line naming
    the option, never the secret) for anything that does not load or contradicts."""
    token = _read_token(args.bearer_token_file, args.bearer_token_env)
    ca_file, cert_file, key_file = args.ca_file, args.cert_file, args.key_file
    if key_file is not None and cert_file is None:
        raise ReadError("--key-file needs --cert-file (the client certificate)")
    if args.insecure and ca_file is not None:
        raise ReadError("--insecure does not verify the server: drop --ca-file, or --insecure")
    if ca_file is None and not args.insecure and cert_file is None:
        return HTTPOptions(token)
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ReadError(f"--ca-file: cannot load {ca_file} ({_ssl_reason(exc)})") from None
    if args.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
        except (OSError, ssl.SSLError) as exc:
            what = f"--cert-file {cert_file}" + (f" / --key-file {key_file}" if key_file else "")
            raise ReadError(
                f"{what}: cannot load the client certificate ({_ssl_reason(exc)})"
            ) from None
    return HTTPOptions(token, context, cert_file is not None)


def _ssl_reason(exc: BaseException) -> str:
    """An OpenSSL error in a few words, not the C file and line."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return _one_line(exc.verify_message)
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return _one_line(exc.reason).lower().replace("_", " ")
    if isinstance(exc, ssl.SSLError):
        text = _SSL_NOISE.sub("", _one_line(exc)).strip()
        return _SSL_PLAIN.get(text, text) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return _one_line(exc.strerror)
    return _one_line(exc) or type(exc).__name__


_SSL_NOISE = re.compile(r"^\[SSL\]\s*|\s*\(_ssl\.c:\d+\)")
_SSL_PLAIN = {
    "PEM lib": "not a PEM file with a certificate and its key",
    "EOF occurred in violation of protocol": "the server closed the connection",
}


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect with the credentials only to the same origin (scheme,
    host, port): an auth proxy's ``/metrics`` -> ``/metrics/`` keeps working, a
    redirect elsewhere (or to plain http) gets no password or token."""

    def redirect_request(
        self, req: Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth is not None and _origin(new.full_url) == _origin(req.full_url):
            new.add_unredirected_header("Authorization", auth)
        return new


class _Deadline:
    """Shuts the fetch's connections when its time is up: a socket timeout bounds
    one read, and a server can answer (status line, headers, body) a byte at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.expired = False
        self._socks: list[Any] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def watch(self, sock: Any) -> None:
        with self._lock:
            self._socks.append(sock)
            if not self.expired:
                return
        self._expire()  # connected after the deadline

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _watched(base: type[http.client.HTTPConnection], deadline: _Deadline) -> Any:
    class Watched(base):  # type: ignore[valid-type, misc]
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    return Watched


class _Handler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """http and https over connections the deadline watches (and replaces both
    default handlers in ``build_opener``)."""

    def __init__(self, deadline: _Deadline, context: ssl.SSLContext | None) -> None:
        super().__init__(context=context)
        self._http = _watched(http.client.HTTPConnection, deadline)
        self._https = _watched(http.client.HTTPSConnection, deadline)

    def http_open(self, req: Request) -> Any:
        return self.do_open(self._http, req)

    def https_open(self, req: Request) -> Any:
        return self.do_open(self._https, req, context=self._context)  # type: ignore[attr-defined]


def _split_credentials(url: str) -> tuple[str, str | None]:
    """The URL without its user info, and the ``Authorization`` header it gave
    (basic auth; user and password percent-decoded, as RFC 3986 writes them)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password) if colon else ''}"
    header = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    return urllib.parse.urlunsplit(parts._replace(netloc=hostport)), header


def _refused(basic: bool, options: HTTPOptions) -> str:
    """What a 401/403 means for the credentials sent (never both: ``fetch``)."""
    if basic:
        return ": the URL's user and password was refused"
    if options.bearer_token is not None:
        return ": the bearer token was refused"
    return (
        ": the endpoint wants credentials (user:password@ in the URL, "
        "--bearer-token-file or --bearer-token-env)"
    )


def fetch(
    url: str, timeout_s: float, options: HTTPOptions, accept: str = ACCEPT
) -> tuple[bytes, str]:
    """GET ``url``: (body, content type).  Reads at most ``MAX_BODY_BYTES``."""
    shown = redact_url(url)
    try:
        target, basic = _split_credentials(url)
    except ValueError as exc:
        raise ReadError(f"{shown}: not a URL ({_one_line(exc)})") from None
    if basic is not None and options.bearer_token is not None:
        raise ReadError(f"{shown}: give user:password@ in the URL or a bearer token, not both")
    request = Request(target, headers={"Accept": accept, "User-Agent": USER_AGENT})
    auth = basic if options.bearer_token is None else f"Bearer {options.bearer_token}"
    if auth is not None:
        request.add_unredirected_header("Authorization", auth)
    deadline = _Deadline(timeout_s)
    opener = urllib.request.build_opener(_Handler(deadline, options.ssl_context), _Redirects())
    hint = "" if options.client_certificate else "; does it want a client certificate?"
    try:
        try:
            with deadline, opener.open(request, timeout=timeout_s) as response:
                body = response.read(MAX_BODY_BYTES + 1)
                ctype = response.headers.get("Content-Type", "") or ""
        except Exception:
            if deadline.expired:  # whatever the cut connection raised
                raise TimeoutError from None
            raise
        if deadline.expired:  # cut by the deadline: what was read may be a part
            raise TimeoutError
    except urllib.error.HTTPError as exc:
        refused = _refused(basic is not None, options) if exc.code in (401, 403) else ""
        raise ReadError(
            f"{shown}: HTTP {exc.code} {_one_line(exc.reason)}{refused}{_detail(exc)}"
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):  # socket.timeout too
            raise ReadError(f"{shown}: no answer within {timeout_s:g} s") from None
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise ReadError(
                f"{shown}: the server's certificate did not verify ({_ssl_reason(reason)}); "
                "give its CA bundle with --ca-file"
            ) from None
        if isinstance(reason, ssl.SSLError):
            raise ReadError(
                f"{shown}: TLS handshake failed ({_ssl_reason(reason)}){hint}"
            ) from None
        raise ReadError(f"{shown}: cannot connect ({_one_line(reason)})") from None
    except TimeoutError:
        raise ReadError(f"{shown}: no answer within {timeout_s:g} s") from None
    except ssl.SSLError as exc:  # TLS 1.3 reports a refused client certificate on read
        raise ReadError(f"{shown}: TLS failed ({_ssl_reason(exc)}){hint}") from None
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


def read_endpoint(url: str, timeout_s: float, options: HTTPOptions) -> Exposition:
    """One read of a metrics endpoint, parsed, with series the doctor can diagnose."""
    body, ctype = fetch(url, timeout_s, options)
    shown = redact_url(url)
    try:
        exposition = parse(body)
    except ExpositionError as exc:
        what = "an HTML page" if "html" in ctype.lower() else "not Prometheus text"
        raise ReadError(f"{shown}: {what} ({exc})") from None
    problem = readable(exposition)
    if problem is not None:
        raise ReadError(f"{shown}: {problem}")
    return exposition


def read_direct(
    urls: Sequence[str], interval_s: float, timeout_s: float, options: HTTPOptions
) -> list[Reading]:
    """Each endpoint read, then (``interval_s`` > 0) read again ``interval_s`` later."""
    targets = [endpoint_url(u) for u in urls]
    names = [redact_url(u) for u in targets]
    if len(set(names)) != len(names):
        raise ReadError("the same URL was given twice")
    first = [(read_endpoint(url, timeout_s, options), time.monotonic()) for url in targets]
    if interval_s <= 0:
        return [Reading(name, e) for name, (e, _) in zip(names, first)]
    time.sleep(interval_s)
    out = []
    for url, name, (before, t0) in zip(targets, names, first):
        exposition = read_endpoint(url, timeout_s, options)
        out.append(Reading(name, exposition, before, max(time.monotonic() - t0, 1e-6)))
    return out


# -- Prometheus -----------------------------------------------------------------------

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_MILLIS = {u: round(s * 1000) for u, s in _UNITS.items()}
_MAX_MILLIS = (1 << 63) - 1


def parse_duration(text: str) -> float:
    """A Prometheus duration (``15m``, ``1h30m``, ``90s``) in seconds; ValueError else."""
    text = text.strip()
    parts = _DURATION.findall(text)
    if "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration like 15m or 1h30m: {text!r}")
    millis = sum(int(n) * _MILLIS[u] for n, u in parts)
    if millis <= 0:
        raise ValueError(f"a duration must be > 0, got {text!r}")
    if millis > _MAX_MILLIS:  # as Prometheus: a duration is an int64 of milliseconds
        raise ValueError(f"a duration must be at most 292y, got {text!r}")
    return millis / 1000


def series_selector(selector: str) -> str:
    """The PromQL selector of every series the doctor reads, narrowed by the user's
    ``{...}`` (``ValueError`` if it is not one)."""
    text = selector.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f'a selector is written {{label="value", ...}}, got {selector!r}')
    inner = text[1:-1].strip().rstrip(",")
    # Both spellings: Prometheus stores sglang:x as sglang_x when it scraped
    # OpenMetrics (figures.canonical).
    sglang = "|".join(sorted(SGLANG_SERIES | {n.replace(":", "_", 1) for n in SGLANG_SERIES}))
    names = f'__name__=~"hicache_existence_.+|{sglang}"'
    return "{" + names + (", " + inner if inner else "") + "}"


def _api_query(
    base: str, query: str, at: float, timeout_s: float, options: HTTPOptions
) -> list[Any]:
    params = urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"})
    url = f"{base.rstrip('/')}/api/v1/query?{params}"
    shown = redact_url(base)
    try:
        body, _ = fetch(url, timeout_s, options, accept="application/json")
    except ReadError as exc:
        # Prometheus answers a bad query with HTTP 400 and a JSON error: say which.
        raise ReadError(str(exc).replace(redact_url(url), shown + " (query API)")) from None
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
    data = data if isinstance(data, dict) and data.get("resultType") == "vector" else {}
    result = data.get("result")
    if not isinstance(result, list):
        raise ReadError(f"{shown}: not a Prometheus instant-vector answer")
    return result


def _samples(base: str, result: list[Any]) -> dict[tuple[str, str], list[Sample]]:
    """Instant-vector results grouped by (job, instance)."""
    out: dict[tuple[str, str], list[Sample]] = {}
    for item in result:
        item = item if isinstance(item, dict) else {}
        metric, value = item.get("metric"), item.get("value", ())
        pair = isinstance(value, list) and len(value) == 2 and isinstance(value[1], str)
        number = value_of(value[1]) if pair else None
        if (
            not isinstance(metric, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items())
            or number is None
        ):
            raise ReadError(f"{redact_url(base)}: a malformed sample in the query answer")
        name = metric.get("__name__", "")
        if not is_read(name):
            continue
        labels = tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))
        where = (metric.get("job", ""), metric.get("instance", ""))
        out.setdefault(where, []).append(Sample(name, labels, number))
    return out


def read_prometheus(
    base: str, selector: str, window_s: float, timeout_s: float, options: HTTPOptions
) -> list[Reading]:
    """The same series read from Prometheus at ``now - window_s`` and ``now``: one
    ``Reading`` per (job, instance), as two scrapes ``window_s`` apart would give."""
    endpoint_url(base)  # validates the scheme
    try:
        query = series_selector(selector)
    except ValueError as exc:
        raise ReadError(f"--selector: {exc}") from None
    t1 = time.time()
    t0 = t1 - window_s
    last = _samples(base, _api_query(base, query, t1, timeout_s, options))
    first = _samples(base, _api_query(base, query, t0, timeout_s, options))
    # Instances without the package's or SGLang's storage series (a decode server,
    # an unrelated job the selector caught) are not what the doctor diagnoses.
    last = {where: s for where, s in last.items() if readable(Exposition(tuple(s))) is None}
    if not last:
        raise ReadError(
            f"{redact_url(base)}: no instance has hicache_existence_* or SGLang storage "
            f"series matching {query}"
        )
    # An instance is named by its label, by job/label where two targets share the
    # label (or the placeholder); names still shared (crafted labels) are refused: the
    # fleet's figures are keyed by name, so one target would hide another's.
    short = {where: where[1] or "(no instance label)" for where in last}
    shared = Counter(short.values())
    names = {w: f"{w[0]}/{n}" if shared[n] > 1 else n for w, n in short.items()}
    clash = sorted(n for n, k in Counter(names.values()).items() if k > 1)
    if clash:
        raise ReadError(
            f"{redact_url(base)}: targets of different jobs or instances share the name "
            f"{clash[0]!r}; narrow --selector to one of them"
        )
    return [
        Reading(names[w], Exposition(tuple(s)), Exposition(tuple(first.get(w, ()))), window_s)
        for w, s in sorted(last.items())
    ]
