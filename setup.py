"""Build hook for the optional compiled accelerators.

* ``hicache_existence/core/_lru.c``: the LRU index behind both cache generations;
* ``hicache_existence/accounting/_ghosts.c``: the miss-reason memory's trace scatter/gather;
* ``hicache_existence/accounting/_recorder.c``: the trace recorder's page test.

Everything else lives in pyproject.toml.  Both extensions are ``optional``:
where no C compiler is available the package installs and runs on its
pure-Python equivalents (``hicache_existence.core.lru``, ``hicache_existence.accounting.ghosts``),
only slower.  ``hicache_existence.core.lru.BACKEND`` says which one runs.
"""

from setuptools import Extension, setup

FLAGS = [
    "-O3",
    "-std=c99",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

setup(
    ext_modules=[
        Extension(
            f"hicache_existence.{name}",
            sources=[f"hicache_existence/{name.replace('.', '/')}.c"],
            depends=["hicache_existence/core/_sampler.h"],
            optional=True,
            extra_compile_args=FLAGS,
        )
        for name in ("core._lru", "accounting._ghosts", "accounting._recorder")
    ]
)
