"""The backup thread's hooks: this rank's outcome, and the backends' own answers.

``_page_backup`` collects, during one storage write, which pages the file or
Mooncake backend said it already held, then hands the outcome to the scheduler.
"""

from __future__ import annotations

from typing import Any

from hicache_existence.integrations.sglang.cache_mode import pool_name
from hicache_existence.integrations.sglang.process import PROCESS
from hicache_existence.integrations.sglang.write_hooks.binding import (
    Hooked,
    Params,
    guard,
)
from hicache_existence.integrations.sglang.write_path import FEEDS


def _page_backup(p: Params) -> Hooked:
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
            try:
                feed.end_backup(controller, operation_of(a, kw), answers)
            except Exception as exc:
                feed.abandon_backup()
                feed.error(exc)

    return around_page_backup


def _file_set(p: Params) -> Hooked:
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


def _file_exists(p: Params) -> Hooked:
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


def _mooncake_batch_set_v1(p: Params) -> Hooked:
    keys_of = p["keys"]

    def around_mooncake_batch_set_v1(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore.batch_set_v1``: its pages are the next existence
        query's (it puts only the objects ``batch_is_exist`` misses)."""
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        if feed is None or answers is None:
            return original(backend, *a, **kw)
        try:
            answers.batch_pages = list(keys_of(a, kw))
        except Exception as exc:
            feed.error(exc)
        try:
            return original(backend, *a, **kw)
        finally:
            answers.batch_pages = None

    return around_mooncake_batch_set_v1


def _mooncake_batch_set_v2(p: Params) -> Hooked:
    def transfers_of(a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return a[0] if a else kw.get("transfers")

    def around_mooncake_batch_set_v2(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore.batch_set_v2`` (hybrid pools): its transfers' pages,
        pool by pool, are the next existence query's (``_batch_io_v2`` asks
        ``_batch_exist`` over every pool's objects, in transfer order, and puts only
        the missing ones)."""
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        if feed is None or answers is None:
            return original(backend, *a, **kw)
        try:
            spans = []
            for transfer in transfers_of(a, kw) or ():
                keys = list(transfer.keys or ())
                if keys:
                    _, per = backend._get_hybrid_page_component_keys(keys, transfer)
                    spans.append((pool_name(transfer.name), keys, int(per)))
            answers.batch_spans = spans
        except Exception as exc:
            feed.error(exc)
        try:
            return original(backend, *a, **kw)
        finally:
            answers.batch_spans = None

    return around_mooncake_batch_set_v2


def _mooncake_batch_exist(p: Params) -> Hooked:
    def around_mooncake_batch_exist(original: Hooked, backend: Any, *a: Any, **kw: Any) -> Any:
        """AROUND ``MooncakeStore._batch_exist``: a page existed when all of its
        objects did (objects are laid out page by page)."""
        answer = original(backend, *a, **kw)
        feed = FEEDS.get(PROCESS.pid)
        answers = feed.collecting() if feed is not None else None
        spans = answers.batch_spans if answers is not None else None
        if feed is not None and answers is not None and spans:
            # 0.5.23 asks once for every pool, 0.5.21 once per pool: this answer
            # covers the leading spans whose objects it has.
            rest = list(spans)
            answers.batch_spans = None

            def existed_v2() -> None:
                at = 0
                while rest and at + len(rest[0][1]) * rest[0][2] <= len(answer):
                    pool, keys, per = rest.pop(0)
                    for page in keys:
                        part = answer[at : at + per]
                        at += per
                        if per and all(int(s) == 1 for s in part):
                            answers.saw_page(pool, page)
                answers.batch_spans = rest or None

            guard(feed, existed_v2)
            return answer
        pages = answers.batch_pages if answers is not None else None
        if feed is not None and answers is not None and pages:
            answers.batch_pages = None  # only the write's own query

            def existed() -> None:
                per = len(answer) // len(pages)
                for i, page in enumerate(pages):
                    if per and all(int(s) == 1 for s in answer[i * per : (i + 1) * per]):
                        answers.saw_page("kv", page)

            guard(feed, existed)
        return answer

    return around_mooncake_batch_exist
