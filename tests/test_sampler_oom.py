"""The compiled Sampler after a failed allocation: a call that runs out of memory
counts its references as lost, and the sampler stays usable (no crash later).

Each case runs in a child process: the failure it guards against is a segfault."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hicache_existence.core import lru

testcapi = pytest.importorskip("_testcapi")
needs_c = pytest.mark.skipif(lru.c_index() is None, reason="the compiled index is not built")
needs_hooks = pytest.mark.skipif(
    not hasattr(testcapi, "set_nomemory"), reason="_testcapi.set_nomemory is missing"
)


@needs_c
@needs_hooks
def test_a_failed_first_allocation_leaves_the_sampler_usable() -> None:
    """Fail each of the first allocations of a fresh sampler's first push in turn
    (s_grow_times allocates owner, bits, then the Fenwick tree): the next calls
    must work.  A failure at the Fenwick tree used to leave bits allocated with
    ntimes == 0 and fen == NULL, and the next push compacted into a NULL fen."""
    code = textwrap.dedent(
        """
        import _testcapi
        from hicache_existence.core._lru import Sampler

        batch = ["a"]
        for k in range(8):
            s = Sampler(2**64, 10)
            _testcapi.set_nomemory(k, k + 1)
            try:
                s.added(batch)
            finally:
                _testcapi.remove_mem_hooks()
            s.added(["b"])
            s.added(["a", "c"])
            assert s.counts()["tracked"] <= 3, s.counts()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        done.returncode,
        done.stdout,
        done.stderr[-2000:],
    )
