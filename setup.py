"""Build hook for the optional compiled LRU index (hicache_existence/_lru.c).

Everything else lives in pyproject.toml.  The extension is ``optional``: where
no C compiler is available the package installs and runs on its pure-Python
index (hicache_existence.lru), only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache_existence._lru",
            sources=["hicache_existence/_lru.c"],
            optional=True,
            extra_compile_args=["-O3", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ]
)
