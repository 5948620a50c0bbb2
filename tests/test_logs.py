"""Structured log events: the library never configures logging, events reach stdlib
handlers with stable names and fields, rate limiting, the CLI-only JSON setup,
and the monitor's derived events."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
import structlog

import hicache_existence as he
from hicache_existence import logs
from hicache_existence.exporters.monitor import Monitor


@pytest.fixture
def reset_logging():
    """Restore the root logger and structlog after a test that configures them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    structlog.reset_defaults()


def test_library_import_and_use_configure_nothing():
    """Importing the package, making exporters and logging events leaves the root
    logger and structlog unconfigured (checked in a fresh interpreter)."""
    code = (
        "import logging, structlog\n"
        "import hicache_existence as he\n"
        "from hicache_existence import exporters\nfrom hicache_existence import logs\n"
        "from hicache_existence.exporters import prometheus, multiprocess, otel\n"
        "from hicache_existence.exporters.series import SeriesReader\n"
        "s = SeriesReader(he.StorageExistenceCache(4)); s.sample()\n"
        "logs.get_logger('hicache_existence.x').info(logs.STARTUP, a=1)\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "assert not structlog.is_configured()\n"
        "assert logging.getLogger('hicache_existence').handlers == []\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_events_reach_stdlib_with_name_and_fields(caplog):
    """Without structlog configuration, an event is a stdlib record carrying its
    stable name and fields, rendered as 'event key=value'."""
    log = logs.get_logger("hicache_existence.test")
    with caplog.at_level(logging.INFO, logger="hicache_existence.test"):
        log.info(logs.CACHE_CLEARED, pool="kv", cleared_pages=3, note="two words")
        log.debug(logs.MISS_TRACED, pool="kv")  # below the level: dropped
    (record,) = caplog.records
    assert record.hicache_event == "hicache_existence.cache_cleared"
    assert record.hicache_fields == {"pool": "kv", "cleared_pages": 3, "note": "two words"}
    assert record.getMessage() == (
        'hicache_existence.cache_cleared pool=kv cleared_pages=3 note="two words"'
    )


def test_event_names_are_stable_and_unique():
    """Event names share one prefix and are listed once in EVENTS."""
    assert len(set(logs.EVENTS)) == len(logs.EVENTS)
    assert all(e.startswith("hicache_existence.") for e in logs.EVENTS)


def test_rate_limiter_token_bucket():
    """allow() admits a burst, then rate tokens per second; refusals are counted."""
    now = [0.0]
    limiter = logs.RateLimiter(2.0, burst=2, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(3)] == [True, True, False]
    now[0] = 0.5
    assert [limiter.allow(), limiter.allow()] == [True, False]
    assert limiter.take_suppressed() == 2 and limiter.suppressed == 0
    with pytest.raises(ValueError, match="rate"):
        logs.RateLimiter(-1)
    with pytest.raises(ValueError, match="burst"):
        logs.RateLimiter(1, burst=0)


def test_cli_json_setup_renders_structlog_and_stdlib_events(reset_logging):
    """configure_logging(json_output=True) makes structlog and stdlib events one
    JSON object per line with the event name and fields."""
    stream = io.StringIO()
    logs.configure_logging("info", json_output=True, stream=stream)
    logs.get_logger("hicache_existence.cli").info(logs.STARTUP, mode="standalone", port=9464)
    logging.getLogger("other.library").warning("plain %s", "message")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "hicache_existence.startup"
    assert lines[0]["port"] == 9464 and lines[0]["level"] == "info"
    assert lines[1]["event"] == "plain message" and lines[1]["level"] == "warning"


def test_cli_setup_rejects_unknown_level(reset_logging):
    """A bad level names the argument and configures nothing."""
    before = list(logging.getLogger().handlers)
    with pytest.raises(ValueError, match="level"):
        logs.configure_logging("loud")
    assert logging.getLogger().handlers == before


def test_json_formatter_without_structlog():
    """The stdlib JSON formatter (used when structlog is absent) keeps name and fields."""
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", ("msg",), None)
    record.hicache_event = logs.CACHE_AT_CAPACITY
    record.hicache_fields = {"pool": "kv", "entries": 4}
    out = json.loads(logs.JsonFormatter().format(record))
    assert out["event"] == logs.CACHE_AT_CAPACITY and out["entries"] == 4


def test_json_formatters_keep_a_record_whose_fields_are_not_ours(capsys):
    """Another library's record may carry ``hicache_fields`` of any type: the root
    formatters (they see every record) still render it, without our fields."""
    record = logging.LogRecord("other", logging.INFO, __file__, 1, "plain", (), None)
    record.hicache_fields = None
    assert json.loads(logs.JsonFormatter().format(record))["event"] == "plain"
    assert logs.get_logger().name == "hicache_existence"


def test_the_cli_module_runs_as_a_script_and_replay_exports_its_names():
    """``python -m hicache_existence.cli`` is the CLI, as ``python -m
    hicache_existence`` is; the replay package offers its documented names."""
    from hicache_existence.replay import read_trace, run_model, sweep

    assert callable(read_trace) and callable(run_model) and callable(sweep)
    out = subprocess.run(
        [sys.executable, "-m", "hicache_existence.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert he.__version__ in out.stdout


def test_monitor_at_capacity_once_clears_and_bursts(caplog):
    """The monitor logs at-capacity once per pool, each clear, and a rate-limited
    eviction burst, from snapshot deltas only."""
    now = [0.0]
    cache = he.StorageExistenceCache(10)
    monitor = Monitor(burst_fraction=0.5, clock=lambda: now[0])
    kv = cache.pool("kv")
    with caplog.at_level(logging.INFO, logger="hicache_existence.exporters.monitor"):
        monitor.observe(cache.stats())
        kv.add([f"p{i}" for i in range(10)])
        now[0] = 1.0
        monitor.observe(cache.stats())  # at cap
        kv.add([f"q{i}" for i in range(10)])  # 10 evictions in 1 s >= 0.5 x 10
        now[0] = 2.0
        monitor.observe(cache.stats())
        kv.add([f"r{i}" for i in range(10)])
        now[0] = 3.0
        monitor.observe(cache.stats())  # burst again, rate-limited (1/min)
        kv.clear()
        now[0] = 4.0
        monitor.observe(cache.stats())
    names = [r.hicache_event for r in caplog.records]
    assert names == [logs.CACHE_AT_CAPACITY, logs.EVICTION_BURST, logs.CACHE_CLEARED]
    burst = caplog.records[1].hicache_fields
    assert burst["pool"] == "kv" and burst["evictions"] == 10 and burst["capacity"] == 10
    assert caplog.records[2].hicache_fields["cleared_pages"] == 10


@pytest.fixture
def package_logger_restored():
    """Restore the package logger's level, handlers and propagation."""
    package = logging.getLogger(logs.PACKAGE_LOGGER)
    saved = (package.level, list(package.handlers), package.propagate)
    yield package
    package.setLevel(saved[0])
    package.handlers[:] = saved[1]
    package.propagate = saved[2]


def test_package_logging_sets_the_package_logger_only(package_logger_restored):
    """configure_package_logging("debug", json_output=True) lets the package's
    debug events out as JSON lines and touches no other logger; called again with
    the defaults it undoes itself; a bad level changes nothing."""
    package = package_logger_restored
    root = logging.getLogger()
    root_before = (root.level, list(root.handlers))
    stream = io.StringIO()
    logs.configure_package_logging("debug", json_output=True, stream=stream)
    logs.get_logger("hicache_existence.x").debug(logs.MISS_TRACED, pool="kv")
    logging.getLogger("other.library").debug("not ours")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["event"], x["level"], x["pool"]) for x in lines] == [
        (logs.MISS_TRACED, "debug", "kv")
    ]
    assert (root.level, list(root.handlers)) == root_before
    assert package.propagate is False and package.level == logging.DEBUG
    logs.configure_package_logging("debug", json_output=True, stream=stream)
    assert [type(h).__name__ for h in package.handlers] == ["_PackageHandler"]  # replaced
    with pytest.raises(ValueError, match="level"):
        logs.configure_package_logging("loud")
    assert package.level == logging.DEBUG
    logs.configure_package_logging("")
    assert package.level == logging.NOTSET and package.propagate is True
    assert not [h for h in package.handlers if isinstance(h, logging.StreamHandler)]


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], ("warning", False)),
        ({"HICACHE_EXISTENCE_LOGGING__LEVEL": "debug"}, [], ("debug", False)),
        ({"HICACHE_EXISTENCE_LOGGING__JSON": "1"}, [], ("warning", True)),
        ({"HICACHE_EXISTENCE_LOGGING__LEVEL": "debug"}, ["--log-level", "error"], ("error", False)),
        ({"HICACHE_EXISTENCE_LOGGING__JSON": "0"}, ["--log-json"], ("warning", True)),
    ],
)
def test_cli_logging_follows_the_configuration_and_flags_win(
    monkeypatch, tmp_path, env, argv, expected
):
    """The CLI configures logging from logging.level / logging.json in the
    environment; --log-level / --log-json override them."""
    from hicache_existence import cli

    for key in [k for k in os.environ if k.startswith("HICACHE_EXISTENCE_LOGGING")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = []

    def record(level, json_output=False):
        seen.append((level, json_output))

    monkeypatch.setattr(logs, "configure_logging", record)
    code = cli.main([*argv, "replay", "--quiet", "--out", str(tmp_path), str(tmp_path / "none")])
    assert code == 2 and seen == [expected]


def test_cli_refuses_an_invalid_logging_setting(monkeypatch, capsys):
    """A logging.level the configuration does not allow stops the CLI with a
    message naming the key, before any command runs."""
    from hicache_existence import cli

    monkeypatch.setenv("HICACHE_EXISTENCE_LOGGING__LEVEL", "loud")
    assert cli.main(["replay", "missing.jsonl"]) == 2
    assert "logging.level" in capsys.readouterr().err
