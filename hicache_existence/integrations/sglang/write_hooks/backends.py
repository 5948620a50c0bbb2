"""The backup thread's hooks: this rank's outcome, and the backends' own answers.

``_page_backup`` collects, during one storage write, which pages the file or
Mooncake backend said it already held, then hands the outcome to the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_existence.integrations.sglang.cache_mode import pool_name
from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import (
    Hooked,
    Params,
    guard,
)
from hicache_existence.integrations.sglang.write_path import FEEDS


def page_backup(p: Params) -> Hooked:
    operation_of = p["operation"]

    def around_page_backup(original: Hooked, controller: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``_page_backup`` (backup thread): collect the backend's existence
        answers during the write, then hand this rank's outcome to the scheduler."""
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.begin_backup(controller) if feed is not None else None
        if feed is None or answers is None:
            return original(controller, *a, **kw)
        try:
            return original(controller, *a, **kw)
        finally:
            try:  # end_backup stops collecting first, whatever fails after
                feed.end_backup(controller, operation_of(a, kw), answers)
            except Exception as exc:
                feed.error(exc)

    return around_page_backup


def file_set(p: Params) -> Hooked:
    key_of = p["key"]

    def around_file_set(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``HiCacheFile.set``: it asks ``exists`` first and skips a stored page."""
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        key = key_of(a, kw)
        if answers is None or not isinstance(key, str):
            return original(backend, *a, **kw)
        answers.probe, answers.answer = key, None
        try:
            ok = original(backend, *a, **kw)
        finally:
            answers.probe = None
        if ok and answers.answer:
            answers.saw(key)
        return ok

    return around_file_set


def file_exists(p: Params) -> Hooked:
    key_of = p["key"]

    def around_file_exists(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``HiCacheFile.exists``: the answer ``set`` acts on."""
        answer = original(backend, *a, **kw)
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        if answers is not None and answers.probe is not None and key_of(a, kw) == answers.probe:
            answers.answer = bool(answer)
        return answer

    return around_file_exists


def _batch_set(
    spans_of: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any], name: str, doc: str
) -> Hooked:
    """An AROUND hook on a Mooncake ``batch_set``: ``spans_of`` gives its pages,
    (pool, pages, objects per page or ``None``: as many as the answer has per page),
    which are the next existence query's (it puts only the objects missing)."""

    def around_mooncake_batch_set(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        if feed is None or answers is None:
            return original(backend, *a, **kw)
        try:
            answers.batch_spans = spans_of(backend, a, kw) or None
        except Exception as exc:
            feed.error(exc)
        try:
            return original(backend, *a, **kw)
        finally:
            answers.batch_spans = None

    around_mooncake_batch_set.__name__ = around_mooncake_batch_set.__qualname__ = name
    around_mooncake_batch_set.__doc__ = doc
    return around_mooncake_batch_set


def mooncake_batch_set_v1(p: Params) -> Hooked:
    keys_at = p["keys"].index  # read inline: no frame per write

    def spans(backend: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        given: Any = a[keys_at] if 0 <= keys_at < len(a) else kw.get("keys")
        keys = list(given)
        return [("kv", keys, None)] if keys else None

    return _batch_set(
        spans,
        "around_mooncake_batch_set_v1",
        """AROUND ``MooncakeStore.batch_set_v1``: its pages are the next existence
        query's (it puts only the objects ``batch_is_exist`` misses).""",
    )


def mooncake_batch_set_v2(p: Params) -> Hooked:
    def spans(backend: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        out = []
        for transfer in (a[0] if a else kw.get("transfers")) or ():
            keys = list(transfer.keys or ())
            if keys:
                _, per = backend._get_hybrid_page_component_keys(keys, transfer)
                out.append((pool_name(transfer.name), keys, int(per)))
        return out

    return _batch_set(
        spans,
        "around_mooncake_batch_set_v2",
        """AROUND ``MooncakeStore.batch_set_v2`` (hybrid pools): its transfers' pages,
        pool by pool, are the next existence query's (``_batch_io_v2`` asks
        ``_batch_exist`` over every pool's objects, in transfer order, and puts only
        the missing ones).""",
    )


def mooncake_batch_exist(p: Params) -> Hooked:
    def around_mooncake_batch_exist(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore._batch_exist``: a page existed when all of its
        objects did (objects are laid out page by page)."""
        answer = original(backend, *a, **kw)
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        spans = answers.batch_spans if answers is not None else None
        if feed is None or answers is None or not spans:
            return answer
        # 0.5.23 asks once for every pool, 0.5.21 once per pool: this answer covers
        # the leading spans whose objects it has (batch_set_v1's: the whole answer).
        rest = list(spans)
        answers.batch_spans = None

        def existed() -> None:
            at = 0
            while rest:
                pool, keys, per = rest[0]
                if per is None:
                    per = len(answer) // len(keys)
                if at + len(keys) * per > len(answer):
                    break
                rest.pop(0)
                for page in keys:
                    part = answer[at : at + per]
                    at += per
                    if per and all(int(s) == 1 for s in part):
                        answers.saw_page(pool, page)
            answers.batch_spans = rest or None

        guard(feed, existed)
        return answer

    return around_mooncake_batch_exist
