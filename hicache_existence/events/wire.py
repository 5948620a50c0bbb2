"""The KV-event wire format routers already read, written without a third-party codec.

SGLang's ``--kv-events-config`` publisher (and vLLM's, which Dynamo decodes with the
same code path) sends each batch as a ZeroMQ multipart message ``(topic, seq,
payload)``: ``seq`` an 8-byte big-endian counter, ``payload`` a msgpack array
``[ts, events, dp_rank]``.  Every event is a msgpack map tagged by its class name
under ``"type"`` whose other keys are its field names (``event_map``); a field with
a default is left out while it holds that default, the others are always present.

The package's runtime path has no msgpack dependency; the encoding is checked
against SGLang's own classes, which decode it (``tests/test_events_sglang.py``).
Only the msgpack types the events use are written: nil, booleans, 64-bit
integers, float64, UTF-8 strings, arrays and string-keyed maps.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def block_hash(page: str) -> int:
    """The event block hash of an SGLang page hash (64 hex digits): its first 64
    bits as a signed integer, as SGLang's own events derive it from the same
    page hash (``hash_str_to_int64``)."""
    value = int(page[:16], 16)
    return value - (1 << 64) if value >= (1 << 63) else value


@dataclass(frozen=True)
class Stored:
    """One ``BlockStored``: a run of blocks, each the child of the one before."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True)
class Removed:
    """One ``BlockRemoved``."""

    block_hashes: tuple[int, ...]
    medium: str


Event = Stored | Removed


def event_map(event: Event) -> dict[str, Any]:
    """The tagged map of one event, in SGLang's field order."""
    if isinstance(event, Stored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
        }
    return {
        "type": "BlockRemoved",
        "block_hashes": list(event.block_hashes),
        "medium": event.medium,
    }


def encode_batch(ts: float, events: Sequence[Event], dp_rank: int | None) -> bytes:
    """The msgpack payload of one ``KVEventBatch``: ``[ts, events, dp_rank]``."""
    out = bytearray()
    _pack([float(ts), [event_map(e) for e in events], dp_rank], out)
    return bytes(out)


def _pack(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        if -32 <= value < 0x80:  # positive and negative fixint
            out.append(value & 0xFF)
        elif value >= 0:
            _sized(value, value, _UINT, out)
        else:  # ~value < 2**(k-1) iff value >= -2**(k-1)
            _sized(~value, value, _INT, out)
    elif isinstance(value, float):
        out.append(0xCB)
        out += struct.pack(">d", value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _header(len(data), 0xA0, 32, _STR, out)
        out += data
    elif isinstance(value, (list, tuple)):
        _header(len(value), 0x90, 16, _ARRAY, out)
        for item in value:
            _pack(item, out)
    elif isinstance(value, Mapping):
        _header(len(value), 0x80, 16, _MAP, out)
        for key, item in value.items():
            _pack(str(key), out)
            _pack(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as a KV event field")


#: msgpack's sized forms, narrowest first: (exclusive bound, struct format, type byte).
_Forms = tuple[tuple[int, str, int], ...]
_UINT: _Forms = (
    (1 << 8, ">BB", 0xCC),
    (1 << 16, ">BH", 0xCD),
    (1 << 32, ">BI", 0xCE),
    (1 << 64, ">BQ", 0xCF),
)
_INT: _Forms = (
    (1 << 7, ">Bb", 0xD0),
    (1 << 15, ">Bh", 0xD1),
    (1 << 31, ">Bi", 0xD2),
    (1 << 63, ">Bq", 0xD3),
)
_STR: _Forms = ((1 << 8, ">BB", 0xD9), (1 << 16, ">BH", 0xDA), (1 << 32, ">BI", 0xDB))
_ARRAY: _Forms = ((1 << 16, ">BH", 0xDC), (1 << 32, ">BI", 0xDD))
_MAP: _Forms = ((1 << 16, ">BH", 0xDE), (1 << 32, ">BI", 0xDF))


def _sized(key: int, value: int, forms: _Forms, out: bytearray) -> None:
    """``value`` in the first of ``forms`` whose bound ``key`` is below."""
    for bound, fmt, tag in forms:
        if key < bound:
            out += struct.pack(fmt, tag, value)
            return
    raise ValueError(f"integer {value} does not fit in 64 bits")


def _header(n: int, fix: int, fix_below: int, forms: _Forms, out: bytearray) -> None:
    """A string, array or map header for ``n`` bytes or entries: the fix form
    (``fix | n``) below ``fix_below``, else the narrowest sized form."""
    if n < fix_below:
        out.append(fix | n)
    else:
        _sized(n, n, forms, out)
