"""A host memory mode whose write path could not be hooked exports no write
families (absent, never 0 while L3 is written), and the write path of the
controller every tree writes through (``HybridCacheController`` on sglang
0.5.21-0.5.23) is as required as ``HiCacheController``'s.

The real-server counterpart (a renamed method or parameter inside real sglang
0.5.23 servers, against SGLang's own counters) is ``tests/real_server/test_drift.py``.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_write_path import _any_target

import hicache_existence as he
from hicache_existence.accounting.writes import WriteAccounting
from hicache_existence.config import Config
from hicache_existence.exporters.catalog import CATALOG
from hicache_existence.exporters.multiprocess import MultiprocessFeeder
from hicache_existence.exporters.prometheus import PrometheusCollector
from hicache_existence.exporters.series import SeriesReader
from hicache_existence.integrations.sglang import write_hooks as wh
from hicache_existence.runtime import ExistenceRuntime

WRITE_FAMILIES = {spec.name for spec in CATALOG if spec.source == "writes"}
CACHE_FAMILIES = {spec.name for spec in CATALOG if spec.source == "cache"}


#: A stand-in target whose signature has every parameter a hook reads.
_target = _any_target


def _write_storage_param_renamed(
    self: Any, host_indices: Any, token_ids: Any, hash_values: Any = None, prefix_keys: Any = None
) -> None:
    """``write_storage`` with ``hash_value`` renamed."""


def _register(resolve: Any) -> tuple[list[str], list[str], set[str]]:
    got: list[str] = []
    said: list[str] = []
    off: set[str] = set()
    registry = NS(register=lambda target, fn, kind: got.append(target))
    done = wh.register(
        registry, NS(AROUND="AROUND", AFTER="AFTER"), "current", resolve, said.append, off=off
    )
    assert done == got
    return done, said, off


def test_a_changed_hybrid_write_storage_turns_cache_mode_off() -> None:
    """The controller every 0.5.21-0.5.23 tree writes L3 through renames a parameter
    of ``write_storage``: one warning names it and says cache mode's counters are off;
    no cache-mode hook is installed; buffer mode counts as before."""
    target = f"{wh.HYBRID_CONTROLLER}.write_storage"

    def resolve(name: str) -> object:
        return _write_storage_param_renamed if name == target else _target

    done, said, off = _register(resolve)
    assert off == {"cache"}
    assert len(said) == 1 and said[0].startswith(target), said
    assert "cache-mode write counters and dedup (cache-mode servers) are off" in said[0]
    assert not any(t.endswith((".write_storage", ".write_backup_storage")) for t in done)
    assert f"{wh.PIPELINE}._drop_queue_head" in done
    assert f"{wh.HYBRID_CONTROLLER}._page_backup" in done  # buffer mode reads the outcome


def test_a_missing_hybrid_page_backup_turns_both_modes_off() -> None:
    """Its ``_page_backup`` gives both modes this rank's outcome: gone, nothing is fed."""
    target = f"{wh.HYBRID_CONTROLLER}._page_backup"

    def resolve(name: str) -> object:
        if name == target:
            raise LookupError(name)
        return _target

    done, said, off = _register(resolve)
    assert done == [] and off == {"buffer", "cache"}
    assert len(said) == 1 and "buffer-mode write counters" in said[0] and "cache-mode" in said[0]


def test_an_sglang_without_the_hybrid_controller_class_skips_its_hooks_quietly() -> None:
    """An sglang without ``HybridCacheController`` at all (its trees write through
    ``HiCacheController``): no warning, both modes count."""

    def resolve(name: str) -> object:
        if name.startswith(wh.HYBRID_CONTROLLER):
            raise LookupError(name)
        return _target

    done, said, off = _register(resolve)
    assert said == [] and off == set()
    assert f"{wh.CONTROLLER}.write_storage" in done and f"{wh.CONTROLLER}._page_backup" in done
    assert not any(t.startswith(wh.HYBRID_CONTROLLER) for t in done)


def test_registration_with_everything_found_turns_nothing_off() -> None:
    done, said, off = _register(lambda name: _target)
    assert said == [] and off == set()
    assert {f"{wh.HYBRID_CONTROLLER}.write_storage", f"{wh.CONTROLLER}.write_storage"} <= set(done)


def _families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text) if f.samples}


def _written(writes: WriteAccounting) -> None:
    writes.written("kv", 4)
    writes.acked("kv", 4)


def test_without_write_families_no_exporter_shows_them() -> None:
    """``write_families=False``: the write families are on neither the standalone
    collector's page nor the multiprocess registry, even with writes counted; the
    cache's families are there as before. With the default they are all there."""
    cache = he.StorageExistenceCache(16)
    cache.pool("kv").add(["a" * 64])
    writes = WriteAccounting()
    _written(writes)
    for write_families in (True, False):
        reader = SeriesReader(cache, writes=writes, write_families=write_families)
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(reader))
        standalone = _families(generate_latest(registry).decode())
        mp_registry = CollectorRegistry()
        feeder = MultiprocessFeeder(reader, registry=mp_registry)
        feeder.flush(force=True)
        multiprocess = _families(generate_latest(mp_registry).decode())
        for shown in (standalone, multiprocess):
            assert shown >= CACHE_FAMILIES
            if write_families:
                assert shown >= WRITE_FAMILIES
            else:
                assert not WRITE_FAMILIES & shown, WRITE_FAMILIES & shown
        sampled = set(reader.sample()) & WRITE_FAMILIES
        assert sampled == (WRITE_FAMILIES if write_families else set())


def test_a_runtime_that_does_not_count_writes_exports_no_write_family() -> None:
    config = Config.from_env({"HICACHE_EXISTENCE_METRICS__MODE": "off"})
    on = ExistenceRuntime(config)
    off = ExistenceRuntime(config, count_writes=False)
    assert set(on.telemetry.series_reader.sample()) >= WRITE_FAMILIES
    assert not WRITE_FAMILIES & set(off.telemetry.series_reader.sample())
    assert set(off.telemetry.series_reader.sample()) >= CACHE_FAMILIES
