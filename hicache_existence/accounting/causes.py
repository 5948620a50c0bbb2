"""Why a page was written to L3 again: the cause of each redundant write.

A redundant write is a written page the backend said it already held (the file
backend's ``exists``, Mooncake's ``batch_is_exist``).  ``CauseTracker`` keeps the
little it takes to say why SGLang wrote it anyway, from the events the write path
reports in scheduler-thread order (every TP rank sees the same ones): a hit query
(``queried``), a prefetch's outcome (``prefetched``), a write's launch (``launched``,
which consumes its pages' pending prefetch dispositions) and its ack (``stored``).

``classify(node, pages, believed, held)`` names each redundant page's cause, the
first of ``CAUSES`` that matches (docs/metrics.md, "Causes of redundant writes",
says what each means): ``believed_node`` (in ``held``), the page's last prefetch
disposition, ``host_copy_reclaimed`` (the same tree node wrote before: a node
writes its pages once while its host copy lives), ``recompute`` (in ``believed``,
or ``remembers`` says believed now or once), ``other_instance`` (``remembers``
says never), ``unclassified`` (``remembers`` cannot tell: no miss-reason memory).

Memory is bounded and the work per event is C-level batch dict and set operations
(a Python step only per page that had a disposition): dispositions and the nodes
that wrote are kept in two generations each (the older dropped when the newer
holds ``max_entries``), so the most recent ``max_entries`` to ``2 * max_entries``
are remembered.  Pages are the tree's own hash strings.  A query's pages share
one disposition object, so its own prefetch reporting next with every page
delivered (the common case) costs one store, not a pass over the chain.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Final, Literal, get_args

from hicache_existence.core import _validate

Cause = Literal[
    "believed_node",
    "below_prefetch_threshold",
    "prefetch_shortfall",
    "host_copy_reclaimed",
    "recompute",
    "other_instance",
    "unclassified",
]

#: Every cause, in classification order (the metric's label values).
CAUSES: Final[tuple[Cause, ...]] = get_args(Cause)

_BELOW: Final = 1
_SHORT: Final = 2
#: Delivered by a prefetch: no disposition (kept, rather than popped page by page).
_LOADED: Final = 3


class _Query:
    """The disposition a hit query at or above the threshold gives its pages, shared
    by them: when its own prefetch reports next and delivers every page, one store
    turns all of them to ``_LOADED`` (``prefetched``), not a pass over the chain."""

    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code = _SHORT


#: ``(pool, page) -> True / False / None``: whether this process has a record of the
#: page (believed now, or once believed), or ``None`` when it cannot tell.
Remembers = Callable[[str, str], "bool | None"]


class _Generations:
    """A bounded map keeping the most recent ``size`` to ``2 * size`` keys: two
    dicts, the older dropped whole when the newer fills (O(1) per operation)."""

    __slots__ = ("size", "new", "old")

    def __init__(self, size: int) -> None:
        self.size = size
        self.new: dict[Hashable, Any] = {}
        self.old: dict[Hashable, Any] = {}

    def put(self, key: Hashable, value: Any) -> None:
        new = self.new
        new[key] = value
        if len(new) >= self.size:
            self.old, self.new = new, {}

    def put_many(self, keys: Iterable[Hashable], value: Any) -> None:
        """``put`` of every key (one C-level update; the generation may overshoot
        ``size`` by the batch before it turns over)."""
        new = self.new
        new.update(dict.fromkeys(keys, value))
        if len(new) >= self.size:
            self.old, self.new = new, {}

    def pop(self, key: Hashable) -> Any:
        value = self.new.pop(key, None)
        old = self.old.pop(key, None)
        return old if value is None else value

    def __contains__(self, key: object) -> bool:
        return key in self.new or key in self.old

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def clear(self) -> None:
        self.new, self.old = {}, {}


class CauseTracker:
    """The bounded memory behind ``classify`` (module docstring)."""

    def __init__(self, remembers: Remembers | None = None, max_entries: int = 65536) -> None:
        self.max_entries = _validate.count(max_entries, "max_entries", 1)
        self.remembers = remembers
        #: page -> its last prefetch disposition not yet consumed by a write.
        self._disposition = _Generations(self.max_entries)
        #: nodes whose write was acknowledged.
        self._nodes = _Generations(self.max_entries)
        #: page -> disposition taken at its launch, until its ack (in flight only).
        self._taken: dict[str, int] = {}
        #: The last disposition event, when it was a query at or above the threshold:
        #: its shared disposition and the pages it was given.  Any other event that
        #: changes the dispositions closes it (``None``).
        self._open: tuple[_Query, list[str]] | None = None

    # -- events --------------------------------------------------------------------
    def queried(self, chain: Sequence[str], found: int, *, below_threshold: bool) -> None:
        """A rank-agreed hit query found ``chain``'s first ``found`` pages in L3.
        Below the prefetch threshold they are not loaded, so a rewrite is
        ``below_prefetch_threshold``; at or above it, until the due prefetch reports,
        a ``prefetch_shortfall`` (a prefetch revoked for lack of host memory never
        reports)."""
        if found <= 0:
            return
        if below_threshold:
            self._open = None
            pages = chain if found >= len(chain) else chain[:found]
            self._disposition.put_many(pages, _BELOW)
            return
        # A list of its own: compared with the prefetch's pages when that reports.
        kept = chain[:found] if type(chain) is list else list(chain[:found])
        query, disp = _Query(), self._disposition
        disp.put_many(kept, query)
        # Open unless the put turned the generations over (then ``new`` is empty and a
        # ``_LOADED`` put would add the pages to it again, which a store would not).
        self._open = (query, kept) if disp.new else None

    def prefetched(self, requested: Sequence[str], loaded: int) -> None:
        """A prefetch of ``requested`` delivered its first ``loaded`` pages: those
        are no shortfall; the rest (a deadline, a failed transfer, no host memory) is."""
        n = len(requested)
        cut = min(max(loaded, 0), n)
        opened, self._open = self._open, None
        if cut == n and opened is not None and opened[1] == requested:
            # The query just before it (no disposition changed since) asked for exactly
            # these pages and all came: the same as ``_LOADED`` on each, in one store.
            opened[0].code = _LOADED
            return
        if cut:  # loaded whole (the common case): the chain itself, not a copy of it
            self._disposition.put_many(requested if cut == n else requested[:cut], _LOADED)
        if cut < n:
            self._disposition.put_many(requested[cut:], _SHORT)

    def launched(self, node: Any, pages: Iterable[str]) -> None:
        """A write of ``pages`` by ``node`` left: take their dispositions."""
        disp = self._disposition
        new, old = disp.new, disp.old
        if not new and not old:  # the common case, without a call
            return
        if type(pages) is not list:  # read twice below
            pages = list(pages)
        # C-level view intersections, inline: every node write runs this.
        found = new.keys() & pages
        if old:
            found |= old.keys() & pages
        if not found:
            return
        self._open = None
        taken = self._taken
        if len(taken) > 4 * self.max_entries:  # writes that never came back (a reset)
            taken.clear()
        for page in found:
            code = disp.pop(page)
            if type(code) is _Query:  # its state now, fixed for this write
                code = code.code
            if code is not None and code != _LOADED:
                taken[page] = code  # type: ignore[index]

    def stored(self, node: Any, pages: Iterable[str]) -> None:
        """The write of ``pages`` by ``node`` was acknowledged."""
        if node is not None:
            self._nodes.put(node, True)
        taken = self._taken
        if taken:
            for page in pages:
                taken.pop(page, None)

    # -- classification --------------------------------------------------------------
    def classify(
        self,
        node: Any,
        pages: Iterable[str],
        believed: Iterable[str] = (),
        held: Iterable[str] = (),
        pool: str = "kv",
    ) -> dict[Cause, int]:
        """The causes of redundant ``pages`` written by ``node`` (call before
        ``stored`` records this write): ``believed``, the pages believed stored when
        it left; ``held``, those among them an admission decision consulted."""
        out: dict[Cause, int] = {}
        if type(pages) is not list:  # read twice in the common case
            pages = list(pages)
        held_set, believed_set = set(held), set(believed)
        taken = self._taken
        rewritten = node is not None and node in self._nodes
        if pages and not held_set and (not taken or taken.keys().isdisjoint(pages)):
            # No page decided the write or has a disposition (every ack of a write
            # whose pages were all believed, in the common case): one cause for all,
            # found by C-level set tests rather than the loop below.
            if rewritten:
                return {"host_copy_reclaimed": len(pages)}
            if believed_set.issuperset(pages):
                return {"recompute": len(pages)}
        remembers = self.remembers
        for page in pages:
            cause: Cause
            code = taken.get(page)
            if page in held_set:
                cause = "believed_node"
            elif code == _BELOW:
                cause = "below_prefetch_threshold"
            elif code == _SHORT:
                cause = "prefetch_shortfall"
            elif rewritten:
                cause = "host_copy_reclaimed"
            elif page in believed_set:
                cause = "recompute"
            else:
                known = None if remembers is None else remembers(pool, page)
                cause = (
                    "unclassified" if known is None else "recompute" if known else "other_instance"
                )
            out[cause] = out.get(cause, 0) + 1
        return out

    def reset(self) -> None:
        """L3 was cleared: nothing pending is a disposition any more."""
        self._open = None
        self._disposition.clear()
        self._nodes.clear()
        self._taken.clear()

    def __len__(self) -> int:
        return len(self._disposition) + len(self._nodes) + len(self._taken)
