"""The server flags through sglang's real argument machinery: ``prepare_server_args``
(argv, a JSON file, ``--config`` YAML), pickling into a spawned process as the
scheduler's ``ServerArgs`` travels, usage errors for bad values, and the real
``python -m sglang.launch_server`` / ``sglang serve`` entry points."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hx_harness import REPO, TIMEOUT_S, Scenarios

pytestmark = [pytest.mark.sglang]


def test_flags_parse_and_ride_on_server_args(scenarios: Scenarios) -> None:
    """``--enable-hicache-existence --hicache-existence-config @file`` end up on
    the ServerArgs record (the file's JSON, read once) and switch the environment
    the scheduler processes inherit; a command line without them adds nothing."""
    r = scenarios.get("flags").value()
    expected = {"enabled": True, "config": '{"divergence":{"interval_steps":7,"policy":"heal"}}'}
    assert r["env_before"] is None
    assert r["argv"] == expected
    assert r["env_after"] == "1"
    assert r["plain_extras"] is False
    assert r["warnings"] == []


def test_flags_survive_pickling_into_a_spawned_process(scenarios: Scenarios) -> None:
    """The record keeps the values through pickle, and a spawn-context child (how
    sglang starts schedulers) reads both the values and the inherited switch."""
    r = scenarios.get("flags").value()
    assert r["pickled"] == r["argv"]
    assert r["spawned"] == {"values": r["argv"], "env_enabled": "1"}


def test_flags_in_sglang_config_yaml(scenarios: Scenarios) -> None:
    """sglang's ``--config file.yaml`` merger accepts our flags like its own."""
    r = scenarios.get("flags").value()
    assert r["yaml"] == {"enabled": True, "config": '{"metrics":{"port":9555}}'}


def test_bad_config_is_a_usage_error_naming_the_flag(scenarios: Scenarios) -> None:
    """An unknown policy, broken JSON and a missing file stop the launch with
    argparse's exit status 2 and a message naming the flag and the problem."""
    bad = scenarios.get("flags").value()["bad"]
    for case, needle in (
        ("policy", "divergence.policy must be one of"),
        ("json", "not valid JSON"),
        ("file", "neither JSON nor a readable file"),
    ):
        assert bad[case]["code"] == 2, case
        (line,) = bad[case]["stderr"]
        assert "argument --hicache-existence-config" in line and needle in line, line


def _run(argv: list[str], scenarios: Scenarios) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        env=scenarios.env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=str(REPO),
    )


def test_launch_server_help_lists_the_flags(scenarios: Scenarios) -> None:
    """``python -m sglang.launch_server --help`` loads plugins before parsing, so
    its help lists both flags."""
    proc = _run(["-m", "sglang.launch_server", "--help"], scenarios)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.fail(f"sglang.launch_server does not start here: {proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--enable-hicache-existence" in proc.stdout
    assert "--hicache-existence-config" in proc.stdout


def test_sglang_serve_parses_the_flags(scenarios: Scenarios) -> None:
    """``sglang serve`` (sglang.cli.main) parses our flags with its own parser: an
    invalid configuration is rejected before any model is touched."""
    code = "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; main()"
    config = json.dumps({"divergence": {"policy": "sometimes"}})
    proc = _run(
        [
            "-c",
            code,
            "serve",
            "--model-type",
            "llm",
            "--model-path",
            "dummy",
            "--enable-hicache-existence",
            "--hicache-existence-config",
            config,
        ],
        scenarios,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "argument --hicache-existence-config" in proc.stderr
    assert "divergence.policy must be one of" in proc.stderr
