"""Cache mode's write rule (``CacheModeWrites.plan`` and ``launched``) against a
reference model, for every shape of node write: believed, in-flight and new pages,
dedup on and off, prefix-keyed backends, extra pools (hybrid models) with and
without keys, and sglang's own dedup (``upstream_dedup``), in both cache
generations.  The model is the rule the module docstring states, plus the
launch's convention for what the ack counts as believed at launch (every page of a
node whose pages are all believed or in flight; otherwise the believed ones); it
says which pages go out, which are left out, what stays in flight until the ack,
and what the ack will count as believed, and the plan, the counters and the
pending operation must say the same."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.accounting.causes import CauseTracker
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.integrations.sglang.cache_mode import CacheModeWrites

#: A page's state before the write: believed stored, in flight only, or new.
STATES = ("believed", "inflight", "new")
#: The extra pools a hybrid model's node write may carry.
EXTRA = ("swa", "mamba")

Keyed = list[tuple[str, str]]


def reference(
    kv: Keyed, extra: dict[str, Keyed], *, dedup: bool, prefix_keyed: bool, upstream_dedup: bool
) -> tuple[list[str], dict[str, list[str]], set[str], dict[str, set[str]]]:
    """(KV pages written, extra pools' keys written, KV pages counted believed at
    launch, per extra pool written its keys believed at launch)."""
    pages = [p for p, _ in kv]
    extra = {name: keys for name, keys in extra.items() if keys}  # a pool without keys: none
    sent_extra = {n: [k for k, _ in keys] for n, keys in extra.items()}
    extra_believed = {n: {k for k, s in keys if s == "believed"} for n, keys in extra.items()}
    believed = {p for p, s in kv if s == "believed"}
    if upstream_dedup:  # sglang decided what goes out; ours counts it
        return pages, sent_extra, believed, extra_believed
    covered = all(s != "new" for _, s in kv)
    noted = set(pages) if covered else believed
    if not dedup:
        return pages, sent_extra, noted, extra_believed
    if extra:  # the whole node or nothing
        if covered and all(s != "new" for keys in extra.values() for _, s in keys):
            return [], {}, noted, {}
        return pages, sent_extra, noted, extra_believed
    if covered:
        return [], {}, noted, {}
    if prefix_keyed:  # only the believed prefix
        first = next(i for i, (_, s) in enumerate(kv) if s != "believed")
        return pages[first:], {}, noted, {}
    return [p for p, s in kv if s != "believed"], {}, noted, {}


def _pages(prefix: str, max_size: int = 6) -> Any:
    return st.lists(st.sampled_from(STATES), max_size=max_size).map(
        lambda states: [(f"{prefix}{i:063x}", s) for i, s in enumerate(states)]
    )


@settings(max_examples=300, deadline=None)
@given(
    kv=_pages("k"),
    # None: no extra_pools argument; {}: an empty list of transfers
    extra=st.one_of(st.none(), st.dictionaries(st.sampled_from(EXTRA), _pages("x", 4))),
    dedup=st.booleans(),
    prefix_keyed=st.booleans(),
    upstream_dedup=st.booleans(),
    flat=st.booleans(),
)
def test_the_plan_and_the_launch_follow_the_written_rule(
    kv: Keyed,
    extra: dict[str, Keyed] | None,
    dedup: bool,
    prefix_keyed: bool,
    upstream_dedup: bool,
    flat: bool,
) -> None:
    # distinct keys per pool (the strategy numbers them alike); None: no extra_pools
    # argument at all, {}: an empty list of transfers
    given_extra = extra
    extra = {n: [(f"{n}{k[len(n) :]}", s) for k, s in keys] for n, keys in (extra or {}).items()}
    cache: Any = FlatStorageExistenceCache(1024) if flat else StorageExistenceCache(1024)
    writes = WriteAccounting()
    mode = CacheModeWrites(
        writes,
        cache,
        dedup=dedup,
        upstream_dedup=upstream_dedup,
        causes=CauseTracker(64),
        size_pool=lambda pool: None,
    )
    for name, keyed in {"kv": kv, **extra}.items():
        view = cache.pool(name)
        view.add([k for k, s in keyed if s == "believed"])
        view.track_inflight([k for k, s in keyed if s == "inflight"])
    refs_before = {n: cache.pool(n).inflight_refs() for n in ("kv", *extra)}
    queries_before = {n: cache.pool(n).stats().queries for n in ("kv", *extra)}
    transfers = (
        None
        if given_extra is None
        else [NS(name=n, keys=[k for k, _ in ks]) for n, ks in extra.items()]
    )
    want_kv, want_extra, want_noted, want_extra_noted = reference(
        kv, extra, dedup=dedup, prefix_keyed=prefix_keyed, upstream_dedup=upstream_dedup
    )

    plan = mode.plan([p for p, _ in kv], transfers, prefix_keyed=prefix_keyed)
    assert plan.written_pages == want_kv
    keyed_extra = [n for n, ks in extra.items() if ks]
    assert plan.whole == (len(want_kv) == len(kv) and set(want_extra) == set(keyed_extra))
    # Counted lookups, dedup on or off alike: none where sglang's own dedup looked
    # already; else the KV pool's pages once, then the extra pools in order, up to the
    # first whose keys are not all covered.
    looked = dict.fromkeys(queries_before, 0)
    if not upstream_dedup:
        looked["kv"] = 1 if kv else 0
        for name in keyed_extra:
            looked[name] = 1
            if any(st == "new" for _, st in extra[name]):
                break
    assert {n: cache.pool(n).stats().queries - q for n, q in queries_before.items()} == looked
    mode.launched(7, plan, "node")

    stats = writes.stats()
    assert (stats["kv"].written, stats["kv"].avoided) == (len(want_kv), len(kv) - len(want_kv))
    for name in keyed_extra:
        sent = len(want_extra.get(name, ()))
        assert (stats[name].written, stats[name].avoided) == (sent, len(extra[name]) - sent)
    node, written, noted, pending_extra, pending_extra_noted = mode._pending[7]
    assert node == "node" and written == want_kv
    assert set(noted) == want_noted & set(want_kv)
    assert dict(pending_extra) == want_extra
    assert dict(pending_extra_noted) == want_extra_noted
    # what went out stays in flight until its ack: one more ref per page sent
    for name, sent_keys in {"kv": want_kv, **want_extra}.items():
        refs = cache.pool(name).inflight_refs()
        before = refs_before[name]
        assert refs == {**before, **{k: before.get(k, 0) + 1 for k in sent_keys}}
