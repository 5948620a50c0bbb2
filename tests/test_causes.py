"""The causes of redundant writes (``accounting/causes.py``): each rule on its own,
the order in which they apply, the bounds, and a differential test against an
unbounded reference model over random event sequences."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_existence.accounting.causes import CAUSES, CauseTracker


def pages(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:063x}" for i in range(n)]


def known(*pages_known: str) -> Any:
    """A ``remembers`` that knows exactly ``pages_known`` (and every pool)."""
    got = set(pages_known)
    return lambda pool, page: page in got


def test_a_page_nobody_here_knew_is_another_instances() -> None:
    """No local record (not believed, not remembered): other_instance."""
    t = CauseTracker(known())
    assert t.classify(1, pages("a", 3)) == {"other_instance": 3}


def test_without_a_miss_memory_not_believed_cannot_be_told_apart() -> None:
    """When ``remembers`` cannot tell (no miss-reason memory), a page not believed
    at the launch is unclassified, never a guess; believed ones are recomputes."""
    a = pages("a", 3)
    t = CauseTracker(lambda pool, page: None)
    assert t.classify(1, a, believed=a[:1]) == {"recompute": 1, "unclassified": 2}
    assert CauseTracker().classify(1, a) == {"unclassified": 3}


def test_a_page_believed_or_remembered_is_a_recompute() -> None:
    """Believed when the write left, or remembered (believed now, or once):
    stored or learnt before, evicted from device and host, computed again."""
    a = pages("a", 4)
    t = CauseTracker(known(a[3]))
    assert t.classify(2, a, believed=a[:2]) == {"recompute": 3, "other_instance": 1}


def test_the_same_node_writing_again_lost_its_host_copy() -> None:
    """The node that stored the pages writes them again: its host copy was
    reclaimed while it lived (write_back duplicate reclaim)."""
    t = CauseTracker(known())
    a = pages("a", 3)
    t.stored(7, a)
    assert t.classify(7, a, believed=a) == {"host_copy_reclaimed": 3}
    assert t.classify(8, a, believed=a) == {"recompute": 3}
    t.stored(None, a)  # a write that names no node (buffer mode) records none
    assert t.classify(None, a, believed=a) == {"recompute": 3}


def test_a_query_below_the_threshold_explains_the_rewrite() -> None:
    """Found in L3 by a hit query too short to prefetch, then written: the
    disposition taken at the launch names the cause."""
    t = CauseTracker(known())
    a = pages("a", 5)
    t.queried(a, 3, below_threshold=True)
    t.launched(2, a)
    assert t.classify(2, a, believed=a) == {"below_prefetch_threshold": 3, "recompute": 2}


def test_a_prefetch_that_stopped_short_explains_the_rest() -> None:
    """A query at or above the threshold asks for a prefetch; what it did not
    deliver and is written again is a shortfall, what it loaded is no
    disposition (written again later, it is a recompute)."""
    t = CauseTracker(known())
    a = pages("a", 6)
    t.queried(a, 6, below_threshold=False)
    t.prefetched(a, 2)
    t.launched(3, a)
    assert t.classify(3, a, believed=a) == {"recompute": 2, "prefetch_shortfall": 4}


def test_a_revoked_prefetch_is_a_shortfall() -> None:
    """A query above the threshold whose prefetch never delivered (revoked for
    host capacity): its pages, written again, are a shortfall."""
    t = CauseTracker(known())
    a = pages("a", 4)
    t.queried(a, 9, below_threshold=False)  # found beyond the chain: all of it
    t.launched(1, a)
    assert t.classify(1, a) == {"prefetch_shortfall": 4}


def test_a_disposition_is_consumed_by_the_next_write() -> None:
    """The write after the query takes its disposition; a later write of the same
    page is what the local record says."""
    t = CauseTracker(known())
    a = pages("a", 2)
    t.queried(a, 2, below_threshold=True)
    t.launched(1, a)
    assert t.classify(1, a) == {"below_prefetch_threshold": 2}
    t.stored(1, a)
    t.launched(2, a)
    assert t.classify(2, a, believed=a) == {"recompute": 2}


def test_held_pages_come_first() -> None:
    """Where the existence cache decided the write and believed a page stored,
    the page was written with its node: believed_node, whatever else is known."""
    t = CauseTracker(known())
    a = pages("a", 3)
    t.queried(a, 3, below_threshold=True)
    t.launched(1, a)
    assert t.classify(1, a, believed=a, held=a[:1]) == {
        "believed_node": 1,
        "below_prefetch_threshold": 2,
    }


def test_memory_is_bounded_by_two_generations() -> None:
    """Dispositions and nodes keep the most recent max_entries to 2*max_entries;
    a size below 1 is refused."""
    t = CauseTracker(known(), max_entries=8)
    for i in range(20):
        t.queried(pages(f"q{i:02d}", 3), 3, below_threshold=i % 2 == 0)
        t.stored(i, pages(f"s{i:02d}", 3))
    assert len(t) <= 2 * 8 + 2 * 8
    newest = pages("q18", 3)  # even: below the threshold
    t.launched(99, newest)
    assert t.classify(99, newest) == {"below_prefetch_threshold": 3}
    oldest = pages("q00", 3)
    t.launched(98, oldest)
    assert t.classify(98, oldest) == {"other_instance": 3}  # its disposition was dropped
    with pytest.raises(ValueError):
        CauseTracker(max_entries=0)
    with pytest.raises(TypeError):
        CauseTracker(max_entries="8")  # type: ignore[arg-type]


class _Reference:
    """The rules with unbounded memory and no shortcuts."""

    def __init__(self, remembered: set[str]) -> None:
        self.disp: dict[str, str] = {}
        self.taken: dict[str, str] = {}
        self.nodes: set[int] = set()
        self.remembered = remembered

    def queried(self, ps: list[str], below: bool) -> None:
        for p in ps:
            self.disp[p] = "below" if below else "short"

    def prefetched(self, loaded: list[str], requested: list[str]) -> None:
        for p in requested:
            if p in loaded:
                self.disp.pop(p, None)
            else:
                self.disp[p] = "short"

    def launched(self, ps: list[str]) -> None:
        for p in ps:
            d = self.disp.pop(p, None)
            if d is not None:
                self.taken[p] = d

    def stored(self, node: int, ps: list[str]) -> None:
        self.nodes.add(node)
        for p in ps:
            self.taken.pop(p, None)

    def classify(
        self, node: int, ps: list[str], believed: list[str], held: list[str]
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in ps:
            if p in held:
                c = "believed_node"
            elif self.taken.get(p) == "below":
                c = "below_prefetch_threshold"
            elif self.taken.get(p) == "short":
                c = "prefetch_shortfall"
            elif node in self.nodes:
                c = "host_copy_reclaimed"
            elif p in believed or p in self.remembered:
                c = "recompute"
            else:
                c = "other_instance"
            out[c] = out.get(c, 0) + 1
        return out


_PAGES = pages("p", 12)
_span = st.lists(st.sampled_from(_PAGES), min_size=0, max_size=6, unique=True)
_event = st.one_of(
    st.tuples(st.just("queried"), _span, st.integers(-1, 7), st.booleans()),
    st.tuples(st.just("prefetched"), _span, st.integers(-1, 7)),
    st.tuples(st.just("write"), _span, st.integers(0, 3), _span, _span),
    # a query and its own prefetch of what it found, next (the one-store shortcut)
    st.tuples(st.just("fetch"), _span, st.integers(-1, 7), st.integers(-1, 7), st.booleans()),
    # a prefetch of the pages the last query found, whatever happened since
    st.tuples(st.just("prefetch_last"), st.integers(-1, 7)),
)


def _apply(t: CauseTracker, ev: tuple[Any, ...], last: list[str]) -> dict[str, int] | None:
    """One event on a tracker (a write's classification returned; ``last``: the
    pages the last query found, which ``prefetch_last`` requests)."""
    if ev[0] in ("queried", "fetch"):
        last[:] = ev[1][: max(ev[2], 0)]
    if ev[0] == "queried":
        t.queried(ev[1], ev[2], below_threshold=ev[3])
    elif ev[0] == "prefetch_last":
        t.prefetched(list(last), ev[1])
    elif ev[0] == "prefetched":
        t.prefetched(ev[1], ev[2])
    elif ev[0] == "fetch":
        _, span, found, loaded, below = ev
        t.queried(span, found, below_threshold=below)
        t.prefetched(span[: max(found, 0)], loaded)
    else:
        ps, node, believed, held = _write(ev)
        t.launched(node, ps)
        got = t.classify(node, ps, believed, held)
        t.stored(node, ps)
        return dict(got)
    return None


def _write(ev: tuple[Any, ...]) -> tuple[list[str], int, list[str], list[str]]:
    """A write event's pages, node, believed pages (among them) and held (among those)."""
    _, ps, node, believed, held = ev
    believed = [p for p in believed if p in ps]
    return ps, node, believed, [p for p in held if p in believed]


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=40), _span)
def test_the_tracker_agrees_with_the_reference(
    events: list[tuple[Any, ...]], remembered: list[str]
) -> None:
    """Random queries, prefetches and writes (launch, classify, ack): with room
    for every page, the tracker names the same causes as the reference model,
    and every classified page gets exactly one cause."""
    t, ref = CauseTracker(known(*remembered)), _Reference(set(remembered))
    last: list[str] = []
    for ev in events:
        if ev[0] == "queried":
            _apply(t, ev, last)
            ref.queried(ev[1][: max(ev[2], 0)], ev[3])
        elif ev[0] == "prefetched":
            t.prefetched(ev[1], ev[2])
            ref.prefetched(ev[1][: max(ev[2], 0)], ev[1])
        elif ev[0] == "prefetch_last":
            requested = list(last)
            _apply(t, ev, last)
            ref.prefetched(requested[: max(ev[1], 0)], requested)
        elif ev[0] == "fetch":
            _apply(t, ev, last)
            _, span, found, loaded, below = ev
            ref.queried(span[: max(found, 0)], below)
            requested = span[: max(found, 0)]
            ref.prefetched(requested[: max(loaded, 0)], requested)
        else:
            ps, node, believed, held = _write(ev)
            ref.launched(ps)
            want = ref.classify(node, ps, believed, held)
            got = _apply(t, ev, last)  # launch, classify, ack
            assert got == want
            assert got is not None and sum(got.values()) == len(ps) and set(got) <= set(CAUSES)
            ref.stored(node, ps)


class _EveryPage(CauseTracker):
    """The tracker without its one-store shortcut: a prefetch always writes each
    page's disposition (what ``prefetched`` did before the shortcut)."""

    def queried(self, chain: Any, found: int, *, below_threshold: bool) -> None:
        super().queried(chain, found, below_threshold=below_threshold)
        self._open = None


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=40), _span, st.integers(1, 6))
def test_the_shortcut_changes_nothing_even_when_memory_is_short(
    events: list[tuple[Any, ...]], remembered: list[str], room: int
) -> None:
    """With room for only a few pages (generations turning over), the tracker with
    the shortcut names every write's causes as the one without it, and holds as much."""
    fast = CauseTracker(known(*remembered), max_entries=room)
    slow = _EveryPage(known(*remembered), max_entries=room)
    seen_fast: list[str] = []
    seen_slow: list[str] = []
    for ev in events:
        assert _apply(fast, ev, seen_fast) == _apply(slow, ev, seen_slow)
        assert len(fast) == len(slow)


def test_a_query_whose_prefetch_delivers_everything_leaves_no_shortfall() -> None:
    """The shortcut's own case, and its limits: a prefetch that delivered every
    page its query found leaves no shortfall; one for fewer pages (the host had room
    for part), or after a write took one of them, writes each page as before."""
    sizes = []
    for t in (CauseTracker(known()), _EveryPage(known())):
        chain = pages("c", 4)
        t.queried(chain, 3, below_threshold=False)
        t.prefetched(chain[:3], 99)
        t.launched(1, chain)
        assert t.classify(1, chain) == {"other_instance": 4}
        t.queried(pages("d", 4), 4, below_threshold=False)
        t.prefetched(pages("d", 2), 2)  # truncated to host room: the rest stays short
        t.launched(2, pages("d", 4))
        assert t.classify(2, pages("d", 4)) == {"other_instance": 2, "prefetch_shortfall": 2}
        t.queried(pages("e", 2), 2, below_threshold=False)
        t.launched(3, pages("e", 2)[:1])  # a write between the query and its prefetch
        t.prefetched(pages("e", 2), 2)
        assert t.classify(3, pages("e", 2)[:1]) == {"prefetch_shortfall": 1}
        t.stored(3, pages("e", 2)[:1])
        sizes.append(len(t))  # the page written holds its disposition again
        t.launched(4, pages("e", 2)[1:])
        assert t.classify(4, pages("e", 2)[1:]) == {"other_instance": 1}
    assert sizes[0] == sizes[1]
