"""Test-only stand-in for the names sglang's CPU engine imports from sgl_kernel's CPU build.

Why: with ``SGLANG_USE_CPU_ENGINE=1`` sglang 0.5.23 imports CPU kernels from
``sgl_kernel`` at module import (``sglang/kernels/ops/kvcache/cache_move.py``:
``from sgl_kernel import copy_all_layer_kv_cache_cpu``; ``srt/mem_cache/allocation.py``:
``assign_req_to_token_pool_cpu``, ...). That CPU build is not on PyPI, so without this
package ``python -m sglang.launch_server --device cpu`` dies at import with
``ModuleNotFoundError: No module named 'sgl_kernel'``. On a CPU without AMX the engine
takes torch code paths and never calls these kernels: every name here raises if called,
so a test can never silently run on a fake kernel.

Only on the server's ``PYTHONPATH`` through ``tests/real_server/harness.py``; never in
the package.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+hicache-existence-test-standin"


def __getattr__(name: str) -> Any:
    """Any ``*_cpu`` name of the CPU build (sglang imports a dozen at module level on
    the CPU engine); anything else is absent, as sglang's feature probes expect."""
    if name.endswith("_cpu"):
        return _unavailable(name)
    raise AttributeError(name)


def _unavailable(name: str) -> Any:
    def call(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a test stand-in (tests/real_server/standins): "
            "the CPU kernel build is not installed"
        )

    call.__name__ = name
    return call
