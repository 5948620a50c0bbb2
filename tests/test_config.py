"""Config: one typed object from defaults, JSON, files and environment; clear errors."""

from __future__ import annotations

import json
import os

import pytest

from hicache_existence.config import Config, ConfigError, is_setting_variable, redact_url
from hicache_existence.core import lru


def test_sources_merge_in_order_env_then_text():
    """Environment (blob, then per-key variables) is applied before explicit text."""
    env = {
        "HICACHE_EXISTENCE_CONFIG": '{"divergence": {"interval_steps": 5, "policy": "heal"}}',
        "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "6",
        "HICACHE_EXISTENCE_ENABLED": "yes",
        "HICACHE_EXISTENCE_METRICS__FLUSH_INTERVAL_S": "0.5",
    }
    config = Config.load('{"divergence": {"interval_steps": 7}}', env=env)
    assert config.enabled is True
    assert config.divergence.interval_steps == 7
    assert config.divergence.policy == "heal"
    assert config.metrics.flush_interval_s == 0.5


def test_file_and_at_path_are_read(tmp_path):
    """A path or @path holds the JSON."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cache": {"max_entries": 1234}}))
    assert Config.from_json(str(path)).cache.max_entries == 1234
    assert Config.from_json(f"@{path}").cache.max_entries == 1234


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"nope": 1}', "unknown configuration key 'nope'"),
        ('{"divergence": {"policy": "panic"}}', "divergence.policy must be one of"),
        ('{"metrics": {"port": "80"}}', "metrics.port must be an integer"),
        ('{"metrics": {"port": 70000}}', "metrics.port must be <= 65535"),
        ('{"divergence": {"pool_slots": 1025}}', "divergence.pool_slots must be <= 1024"),
        ('{"divergence": {"timeout_s": 0}}', "divergence.timeout_s must be > 0"),
        ('{"reconciler": {"breaker_backoff_s": 0}}', "reconciler.breaker_backoff_s must be > 0"),
        ('{"metrics": {"flush_interval_s": "1"}}', "metrics.flush_interval_s must be a number"),
        ('{"metrics": {"host": 1}}', "metrics.host must be a string"),
        ('{"cache": {"max_entries": 0}}', "cache.max_entries must be >= 1"),
        ('{"advisor": {"sampling_rate": 2}}', "advisor.sampling_rate must be within [0, 1]"),
        ('{"enabled": "true"}', "enabled must be a boolean"),
        ('{"cache_mode": {"dedup": "yes"}}', "cache_mode.dedup must be a boolean"),
        ('{"cache_mode": {"dedup": 1}}', "cache_mode.dedup must be a boolean"),
        ("[1, 2]", "must be an object"),
        ("{not json", "not valid JSON"),
        ("/no/such/file.json", "neither JSON nor a readable file"),
    ],
)
def test_bad_values_raise_config_error_naming_the_key(text, needle):
    """Every malformed value raises ConfigError with the key (never a silent default)."""
    with pytest.raises(ConfigError) as info:
        Config.load(text, env={})
    assert needle in str(info.value)


def test_bad_environment_values_name_the_variable_key():
    """A per-key variable with a bad value fails like JSON would."""
    with pytest.raises(ConfigError, match=r"divergence\.interval_steps must be an integer"):
        Config.from_env({"HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "often"})
    with pytest.raises(ConfigError, match="unknown configuration key"):
        Config.from_env({"HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEP": "5"})
    with pytest.raises(ConfigError, match=r"cache_mode\.dedup must be a boolean"):
        Config.from_env({"HICACHE_EXISTENCE_CACHE_MODE__DEDUP": "sometimes"})
    assert Config.from_env({"HICACHE_EXISTENCE_CACHE_MODE__DEDUP": "1"}).cache_mode.dedup
    with pytest.raises(ConfigError, match=r"metrics\.flush_interval_s must be a number"):
        Config.from_env({"HICACHE_EXISTENCE_METRICS__FLUSH_INTERVAL_S": "soon"})
    env = Config.from_env(
        {"HICACHE_EXISTENCE_METRICS__FLUSH_INTERVAL_S": "2", "HICACHE_EXISTENCE_METRICS__HOST": "0"}
    )
    assert (env.metrics.flush_interval_s, env.metrics.host) == (2.0, "0")


@pytest.mark.parametrize(
    "env",
    [
        {"HICACHE_EXISTENCE_RECORDER__FLUSH_INTERVAL_S": "inf"},
        {"HICACHE_EXISTENCE_DIVERGENCE__TIMEOUT_S": "nan"},
        {"HICACHE_EXISTENCE_RECONCILER__TIMEOUT_MS": "1e999"},
        {"HICACHE_EXISTENCE_CONFIG": '{"divergence": {"timeout_s": Infinity}}'},
        {"HICACHE_EXISTENCE_CONFIG": '{"reconciler": {"verifications_per_s": 1e400}}'},
    ],
)
def test_an_infinite_or_nan_number_is_refused(env):
    """Infinity passes every ``> 0`` rule, and then breaks what uses it (the
    recorder's writer thread dies in ``Event.wait(inf)``, the divergence handshake
    overflows): every number setting must be finite."""
    with pytest.raises(ConfigError, match="must be a finite number"):
        Config.from_env(env)


@pytest.mark.parametrize("name", ["missing.json", "a-directory", "not-utf8.json"])
def test_an_unreadable_configuration_file_is_a_config_error(tmp_path, name):
    """Every caller handles ConfigError only (the CLI, the launcher, the server
    flag): a file that cannot be read must be one, naming the file."""
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "not-utf8.json").write_bytes(b'{"enabled": "\xff"}')
    path = tmp_path / name
    for text in (str(path), f"@{path}"):
        with pytest.raises(ConfigError, match="neither JSON nor a readable file") as info:
            Config.from_env({"HICACHE_EXISTENCE_CONFIG": text})
        assert name in str(info.value)


def test_the_cli_says_an_unreadable_configuration_in_one_line(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "HICACHE_EXISTENCE_CONFIG": f"@{tmp_path / 'missing.json'}"}
    p = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "doctor", "http://127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-500:]
    assert "Traceback" not in p.stderr and "missing.json" in p.stderr


def test_tooling_variables_are_not_settings():
    """Test-runner and env-builder switches never reach Config."""
    env = {
        "HICACHE_EXISTENCE_REQUIRE_ALL": "1",
        "HICACHE_EXISTENCE_ENV_FLAVOR": "full",
        "HICACHE_EXISTENCE_CACHE_DIR": "/tmp/x",
        "HICACHE_EXISTENCE_PYTHON": "python3.11",
        "HICACHE_EXISTENCE_PYTHON_3_11": "/usr/bin/python3.11",  # run-all.sh's matrix
        lru.ENV_BACKEND: "python",  # the index switch, read once at import
    }
    assert Config.from_env(env) == Config()
    assert not any(is_setting_variable(k) for k in env)
    assert is_setting_variable("HICACHE_EXISTENCE_ENABLED")
    assert not is_setting_variable("HICACHE_EXISTENCE_CONFIG")


def test_redacted_masks_credentials_everywhere_they_are_shown():
    """Passwords in the Redis URL never appear in redacted output."""
    config = Config.from_mapping(
        {"reconciler": {"redis_url": "rediss://user:s3cret@redis.example:6380/2"}}
    )
    shown = json.dumps(config.redacted())
    assert "s3cret" not in shown and "user:***@redis.example:6380" in shown
    assert redact_url("redis://:pw@h:1/0") == "redis://***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    # redis-py's ?password= (a unix socket's only way to give one), any scheme.
    assert (
        redact_url("unix:///tmp/r.sock?db=0&password=pw") == "unix:///tmp/r.sock?db=0&password=***"
    )
    assert redact_url("redis://u:pw@h:1/0?Pass%77ord=x&db=1#f") == (
        "redis://u:***@h:1/0?Pass%77ord=***&db=1#f"
    )
    assert redact_url("redis://h:1/0?db=1&password") == "redis://h:1/0?db=1&password"


def test_round_trip_through_json():
    """to_json() output loads back to an equal Config."""
    config = Config.from_mapping({"enabled": True, "metrics": {"port": 9500}})
    assert Config.from_json(config.to_json()) == config


def test_the_recorder_path_defaults_to_one_absolute_directory(tmp_path, monkeypatch):
    """``recorder.path`` by default names the same absolute directory wherever the
    server's working directory is (a supervisor may start it anywhere)."""
    from hicache_existence.config import RECORDER_DEFAULT_PATH

    seen = set()
    for where in (tmp_path, tmp_path / "elsewhere"):
        where.mkdir(exist_ok=True)
        monkeypatch.chdir(where)
        seen.add(Config.load(None, env={}).recorder.path)
        seen.add(Config().recorder.path)
    assert seen == {RECORDER_DEFAULT_PATH}
    assert os.path.isabs(RECORDER_DEFAULT_PATH)


def test_a_relative_recorder_path_is_made_absolute_when_loaded(tmp_path, monkeypatch):
    """A relative ``recorder.path`` (JSON, a file, a variable) or one with ``~`` is
    resolved once, at load, against the loading process's working directory: the
    loaded object and its JSON (what ``hicache-existence launch`` hands the server)
    keep naming that directory after the working directory changed."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    start = tmp_path / "start"
    start.mkdir()
    monkeypatch.chdir(start)
    config_file = start / "hx.json"
    config_file.write_text(json.dumps({"recorder": {"path": "from-file"}}))
    loaded = {
        "json": Config.load('{"recorder": {"path": "traces"}}', env={}).recorder.path,
        "dots": Config.load('{"recorder": {"path": "./a/../traces"}}', env={}).recorder.path,
        "file": Config.load(str(config_file), env={}).recorder.path,
        "env": Config.from_env({"HICACHE_EXISTENCE_RECORDER__PATH": "from-env"}).recorder.path,
        "home": Config.load('{"recorder": {"path": "~/hx"}}', env={}).recorder.path,
    }
    assert loaded == {
        "json": str(start / "traces"),
        "dots": str(start / "traces"),
        "file": str(start / "from-file"),
        "env": str(start / "from-env"),
        "home": str(home / "hx"),
    }
    config = Config.load('{"recorder": {"path": "traces"}}', env={})
    monkeypatch.chdir(tmp_path)
    assert config.recorder.path == str(start / "traces")
    assert Config.from_json(config.to_json()).recorder.path == str(start / "traces")
    with pytest.raises(ConfigError, match=r"recorder\.path must not be empty"):
        Config.load('{"recorder": {"path": ""}}', env={})


@pytest.mark.parametrize("secret", ["s3cr/et", "s3cr?et", "s3cr#et", "12/et"])
def test_a_password_not_percent_encoded_is_masked_too(monkeypatch, secret):
    """Operators paste raw passwords: one holding / ? or # ends the URL's host part
    early, so the password is masked up to the last @, in the start-up event and in
    the URL check's error (whose parser's text would quote part of it)."""
    from hicache_existence.reconcile.redis_truth import validate_redis_url

    url = f"redis://:{secret}@redis.example:6379/0"
    assert secret[:4] not in redact_url(url)
    assert redact_url(url).endswith("@redis.example:6379/0")
    monkeypatch.setenv("HICACHE_EXISTENCE_RECONCILER__REDIS_URL", url)
    try:
        shown = json.dumps(Config.from_env().redacted())
    except ConfigError as exc:
        shown = str(exc)
    assert secret[:4] not in shown
    try:
        validate_redis_url(url, "reconciler.redis_url")
    except ConfigError as exc:
        assert secret[:4] not in str(exc)


def test_a_recorder_rate_below_its_resolution_is_refused():
    """The recorder's bound is resolved to 2^-32 and replay scales by the configured
    rate: below 1e-6 the two would part by more than 0.03%."""
    assert Config.from_json('{"recorder": {"sample_rate": 1e-6}}').recorder.sample_rate == 1e-6
    with pytest.raises(ConfigError, match=r"recorder\.sample_rate must be >= 1e-06"):
        Config.from_json('{"recorder": {"sample_rate": 1e-9}}')


@pytest.mark.parametrize(
    "url", ["redis://:p@ss/word@redis-host:6379/0", "redis://admin:p@ss/word@redis-host:6379/0"]
)
def test_a_raw_password_holding_at_and_slash_is_masked(url):
    """The URL check accepts it (host "ss"), so it reaches logs: nothing of it shows."""
    from hicache_existence.reconcile.redis_truth import validate_redis_url

    validate_redis_url(url)
    assert "ss/word" not in redact_url(url) and redact_url(url).endswith("@redis-host:6379/0")
