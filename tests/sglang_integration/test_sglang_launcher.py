"""``hicache-existence launch``: launching is enabling; our flags become the
environment, every other argument reaches sglang unchanged; the exec'd process's
plugin (loaded by sglang's own loader) sees itself enabled with the launcher's
configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hx_harness import HERE, REPO, TIMEOUT_S, Outcome, Scenarios

from hicache_existence.config import Config
from hicache_existence.integrations.sglang.launcher import LaunchError, plan, split_flags

TRICKY = ["--model-path", "a b", "--json", '{"x": [1, 2]}', "", "ünï", "--", "--tp=2", "-x"]


def test_split_flags_takes_only_ours_in_order() -> None:
    """Both spellings of the config flag and the switch are taken out wherever
    they stand; everything else, ``--`` included, keeps its order."""
    args = ["--enable-hicache-existence", *TRICKY[:4], "--hicache-existence-config={}"]
    args += [*TRICKY[4:], "--hicache-existence-config", '{"a": 1}']
    enabled, config, rest = split_flags(args)
    assert enabled is True
    assert config == '{"a": 1}'  # the last one wins, like argparse
    assert rest == TRICKY


def test_split_flags_rejects_a_missing_value() -> None:
    """A trailing --hicache-existence-config without a value is an error naming it."""
    with pytest.raises(LaunchError, match="--hicache-existence-config needs a value"):
        split_flags(["--model-path", "m", "--hicache-existence-config"])
    with pytest.raises(LaunchError, match="takes no value"):
        split_flags(["--enable-hicache-existence=1"])


def test_plan_flag_config_wins_over_variables() -> None:
    """The flag's configuration is merged over the environment's blob and per-key
    variables, which are folded into the child's HICACHE_EXISTENCE_CONFIG and
    removed, so they cannot override the flag in sglang's processes."""
    env = {
        "HICACHE_EXISTENCE_CONFIG": '{"divergence": {"interval_steps": 5, "policy": "heal"}}',
        "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS": "6",
        "HICACHE_EXISTENCE_METRICS__PORT": "9999",
        "HICACHE_EXISTENCE_REQUIRE_ALL": "1",
        "UNRELATED": "kept",
    }
    launch = plan(
        ["--model-path", "m"],
        config='{"divergence": {"interval_steps": 7}}',
        env=env,
        python="/py",
    )
    assert launch.argv == ("/py", "-m", "sglang.launch_server", "--model-path", "m")
    child = launch.environment(env)
    assert set(launch.unset_env) == {
        "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS",
        "HICACHE_EXISTENCE_METRICS__PORT",
    }
    config = Config.from_env(child)
    assert config.enabled is True
    assert config.divergence.interval_steps == 7  # flag
    assert config.divergence.policy == "heal"  # blob
    assert config.metrics.port == 9999  # per-key variable, folded in
    assert child["UNRELATED"] == "kept" and child["HICACHE_EXISTENCE_REQUIRE_ALL"] == "1"


def test_plan_without_flags_enables_and_keeps_the_environment() -> None:
    """With none of our flags the launch still enables the package (what ``launch``
    promises), over an environment that says otherwise, and leaves the
    environment's configuration as it is."""
    env = {
        "HICACHE_EXISTENCE_DIVERGENCE__POLICY": "abort",
        "HICACHE_EXISTENCE_ENABLED": "0",
        "HICACHE_EXISTENCE_CONFIG": '{"enabled": false}',
    }
    launch = plan(["x"], env=env, entry="serve", python="/py")
    assert launch.set_env == {"HICACHE_EXISTENCE_ENABLED": "1"}
    assert launch.unset_env == ()
    assert launch.argv[:2] == ("/py", "-c") and launch.argv[-2:] == ("serve", "x")
    config = Config.from_env(launch.environment(env))
    assert config.enabled is True and config.divergence.policy == "abort"


def test_plan_enables_over_a_configuration_that_says_disabled() -> None:
    """Like the server flag, launching wins over ``"enabled": false`` in the
    configuration it is given: the child's merged configuration is enabled."""
    launch = plan(["x"], config='{"enabled": false}', env={}, python="/py")
    assert launch.set_env["HICACHE_EXISTENCE_ENABLED"] == "1"
    assert Config.from_env(launch.environment({})).enabled is True


def test_plan_rejects_bad_input_with_clear_errors() -> None:
    """A bad configuration or entry fails before anything is started."""
    with pytest.raises(LaunchError, match=r"divergence\.policy must be one of"):
        plan([], config='{"divergence": {"policy": "x"}}', env={})
    with pytest.raises(LaunchError, match="invalid hicache-existence configuration"):
        plan([], env={"HICACHE_EXISTENCE_METRICS__PORT": "-1"})
    with pytest.raises(LaunchError, match="--sglang-entry must be one of"):
        plan([], entry="nope", env={})


def test_print_shows_the_plan_with_secrets_masked() -> None:
    """``--print`` shows argv and environment changes, masking a Redis password."""
    config = json.dumps({"reconciler": {"redis_url": "redis://u:hunter2@h:6379/0"}})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache_existence",
            "launch",
            "--print",
            "--hicache-existence-config",
            config,
            "--",
            "--model-path",
            "m",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["forwarded"] == ["--model-path", "m"]
    assert shown["set_env"]["HICACHE_EXISTENCE_ENABLED"] == "1"
    assert "hunter2" not in proc.stdout and "u:***@h:6379" in proc.stdout


def test_print_of_a_bare_launch_shows_the_package_enabled() -> None:
    """``launch --print -- --model-path x`` (no flag of ours) sets
    HICACHE_EXISTENCE_ENABLED=1 and nothing else, as README and ``--help`` say."""
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_existence", "launch", "--print", "--", "--model-path", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
        env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_EXISTENCE_")},
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["forwarded"] == ["--model-path", "x"]
    assert shown["set_env"] == {"HICACHE_EXISTENCE_ENABLED": "1"} and shown["unset_env"] == []


@pytest.mark.sglang
def test_launcher_execs_with_args_unchanged_and_plugin_enabled(scenarios: Scenarios) -> None:
    """The real exec, without --enable-hicache-existence and from an environment
    that says disabled: the child got exactly the forwarded argv, the environment,
    and sglang's loader enabled the plugin with the flag's configuration."""
    env = scenarios.env(
        HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS="3", HICACHE_EXISTENCE_ENABLED="0"
    )
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache_existence",
            "launch",
            "--sglang-entry",
            "module:hx_scenarios",
            "--hicache-existence-config",
            '{"divergence": {"interval_steps": 9}}',
            "--",
            "launched",
            *TRICKY,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=str(REPO),
    )
    result = Outcome("launched", proc.returncode, proc.stdout, proc.stderr).value()
    assert result["argv"] == TRICKY
    assert result["env"]["HICACHE_EXISTENCE_ENABLED"] == "1"
    assert "HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS" not in result["env"]
    assert result["config_interval"] == 9
    assert result["status"]["enabled"] is True and result["status"]["cache"] is True
