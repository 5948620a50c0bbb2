"""Cache mode's write rule (``CacheModeWrites.plan`` and ``launched``) against a
reference model written from the module docstring, for every shape of node write:
believed, in-flight and new pages, dedup on and off, prefix-keyed backends, extra
pools (hybrid models) with and without keys, and sglang's own dedup
(``upstream_dedup``).  The model says which pages go out, which are left out, and
which the ack will count as believed at launch; the plan, the counters and the
pending operation must say the same."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.accounting.causes import CauseTracker
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.integrations.sglang.cache_mode import CacheModeWrites

#: A page's state before the write: believed stored, in flight only, or new.
STATES = ("believed", "inflight", "new")


def reference(
    kv: list[tuple[str, str]],
    extra: dict[str, list[tuple[str, str]]],
    *,
    dedup: bool,
    prefix_keyed: bool,
    upstream_dedup: bool,
) -> tuple[list[str], dict[str, list[str]], set[str]]:
    """(KV pages written, extra pools' keys written, KV pages believed at launch)."""
    pages = [p for p, _ in kv]
    believed = {p for p, s in kv if s == "believed"}
    extra = {name: keys for name, keys in extra.items() if keys}
    if upstream_dedup:  # sglang decided; ours counts what it sends
        return pages, {n: [k for k, _ in keys] for n, keys in extra.items()}, believed
    covered = all(s != "new" for _, s in kv)
    noted = set(pages) if covered else believed  # covered: every page counts as believed
    everything = pages, {n: [k for k, _ in keys] for n, keys in extra.items()}, noted
    if not dedup:
        return everything
    if extra:  # the whole node or nothing
        if covered and all(s != "new" for keys in extra.values() for _, s in keys):
            return [], {}, noted
        return everything
    if covered:
        return [], {}, noted
    if prefix_keyed:  # only the believed prefix
        first = next(i for i, (_, s) in enumerate(kv) if s != "believed")
        return pages[first:], {}, noted
    return [p for p, s in kv if s != "believed"], {}, noted


def _pages(prefix: str) -> Any:
    return st.lists(st.sampled_from(STATES), max_size=6).map(
        lambda states: [(f"{prefix}{i:063x}", s) for i, s in enumerate(states)]
    )


@settings(max_examples=400, deadline=None)
@given(
    kv=_pages("k"),
    swa=st.one_of(st.none(), _pages("s")),
    dedup=st.booleans(),
    prefix_keyed=st.booleans(),
    upstream_dedup=st.booleans(),
)
def test_the_plan_and_the_launch_follow_the_written_rule(
    kv: list[tuple[str, str]],
    swa: list[tuple[str, str]] | None,
    dedup: bool,
    prefix_keyed: bool,
    upstream_dedup: bool,
) -> None:
    cache = StorageExistenceCache(1024)
    writes = WriteAccounting()
    mode = CacheModeWrites(
        writes,
        cache,
        dedup=dedup,
        upstream_dedup=upstream_dedup,
        causes=CauseTracker(64),
        size_pool=lambda pool: None,
    )
    pools = {"kv": kv, **({"swa": swa} if swa is not None else {})}
    for name, keyed in pools.items():
        view = cache.pool(name)
        view.add([k for k, s in keyed if s == "believed"])
        view.track_inflight([k for k, s in keyed if s == "inflight"])
    transfers = None if swa is None else [NS(name="swa", keys=[k for k, _ in swa])]
    want_kv, want_extra, want_noted = reference(
        kv,
        {} if swa is None else {"swa": swa},
        dedup=dedup,
        prefix_keyed=prefix_keyed,
        upstream_dedup=upstream_dedup,
    )

    plan = mode.plan([p for p, _ in kv], transfers, prefix_keyed=prefix_keyed)
    assert plan.written_pages == want_kv
    assert plan.whole == (len(want_kv) == len(kv) and (not swa or "swa" in want_extra))
    mode.launched(7, plan, "node")

    stats = writes.stats()
    assert (stats["kv"].written, stats["kv"].avoided) == (len(want_kv), len(kv) - len(want_kv))
    if swa:
        sent = len(want_extra.get("swa", ()))
        assert (stats["swa"].written, stats["swa"].avoided) == (sent, len(swa) - sent)
    node, written, noted, extra, _ = mode._pending[7]
    assert node == "node" and written == want_kv
    assert set(noted) == want_noted & set(want_kv)
    assert dict(extra) == want_extra
