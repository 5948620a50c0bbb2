"""Why a page was written to L3 again: the cause of each redundant write.

A redundant write is a written page the backend said it already held (the file
backend's ``exists``, Mooncake's ``batch_is_exist``).  ``CauseTracker`` keeps the
little it takes to say why SGLang wrote it anyway, from events the write path
reports in scheduler-thread order (every TP rank sees the same ones):

* ``queried(pages, below_threshold)``: a rank-agreed prefetch hit query found
  ``pages`` in L3.  Below the prefetch threshold they are not loaded: if they are
  written again, the cause is ``below_prefetch_threshold``; at or above it a
  prefetch is due, and until it reports, a rewrite is a ``prefetch_shortfall``
  (a prefetch revoked for lack of host memory never reports);
* ``prefetched(loaded, requested)``: a prefetch loaded ``loaded``; the requested
  pages it did not deliver (a deadline, a failed transfer, no host memory for them)
  are computed again: ``prefetch_shortfall``;
* ``launched(node, pages)``: a write of ``pages`` by tree node ``node`` left; the
  pending dispositions of its pages are taken here (a page's next write consumes
  its query's verdict);
* ``stored(pages)``: a write was acknowledged: these pages have a local record.

``classify(node, pages, believed)`` then names each redundant page's cause, first
match wins:

1. ``believed_node``: the existence cache was consulted for this write and
   believed the page stored, yet it was written: its node also spanned uncovered
   pages and was written whole (buffer mode; cache mode's node rules);
2. ``below_prefetch_threshold`` / ``prefetch_shortfall``: the page's last prefetch
   disposition, as above;
3. ``host_copy_reclaimed``: the same tree node wrote the page before.  A node
   writes its pages once while its host copy lives; under ``write_back``, host
   pressure reclaims the host copy of a node that is also on the device (a
   "duplicate"), and the node's next device eviction backs it up to host, and L3,
   again (SGLang's ``SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM`` turns that off);
4. ``recompute``: this process stored or loaded the page before (a local record):
   evicted from device and host, computed again, written again;
5. ``other_instance``: no local record of the page: another instance (or an
   earlier run of this one) stored it;
6. ``unclassified``: the local record was dropped for space, so neither 4 nor 5
   can be told.

Memory is bounded: the dispositions and the local record are FIFO maps of at most
``max_pages`` page hashes each (the hash strings are the tree's own objects; an
entry costs a dict slot).  Counting happens per redundant page only, at the ack.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

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
CAUSES: Final[tuple[Cause, ...]] = (
    "believed_node",
    "below_prefetch_threshold",
    "prefetch_shortfall",
    "host_copy_reclaimed",
    "recompute",
    "other_instance",
    "unclassified",
)

_BELOW: Final = 1
_SHORT: Final = 2
_LOADED: Final = 3


class CauseTracker:
    """The bounded memory behind ``classify`` (module docstring)."""

    def __init__(self, max_pages: int = 1 << 20) -> None:
        self.max_pages = _validate.count(max_pages, "max_pages", 1)
        #: page -> its last prefetch disposition not yet consumed by a write.
        self._disposition: OrderedDict[str, int] = OrderedDict()
        #: page -> node that last wrote it (acknowledged or loaded: a local record).
        self._record: OrderedDict[str, Any] = OrderedDict()
        self._record_dropped = 0
        #: page -> disposition taken at its launch, until its ack classifies it.
        self._taken: OrderedDict[str, int] = OrderedDict()

    # -- events --------------------------------------------------------------------
    def queried(self, pages: Sequence[str], *, below_threshold: bool) -> None:
        """A rank-agreed hit query found ``pages`` (a chain prefix) in L3.  Below
        the threshold nothing is loaded; at or above it a prefetch is due, and
        until ``prefetched`` says what it delivered, a rewrite is a shortfall
        (a prefetch revoked for host capacity never reports)."""
        disp = self._disposition
        code = _BELOW if below_threshold else _SHORT
        for page in pages:
            disp.pop(page, None)
            disp[page] = code
        self._trim(disp)

    def prefetched(self, loaded: Iterable[str], requested: Iterable[str]) -> None:
        """A prefetch delivered ``loaded`` (a prefix of ``requested``)."""
        disp, record = self._disposition, self._record
        got = set(loaded)
        for page in requested:
            disp.pop(page, None)
            if page in got:
                disp[page] = _LOADED
                record.pop(page, None)
                record[page] = None
            else:
                disp[page] = _SHORT
        self._trim(disp)
        self._trim_record()

    def launched(self, node: Any, pages: Iterable[str]) -> None:
        """A write of ``pages`` by ``node`` left: take their dispositions."""
        disp, taken = self._disposition, self._taken
        if not disp:
            return
        for page in pages:
            code = disp.pop(page, None)
            if code is not None and code != _LOADED:
                taken[page] = code
        self._trim(taken)

    def stored(self, node: Any, pages: Iterable[str]) -> None:
        """A write of ``pages`` by ``node`` was acknowledged: a local record."""
        record, taken = self._record, self._taken
        for page in pages:
            record.pop(page, None)
            record[page] = node
            if taken:
                taken.pop(page, None)
        self._trim_record()

    # -- classification --------------------------------------------------------------
    def classify(
        self, node: Any, pages: Iterable[str], believed: Iterable[str] = ()
    ) -> dict[Cause, int]:
        """The causes of redundant ``pages`` written by ``node`` (before ``stored``
        records this write); ``believed``: those the cache believed stored when an
        admission decision consulted it."""
        out: dict[Cause, int] = {}
        held = set(believed)
        taken, record = self._taken, self._record
        for page in pages:
            cause: Cause
            code = taken.get(page)
            if page in held:
                cause = "believed_node"
            elif code == _BELOW:
                cause = "below_prefetch_threshold"
            elif code == _SHORT:
                cause = "prefetch_shortfall"
            elif page in record:
                writer = record[page]
                same = writer is not None and writer == node
                cause = "host_copy_reclaimed" if same else "recompute"
            elif self._record_dropped:
                cause = "unclassified"
            else:
                cause = "other_instance"
            out[cause] = out.get(cause, 0) + 1
        return out

    def reset(self) -> None:
        """L3 was cleared: no page has a local record any more."""
        self._disposition.clear()
        self._record.clear()
        self._taken.clear()
        self._record_dropped = 0

    def __len__(self) -> int:
        return len(self._disposition) + len(self._record) + len(self._taken)

    # -- bounds ----------------------------------------------------------------------
    def _trim(self, fifo: OrderedDict[str, Any]) -> None:
        for _ in range(len(fifo) - self.max_pages):
            fifo.popitem(last=False)

    def _trim_record(self) -> None:
        excess = len(self._record) - self.max_pages
        if excess > 0:
            self._record_dropped += excess
            self._trim(self._record)
