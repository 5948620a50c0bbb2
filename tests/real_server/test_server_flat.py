"""The flat generation's write accounting inside a real SGLang 0.5.19-0.5.21 server.

Run by CI's sglang 0.5.21 leg (``tests/run-all.sh``); the 0.5.23 legs deselect it
(their server builds the per-pool generation, which ``test_write_accounting.py``
covers). A real ``sglang.launch_server`` 0.5.21 on CPU, buffer mode over the file
backend, with ``--enable-hicache-existence``. Two facts of 0.5.21 on CPU shape it:

- the page size is 1: 0.5.21's paged allocator extends with a Triton kernel only
  (``alloc_extend_kernel``), and Triton has no driver here ("0 active drivers");
  0.5.22 added a torch path. With one token per page the token allocator is used;
- the ``device_module`` CPU stand-in (``standins/hx_cpu_standins.py``) gives the
  HiCache controller CPU streams, as 0.5.22+ does itself.

The counters are compared with the file backend's page files and SGLang's own
``sglang:backuped_tokens_total``. Prompts stay below SGLang's prefetch threshold,
so nothing is loaded back and every belief comes from an acknowledged write.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from harness import (
    WRITE_PAGES,
    Server,
    ServerSpec,
    block_tokens_for,
    delta,
    family,
    launch,
    sample_value,
    settle,
)

pytestmark = pytest.mark.real_server

P = "hicache_existence_"
FLAT_CLASS = "hicache_existence.core.flat.FlatStorageExistenceCache"
COUNTERS = (*WRITE_PAGES, "page_inserts")
A_TOKENS, B_TOKENS = 48, 32
MAX_NEW = 2  # generated tokens per request


def _read(srv: Server) -> dict[str, float]:
    """Every family must be on /metrics (a missing one fails, never reads 0)."""
    fams = srv.metrics()
    out = {c: family(fams, P + c).total("_total") for c in COUNTERS}
    # SGLang creates its labelled series at the first backup: absent before it.
    out["sglang_backuped_pages"] = sample_value(
        fams, "sglang:backuped_tokens_total", absent_ok=True
    )
    out["files"] = float(len(srv.l3_pages()))
    return out


def reading(srv: Server) -> dict[str, float]:
    """The counters and the truth beside them once all have stopped changing."""
    srv.wait_writes_settled()
    return settle(lambda: _read(srv))


@pytest.fixture(scope="module")
def phases() -> Iterator[tuple[dict[str, dict[str, float]], list[str], list[list[int]]]]:
    """A; flush; A again; flush; A+B (one node spanning believed A and new B)."""
    a = block_tokens_for(1, A_TOKENS, salt="flat")
    b = block_tokens_for(2, B_TOKENS, salt="flat")
    with launch(ServerSpec(page_size=1, env={"HX_PROBES": "1"})) as srv:
        classes = [p["cache_class"] for p in srv.probes("tree")]
        r = {"start": reading(srv)}
        outputs = [srv.generate(a, MAX_NEW)]
        r["a"] = reading(srv)
        srv.flush_cache()
        outputs.append(srv.generate(a, MAX_NEW))
        r["a_again"] = reading(srv)
        srv.flush_cache()
        outputs.append(srv.generate(a + b, MAX_NEW))
        r["a_b"] = reading(srv)
        yield r, classes, outputs


def test_the_server_runs_the_flat_generation(phases) -> None:
    """The real 0.5.21 scheduler built our flat cache (the class upstream's flat
    StorageExistenceCache was replaced with), and answered every request."""
    _, classes, outputs = phases
    assert classes == [FLAT_CLASS], classes
    assert [len(o) for o in outputs] == [2, 2, 2]
    assert outputs[0] == outputs[1]


def test_every_phase_counts_what_l3_and_sglang_saw(phases) -> None:
    """In every phase: written - redundant = page files created, acknowledged =
    written = SGLang's own backed-up pages, nothing failed."""
    r, _, _ = phases
    names = list(r)
    for before, after in itertools.pairwise(names):
        d = delta(r[after], r[before])
        assert d["written_pages"] - d["redundant_written_pages"] == d["files"], (after, d)
        assert d["write_acknowledged_pages"] == d["written_pages"], (after, d)
        assert d["sglang_backuped_pages"] == d["written_pages"], (after, d)
        assert d["write_failed_pages"] == 0, (after, d)


def test_writes_avoided_and_redundant_in_the_flat_generation(phases) -> None:
    """A: every page of its finished sequence is written once (the 48 prompt
    tokens and the 2 generated ones: one page each at page size 1). A again:
    nothing is written, and both insert walks are avoided (the prompt's 48 pages,
    then the finished sequence's 50). A+B: B's pages and its 2 generated tokens
    are new files; A's 48 prompt pages are written again because 0.5.21 writes a
    node whole once any page of it is not covered, and each of those is a
    redundant write of a page believed stored."""
    r, _, _ = phases
    a = delta(r["a"], r["start"])
    assert a["files"] == a["written_pages"] == A_TOKENS + MAX_NEW, a
    assert a["redundant_written_pages"] == 0, a
    again = delta(r["a_again"], r["a"])
    assert again["written_pages"] == 0 and again["files"] == 0, again
    assert again["write_avoided_pages"] == A_TOKENS + (A_TOKENS + MAX_NEW), again
    a_b = delta(r["a_b"], r["a_again"])
    assert a_b["files"] == B_TOKENS + MAX_NEW, a_b
    assert a_b["redundant_written_pages"] == a_b["redundant_believed_pages"] == A_TOKENS, a_b
