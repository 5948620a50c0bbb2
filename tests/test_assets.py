"""``hicache-existence assets DIR`` from a real wheel: the sdist is built from a clean
copy of the checkout, a wheel from the sdist (so MANIFEST.in and setup.py both have to
carry the assets), installed --no-deps into a fresh venv, and its command writes the
dashboards, rules, manifests and recipes byte for byte as the checkout holds them.

The wheel is built without a C compiler (``CC=/bin/false``: the extensions are optional),
which keeps the module well under a minute; tests/envs/bare-import.sh builds the
compiled wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_existence.commands import assets

REPO = Path(__file__).resolve().parents[1]
_JUNK = shutil.ignore_patterns(".git", "build", "dist", "*.so", "*.egg-info", "__pycache__")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The console script of a fresh venv holding only the wheel built from the sdist."""
    tmp = tmp_path_factory.mktemp("assets-dist")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(REPO, src, ignore=_JUNK)
    build = tmp / "build-venv"
    _run([sys.executable, "-m", "venv", str(build)], cwd=tmp)
    bpy = str(build / "bin" / "python")
    pip = [bpy, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "install", "setuptools>=77", "wheel"], cwd=tmp, timeout=300)
    hook = f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))"
    sdist = dist / _run([bpy, "-c", hook], cwd=src).stdout.strip().splitlines()[-1]
    env = {**os.environ, "CC": "/bin/false"}
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(sdist)],
        cwd=tmp,
        env=env,
        timeout=300,
    )
    (wheel,) = dist.glob("*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--no-deps",
            str(wheel),
        ],
        cwd=tmp,
    )
    return venv / "bin" / "hicache-existence"


def _assets(cli: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cli), "assets", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _written(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _assert_equal_to_checkout(out: Path) -> None:
    expected = assets.asset_files(REPO)
    assert _written(out) == expected
    for rel in expected:
        assert (out / rel).read_bytes() == (REPO / rel).read_bytes(), rel
        executable = bool((REPO / rel).stat().st_mode & 0o100)
        assert bool((out / rel).stat().st_mode & 0o100) == executable, rel


def test_the_asset_list_covers_what_operators_need() -> None:
    """The packaged set holds the dashboard, rules and promtool tests, every kustomize
    resource and the PD recipes (a pattern gone stale would leave one out)."""
    files = set(assets.asset_files(REPO))
    for rel in (
        "dashboards/hicache-existence-dashboard.json",
        "integrations/prometheus/rules.yml",
        "integrations/prometheus/tests.yml",
        "integrations/kubernetes/kustomization.yaml",
        "integrations/kubernetes/prometheusrule.yaml",
        "integrations/sglang/prefill.sh",
        "integrations/sglang/common.sh",
    ):
        assert rel in files, rel


def test_a_pattern_that_matches_nothing_fails(tmp_path: Path) -> None:
    """setup.py's asset listing fails on a tree without the assets (a sdist missing
    them) instead of building a wheel without them."""
    with pytest.raises(assets.AssetsError, match="dashboards"):
        assets.asset_files(tmp_path)


def test_installed_wheel_writes_the_checkouts_assets(cli: Path, tmp_path: Path) -> None:
    """The wheel built from the sdist writes every asset byte-equal to the checkout,
    executable bits included, with no third-party package installed."""
    out = tmp_path / "out"
    proc = _assets(cli, str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(assets.asset_files(REPO))} asset files" in proc.stdout
    _assert_equal_to_checkout(out)


def test_no_file_is_overwritten_without_force(cli: Path, tmp_path: Path) -> None:
    """On a directory that holds one of the assets, the command exits 2 with one line
    naming it, writes nothing at all; --force overwrites and restores the assets."""
    out = tmp_path / "out"
    clash = out / "integrations" / "sglang" / "router.sh"
    clash.parent.mkdir(parents=True)
    clash.write_text("mine\n")
    (out / "notes.txt").write_text("unrelated\n")
    proc = _assets(cli, str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hicache-existence assets: error: {clash} exists; not overwriting it (use --force)"
    ]
    assert clash.read_text() == "mine\n"
    assert _written(out) == ["integrations/sglang/router.sh", "notes.txt"]

    proc = _assets(cli, "--force", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out / "notes.txt").unlink()
    _assert_equal_to_checkout(out)


def test_a_second_run_names_the_first_file(cli: Path, tmp_path: Path) -> None:
    """Run twice into the same directory: the second run refuses, naming the first
    asset in order, and leaves the files as the first run wrote them."""
    out = tmp_path / "out"
    assert _assets(cli, str(out), cwd=tmp_path).returncode == 0
    proc = _assets(cli, str(out), cwd=tmp_path)
    assert proc.returncode == 2
    first = out / assets.asset_files(REPO)[0]
    assert proc.stderr.strip() == (
        f"hicache-existence assets: error: {first} exists; not overwriting it (use --force)"
    )
    _assert_equal_to_checkout(out)


def test_a_file_as_dir_is_a_one_line_error(cli: Path, tmp_path: Path) -> None:
    """DIR naming a regular file exits 2 with one line, no traceback."""
    target = tmp_path / "file"
    target.write_text("x")
    proc = _assets(cli, str(target), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"hicache-existence assets: error: {target} exists and is not a directory"
    )


def test_checkout_install_writes_the_same_assets(tmp_path: Path) -> None:
    """Run from the checkout (an editable install, no packaged copy), the command reads
    the checkout's files: the same set, byte-equal."""
    from hicache_existence import cli as cli_module

    assert cli_module.main(["assets", str(tmp_path / "out")]) == 0
    _assert_equal_to_checkout(tmp_path / "out")
