"""Storage-tier KV events in a SGLang scheduler (docs/kv-events.md): the blocks of an
acknowledged buffer-mode write (from its intent's ``BufferBackupSnapshot``), the
publishing rank (gated as SGLang's ``is_kv_publisher_rank``), and SGLang's own
publisher (with ``--kv-events-config``, captured by an AFTER hook on
``init_kv_events``; ``publish`` is called from the emitter's thread, never the
scheduler's).  Without it, the package's own ZeroMQ publisher binds ``events.endpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from hicache_existence.events.emitter import Block, KvEvents, Placement, Sink
from hicache_existence.events.wire import Event, Stored

logger = logging.getLogger("hicache_existence.integrations.sglang")

TARGET = (
    "sglang.srt.managers.scheduler_components.kv_events_publisher."
    "SchedulerKvEventsPublisher.init_kv_events"
)

#: SGLang's KV-event publisher of this process, once its scheduler made one.
_PUBLISHER: list[Any] = []


def acked_blocks(intent: Any, keys: Sequence[str], stored: int) -> tuple[list[Block], int]:
    """The blocks of ``keys[:stored]`` (the pages this rank stored, leading ones), and
    how many of them cannot be published (their event hash is not known)."""
    pages = list(keys[:stored])
    if not pages:
        return [], 0
    snapshot: Any = getattr(intent, "snapshot", None)
    key = getattr(snapshot, "key", None)
    values = list(getattr(snapshot, "hash_values", None) or ())
    if (
        key is None
        or not values
        or getattr(key, "extra_key", None) is not None
        or getattr(key, "cache_salt", None) is not None
        or getattr(key, "is_bigram", False)
    ):
        return [], len(pages)
    tokens = list(key.token_ids)
    page_size = len(tokens) // len(values)
    if page_size <= 0 or len(tokens) != page_size * len(values):
        return [], len(pages)
    index = {page: i for i, page in enumerate(values)}
    root_parent = None if snapshot.parent_is_root else snapshot.parent_last_hash
    blocks: list[Block] = []
    unknown = 0
    for page in pages:
        i = index.get(page)
        if i is None:
            unknown += 1
            continue
        parent = values[i - 1] if i else root_parent
        blocks.append((page, parent, tokens[i * page_size : (i + 1) * page_size]))
    return blocks, unknown


def feed(events: KvEvents, intent: Any, keys: Sequence[str], stored: int) -> None:
    """The storage ack of a buffer-mode write: publish the stored blocks (one queue
    item on the scheduler thread; ``acked_blocks`` runs on the emitter's thread,
    and the references stay valid: the snapshot is a frozen struct with SGLang's
    own copies for this write, and ``keys`` never change after the ack)."""
    if stored > 0:
        events.stored_from(acked_blocks, (intent, keys, stored), stored)


class SglangSink:
    """Publishes on SGLang's own ``EventPublisher`` (found when the first batch goes)."""

    #: For the start-up line: subscribers read SGLang's own stream.
    where = "SGLang's --kv-events-config publisher"

    def __init__(self) -> None:
        from sglang.srt.disaggregation.kv_events import (
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        self._classes = (BlockStored, BlockRemoved, KVEventBatch)

    def send(self, ts: float, events: Sequence[Event]) -> None:
        if not _PUBLISHER:
            raise RuntimeError("SGLang's KV event publisher was not found in this process")
        block_stored, block_removed, batch = self._classes
        out = [
            block_stored(
                block_hashes=list(e.block_hashes),
                parent_block_hash=e.parent_block_hash,
                token_ids=list(e.token_ids),
                block_size=e.block_size,
                lora_id=None,
                medium=e.medium,
            )
            if isinstance(e, Stored)
            else block_removed(block_hashes=list(e.block_hashes), medium=e.medium)
            for e in events
        ]
        _PUBLISHER[-1].publish(batch(ts=ts, events=out))

    def close(self) -> None:
        """SGLang's publisher is SGLang's to close."""


def placement(backend: str, fallback: tuple[int, int, int]) -> Placement:
    """This scheduler's place among the publishers, from SGLang's parallel context
    (``fallback``: ``(tp_rank, pp_rank, dp_rank)`` where it cannot be read)."""
    tp, pp, dp = fallback
    sink: Callable[[], Sink | None] | None = None
    try:
        from sglang.srt.disaggregation.kv_events import select_kv_publisher_dp_rank
        from sglang.srt.runtime_context import get_observability, get_parallel

        p = get_parallel()
        publishes = p.pp_rank == 0 and p.attn_tp_rank == 0 and p.attn_cp_rank == 0
        dp = select_kv_publisher_dp_rank(p.attn_dp_size, p.attn_dp_rank, p.dp_rank)
        if get_observability().kv_events_config:
            sink = SglangSink
    except Exception as exc:
        logger.info("hicache-existence: KV events placed by the package's facts (%r)", exc)
        publishes = tp == 0 and pp == 0
    return Placement(publishes, dp, backend, sink)


def after_init_kv_events(result: Any, publisher: Any, *a: Any, **kw: Any) -> None:
    """AFTER ``SchedulerKvEventsPublisher.init_kv_events``: keep the scheduler's
    publisher (when this rank has one) for the storage-tier events."""
    try:
        if getattr(publisher, "enable_kv_cache_events", False):
            made = getattr(publisher, "kv_event_publisher", None)
            if made is not None:
                _PUBLISHER[:] = [made]
    except Exception as exc:  # never into the scheduler
        logger.warning("hicache-existence: SGLang's KV event publisher not found (%r)", exc)
    return None
