"""Real SGLang servers on CPU for tests: launch, traffic, scrape.

Every server is a real ``python -m sglang.launch_server`` process (sglang 0.5.23's
CPU engine: ``SGLANG_USE_CPU_ENGINE=1 --device cpu --disable-cuda-graph``) serving a
tiny random-weight Llama written on the fly (``--load-format dummy
--skip-tokenizer-init``; requests send ``input_ids``), on loopback only. HiCache
buffer mode over the file backend is on by default, and the package is enabled by
its own server flag. The CPU stand-ins in ``standins/`` reach every server process
through ``PYTHONPATH`` (``standins/sitecustomize.py``; each stand-in says what fails
without it).

API (stable; other tests build on it)::

    spec = ServerSpec(existence=True, config={"cache": {"max_entries": 64}})
    with launch(spec) as srv:                 # waits until /health_generate answers
        out = srv.generate(ids, max_new_tokens=4)      # greedy: list of output ids
        srv.flush_cache()                     # POST /flush_cache, retried while 400
        srv.wait_writes_settled()             # backuped tokens and L3 files stop moving
        fams = srv.metrics()                  # {family name: Family} from /metrics
        srv.value("sglang:backuped_tokens_total")          # sum over samples (raises
                                              # MissingSeries if absent: absent_ok=True)
        srv.l3_pages()                        # {file name: size} in the L3 directory
        srv.log.read_text()                   # the server's stdout+stderr
    # stop() on exit: SIGINT, then SIGKILL of the process group after a grace period
    launch(spec, launcher=True)               # through ``hicache-existence launch --``
    proc_view(srv.proc.pid)                   # (argv, environ) of the running process
    family(fams, name), sample_value(fams, sample, **labels)   # strict readers of a scrape
    our_totals(fams, names), cause_pages(fams)  # our counters; redundant pages by cause
    scrape(url)                               # another /metrics (a standalone exporter)
    free_ports(n)                             # n consecutive free ports
    FileCreations(l3_dir).close()             # page files renamed into place (inotify)

Readers are strict: a family or sample that is not on ``/metrics`` raises
``MissingSeries`` (so ``failed == 0`` cannot pass because a family disappeared);
pass ``absent_ok=True`` where absence is expected (SGLang creates its labelled
series at their first event).

``ServerSpec`` fields: ``existence`` (``--enable-hicache-existence``), ``config``
(dict written to a JSON file for ``--hicache-existence-config``, or ``config_text``
for raw text), ``hicache`` (buffer mode over the file backend), ``l3_dir`` (reuse one
across servers for a warm L3), ``page_size``, ``metrics`` (``--enable-metrics``),
``tp_size``, ``hicache_ratio``, ``env`` (extra environment), ``extra_args``, ``storage_backend`` /
``storage_extra_config`` (e.g. ``dynamic`` with the ledger wrapper), ``standins_off``
(turn single stand-ins off, to show what fails), ``max_total_tokens``,
``sleep_on_idle`` (``--sleep-on-idle``, for stacks of three servers or more).

Traffic: ``trace_requests()`` maps the repository's Mooncake trace to token ids:
each hash id becomes a deterministic block of ``block_tokens`` ids (default 32, the
trace's 512 scaled down) below the vocabulary size, so requests share prefixes
exactly as in the trace.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# tests/: the one port picker, for the benchmarks that import this harness too
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reconcile_redis_server import HANDED_OUT, free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STANDINS = HERE / "standins"
TRACE = REPO / "tests" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"

VOCAB = 1024
#: A Llama small enough for CPU (section 8 of the design notes): 256 bytes of KV per token.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
START_TIMEOUT_S = float(os.environ.get("HX_SERVER_START_TIMEOUT_S", "240"))
REQUEST_TIMEOUT_S = 120.0
#: ``ServerSpec.prefetch_policy`` for servers held to exact counts that depend on what a
#: prefetch loaded: sglang's default, ``best_effort``, ends a prefetch (its hit query
#: included) when its request is scheduled, so under slow I/O it loads less (880 of
#: 7,520 tokens beside a disk writer), or none, and the prefix is computed and written
#: again.  ``wait_complete`` loads every prefetch whole.
LOAD_WHOLE = "wait_complete"


def free_ports(n: int, attempts: int = 50) -> int:
    """The first of ``n`` consecutive free ports (a standalone exporter per
    scheduler binds ``metrics.port + index``)."""
    for _ in range(attempts):
        first = free_port()
        if first + n - 1 > 65535 or HANDED_OUT.intersection(range(first + 1, first + n)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        HANDED_OUT.update(range(first, first + n))
        return first
    raise RuntimeError(f"no {n} consecutive free ports in {attempts} attempts")


def write_model(root: Path, drop: Sequence[str] = (), **overrides: Any) -> Path:
    """A model directory holding only ``config.json`` (weights are random: ``dummy``)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in TINY_LLAMA.items() if k not in drop}
    (root / "config.json").write_text(json.dumps({**config, **overrides}))
    return root


@dataclass
class ServerSpec:
    existence: bool = True
    config: Mapping[str, Any] | None = None
    config_text: str | None = None
    hicache: bool = True
    l3_dir: Path | None = None
    page_size: int = 16
    metrics: bool = True
    tp_size: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    storage_backend: str = "file"
    storage_extra_config: Mapping[str, Any] | None = None
    standins_off: Sequence[str] = ()
    max_total_tokens: int = 65536
    #: Host pool size as a multiple of the device pool. Explicit, because sglang's
    #: auto-sizing keeps a 10 GiB host reserve and refuses to start ("No host memory
    #: is left for HiCache") whenever the machine's free memory dips below it.
    hicache_ratio: float = 2.0
    #: Seed of the dummy weights: equal seeds give equal models across servers.
    random_seed: int = 1234
    #: ``--hicache-host-memory-mode``: ``buffer_only`` (the package's first mode) or
    #: ``cache`` (HiCache's default: host memory keeps a copy, L3 is written from it).
    host_memory_mode: str = "buffer_only"
    #: ``--hicache-write-policy`` (``None``: sglang's default, ``write_through``).
    write_policy: str | None = None
    #: ``--hicache-storage-prefetch-policy`` (``None``: sglang's default, ``best_effort``,
    #: which ends a prefetch when its request is scheduled: how much of it loaded then
    #: depends on the machine's load).  ``LOAD_WHOLE`` for tests that compare
    #: prefetch-dependent counts across servers or with a known figure.
    prefetch_policy: str | None = None
    #: ``--sleep-on-idle``: an idle scheduler waits in a poll (up to 1 s) instead of
    #: spinning a core (sglang's default, kept everywhere else).  For stacks of three
    #: servers or more on a 2-core machine, where the idle ones' spinning slows every
    #: start-up and request of the others (the PD stack and doctor's fleet: 155 s less
    #: of 388 s); one or two servers gain nothing, the poll delays their write acks.
    #: ``HX_SERVER_SLEEP_ON_IDLE=0`` turns it off everywhere.
    sleep_on_idle: bool = False
    #: ``config.json`` of the served model: ``TINY_LLAMA`` updated with these keys
    #: (another architecture's whole config for the MLA and hybrid shapes).
    model: Mapping[str, Any] = field(default_factory=dict)
    #: Keys of ``TINY_LLAMA`` left out of the served config (``model`` replaces the
    #: rest): another architecture's config must not inherit Llama-only keys.
    model_drop: Sequence[str] = ()


def server_env(spec: ServerSpec, l3_dir: Path) -> dict[str, str]:
    """The environment of a test server: the test process's, minus anything that
    would configure the package, sglang's plugins or Prometheus from outside."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (
            k.startswith("HICACHE_EXISTENCE_") and not k.startswith("HICACHE_EXISTENCE_REQUIRE")
        )
        and k not in ("SGLANG_PLUGINS", "PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH")
    }
    paths = [str(STANDINS), str(REPO)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(l3_dir),
        HX_CPU_STANDINS_OFF=",".join(spec.standins_off),
        HX_PROBES="1",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    if spec.tp_size > 1:
        env.setdefault(
            "SGLANG_CPU_OMP_THREADS_BIND",
            "|".join(str(i % (os.cpu_count() or 1)) for i in range(spec.tp_size)),
        )
    env.update(spec.env)
    return env


def sleep_on_idle_allowed() -> bool:
    """``HX_SERVER_SLEEP_ON_IDLE=0`` runs every server on sglang's spinning idle loop."""
    return os.environ.get("HX_SERVER_SLEEP_ON_IDLE", "1") != "0"


def server_args(spec: ServerSpec, model: Path, port: int, workdir: Path) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--device",
        "cpu",
        "--disable-cuda-graph",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--page-size",
        str(spec.page_size),
        "--max-total-tokens",
        str(spec.max_total_tokens),
        "--random-seed",
        str(spec.random_seed),
        "--tp-size",
        str(spec.tp_size),
        "--log-level",
        "info",
        "--served-model-name",
        "tiny-llama",
    ]
    if spec.metrics:
        args.append("--enable-metrics")
    if spec.sleep_on_idle and sleep_on_idle_allowed():
        args.append("--sleep-on-idle")
    if spec.hicache:
        args += [
            "--enable-hierarchical-cache",
            "--hicache-host-memory-mode",
            spec.host_memory_mode,
            "--hicache-storage-backend",
            spec.storage_backend,
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            "page_first_direct",
            "--hicache-ratio",
            str(spec.hicache_ratio),
        ]
        if spec.write_policy is not None:
            args += ["--hicache-write-policy", spec.write_policy]
        if spec.prefetch_policy is not None:
            args += ["--hicache-storage-prefetch-policy", spec.prefetch_policy]
        if spec.storage_extra_config is not None:
            args += [
                "--hicache-storage-backend-extra-config",
                json.dumps(spec.storage_extra_config),
            ]
    if spec.existence:
        args.append("--enable-hicache-existence")
    if spec.config is not None or spec.config_text is not None:
        path = workdir / "hicache-existence.json"
        path.write_text(
            spec.config_text if spec.config_text is not None else json.dumps(spec.config)
        )
        args += ["--hicache-existence-config", str(path)]
    return args + list(spec.extra_args)


class ServerDied(RuntimeError):
    pass


class PortTaken(RuntimeError):
    """The server could not bind a port: another process took it between
    ``free_port()`` and the bind (an ephemeral port reused by any outgoing
    connection on the machine, or a port sglang picked for itself).  ``start``
    launches again on a fresh port rather than wait out the start-up timeout."""


#: What sglang's parts log when a port they bind is taken: uvicorn (the HTTP port),
#: ZMQ (the scheduler's and detokenizer's TCP ports) and torch.distributed's store.
#: Not our exporter's "metrics endpoint not started: ... Address already in use",
#: which costs only the metrics endpoint (the server starts; a test provokes it).
BIND_FAILURES = (
    "error while attempting to bind on address",
    "ZMQError: Address already in use",
    "EADDRINUSE",
)
#: Launches of one server before a taken port is an error.
START_ATTEMPTS = 3


def foreign(content_type: str | None, head: bytes) -> bool:
    """Whether a readiness answer came from a Prometheus exposition server (another
    test process's exporter, which answers every GET path) that bound the port
    ``free_port()`` chose before this launch did: the launch's own bind then fails
    only after its model loads, and every request in between reaches the exporter
    (``POST /generate`` -> 405).  Neither SGLang's ``/health`` nor the router's
    answers in the exposition format."""
    kind = (content_type or "").lower()
    return kind.startswith(
        ("text/plain; version=0.0.4", "application/openmetrics-text")
    ) or head.startswith((b"# HELP ", b"# TYPE "))


def sglang_total(fams: Mapping[str, Family], name: str, suffix: str = "_total") -> float:
    """An SGLang counter's total; 0 while absent: SGLang creates its storage
    counters at their first event (``sglang:backuped_tokens`` at the first backup).
    Our own families are never read this way (they exist at 0 from the start)."""
    fam = fams.get(name)
    return fam.total(suffix) if fam is not None else 0.0


class MissingSeries(AssertionError):
    """A series a test reads is not on ``/metrics`` at all.

    The readers below raise it instead of reading 0, so that ``failed == 0`` or
    ``redundant == 0`` cannot pass because a family disappeared or a name is
    misspelt; a caller that expects absence says so with ``absent_ok=True``."""


@dataclass
class Family:
    """One metric family of ``/metrics``: its samples as (name, labels, value)."""

    name: str
    type: str
    samples: list[tuple[str, dict[str, str], float]]

    def total(self, suffix: str = "", *, absent_ok: bool = False, **labels: str) -> float:
        """Sum of the samples whose name ends with ``suffix`` and that carry these
        labels; ``MissingSeries`` when none does (unless ``absent_ok``)."""
        matched = [
            v
            for n, lab, v in self.samples
            if n.endswith(suffix) and all(lab.get(k) == want for k, want in labels.items())
        ]
        if not matched and not absent_ok:
            raise MissingSeries(f"{self.name}: no sample *{suffix} with labels {labels}")
        return sum(matched)


def parse_metrics(text: str) -> dict[str, Family]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        samples = [(s.name, dict(s.labels), float(s.value)) for s in fam.samples]
        out[fam.name] = Family(fam.name, fam.type, samples)
    return out


def family(fams: Mapping[str, Family], name: str) -> Family:
    """The family ``name`` (without ``_total``) of a parsed scrape; ``MissingSeries``
    when the scrape has none."""
    try:
        return fams[name]
    except KeyError:
        ours = sorted(n for n in fams if n.startswith("hicache_existence_"))
        raise MissingSeries(f"no family {name!r} on /metrics (ours there: {ours})") from None


def sample_value(
    fams: Mapping[str, Family], sample: str, *, absent_ok: bool = False, **labels: str
) -> float:
    """Sum of the samples named exactly ``sample`` (with these labels) in a parsed
    scrape; ``MissingSeries`` when there is none (unless ``absent_ok``)."""
    matched = [
        v
        for fam in fams.values()
        for n, lab, v in fam.samples
        if n == sample and all(lab.get(k) == want for k, want in labels.items())
    ]
    if not matched and not absent_ok:
        raise MissingSeries(f"no sample {sample} with labels {labels} on /metrics")
    return sum(matched)


#: Our families' prefix on ``/metrics``.
OURS = "hicache_existence_"
#: The write path's page counters (``our_totals`` reads them).
WRITE_PAGES = (
    "written_pages",
    "write_acknowledged_pages",
    "write_failed_pages",
    "redundant_written_pages",
    "redundant_believed_pages",
    "write_avoided_pages",
)


def our_totals(fams: Mapping[str, Family], names: Sequence[str]) -> dict[str, float]:
    """Each of our counters (name without the prefix), summed over pools; strict:
    our families exist at 0 from the start, so a missing one is a defect."""
    return {n: family(fams, OURS + n).total("_total") for n in names}


def cause_pages(fams: Mapping[str, Family]) -> dict[str, float]:
    """Redundant pages by cause, summed over pools (a cause never seen has no
    sample: the family itself must be there)."""
    out: dict[str, float] = {}
    for _, labels, value in family(fams, OURS + "redundant_cause_pages").samples:
        out[labels["cause"]] = out.get(labels["cause"], 0.0) + value
    return out


def scrape(url: str, timeout_s: float = 30.0) -> dict[str, Family]:
    """A ``/metrics`` endpoint other than SGLang's (e.g. a scheduler's standalone
    exporter), parsed."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse_metrics(r.read().decode())


class Server:
    """A running server; built by ``launch``."""

    def __init__(self, spec: ServerSpec, workdir: Path, l3_dir: Path, port: int) -> None:
        self.spec = spec
        self.workdir = workdir
        self.l3_dir = l3_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "server.log"
        self.model = write_model(workdir / "model", drop=spec.model_drop, **spec.model)
        self.args = server_args(spec, self.model, port, workdir)
        self.env = server_env(spec, l3_dir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0
        #: Where this launch's part of the log begins (``port_taken`` reads from there).
        self._log_from = 0
        #: The readiness route, and what the start-up error calls this process.
        self.health = "/health"
        self.what = "server"

    # -- life cycle -------------------------------------------------------------------
    def start(self, spawned_at: float | None = None) -> Server:
        """Spawn (unless ``spawn`` already ran at ``spawned_at``) and wait until ready;
        on ``PortTaken``, launch again on a fresh port."""
        t0 = self.spawn() if spawned_at is None else spawned_at
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._wait_ready(t0)
            except PortTaken:
                if attempt == START_ATTEMPTS:
                    raise
                self.rebind(free_port())
                t0 = self.spawn()
        raise AssertionError("unreachable")

    def rebind(self, port: int) -> None:
        """Move a stopped server to ``port``: the ``--port`` argument, the URL."""
        at = self.args.index("--port")
        self.args[at + 1] = str(port)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def spawn(self) -> float:
        """Start the process without waiting; returns its start time (monotonic)."""
        t0 = time.monotonic()
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return t0

    def _wait_ready(self, t0: float) -> Server:
        deadline = t0 + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.port_taken():
                self.stop(grace_s=5.0)
                raise PortTaken(
                    f"{self.what} on port {self.port}: a port was taken:\n{self.tail()}"
                )
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=5) as r:
                    if r.status == 200 and foreign(r.headers.get("Content-Type"), r.read(64)):
                        self.stop(grace_s=5.0)
                        raise PortTaken(
                            f"{self.what} on port {self.port}: {self.health} was answered "
                            "by a Prometheus exposition server, not by this launch"
                        )
                    if r.status == 200:
                        self.start_s = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.what} not up in {START_TIMEOUT_S}s; log tail:\n{self.tail()}")

    def launch_log(self) -> str:
        """What this launch wrote to the log (since ``spawn``; "" before)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def port_taken(self) -> bool:
        """Whether this launch's log says a bind failed."""
        text = self.launch_log()
        return any(sign in text for sign in BIND_FAILURES)

    def check_alive(self) -> None:
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            raise ServerDied(f"server exited with {rc}; log tail:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGINT to the launcher, then SIGKILL of its whole process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode

    # -- HTTP --------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 4, **sampling: Any
    ) -> list[int]:
        """Greedy generation (temperature 0, EOS ignored): the output token ids."""
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **sampling,
        }
        status, body = self._request(
            "POST", "/generate", {"input_ids": list(input_ids), "sampling_params": params}
        )
        if status != 200:
            self.check_alive()
            raise RuntimeError(f"/generate answered {status}: {body[:500]!r}")
        return list(json.loads(body)["output_ids"])

    def generate_full(self, input_ids: Sequence[int], max_new_tokens: int = 4) -> dict[str, Any]:
        """The whole ``/generate`` answer (``meta_info`` has ``cached_tokens`` etc.)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        status, body = self._request(
            "POST", "/generate", {"input_ids": list(input_ids), "sampling_params": params}
        )
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {body[:500]!r}")
        return dict(json.loads(body))

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the device tree; sglang answers 400 while storage writes are pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self._request("POST", "/flush_cache")
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"/flush_cache kept answering {status}: {body[:200]!r}")
            time.sleep(0.2)

    def metrics_text(self) -> str:
        status, body = self._request("GET", "/metrics", timeout=30)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body.decode()

    def metrics(self) -> dict[str, Family]:
        """SGLang's ``/metrics``, parsed: {family name (no ``_total``): Family}."""
        return parse_metrics(self.metrics_text())

    def value(self, sample: str, *, absent_ok: bool = False, **labels: str) -> float:
        """Sum of the samples named exactly ``sample`` (with these labels) on
        ``/metrics``; ``MissingSeries`` when there is none, unless ``absent_ok``
        (a series that may legitimately not exist yet then reads 0)."""
        return sample_value(self.metrics(), sample, absent_ok=absent_ok, **labels)

    def samples(self, sample: str) -> list[tuple[dict[str, str], float]]:
        return [
            (lab, v) for fam in self.metrics().values() for n, lab, v in fam.samples if n == sample
        ]

    def probes(self, kind: str) -> list[dict[str, Any]]:
        """The ``HX-PROBE`` records of this kind in the log (``standins/hx_probes.py``)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            at = line.find("HX-PROBE ")
            if at >= 0:
                rec = json.loads(line[at + len("HX-PROBE ") :])
                if rec.get("kind") == kind:
                    out.append(rec)
        return out

    # -- L3 ----------------------------------------------------------------------------
    def l3_pages(self) -> dict[str, int]:
        """Page files in the file backend's directory: {name: size in bytes}.

        Only pages in place: the backend writes each page to ``.<uuid>.tmp`` and
        renames it, so a dot-file is a write in flight (not a page, and gone by the
        time it would be stat()ed)."""
        if not self.l3_dir.is_dir():
            return {}
        pages = {}
        for p in self.l3_dir.iterdir():
            if p.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                if p.is_file():
                    pages[p.name] = p.stat().st_size
        return pages

    def wait_writes_settled(self, quiet_s: float = 1.5, timeout_s: float = 60.0) -> None:
        """Until sglang's backed-up token count and the L3 file set stop changing
        (writes are asynchronous: the storage thread acks after the request returns)."""
        deadline = time.monotonic() + timeout_s
        last: tuple[float, int] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            now = (
                # sglang creates the labelled series at the first backup
                self.value("sglang:backuped_tokens_total", absent_ok=True)
                if self.spec.metrics
                else 0.0,
                len(self.l3_pages()),
            )
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.25)
        raise TimeoutError("writes did not settle")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def via_launcher(args: Sequence[str]) -> list[str]:
    """``python -m sglang.launch_server ARGS`` as ``python -m hicache_existence
    launch -- ARGS``: the package's launcher takes our flags out of ARGS, turns
    them into the environment and ``exec``s sglang (same process id)."""
    python, *entry = args[:3]
    if entry != ["-m", "sglang.launch_server"]:
        raise ValueError(f"not a launch_server command line: {list(args[:3])}")
    return [python, "-m", "hicache_existence", "launch", "--", *args[3:]]


def proc_view(pid: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment a running process has (``/proc``): what
    the launcher's ``exec`` really handed to sglang."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (e.decode(errors="replace").partition("=") for e in env if e)
    return [a.decode(errors="replace") for a in argv if a], {k: v for k, _, v in pairs}


@contextlib.contextmanager
def launch(
    spec: ServerSpec, workdir: Path | None = None, *, launcher: bool = False
) -> Iterator[Server]:
    """Start a server for ``spec`` and stop it (and all its children) on exit;
    ``launcher=True`` starts it through ``hicache-existence launch`` (``via_launcher``)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hx-srv-")))
        workdir.mkdir(parents=True, exist_ok=True)
        l3 = spec.l3_dir if spec.l3_dir is not None else workdir / "l3"
        l3.mkdir(parents=True, exist_ok=True)
        srv = Server(spec, workdir, l3, free_port())
        if launcher:
            srv.args = via_launcher(srv.args)
        try:
            yield srv.start()
        finally:
            srv.stop()


@contextlib.contextmanager
def launch_together(specs: Sequence[ServerSpec], workdir: Path) -> Iterator[list[Server]]:
    """Start servers whose start-ups overlap (``workdir/<i>`` each), and stop them
    all on exit: two servers side by side cost one start-up's wall time."""
    servers: list[Server] = []
    try:
        for i, spec in enumerate(specs):
            wd = workdir / str(i)
            wd.mkdir(parents=True, exist_ok=True)
            l3 = spec.l3_dir if spec.l3_dir is not None else wd / "l3"
            l3.mkdir(parents=True, exist_ok=True)
            servers.append(Server(spec, wd, l3, free_port()))
        started = [srv.spawn() for srv in servers]
        for srv, t0 in zip(servers, started):
            srv.start(spawned_at=t0)
        yield servers
    finally:
        stop_together(servers)


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """Run ``calls`` at once (one thread each: the servers they drive work in
    parallel), and return their results in order; the first exception raised in
    any of them is raised here once all have finished."""
    import threading

    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], T]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # raised on the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def stop_together(servers: Sequence[Server], grace_s: float = 15.0) -> None:
    """SIGINT to every server at once, one shared grace period, then ``stop``
    (SIGKILL of what is left): one grace period, not one per server."""
    for srv in servers:
        if srv.proc is not None and srv.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(srv.proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for srv in servers:
        if srv.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.proc.wait(max(0.0, deadline - time.monotonic()))
    for srv in servers:
        srv.stop(grace_s=0.0)


def run_to_exit(spec: ServerSpec, workdir: Path, timeout_s: float = 180.0) -> tuple[int, str]:
    """Launch and wait for the launcher to exit on its own (bad-input tests)."""
    srv = Server(spec, workdir, spec.l3_dir or workdir / "l3", free_port())
    with open(srv.log, "ab") as log:
        proc = subprocess.Popen(
            srv.args,
            env=srv.env,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, srv.log.read_text(errors="replace")


class FileCreations:
    """Every page file renamed into place in one directory, as the kernel reports
    it (inotify ``IN_MOVED_TO``), while the watcher runs.

    SGLang's file backend writes a page to a temporary file and renames it onto
    ``<key>.bin``, and skips a page whose file exists: each rename is one write
    that stored a page L3 did not hold (two instances racing on one page rename
    it twice). ``first_ctime_ns`` keeps each name's inode change time at its
    first rename (read when the event arrives; the kernel's coarse clock can only
    put it early). Linux only (``ctypes`` over libc).

    The watch also takes ``IN_MOVED_FROM``, the other half of each rename, which
    names the unique temporary file: inotify merges an unread event into an
    identical one queued just before it (same mask, watch and name; a rename's
    cookie is not compared), so two renames onto one page in a row, the race of
    two instances, would read as one. With each rename's own ``IN_MOVED_FROM``
    between them, no two ``IN_MOVED_TO`` are ever adjacent."""

    IN_MOVED_FROM = 0x00000040
    IN_MOVED_TO = 0x00000080
    IN_Q_OVERFLOW = 0x00004000

    def __init__(self, directory: Path) -> None:
        import ctypes
        import threading

        self.directory = Path(directory)
        self.counts: Counter[str] = Counter()
        self.first_ctime_ns: dict[str, int] = {}
        self.overflowed = False
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = self.IN_MOVED_FROM | self.IN_MOVED_TO
        wd = libc.inotify_add_watch(self._fd, os.fsencode(self.directory), mask)
        if wd < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {self.directory}")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="l3-creations", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select

        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.2)
            self.drain()

    def drain(self) -> None:
        """Read every event queued so far."""
        import struct

        with self._lock:
            while True:
                try:
                    buf = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    return
                except OSError:  # closed
                    return
                at = 0
                while at + 16 <= len(buf):
                    _wd, mask, _cookie, size = struct.unpack_from("iIII", buf, at)
                    name = buf[at + 16 : at + 16 + size].split(b"\0", 1)[0].decode()
                    at += 16 + size
                    if mask & self.IN_Q_OVERFLOW:
                        self.overflowed = True
                    if mask & self.IN_MOVED_TO and name.endswith(".bin"):
                        self.counts[name] += 1
                        if name not in self.first_ctime_ns:
                            with contextlib.suppress(OSError):
                                st = (self.directory / name).stat()
                                self.first_ctime_ns[name] = st.st_ctime_ns

    def close(self) -> Counter[str]:
        """Stop watching; every rename seen, by file name."""
        self._stop.set()
        self._thread.join(5)
        self.drain()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self.overflowed:
            raise RuntimeError(f"inotify queue overflowed watching {self.directory}")
        return self.counts


# -- traffic ----------------------------------------------------------------------------
T = TypeVar("T")


def settle(read: Callable[[], T], quiet_s: float = 2.0, timeout_s: float = 90.0) -> T:
    """``read()`` once its answer has not changed for ``quiet_s`` (writes are
    acknowledged after a request returns; our series are flushed once a second)."""
    last: T | None = None
    since = deadline = time.monotonic()
    deadline += timeout_s
    while time.monotonic() < deadline:
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.4)
    raise TimeoutError(f"did not settle: {last}")


def poll(check: Callable[[], Any], timeout_s: float = 30.0, every_s: float = 0.5) -> Any:
    """``check()``'s first true answer, or its last answer after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = check()
        if out or time.monotonic() > deadline:
            return out
        time.sleep(every_s)


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Per-key change between two readings (a key new in ``after`` counts from 0)."""
    return {k: after[k] - before.get(k, 0.0) for k in after}


def block_tokens_for(
    hash_id: int, block_tokens: int = 32, vocab: int = VOCAB, salt: str = ""
) -> list[int]:
    """The deterministic token block of one trace hash id (ids 3..vocab-1: below the
    vocabulary, clear of BOS/EOS)."""
    out: list[int] = []
    counter = 0
    while len(out) < block_tokens:
        digest = hashlib.sha256(f"{salt}:{hash_id}:{counter}".encode()).digest()
        out.extend(
            3 + int.from_bytes(digest[i : i + 2], "little") % (vocab - 3) for i in range(0, 32, 2)
        )
        counter += 1
    return out[:block_tokens]


@dataclass(frozen=True)
class TraceRequest:
    hash_ids: tuple[int, ...]
    input_ids: tuple[int, ...]
    output_length: int


def trace_requests(
    limit: int = 40,
    block_tokens: int = 32,
    max_blocks: int = 24,
    max_new_tokens: int = 2,
    path: Path = TRACE,
    salt: str = "",
    min_blocks: int = 1,
    shared_only: bool = False,
    window: int | None = None,
) -> list[TraceRequest]:
    """The first ``limit`` requests of the Mooncake trace (in trace order) as token
    ids: each hash id a block of ``block_tokens`` ids (512 scaled down), at most
    ``max_blocks`` blocks per request (the leading ones: prefixes stay shared as in
    the trace). ``min_blocks`` drops shorter requests (e.g. 8 x 32 tokens reaches
    sglang's default 256-token L3 prefetch threshold); ``shared_only`` keeps only
    requests whose first block another kept request also starts with; ``window``
    reads only the first this many requests of the trace."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = records[:window]
    records = [r for r in records if len(r["hash_ids"]) >= min_blocks]
    if shared_only:
        firsts = Counter(r["hash_ids"][0] for r in records)
        records = [r for r in records if firsts[r["hash_ids"][0]] > 1]
    out: list[TraceRequest] = []
    for rec in records[:limit]:
        ids = tuple(rec["hash_ids"][:max_blocks])
        tokens: list[int] = []
        for h in ids:
            tokens += block_tokens_for(h, block_tokens, salt=salt)
        out.append(TraceRequest(ids, tuple(tokens), min(int(rec["output_length"]), max_new_tokens)))
    return out


@dataclass(frozen=True)
class Turn:
    """One request of a multi-turn conversation: its prompt, and where it is in the
    conversation (``conversation``, ``turn``)."""

    conversation: int
    turn: int
    input_ids: tuple[int, ...]


def conversation_requests(
    conversations: int = 30,
    turns: int = 10,
    system_tokens: int = 96,
    user_tokens: tuple[int, int] = (160, 480),
    reply_tokens: tuple[int, int] = (64, 192),
    salt: str = "conv",
) -> list[Turn]:
    """A deterministic multi-turn chat workload, conversations interleaved turn by
    turn (turn 1 of every conversation, then turn 2, ...), so that a conversation's
    prefix meets the other conversations' traffic before its next turn.

    Turn ``k`` of a conversation sends its system prompt, every earlier user message
    and reply (replies are fixed token blocks, not the model's outputs, so every
    prompt is known up front and equal across runs), then user message ``k``.  Sizes
    are drawn per turn in the given ranges (tokens, inclusive) from ``salt``."""

    def size(tag: str, lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        digest = hashlib.sha256(f"{salt}:{tag}".encode()).digest()
        return lo + int.from_bytes(digest[:4], "little") % (hi - lo + 1)

    history = [
        block_tokens_for(c, system_tokens, salt=f"{salt}:system") for c in range(conversations)
    ]
    out: list[Turn] = []
    for k in range(turns):
        for c in range(conversations):
            user = block_tokens_for(k, size(f"u:{c}:{k}", user_tokens), salt=f"{salt}:u:{c}")
            prompt = history[c] + user
            out.append(Turn(c, k, tuple(prompt)))
            reply = block_tokens_for(k, size(f"r:{c}:{k}", reply_tokens), salt=f"{salt}:r:{c}")
            history[c] = prompt + reply
    return out
