"""``hicache-existence doctor`` against secured endpoints: basic auth from the URL,
bearer tokens, a CA bundle, ``--insecure`` and client certificates, over real HTTPS
on loopback with a throwaway PKI made by ``openssl``.  No secret in any output."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import logging
import secrets
import shutil
import ssl
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_doctor import TEXT, expo, healthy_rows, prom_answer

from hicache_existence.cli import main

USER = "doctor"
PASSWORD = "pw-" + secrets.token_hex(8) + "-secret"
TOKEN = "tok-" + secrets.token_hex(16)
HEALTHY = expo(healthy_rows()).encode()
P = "hicache_existence_"


# -- a throwaway PKI ----------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_key_encrypted: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], usage: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (d / f"{name}.{x}" for x in ("key", "csr", "pem", "ext"))
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
        f"keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    if shutil.which("openssl") is None:
        pytest.fail("these tests need the openssl command (apt-get install -y openssl)")
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(d, "hx-test-ca")
    other = _ca(d, "hx-other-ca")
    server = _leaf(d, "server", ca, "serverAuth")
    client = _leaf(d, "client", ca, "clientAuth")
    encrypted = d / "client-encrypted.key"
    _openssl("pkey", "-in", client[1], "-aes256", "-passout", "pass:unused", "-out", encrypted)
    return PKI(ca[0], other[0], server[0], server[1], client[0], client[1], encrypted)


# -- a secured metrics server ---------------------------------------------------------


@dataclass
class Secured:
    """A loopback server: ``auth`` is ``("basic", user, password)``, ``("bearer", token)``
    or ``None``; ``redirects`` maps a path to the URL it sends a 302 to; every
    request's ``Authorization`` header is recorded."""

    routes: Mapping[str, tuple[str, bytes]]
    auth: tuple[str, ...] | None = None
    redirects: Mapping[str, str] = field(default_factory=dict)
    seen: list[tuple[str, str | None]] = field(default_factory=list)


def _handler(conf: Secured) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            given = self.headers.get("Authorization")
            conf.seen.append((path, given))
            if path in conf.redirects:
                self._answer(302, "text/plain", b"moved", Location=conf.redirects[path])
                return
            if conf.auth is not None and conf.auth[0] == "basic":
                pair = f"{conf.auth[1]}:{conf.auth[2]}".encode()
                if given != "Basic " + base64.b64encode(pair).decode():
                    self._answer(401, "text/plain", b"no", **{"WWW-Authenticate": "Basic"})
                    return
            if conf.auth is not None and conf.auth[0] == "bearer":
                if given is None:
                    self._answer(401, "text/plain", b"no", **{"WWW-Authenticate": "Bearer"})
                    return
                if given != f"Bearer {conf.auth[1]}":
                    self._answer(403, "text/plain", b"forbidden")
                    return
            ctype, body = conf.routes.get(path, ("text/plain", b"no such page"))
            self._answer(200 if path in conf.routes else 404, ctype, body)

        def _answer(self, status: int, ctype: str, body: bytes, **headers: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serve(
    conf: Secured, pki: PKI | None = None, client_ca: Path | None = None
) -> Iterator[tuple[str, int]]:
    """(scheme, port) of a server on 127.0.0.1: https with ``pki``'s server
    certificate, asking for a client certificate signed by ``client_ca``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(conf))
    scheme = "http"
    if pki is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.server_cert, pki.server_key)
        if client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(client_ca)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield scheme, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def url(where: tuple[str, int], path: str = "/metrics", userinfo: str = "") -> str:
    scheme, port = where
    return f"{scheme}://{userinfo + '@' if userinfo else ''}127.0.0.1:{port}{path}"


def doctor(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, *argv: str
) -> tuple[int, str, str]:
    """Run the command; no secret may appear on stdout, stderr or in a log record."""
    with caplog.at_level(logging.DEBUG):
        code = main(["doctor", "--interval", "0", "--timeout", "5", *argv])
    out, err = capsys.readouterr()
    for secret in (PASSWORD, TOKEN, "unused"):
        assert secret not in out and secret not in err and secret not in caplog.text, secret
    assert "Traceback" not in err
    return code, out, err


def one_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1 and err.startswith("hicache-existence doctor: "), err
    for part in parts:
        assert part in err, (part, err)


METRICS = {"/metrics": (TEXT, HEALTHY)}
BASIC = ("basic", USER, PASSWORD)


# -- basic auth -------------------------------------------------------------------------


def test_basic_auth_from_the_url_over_plain_http(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """user:password@ in the URL is sent as basic auth (not resolved as a host name);
    the report shows the URL with the password masked."""
    conf = Secured(METRICS, BASIC)
    with serve(conf) as where:
        code, out, err = doctor(capsys, caplog, url(where, userinfo=f"{USER}:{PASSWORD}"))
    assert (code, err) == (0, ""), err
    assert url(where, userinfo=f"{USER}:***") in out
    assert conf.seen == [
        ("/metrics", "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())
    ]


def test_basic_auth_over_https_verified_with_the_ca_file_percent_decoded(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, pki: PKI
) -> None:
    """HTTPS with --ca-file: the server is verified and the URL's percent-encoded
    password is decoded before it is sent; the JSON source masks it."""
    password = PASSWORD + "@:/"
    conf = Secured(METRICS, ("basic", USER, password))
    quoted = urllib.parse.quote(password, safe="")
    with serve(conf, pki) as where:
        code, out, err = doctor(
            capsys,
            caplog,
            url(where, userinfo=f"{USER}:{quoted}"),
            "--ca-file",
            str(pki.ca),
            "--json",
        )
    assert (code, err) == (0, ""), err
    assert json.loads(out)["source"]["urls"] == [url(where, userinfo=f"{USER}:***")]


def test_a_wrong_password_or_none_exits_2_naming_the_cause(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, pki: PKI
) -> None:
    """A refused password: exit 2, one line 'HTTP 401 ... was refused'; no
    credentials at all: the line says the endpoint wants some."""
    with serve(Secured(METRICS, BASIC), pki) as where:
        code, out, err = doctor(
            capsys, caplog, url(where, userinfo=f"{USER}:{TOKEN}"), "--ca-file", str(pki.ca)
        )
        assert code == 2 and out == ""
        one_line(err, "HTTP 401", "user and password was refused", f"{USER}:***@")
        code, out, err = doctor(capsys, caplog, url(where), "--ca-file", str(pki.ca))
    assert code == 2 and out == ""
    one_line(err, "HTTP 401", "wants credentials")


# -- bearer tokens ---------------------------------------------------------------------------


def test_bearer_token_from_a_file_or_an_environment_variable(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    pki: PKI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--bearer-token-file (its trailing newline dropped) and --bearer-token-env send
    'Authorization: Bearer <token>'."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("HX_TEST_DOCTOR_TOKEN", TOKEN)
    conf = Secured(METRICS, ("bearer", TOKEN))
    with serve(conf, pki) as where:
        target = url(where)
        ca = ("--ca-file", str(pki.ca))
        code, _, err = doctor(capsys, caplog, target, *ca, "--bearer-token-file", str(token_file))
        assert (code, err) == (0, ""), err
        code, _, err = doctor(
            capsys, caplog, target, *ca, "--bearer-token-env", "HX_TEST_DOCTOR_TOKEN"
        )
        assert (code, err) == (0, ""), err
    assert conf.seen == [("/metrics", f"Bearer {TOKEN}")] * 2


def test_a_wrong_token_exits_2(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, pki: PKI, tmp_path: Path
) -> None:
    """A token the server refuses (403): exit 2, one line saying the token was refused."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with serve(Secured(METRICS, ("bearer", "another-token")), pki) as where:
        code, out, err = doctor(
            capsys,
            caplog,
            url(where),
            "--ca-file",
            str(pki.ca),
            "--bearer-token-file",
            str(token_file),
        )
    assert code == 2 and out == ""
    one_line(err, "HTTP 403", "the bearer token was refused")


@pytest.mark.parametrize(
    ("content", "option", "message"),
    [
        (None, "file", "--bearer-token-file: cannot read {path} (No such file or directory)"),
        ("\n", "file", "--bearer-token-file {path}: the file is empty"),
        (TOKEN + "\nHost: evil", "file", "not a bearer token"),
        (None, "env", "the environment variable HX_TEST_DOCTOR_UNSET is unset or empty"),
    ],
)
def test_a_missing_or_malformed_token_exits_2_before_any_read(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    content: str | None,
    option: str,
    message: str,
) -> None:
    """A missing or empty token file, a token that would break the header, an unset
    variable: exit 2, one line naming the option, the token never printed, no request."""
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    monkeypatch.delenv("HX_TEST_DOCTOR_UNSET", raising=False)
    conf = Secured(METRICS)
    with serve(conf) as where:
        argv = (
            ["--bearer-token-file", str(path)]
            if option == "file"
            else ["--bearer-token-env", "HX_TEST_DOCTOR_UNSET"]
        )
        code, out, err = doctor(capsys, caplog, url(where), *argv)
    assert code == 2 and out == "" and conf.seen == []
    one_line(err, message.format(path=path))


# -- TLS ----------------------------------------------------------------------------------


def test_a_certificate_that_does_not_verify_exits_2_and_insecure_reads_it(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, pki: PKI
) -> None:
    """A server certificate not signed by --ca-file's CA (or the system's): exit 2,
    one line naming the verification failure; --insecure reads it."""
    conf = Secured(METRICS, BASIC)
    with serve(conf, pki) as where:
        target = url(where, userinfo=f"{USER}:{PASSWORD}")
        for argv in (["--ca-file", str(pki.other_ca)], []):
            code, out, err = doctor(capsys, caplog, target, *argv)
            assert code == 2 and out == ""
            one_line(err, "certificate did not verify", "--ca-file", f"{USER}:***@")
        assert conf.seen == []  # the password never left before the server was verified
        code, _, err = doctor(capsys, caplog, target, "--insecure")
    assert (code, err) == (0, ""), err


def test_client_certificate_when_the_server_asks_for_one(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, pki: PKI
) -> None:
    """A server requiring a client certificate: read with --cert-file/--key-file;
    without one, or with an encrypted key, exit 2 with one line."""
    conf = Secured(METRICS, ("bearer", TOKEN))
    env = {"HX_TEST_DOCTOR_TOKEN": TOKEN}
    with pytest.MonkeyPatch.context() as mp, serve(conf, pki, client_ca=pki.ca) as where:
        for k, v in env.items():
            mp.setenv(k, v)
        common = [
            url(where),
            "--ca-file",
            str(pki.ca),
            "--bearer-token-env",
            "HX_TEST_DOCTOR_TOKEN",
        ]
        cert = ["--cert-file", str(pki.client_cert)]
        code, _, err = doctor(capsys, caplog, *common, *cert, "--key-file", str(pki.client_key))
        assert (code, err) == (0, ""), err
        code, out, err = doctor(capsys, caplog, *common)
        assert code == 2 and out == ""
        one_line(err, url(where))
        assert "client certificate" in err or "Connection reset" in err, err
        code, out, err = doctor(
            capsys, caplog, *common, *cert, "--key-file", str(pki.client_key_encrypted)
        )
        assert code == 2 and out == ""
        one_line(err, "--key-file: the key is encrypted")
    assert conf.seen == [("/metrics", f"Bearer {TOKEN}")]


# -- every URL the doctor reads ------------------------------------------------------------


def test_prometheus_api_behind_tls_and_a_bearer_token(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    pki: PKI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--prometheus reads its two queries with the same token and CA bundle."""
    answer = prom_answer(
        [
            ({"__name__": P + "written_pages_total", "instance": "a:1", "pool": "kv"}, "300"),
            (
                {"__name__": P + "redundant_written_pages_total", "instance": "a:1", "pool": "kv"},
                "90",
            ),
        ]
    )
    monkeypatch.setenv("HX_TEST_DOCTOR_TOKEN", TOKEN)
    conf = Secured({"/api/v1/query": ("application/json", answer)}, ("bearer", TOKEN))
    with serve(conf, pki) as where:
        base = url(where, path="")
        argv = ["--ca-file", str(pki.ca), "--bearer-token-env", "HX_TEST_DOCTOR_TOKEN"]
        code = main(["doctor", "--prometheus", base, *argv, "--json"])
        out, err = capsys.readouterr()
        assert code == 1 and TOKEN not in out + err, err
        assert [i["instance"] for i in json.loads(out)["instances"]] == ["a:1"]
        monkeypatch.setenv("HX_TEST_DOCTOR_TOKEN", "expired-" + TOKEN[::-1])
        code = main(["doctor", "--prometheus", base, *argv])
        out, err = capsys.readouterr()
    assert code == 2 and out == "" and "expired-" not in err
    one_line(err, "(query API): HTTP 403", "the bearer token was refused")
    assert [a for _, a in conf.seen] == [f"Bearer {TOKEN}"] * 2 + [f"Bearer expired-{TOKEN[::-1]}"]


def test_credentials_follow_a_redirect_only_to_the_same_origin(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A redirect on the same server keeps the basic auth; a redirect to another
    port (another origin) gets no Authorization header at all."""
    elsewhere = Secured(METRICS)
    with serve(elsewhere) as other:
        conf = Secured(METRICS, BASIC, {"/old": "/metrics", "/away": url(other)})
        with serve(conf) as where:
            code, _, err = doctor(capsys, caplog, url(where, "/old", f"{USER}:{PASSWORD}"))
            assert (code, err) == (0, ""), err
            code, _, err = doctor(capsys, caplog, url(where, "/away", f"{USER}:{PASSWORD}"))
            assert (code, err) == (0, ""), err
    assert [p for p, _ in conf.seen] == ["/old", "/metrics", "/away"]
    assert conf.seen[1][1] is not None and conf.seen[1][1].startswith("Basic ")
    assert elsewhere.seen == [("/metrics", None)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["https://a", "--key-file", "k.pem"], "--key-file needs --cert-file"),
        (["http://a", "--ca-file", "ca.pem"], "--ca-file: for https URLs, and no URL is https"),
        (["https://a", "--insecure", "--ca-file", "ca.pem"], "--insecure does not verify"),
        (["https://a", "--ca-file", "/nonexistent/ca.pem"], "--ca-file: cannot load /nonexistent"),
        (
            ["http://a", "--bearer-token-env", "A", "--bearer-token-file", "t"],
            "not both",
        ),
    ],
)
def test_contradictory_or_unloadable_tls_options_exit_2(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    argv: list[str],
    message: str,
) -> None:
    """A key without its certificate, TLS options without an https URL, --insecure
    with a CA bundle, a CA file that is not there, two token sources: exit 2, one line."""
    code, out, err = doctor(capsys, caplog, *argv)
    assert code == 2 and out == ""
    one_line(err, message)


def test_user_info_and_a_bearer_token_together_exit_2(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Basic auth in the URL and a bearer token: one Authorization header only, so
    exit 2 naming both, nothing sent."""
    monkeypatch.setenv("HX_TEST_DOCTOR_TOKEN", TOKEN)
    conf = Secured(METRICS)
    with serve(conf) as where:
        code, out, err = doctor(
            capsys,
            caplog,
            url(where, userinfo=f"{USER}:{PASSWORD}"),
            "--bearer-token-env",
            "HX_TEST_DOCTOR_TOKEN",
        )
    assert code == 2 and out == "" and conf.seen == []
    one_line(err, "user:password@ in the URL or a bearer token, not both")
