"""Build hook for the optional compiled accelerators.

* ``hicache_existence/core/_lru.c``: the LRU index behind both cache generations;
* ``hicache_existence/accounting/_ghosts.c``: the miss-reason memory's trace scatter/gather;
* ``hicache_existence/accounting/_recorder.c``: the trace recorder's page test.

Everything else lives in pyproject.toml.  Both extensions are ``optional``:
where no C compiler is available the package installs and runs on its
pure-Python equivalents (``hicache_existence.core.lru``, ``hicache_existence.accounting.ghosts``),
only slower.  ``hicache_existence.core.lru.BACKEND`` says which one runs.

It also copies the operator assets (dashboards, Prometheus rules and their tests,
Kubernetes manifests, PD recipes: ``SOURCES`` of ``hicache_existence/commands/assets.py``)
into ``hicache_existence/assets/`` of the build, so every wheel carries them for
``hicache-existence assets DIR``.  MANIFEST.in puts the same files into the sdist, so a
wheel built from the sdist carries them too (a pattern that matches nothing fails).
"""

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _assets_module() -> ModuleType:
    """The assets command's module, loaded by path: the package is not importable here."""
    spec = importlib.util.spec_from_file_location(
        "_hicache_existence_assets", ROOT / "hicache_existence" / "commands" / "assets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithAssets(build_py):
    """build_py, then the operator assets into the build's ``hicache_existence/assets``.

    Not in editable mode: an editable install reads them from its checkout."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        assets = _assets_module()
        target = Path(self.build_lib, "hicache_existence", assets.PACKAGED)
        for rel in assets.asset_files(ROOT):
            self.mkpath(str((target / rel).parent))
            self.copy_file(str(ROOT / rel), str(target / rel))


FLAGS = [
    "-O3",
    "-std=c99",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

setup(
    cmdclass={"build_py": BuildPyWithAssets},
    ext_modules=[
        Extension(
            f"hicache_existence.{name}",
            sources=[f"hicache_existence/{name.replace('.', '/')}.c"],
            depends=["hicache_existence/core/_sampler.h"],
            optional=True,
            extra_compile_args=FLAGS,
        )
        for name in ("core._lru", "accounting._ghosts", "accounting._recorder")
    ],
)
