"""Fast tests of the integration's own logic, without sglang: API-shape
detection, replica partitions, labels, the parser hooks, the replacement
class and the per-step hook on stand-in objects."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import pytest

from hicache_existence.config import Config
from hicache_existence.core.cache import StorageExistenceCache
from hicache_existence.core.flat import FlatStorageExistenceCache
from hicache_existence.integrations.sglang import flags, hooks, plugin
from hicache_existence.integrations.sglang.facts import SchedulerFacts, engine_type_of
from hicache_existence.integrations.sglang.targets import detect_generation
from hicache_existence.integrations.sglang.topology import (
    DeferredAgreement,
    DeferredGroup,
    components,
)


class _FlatShape:
    def add(self, pool: str, hashes: Any) -> None: ...
    def contains(self, pool: str, h: str) -> bool: ...
    def contains_all(self, pool: str, hashes: Any) -> bool: ...
    def covers_all(self, pool: str, hashes: Any, extra_cover: Any = frozenset()) -> bool: ...
    def invalidate_beyond(self, pool: str, hashes: Any, keep_pages: int) -> None: ...


def test_generation_is_detected_by_api_shape() -> None:
    """pool()+clear_inflight() is the current API, add(pool, hashes) & co the flat
    one; anything else (or a non-class) is unknown."""
    assert detect_generation(StorageExistenceCache) == "current"
    assert detect_generation(FlatStorageExistenceCache) == "flat"
    assert detect_generation(_FlatShape) == "flat"
    assert detect_generation(type("Other", (), {"add": lambda self, h: None})) is None
    assert detect_generation(StorageExistenceCache()) is None


def test_replica_components_are_the_same_on_every_rank() -> None:
    """Neighbour rows -> connected components in smallest-rank order: TP pairs
    stay apart, a PP link joins them, an isolated rank is its own set."""
    tp_pairs = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert components(tp_pairs) == [(0, 1), (2, 3)]
    with_pp = [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]]
    assert components(with_pp) == [(0, 1, 2, 3)]
    assert components([[1, 0], [0, 1]]) == [(0,), (1,)]
    one_sided = [[1, 0, 1], [0, 1, 0], [0, 0, 1]]  # 0 lists 2, 2 does not list 0
    assert components(one_sided) == [(0, 2), (1,)]


def test_deferred_group_and_agreement_before_and_after_binding() -> None:
    """Before the first step both act as one rank; bound, they delegate."""
    group = DeferredGroup(timeout_s=1.0)
    assert group.all_reduce_max([3, -3]) == [3, -3]
    assert (group.rank, group.size, group.ranks) == (0, 1, (0,))
    agreement = DeferredAgreement()
    assert agreement.world_size == 1 and agreement.min_reduce([4, 5]) == [4, 5]

    class Two:
        world_size = 2

        def min_reduce(self, values: Any) -> list[int]:
            return [min(v, 1) for v in values]

    agreement.bind(Two())
    assert agreement.world_size == 2 and agreement.min_reduce([4, 0]) == [1, 0]


@pytest.mark.parametrize("size", [1, 2])
def test_the_digest_observes_until_the_deferred_group_is_known(size: int) -> None:
    """SGLang's runtime is built with a ``DeferredGroup`` (size 1 until the first
    step binds the real group): the digest must observe from the start, or a TP
    group's checks would compare empty digests and never see a divergence; once
    bound, a world of one drops it (its checks are ok without one)."""
    from hicache_existence.replicas.divergence import InProcessWorld
    from hicache_existence.runtime import ExistenceRuntime

    group = DeferredGroup(timeout_s=1.0)
    runtime = ExistenceRuntime(Config.from_mapping({"enabled": True}), group=group)
    try:
        assert runtime.digest in runtime.tee.observers
        group.bind(InProcessWorld(size).group(0))
        runtime.group_bound()
        assert (runtime.digest in runtime.tee.observers) is (size > 1)
    finally:
        runtime.close()


def test_engine_type_follows_sglangs_mapping() -> None:
    """prefill/decode pass through (str or str enum), anything else is unified,
    PD role switching is dynamic (sglang's own metric labels)."""

    class Mode:
        value = "decode"

    assert engine_type_of("prefill") == "prefill"
    assert engine_type_of(Mode()) == "decode"
    assert engine_type_of("null") == "unified"
    assert engine_type_of("prefill", True) == "dynamic"


def test_labels_are_bounded_and_configuration_wins() -> None:
    """A long served model name keeps its last 128 characters, control characters
    are dropped, and configured model/storage names replace the scheduler's."""
    facts = SchedulerFacts(model_name="x" * 200 + "\x07end", storage_backend="file", tp_rank=3)
    labels = facts.labels()
    assert len(labels.model_name) == 128 and labels.model_name.endswith("end")
    assert "\x07" not in labels.model_name and labels.tp_rank == 3
    assert facts.labels("m", "mooncake").as_dict()["storage_backend"] == "mooncake"
    assert SchedulerFacts(tp_rank=1, tp_size=4, pp_rank=1, pp_size=2, dp_rank=1).process_index == 13


def test_buffer_mode_needs_hierarchical_cache_and_buffer_only() -> None:
    """Buffer mode is known off without HiCache or in cache mode, unknown when
    unreadable."""
    assert (
        SchedulerFacts(hierarchical_cache=False, host_memory_mode="buffer_only").buffer_mode
        is False
    )
    assert SchedulerFacts(host_memory_mode="cache").buffer_mode is False
    assert SchedulerFacts(host_memory_mode="buffer_only").buffer_mode is True
    assert SchedulerFacts().buffer_mode is None


def test_cache_mode_is_read_from_the_facts() -> None:
    """Cache mode needs HiCache (not known off) and host memory mode ``cache``."""
    assert SchedulerFacts(host_memory_mode="cache").cache_mode is True
    assert SchedulerFacts(host_memory_mode="cache", hierarchical_cache=False).cache_mode is False
    assert SchedulerFacts(host_memory_mode="buffer_only").cache_mode is False
    assert SchedulerFacts().cache_mode is False


@pytest.mark.parametrize(
    ("facts", "dedup", "effective", "warning"),
    [
        (SchedulerFacts(host_memory_mode="cache", storage_backend="file"), True, True, None),
        (SchedulerFacts(host_memory_mode="cache", storage_backend="file"), False, False, None),
        (SchedulerFacts(host_memory_mode="cache"), True, False, "without an L3 storage backend"),
        (
            SchedulerFacts(host_memory_mode="buffer_only", storage_backend="file"),
            True,
            False,
            "host memory mode 'buffer_only'",
        ),
    ],
)
def test_dedup_acts_in_cache_mode_with_a_backend_and_warns_once_elsewhere(
    facts: SchedulerFacts,
    dedup: bool,
    effective: bool,
    warning: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """cache_mode.dedup applies only in cache mode with an L3 backend; set where
    it cannot act it gives one warning naming the key (the server runs on)."""
    config = Config.from_mapping({"cache_mode": {"dedup": dedup}})
    assert hooks.dedup_effective(config, facts) is effective
    with caplog.at_level(logging.WARNING, logger="hicache_existence"):
        hooks._warn_dedup_misplaced(config, facts)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and "cache_mode.dedup" in messages[0], messages
        assert warning in messages[0], messages


# -- the parser hooks ----------------------------------------------------------------
def test_flags_are_added_once_and_a_clash_is_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    """Our flags join a parser; if one already exists, ours is not added (argparse
    would fail every launch) and one warning says so."""
    parser = argparse.ArgumentParser()
    assert flags.add_arguments(parser) == [flags.ENABLE_FLAG, flags.CONFIG_FLAG]
    ns = parser.parse_args([flags.ENABLE_FLAG, flags.CONFIG_FLAG, '{"cache": {"max_entries": 9}}'])
    assert flags.values_of_namespace(ns) == flags.FlagValues(True, '{"cache":{"max_entries":9}}')

    clash = argparse.ArgumentParser()
    clash.add_argument(flags.ENABLE_FLAG, action="store_true")
    with caplog.at_level(logging.WARNING, logger="hicache_existence.integrations.sglang"):
        assert flags.add_arguments(clash) == [flags.CONFIG_FLAG]
    assert len(caplog.records) == 1 and flags.ENABLE_FLAG in caplog.records[0].getMessage()


def test_config_flag_rejects_bad_values_naming_the_problem(tmp_path: Any) -> None:
    """Empty, broken JSON, a non-object, an unknown key and a missing file are
    usage errors; a file and @file are read once."""
    for value, needle in (
        ("", "expected JSON"),
        ("{oops", "not valid JSON"),
        ("[1]", "neither JSON nor a readable file"),
        ('{"nope": 1}', "unknown configuration key"),
        (str(tmp_path / "missing.json"), "neither JSON nor a readable file"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            flags.read_config_text(value)
    path = tmp_path / "c.json"
    path.write_text('{"metrics": {"port": 1234}}')
    assert flags.read_config_text(str(path)) == '{"metrics":{"port":1234}}'
    assert flags.read_config_text(f"@{path}") == '{"metrics":{"port":1234}}'


class _Record:
    """Stands in for sglang's ServerArgs (accepts bookkeeping attributes)."""


def test_from_cli_args_hook_attaches_values_and_switches_env(monkeypatch: Any) -> None:
    """Given the flags, the record carries them and the environment gets the
    switch; without them the record and the environment are left alone."""
    monkeypatch.delenv(flags.ENV_ENABLED, raising=False)
    record = _Record()
    ns = argparse.Namespace(
        enable_hicache_existence=True, hicache_existence_config='{"cache":{"max_entries":3}}'
    )
    assert flags.around_from_cli_args(lambda cls, n: record, object, ns) is record
    assert flags.stored_values(record) == flags.FlagValues(True, '{"cache":{"max_entries":3}}')
    assert os.environ[flags.ENV_ENABLED] == "1"

    monkeypatch.delenv(flags.ENV_ENABLED)
    plain = _Record()
    flags.around_from_cli_args(lambda cls, n: plain, object, argparse.Namespace())
    assert flags.stored_values(plain) is None and flags.ENV_ENABLED not in os.environ


def test_explicit_enable_with_invalid_environment_stops_the_launch(monkeypatch: Any) -> None:
    """--enable-hicache-existence with an invalid HICACHE_EXISTENCE_* value exits
    with a message naming the flag and the key, instead of starting without it."""
    monkeypatch.setenv("HICACHE_EXISTENCE_DIVERGENCE__POLICY", "sometimes")
    ns = argparse.Namespace(enable_hicache_existence=True, hicache_existence_config=None)
    expected = r"--enable-hicache-existence: invalid .*divergence\.policy"
    with pytest.raises(SystemExit, match=expected):
        flags.around_from_cli_args(lambda cls, n: _Record(), object, ns)


# -- the replacement class and the per-step hook --------------------------------------
class _Upstream:
    """Stands in for upstream's StorageExistenceCache."""

    def __init__(self, max_entries: int = 7) -> None:
        self.max_entries = max_entries


class _Tree:
    def __init__(self, cache: Any) -> None:
        self.storage_existence_cache = cache


@pytest.fixture
def clean_process(monkeypatch: Any) -> Any:
    for key in list(os.environ):
        if key.startswith("HICACHE_EXISTENCE_") and not key.startswith("HICACHE_EXISTENCE_REQUIRE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HICACHE_EXISTENCE_METRICS__MODE", "off")
    hooks.reset_for_tests()
    yield
    hooks.reset_for_tests()


def test_replacement_returns_upstream_instance_when_disabled(clean_process: Any) -> None:
    """Disabled by the configuration, construction gives upstream's own object."""
    cls = hooks.replacement_class("current", _Upstream)
    obj = cls(5)
    assert type(obj) is _Upstream and obj.max_entries == 5
    assert isinstance(obj, cls) and hooks.current() is None
    assert hooks.declined() == "disabled by the configuration"


def test_replacement_builds_runtime_and_hook_steps_it(clean_process: Any, monkeypatch: Any) -> None:
    """Enabled, construction returns the process runtime's wired cache (an
    instance of the replacement and of our generation's class); the AFTER hook
    steps it only for the tree that holds it."""
    monkeypatch.setenv("HICACHE_EXISTENCE_ENABLED", "1")
    monkeypatch.setenv("HICACHE_EXISTENCE_DIVERGENCE__INTERVAL_STEPS", "2")
    cls = hooks.replacement_class("current", _Upstream)
    assert issubclass(cls, StorageExistenceCache) and issubclass(_Upstream, cls)
    cache = cls()
    entry = hooks.current()
    assert entry is not None and cache is entry.runtime.cache
    assert type(cache) is StorageExistenceCache and isinstance(cache, cls)
    assert hooks.after_check_hicache_events(None, _Tree(cache)) is None
    hooks.after_check_hicache_events(None, _Tree(cache))
    hooks.after_check_hicache_events(None, _Tree(_Upstream()))  # another tree: ignored
    assert entry.steps == 2 and entry.runtime.steps == 2
    assert entry.runtime.checker is not None and entry.runtime.checker.stats().checks == 1
    assert type(cls()) is _Upstream  # a second cache in the process


def test_step_hook_binds_its_tree_and_a_forked_child_steps_nothing(
    clean_process: Any, monkeypatch: Any
) -> None:
    """After its first step the hook steps the bound tree's runtime directly (no
    registry lookup); a forked child, holding copies of the same objects, drops
    the binding and steps nothing of its parent's."""
    monkeypatch.setenv("HICACHE_EXISTENCE_ENABLED", "1")
    cache = hooks.replacement_class("current", _Upstream)()
    entry = hooks.current()
    assert entry is not None
    tree = _Tree(cache)
    for _ in range(3):
        hooks.after_check_hicache_events(None, tree)
    assert entry.runtime.steps == 3
    assert hooks._HOOK.tree is tree and hooks._HOOK.step is entry.runtime.tick
    hooks.after_check_hicache_events(None, _Tree(_Upstream()))  # a foreign tree
    assert entry.runtime.steps == 3
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            hooks.after_check_hicache_events(None, tree)
            ok = hooks._HOOK.tree is None and entry.runtime.steps == 3
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    hooks.after_check_hicache_events(None, tree)
    assert entry.runtime.steps == 4


def test_replacement_flat_generation_honours_explicit_max_entries(
    clean_process: Any, monkeypatch: Any
) -> None:
    """The flat generation builds a FlatStorageExistenceCache; an explicit
    max_entries from the call site is applied."""
    monkeypatch.setenv("HICACHE_EXISTENCE_ENABLED", "1")
    cache = hooks.replacement_class("flat", _FlatShape)(max_entries=321)
    assert type(cache) is FlatStorageExistenceCache and cache.max_entries == 321


def test_setup_failure_falls_back_to_upstream(clean_process: Any, monkeypatch: Any) -> None:
    """If building the runtime fails, the scheduler still gets upstream's cache."""
    monkeypatch.setenv("HICACHE_EXISTENCE_ENABLED", "1")

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("no")

    monkeypatch.setattr(hooks, "build_entry", boom)
    assert type(hooks.replacement_class("current", _Upstream)()) is _Upstream
    assert "setting up failed" in (hooks.declined() or "")


def test_plugin_without_hook_registry_warns_once(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An sglang without sglang.srt.plugins: one warning, nothing registered,
    and register() never raises."""
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", None)
    monkeypatch.setattr(plugin, "_DONE", {})
    with caplog.at_level(logging.WARNING, logger="hicache_existence.integrations.sglang"):
        plugin.register()
        plugin.register()  # idempotent
    assert len(caplog.records) == 1 and "no plugin hook registry" in caplog.records[0].getMessage()
    assert plugin.status()["flags"] is False and plugin.status()["cache"] is False


def test_a_rank_past_port_65535_binds_a_free_port_not_rank_0s() -> None:
    """metrics.port + index past 65535: that process binds an ephemeral port (port
    0, named in its start-up line), never the base port rank 0 holds."""
    import dataclasses

    from hicache_existence.config import Config
    from hicache_existence.integrations.sglang.hooks import _per_rank_port

    cfg = Config()
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, port=65535))
    assert _per_rank_port(cfg, SchedulerFacts(tp_rank=0, tp_size=2)).metrics.port == 65535
    assert _per_rank_port(cfg, SchedulerFacts(tp_rank=1, tp_size=2)).metrics.port == 0
