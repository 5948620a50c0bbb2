"""Argument checks shared by both cache generations.

Every public mutator validates *all* its input before touching the cache, so bad
input raises naming the argument and leaves state, LRU order and counters as they
were.  Hot-path checks run in C: ``"".join`` type-checks a batch of page hashes at
about 3.5 ns a page, far cheaper than a per-item ``isinstance``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

_SEQ_TYPES = (list, tuple)


def page_hashes(hashes: Iterable[str], arg: str = "hashes") -> Sequence[str]:
    """``hashes`` as a list or tuple (``page_sequence``) of ``str``, else ``TypeError``."""
    seq = hashes if type(hashes) in _SEQ_TYPES else page_sequence(hashes, arg)
    try:  # str_items's C pass, inline: this runs on every mutation of the cache
        "".join(seq)
    except TypeError:
        str_items(seq, arg)  # type: ignore[arg-type]
    return seq  # type: ignore[return-value]


def str_items(seq: Sequence[str], arg: str = "hashes") -> None:
    """``TypeError`` naming ``arg[index]`` unless all items are ``str`` (one C pass)."""
    try:
        "".join(seq)
    except TypeError:
        for index, item in enumerate(seq):
            if not isinstance(item, str):
                raise TypeError(
                    f"{arg}[{index}] must be a str page hash, got {type(item).__name__}"
                ) from None
        raise  # pragma: no cover - join failed for another reason


def index_tag(tag: object) -> int:
    """A pool tag as a plain int (``True``/``IntEnum`` -> value), as the C types check it."""
    if not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag < 2**32:
        raise ValueError("tag must be in [0, 2**32)")
    return int(tag)


def index_batch(seq: Sequence[str], tag: object) -> int:
    """The C index's and sampler's checks, in order (container, tag, items); the tag."""
    if not isinstance(seq, _SEQ_TYPES):
        raise TypeError(f"hashes must be a list or tuple of str, got {type(seq).__name__}")
    plain = index_tag(tag)
    str_items(seq, "hashes")
    return plain


def page_sequence(hashes: Iterable[str], arg: str = "hashes") -> Sequence[str]:
    """``hashes`` as a list or tuple (others materialised once: callers may walk it twice),
    items unchecked (an ``LruIndex`` checks them, in C); a bare ``str``/``bytes`` is refused."""
    if type(hashes) in _SEQ_TYPES:
        return hashes  # type: ignore[return-value]
    if isinstance(hashes, (str, bytes, bytearray)):
        raise TypeError(
            f"{arg} must be an iterable of str page hashes, not a single {type(hashes).__name__}"
        )
    try:
        return tuple(hashes)
    except TypeError:
        raise TypeError(
            f"{arg} must be an iterable of str page hashes, got {type(hashes).__name__}"
        ) from None


def page_hash(value: object, arg: str = "page_hash") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str page hash, got {type(value).__name__}")
    return value


def pool_name(name: object, arg: str = "pool") -> str:
    """Return the plain ``str`` value of a pool name (str enums included)."""
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str pool name, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{arg} must be a non-empty pool name")
    # str.__str__ gives a str-enum member's value ("kv"); str() gives "PoolName.KV".
    return str.__str__(name)


def is_int(value: object) -> bool:
    """An ``int`` but not a ``bool`` (never a count or a setting's number here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: object, arg: str) -> float:
    """``value`` as a ``float`` (bools refused: ``TypeError``); the caller checks range."""
    if not is_number(value):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}")
    return float(value)  # type: ignore[arg-type]


def count(value: object, arg: str, minimum: int = 0) -> int:
    """Return ``value`` as an ``int`` >= ``minimum``; bools and floats are refused."""
    if type(value) is int and value >= minimum:  # the common case, one type test
        return value
    if isinstance(value, bool):
        raise TypeError(f"{arg} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{arg} must be an int, got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{arg} must be >= {minimum}, got {number}")
    return number


def container(value: object, arg: str) -> None:
    if not hasattr(type(value), "__contains__"):
        raise TypeError(
            f"{arg} must be a container of page hashes (support 'in'), got {type(value).__name__}"
        )
