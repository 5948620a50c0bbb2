"""The LRU index behind both cache generations (docs/design.md, "Why it is faster").

An LRU-ordered set of ``(tag, page_hash)`` keys, the tag a small int naming the pool
(the seed generation shares one index among pools; the current one gives each pool
its own, tag 0).  It stores, orders and evicts; the caches do the accounting.
``core._lru.LruIndex`` is compiled at install given a compiler; ``PyLruIndex`` (below)
is the fallback and its test reference.  ``HICACHE_EXISTENCE_BACKEND`` (read at
import): ``auto`` (default: compiled if importable), ``c`` (compiled or ImportError)
or ``python``.  Every method validates all input before changing anything.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from types import ModuleType
from typing import Any, Protocol, cast

from hicache_existence.core import _validate
from hicache_existence.core.sampler import PySampler, SamplerType

#: Drains an iterator in C without keeping anything (itertools "consume" recipe).
_exhaust: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
_ABSENT = object()

#: Import-time switch between the two implementations (see the module docstring).
ENV_BACKEND = "HICACHE_EXISTENCE_BACKEND"


class LruIndexType(Protocol):
    """The interface both implementations provide."""

    def touch_prefix(self, hashes: Sequence[str], tag: int = 0, /) -> int: ...
    def touch(self, page_hash: str, tag: int = 0, /) -> bool: ...
    def cover_rest(
        self, hashes: Sequence[str], start: int, tag: int, cover: Container[str] | None, /
    ) -> tuple[int, int]: ...
    def contains(self, page_hash: str, tag: int = 0, /) -> bool: ...
    def add(self, hashes: Sequence[str], tag: int = 0, /) -> int: ...
    def evict(self, count: int, /) -> dict[int, int]: ...
    def evict_keys(self, count: int, /) -> dict[int, list[str]]: ...
    def discard(self, hashes: Sequence[str], tag: int = 0, /) -> list[str]: ...
    def clear(self) -> None: ...
    def keys(self) -> list[str]: ...
    def items(self) -> list[tuple[int, str]]: ...
    def attach(self, tag: int, sampler: SamplerType | None, /) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, page_hash: object) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...


def _check_key(page_hash: object) -> None:
    if not isinstance(page_hash, str):
        raise TypeError(f"page hash must be a str, got {type(page_hash).__name__}")


_STR_ONLY = frozenset({str})


def _exact(seq: Sequence[str]) -> Sequence[str]:
    """Exact ``str`` copies of subclass items (stored keys are plain ``str``)."""
    if {*map(type, seq)} <= _STR_ONLY:  # one C pass
        return seq
    return [h if type(h) is str else str.__str__(h) for h in seq]


class PyLruIndex:
    """Pure-Python ``LruIndex`` on one ``OrderedDict``: tag-0 keys are the ``str`` (no tuple
    to hash), others ``(tag, str)``; with no tagged key (current generation) no tag sort."""

    __slots__ = ("_od", "_tagged", "_samplers")

    def __init__(self) -> None:
        self._od: OrderedDict[str | tuple[int, str], None] = OrderedDict()
        self._tagged = False
        self._samplers: dict[int, PySampler] = {}

    def attach(self, tag: int, sampler: SamplerType | None, /) -> None:
        """Feed ``sampler`` (``PySampler``; None: detach) tag's walks, adds, discards, clears."""
        tag = _validate.index_tag(tag)
        if sampler is None:
            self._samplers.pop(tag, None)
            return
        if not isinstance(sampler, PySampler):
            raise TypeError(f"sampler must be a PySampler or None, got {type(sampler).__name__}")
        self._samplers[tag] = sampler

    def touch_prefix(self, hashes: Sequence[str], tag: int = 0, /) -> int:
        tag = _validate.index_batch(hashes, tag)
        move_to_end = self._od.move_to_end
        try:
            if tag == 0:
                _exhaust(map(move_to_end, hashes))
            else:
                _exhaust(map(move_to_end, zip(repeat(tag), hashes)))
        except KeyError as miss:
            # An earlier occurrence of the missing page would have raised there, so its
            # first index is where the walk stopped.  A tuple key may arrive as args.
            key = miss.args[0] if tag == 0 or len(miss.args) == 1 else miss.args
            return hashes.index(key if tag == 0 else key[1])
        if self._samplers and hashes and (sampler := self._samplers.get(tag)) is not None:
            sampler._fed(hashes, tag, True)
        return len(hashes)

    def touch(self, page_hash: str, tag: int = 0, /) -> bool:
        _check_key(page_hash)
        tag = _validate.index_tag(tag)
        key = page_hash if tag == 0 else (tag, page_hash)
        od = self._od
        if key in od:
            od.move_to_end(key)
            return True
        return False

    def cover_rest(
        self, hashes: Sequence[str], start: int, tag: int, cover: Container[str] | None, /
    ) -> tuple[int, int]:
        """Continue a walk at ``hashes[start]``: touch present pages, count ones in ``cover`` as
        rescues, stop at neither: ``(stop, rescues)``.  No sampler fed (the caller records)."""
        tag = _validate.index_batch(hashes, tag)
        if not 0 <= start <= len(hashes):
            raise ValueError("cover_rest: start out of range")
        od = self._od
        move_to_end = od.move_to_end
        rescues = 0
        i = start
        while i < len(hashes):
            h = hashes[i]  # items checked by index_batch
            key = h if tag == 0 else (tag, h)
            if key in od:
                move_to_end(key)
            elif cover is not None and h in cover:
                rescues += 1
            else:
                break
            i += 1
        return i, rescues

    def contains(self, page_hash: str, tag: int = 0, /) -> bool:
        _check_key(page_hash)
        tag = _validate.index_tag(tag)
        return (page_hash if tag == 0 else (tag, page_hash)) in self._od

    def add(self, hashes: Sequence[str], tag: int = 0, /) -> int:
        tag = _validate.index_batch(hashes, tag)
        seq = _exact(hashes)
        if tag:
            self._tagged = True
        keys = seq if tag == 0 else list(zip(repeat(tag), seq))
        od = self._od
        before = len(od)
        for key in keys:  # measured faster than OrderedDict.update(zip(...))
            od[key] = None
        inserted = len(od) - before
        if inserted != len(keys):
            # Present or repeated pages: re-touch in order, so last occurrences decide.
            _exhaust(map(od.move_to_end, keys))
        if self._samplers and (sampler := self._samplers.get(tag)) is not None:
            sampler._fed(seq, tag, False)
        return inserted

    def evict(self, count: int, /) -> dict[int, int]:
        n, pops = self._pops(count)
        if not self._tagged:  # every key is a tag-0 str: drain in C
            _exhaust(pops)
            return {0: n} if n else {}
        return dict(Counter(0 if isinstance(key, str) else key[0] for key, _ in pops))

    def evict_keys(self, count: int, /) -> dict[int, list[str]]:
        _, pops = self._pops(count)
        popped = list(map(itemgetter(0), pops))
        if not self._tagged:
            return {0: cast("list[str]", popped)} if popped else {}
        out: dict[int, list[str]] = {}
        for key in popped:
            tag, page = (0, key) if isinstance(key, str) else key
            out.setdefault(tag, []).append(page)
        return out

    def _pops(self, count: int) -> tuple[int, Iterator[tuple[str | tuple[int, str], None]]]:
        """How many entries ``count`` removes, and a lazy iterator popping them oldest first."""
        if count < 0:
            raise ValueError("count must be >= 0")
        od = self._od
        n = min(count, len(od))
        return n, map(od.popitem, repeat(False, n))

    def discard(self, hashes: Sequence[str], tag: int = 0, /) -> list[str]:
        tag = _validate.index_batch(hashes, tag)
        if self._samplers and (sampler := self._samplers.get(tag)) is not None:
            sampler.removed(hashes, tag)
        keys = hashes if tag == 0 else list(zip(repeat(tag), hashes))
        results = list(map(self._od.pop, keys, repeat(_ABSENT)))
        return [h for h, r in zip(hashes, results) if r is not _ABSENT]

    def clear(self) -> None:
        for sampler in self._samplers.values():
            sampler.clear()
        self._od.clear()
        self._tagged = False

    def keys(self) -> list[str]:
        if not self._tagged:
            return list(self._od)  # type: ignore[arg-type]
        return [key if isinstance(key, str) else key[1] for key in self._od]

    def items(self) -> list[tuple[int, str]]:
        if not self._tagged:
            return list(zip(repeat(0), self._od))  # type: ignore[arg-type]
        return [(0, key) if isinstance(key, str) else key for key in self._od]

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, page_hash: object) -> bool:
        return isinstance(page_hash, str) and page_hash in self._od

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"<PyLruIndex entries={len(self._od)}>"


def _choice() -> str:
    choice = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if choice not in ("auto", "c", "python"):
        raise ValueError(f"{ENV_BACKEND} must be auto, c or python, got {choice!r}")
    return choice


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``hicache_existence.<name>`` (``core._lru``, ``accounting._ghosts``:
    where setup.py builds them), or ``None`` if the backend switch forbids it or it is not
    built (under ``c`` a missing build is an ImportError)."""
    choice = _choice()
    if choice == "python":
        return None
    try:
        return importlib.import_module(f"hicache_existence.{name}")
    except ImportError:
        if choice == "c":
            raise
        return None


def py_inflight_add(refs: dict[str, int], hashes: Sequence[str]) -> None:
    """One ref more per page of ``hashes`` (a checked list or tuple), in order."""
    get = refs.get
    for h in hashes:
        refs[h] = get(h, 0) + 1


def py_inflight_release(refs: dict[str, int], hashes: Sequence[str]) -> tuple[int, int]:
    """One ref less per page, in order (the last one drops the page):
    ``(released, unmatched)``, the pages that had a ref and those that had none."""
    released = unmatched = 0
    for h in hashes:
        n = refs.get(h)
        if n is None:
            unmatched += 1
            continue
        released += 1
        if n <= 1:
            del refs[h]
        else:
            refs[h] = n - 1
    return released, unmatched


#: The compiled module, where the backend switch allows it and it is built.
_compiled = compiled("core._lru")
#: The implementation the caches use, its sampler (the one ``attach`` takes:
#: ``Sampler(threshold, max_keys, half_life=0)``), and its name ("c" or "python").
LruIndex: Callable[[], LruIndexType] = PyLruIndex if _compiled is None else _compiled.LruIndex
Sampler: Callable[..., SamplerType] = PySampler if _compiled is None else _compiled.Sampler
BACKEND = "python" if _compiled is None else "c"

#: The caches' batch checks and in-flight refcounts, from the same build as the index
#: (a build from before them: the Python twins).  ``page_hashes`` is
#: ``_validate.page_hashes`` (same results and errors) with a list or tuple checked in
#: one C pass that reads no string's characters, where ``"".join`` copies them all.
page_hashes: Callable[..., Sequence[str]] = getattr(_compiled, "page_hashes", _validate.page_hashes)
inflight_add: Callable[[dict[str, int], Sequence[str]], None] = getattr(
    _compiled, "inflight_add", py_inflight_add
)
inflight_release: Callable[[dict[str, int], Sequence[str]], tuple[int, int]] = getattr(
    _compiled, "inflight_release", py_inflight_release
)

#: Bytes an entry costs at full cap (512K entries, CPython 3.11, tracemalloc, hash strings
#: excluded): the C index's 8-byte slot at <= 3/4 load plus its 24-byte node; an
#: ``OrderedDict`` entry.  For the memory estimate metric and sizing miss-reason memory.
BYTES_PER_ENTRY = 40.0 if BACKEND == "c" else 77.3


def c_type(name: str) -> Any:
    """``core._lru.<name>`` whatever the backend switch says, or ``None`` if it is not built."""
    try:
        module = importlib.import_module("hicache_existence.core._lru")
    except ImportError:
        return None
    return getattr(module, name, None)


def c_index() -> Callable[[], LruIndexType] | None:
    """The compiled implementation, or ``None`` when it is not built."""
    return c_type("LruIndex")  # type: ignore[no-any-return]


def sampler_class(index: LruIndexType) -> Callable[..., SamplerType]:
    """The sampler type ``index.attach`` takes (``PySampler`` or the compiled ``Sampler``)."""
    return PySampler if isinstance(index, PyLruIndex) else c_type("Sampler")
