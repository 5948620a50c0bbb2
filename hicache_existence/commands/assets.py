"""``hicache-existence assets DIR``: write out the operator assets of this version.

The Grafana dashboard, the Prometheus rules with their promtool tests, the Kubernetes
manifests and the PD recipes are part of every wheel (``hicache_existence/assets/``,
copied there from the checkout by ``setup.py`` at build time), so an installation
can hand out exactly the assets that match its own metrics, without a checkout.
Files keep their paths relative to the checkout (``dashboards/...``,
``integrations/...``).  Nothing that exists is overwritten unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NAME = "assets"
HELP = "write the dashboards, Prometheus rules, Kubernetes manifests and PD recipes to DIR"

#: The operator assets: glob patterns relative to the checkout's root (files only).
#: ``setup.py`` loads this module by path and copies every match into the wheel; each
#: pattern must match at least one file, so a sdist that lost an asset fails its build.
SOURCES: tuple[str, ...] = (
    "dashboards/*.json",
    "integrations/prometheus/*",
    "integrations/kubernetes/*.yaml",
    "integrations/sglang/*",
)

#: Where the assets are inside the installed package.
PACKAGED = "assets"


class AssetsError(Exception):
    """An asset set that cannot be listed or written (the message is one line)."""


def asset_files(root: Path) -> list[str]:
    """The assets under ``root`` (a checkout), as sorted relative POSIX paths."""
    found: set[str] = set()
    for pattern in SOURCES:
        matches = [p for p in root.glob(pattern) if p.is_file()]
        if not matches:
            raise AssetsError(f"no file matches {pattern!r} under {root}")
        found.update(p.relative_to(root).as_posix() for p in matches)
    return sorted(found)


def source() -> tuple[Path, list[str]]:
    """The directory the assets are read from and their relative paths: the package's
    ``assets/`` (an installed wheel), else the checkout an editable install runs from."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / PACKAGED  # rglob finds nothing when it is missing
    files = sorted(p.relative_to(packaged).as_posix() for p in packaged.rglob("*") if p.is_file())
    if files:
        return packaged, files
    checkout = package.parent
    if (checkout / "dashboards" / "build.py").is_file():
        return checkout, asset_files(checkout)
    raise AssetsError(
        f"this installation carries no operator assets ({packaged} is missing): "
        "reinstall from a wheel built with setup.py"
    )


def write_assets(dest: Path, *, force: bool = False) -> list[str]:
    """Copies every asset under ``dest``; returns the relative paths written.  Without
    ``force`` nothing is written if any target exists (the error names the first one),
    so a refusal never leaves a partly written directory."""
    base, files = source()
    if dest.exists() and not dest.is_dir():
        raise AssetsError(f"{dest} exists and is not a directory")
    for rel in files:
        target = dest / rel
        if target.is_dir():
            raise AssetsError(f"{target} is a directory, where the asset {rel} goes")
        if not force and (target.exists() or target.is_symlink()):
            raise AssetsError(f"{target} exists; not overwriting it (use --force)")
    for rel in files:
        src, target = base / rel, dest / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()
            target.write_bytes(src.read_bytes())
            if src.stat().st_mode & 0o111:
                os.chmod(target, target.stat().st_mode | 0o111)
        except OSError as exc:
            raise AssetsError(f"cannot write {target}: {exc.strerror or exc}") from None
    return files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path, help="target directory (created)")
    parser.add_argument(
        "--force", action="store_true", help="overwrite files that exist (default: refuse)"
    )


def run(args: argparse.Namespace) -> int:
    from hicache_existence._version import __version__

    try:
        files = write_assets(args.dir, force=args.force)
    except AssetsError as exc:
        print(f"hicache-existence assets: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} asset files of hicache-existence {__version__} to {args.dir}")
    return 0
