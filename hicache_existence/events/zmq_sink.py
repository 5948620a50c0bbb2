"""The package's own KV-event publisher: a ZeroMQ PUB socket, SGLang's framing.

Used when the server runs without ``--kv-events-config`` (with it, the events go on
SGLang's own publisher: ``integrations/sglang/kv_events.py``).  Each batch is one
multipart message ``(topic, seq, payload)`` as SGLang's publisher sends it
(``wire``), so a subscriber written for SGLang's stream reads this one unchanged.
There is no replay socket: a subscriber that missed batches sees a gap in ``seq``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hicache_existence.events.wire import Event, encode_batch

logger = logging.getLogger(__name__)


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """``tcp://*:5560`` -> ``tcp://*:5561`` for DP rank 1 (other transports:
    ``_dp<rank>`` appended, as SGLang does for ``inproc``).  Port ``0`` or ``*``
    stays: every replica binds a port of its own choosing (its start-up line names it)."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://") and ":" in endpoint[len("tcp://") :]:
        base, _, port = endpoint.rpartition(":")
        if port in ("0", "*"):
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


class ZmqSink:
    """A bound PUB socket publishing ``KVEventBatch`` messages (publisher thread only)."""

    def __init__(self, endpoint: str, *, dp_rank: int = 0):
        import zmq  # lazily: only a process that publishes needs pyzmq

        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.dp_rank = dp_rank
        self._seq = 0
        self._socket: Any = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(100_000)
        try:
            self._socket.bind(self.endpoint)
        except Exception:
            self._socket.close(linger=0)
            raise
        #: The endpoint actually bound (port 0 resolved): where subscribers connect.
        self.where: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    @classmethod
    def open(cls, endpoint: str, *, dp_rank: int = 0) -> ZmqSink | None:
        """The sink, or ``None`` with one warning naming the endpoint."""
        try:
            return cls(endpoint, dp_rank=dp_rank)
        except Exception as exc:
            logger.warning(
                "hicache-existence: KV events off: cannot bind %s (%s); the server runs "
                "without storage-tier events",
                offset_endpoint(endpoint, dp_rank),
                exc,
            )
            return None

    def send(self, ts: float, events: Sequence[Event]) -> None:
        payload = encode_batch(ts, events, self.dp_rank)
        seq = self._seq
        self._seq += 1
        # (topic, seq, payload), the topic empty as in SGLang's default KVEventsConfig.
        self._socket.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def close(self) -> None:
        self._socket.close(linger=0)
