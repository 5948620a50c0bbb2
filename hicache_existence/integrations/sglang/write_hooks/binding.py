"""How a write-path hook is declared and bound, and what the hooks share.

``Params.bind`` finds each parameter a ``Hook`` reads in the target's own
signature, so no hook guesses upstream's argument positions.  ``guard``,
``bracketed`` and ``read_then_account`` are the error guard and the two AROUND
shapes (a begin/end bracket; a read before upstream's call, accounted after it)
with the prelude (this process's ``WritePath``, ownership) written once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from hicache_existence.integrations.sglang import targets
from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_path import FEEDS, WritePath

Kind = Literal["AROUND", "AFTER"]
Hooked = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Param:
    """One named parameter of an upstream method, read from a hook's ``(args,
    kwargs)`` (``self`` excluded) at the position the target's signature gives it."""

    #: The index of an optional parameter the target does not have.
    ABSENT: ClassVar[int] = 1 << 30

    name: str
    #: Position among the positional arguments after ``self``; -1: keyword-only.
    index: int

    def __call__(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], default: Any = None
    ) -> Any:
        i = self.index
        if 0 <= i < len(args):
            return args[i]
        return kwargs.get(self.name, default)


class Params(dict[str, Param]):
    """The named parameters one hook reads, bound to its target's signature
    (``"name?"``: optional, reads as ``None`` where the signature lacks it)."""

    @classmethod
    def bind(cls, target: object, names: tuple[str, ...]) -> Params:
        """Where each of ``names`` sits in ``target``'s signature (``LookupError``
        naming a required parameter it lacks)."""
        fn = targets.original_of(target)
        try:
            signature = inspect.signature(fn)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise LookupError(f"no signature for {target!r}: {exc}") from None
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = list(signature.parameters.values())
        if params and params[0].name in ("self", "cls"):
            params = params[1:]
        where: dict[str, int] = {}
        for i, p in enumerate(params):
            if p.kind in positional:
                where[p.name] = i
            elif p.kind is inspect.Parameter.KEYWORD_ONLY:
                where[p.name] = -1
        found: dict[str, Param] = {}
        for raw in names:
            name = raw.rstrip("?")
            if name in where:
                found[name] = Param(name, where[name])
            elif name == raw:
                raise LookupError(f"{getattr(fn, '__qualname__', fn)} has no parameter {name!r}")
            else:  # optional: never in the call, always the default
                found[name] = Param(name, Param.ABSENT)
        return cls(found)


Mode = Literal["buffer", "cache"]
BUFFER: frozenset[Mode] = frozenset({"buffer"})
CACHE: frozenset[Mode] = frozenset({"cache"})
MODES: frozenset[Mode] = BUFFER | CACHE

#: What stops being counted, per host memory mode, when that mode loses a required hook.
MODE_COUNTERS: Mapping[Mode, str] = {
    "buffer": "buffer-mode write counters (buffer_only servers) are off",
    "cache": "cache-mode write counters and dedup (cache-mode servers) are off",
}


@dataclass(frozen=True)
class Hook:
    """One hook of the write path."""

    #: Dotted path of the upstream callable (what ``HookRegistry`` patches).
    target: str
    kind: Kind
    #: Factory of the installed callable, given the target's bound parameters.
    build: Callable[[Params], Hooked]
    #: API generations it serves (``current``: 0.5.22+, ``flat``: 0.5.19-0.5.21).
    generations: frozenset[str]
    #: Upstream parameters the hook reads (``"name?"``: may be absent).
    params: tuple[str, ...] = ()
    #: Host memory modes whose accounting is wrong without it: if missing, that
    #: mode's hooks are off (counters absent, never wrong), not the other's.
    required: frozenset[Mode] = frozenset()
    #: What is not counted when this (optional) hook is missing.
    loses: str = ""
    #: Host memory modes it feeds: installed while one of them has all its required hooks.
    serves: frozenset[Mode] = MODES
    #: A class (dotted) the hook needs: without it, skipped with a debug line only.
    only_with: str = ""
    #: Checked at registration like any other, but installed on one object only,
    #: where that object's tree needs it (``write_hooks.install_on``), not on the class.
    per_instance: bool = False

    def bound(self, target: object) -> Hooked:
        """The callable to install on ``target`` (raises ``LookupError`` when its
        signature lacks a parameter the hook reads)."""
        return self.build(Params.bind(target, self.params))


def guard(feed: WritePath, fn: Callable[[], None]) -> None:
    """Run ``fn``; a failure is counted (``WritePath.error``), never raised."""
    try:
        fn()
    except Exception as exc:  # accounting never raises into the scheduler
        feed.error(exc)


#: What ``bracketed``'s ``enter`` returns for a call that is not ours.
SKIP = object()


def bracketed(
    enter: Callable[[WritePath, Any, tuple[Any, ...], dict[str, Any]], Any],
    leave: Callable[[WritePath, Any], None],
    name: str,
    doc: str,
) -> Hooked:
    """An AROUND hook that brackets upstream's call: ``enter(feed, owner, a, kw)``
    (``SKIP``: not ours, upstream runs alone) before it, ``leave(feed, token)``
    after it, even when upstream raises.  Upstream is called exactly once."""

    def around(original: Hooked, owner: Any, *a: Any, **kw: Any) -> Any:
        feed = FEEDS.get(PROCESS.pid)
        token = SKIP if feed is None else enter(feed, owner, a, kw)
        if token is SKIP:
            return original(owner, *a, **kw)
        assert feed is not None
        try:
            return original(owner, *a, **kw)
        finally:
            leave(feed, token)

    around.__name__ = around.__qualname__ = name
    around.__doc__ = doc
    return around


def read_then_account(
    tree_attr: str | None,
    read: Callable[[WritePath, Any, tuple[Any, ...], dict[str, Any]], Any],
    account: Callable[..., None],
    name: str,
    doc: str,
) -> Hooked:
    """An AROUND hook for a call that consumes what it is about, when the owner (or
    its ``tree_attr``) holds this process's cache: ``read(feed, owner, a, kw)``
    before upstream's call (``None``: nothing to account), ``account(feed, *read)``
    after it; failures counted, never raised; no helper frames around the two."""

    def around(original: Hooked, owner: Any, *a: Any, **kw: Any) -> Any:
        feed = FEEDS.get(PROCESS.pid)
        tree = owner if tree_attr is None else getattr(owner, tree_attr, None)
        if feed is None or getattr(tree, "storage_existence_cache", None) is not feed.cache:
            return original(owner, *a, **kw)
        seen = None
        try:
            seen = read(feed, owner, a, kw)
        except Exception as exc:  # accounting never raises into the scheduler
            feed.error(exc)
        result = original(owner, *a, **kw)
        if seen is not None:
            try:
                account(feed, *seen)
            except Exception as exc:
                feed.error(exc)
        return result

    around.__name__ = around.__qualname__ = name
    around.__doc__ = doc
    return around
