"""Load upstream sglang's existence-cache module for side-by-side benchmarks.

The benchmark compares against the *real* upstream code, not a copy: it reads
``sglang/srt/mem_cache/buffer_mode/storage_existence_cache.py`` from an installed
sglang or from a downloaded sglang wheel and executes it in a private module.
Importing ``sglang`` for real would pull its heavy ``__init__`` (torch and friends),
so the module's one sglang import (the ``PoolHitPolicy`` enum) is answered by a
small stand-in through a module-local ``__import__``; nothing is added to
``sys.modules``.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

MODULE_PATH = "sglang/srt/mem_cache/buffer_mode/storage_existence_cache.py"
_STUB_MODULE = "sglang.srt.mem_cache.hicache_storage"


class _PoolHitPolicy(str, enum.Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass(frozen=True)
class UpstreamModule:
    """An executed upstream module and where its source came from."""

    module: types.ModuleType
    origin: str
    sha256: str


def default_wheel_dir() -> Path:
    """Where ``--fetch-upstream`` puts the sglang wheel (outside any checkout)."""
    root = os.environ.get("HICACHE_EXISTENCE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hicache-existence"
    )
    return Path(root) / "wheels"


def _source_from_installed() -> tuple[str, str] | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base).parent / MODULE_PATH
        if path.is_file():
            return path.read_text(encoding="utf-8"), str(path)
    return None


def _source_from_wheel(wheel: Path) -> tuple[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(MODULE_PATH).decode("utf-8"), f"{wheel}!{MODULE_PATH}"


def find_wheel(directory: Path | None = None) -> Path | None:
    """The newest cached sglang wheel, if any."""
    directory = directory or default_wheel_dir()
    wheels = sorted(directory.glob("sglang-*.whl")) if directory.is_dir() else []
    return wheels[-1] if wheels else None


def fetch_wheel(version: str | None = None, directory: Path | None = None) -> Path:
    """Download the sglang wheel (no dependencies) with pip into the cache dir."""
    directory = directory or default_wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    req = f"sglang=={version}" if version else "sglang"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(directory), req],
        check=True,
    )
    wheel = find_wheel(directory)
    if wheel is None:  # pragma: no cover - pip succeeded but wrote no wheel
        raise RuntimeError(f"pip downloaded no sglang wheel into {directory}")
    return wheel


def _execute(source: str, origin: str) -> UpstreamModule:
    stub = types.ModuleType(_STUB_MODULE)
    stub.PoolHitPolicy = _PoolHitPolicy  # type: ignore[attr-defined]
    real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
        if name == _STUB_MODULE:
            return stub
        return real_import(name, globals, locals, fromlist, level)

    module = types.ModuleType("_upstream_storage_existence_cache")
    module.__file__ = origin
    module.__dict__["__builtins__"] = {**vars(builtins), "__import__": _import}
    # The module uses ``from __future__ import annotations``; dataclass-free, so
    # executing it outside sys.modules is safe.
    exec(compile(source, origin, "exec"), module.__dict__)
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return UpstreamModule(module, origin, digest)


def load_upstream(wheel: Path | None = None) -> UpstreamModule | None:
    """The upstream module from ``wheel``, an installed sglang, or the cached wheel."""
    if wheel is not None:
        return _execute(*_source_from_wheel(wheel))
    found = _source_from_installed()
    if found is not None:
        return _execute(*found)
    cached = find_wheel()
    if cached is not None:
        return _execute(*_source_from_wheel(cached))
    return None
