"""The plugin inside the real sglang wheel: loaded by sglang's own
``load_plugins()``, hooks on the real classes, our cache built by a real
``UnifiedRadixCache``, the per-step hook run by the real
``check_hicache_events``; disabled, a missing target and an unknown API shape
leave sglang untouched."""

from __future__ import annotations

import json
import re

import pytest
from hx_harness import (
    EP_NAME,
    EP_VALUE,
    GROUP,
    Scenarios,
    installed_entry_point,
    installed_generation,
)

pytestmark = [pytest.mark.sglang]

CACHE_CLASS = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache.StorageExistenceCache"
STEP = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.check_hicache_events"
ADD = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM = "sglang.srt.server_args.ServerArgs.from_cli_args"
UPSTREAM_MODULE = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache"
PIPELINE = "sglang.srt.mem_cache.buffer_mode.pipeline.BufferModePipeline"
WRITE_BACKUP_STORAGE = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage"
)
WRITE_STORAGE = "sglang.srt.managers.cache_controller.HiCacheController.write_storage"
#: The installed wheel's cache generation (flat up to sglang 0.5.21, current from 0.5.22).
GENERATION = installed_generation()
OUR_CLASS = {
    "current": "hicache_existence.core.cache.StorageExistenceCache",
    "flat": "hicache_existence.core.flat.FlatStorageExistenceCache",
}[GENERATION]


def test_entry_point_is_declared() -> None:
    """The installed distribution declares the plugin's entry point (pyproject.toml)."""
    ep = installed_entry_point()
    assert ep is not None, (
        f'pyproject.toml lacks [project.entry-points."{GROUP}"] {EP_NAME} = "{EP_VALUE}" '
        "(or the environment was not reinstalled): sglang cannot find the plugin"
    )
    assert ep.value == EP_VALUE
    assert ep.dist is not None and ep.dist.name == "hicache-existence"


def test_load_plugins_registers_all_hooks_through_sglang(scenarios: Scenarios) -> None:
    """Enabled, sglang's load_plugins runs our entry point, which registers the
    REPLACE, AFTER and both AROUND hooks under the plugin's name."""
    r = scenarios.get("enabled").value()
    assert r["status"]["cache"] is True and r["status"]["generation"] == GENERATION
    assert r["warnings"] == []
    registry = r["registry"]
    assert registry[CACHE_CLASS] == [["replace", EP_NAME, registry[CACHE_CLASS][0][2]]]
    assert [h[0] for h in registry[STEP]] == ["after"]
    assert [h[0] for h in registry[ADD]] == ["around"]
    assert [h[0] for h in registry[FROM]] == ["around"]
    assert all(h[1] == EP_NAME for hooks in registry.values() for h in hooks)


def test_hooks_apply_to_the_real_classes(scenarios: Scenarios) -> None:
    """apply_hooks put our class in upstream's module and in unified_radix_cache's
    stale ``from ... import`` binding, and wrapped the real check_hicache_events."""
    identity = scenarios.get("enabled").value()["identity"]
    assert identity["class_module"] == "hicache_existence.integrations.sglang.hooks"
    assert identity["urc_binding_is_same"] is True
    assert identity["step_wrapped"] is True
    assert identity["step_qualname"] == "UnifiedRadixCache.check_hicache_events"


def test_unified_radix_cache_constructs_our_cache(scenarios: Scenarios) -> None:
    """A real UnifiedRadixCache's constructor gets the process runtime's cache,
    which upstream's (replaced) name recognises as an instance."""
    built = scenarios.get("enabled").value()["constructed"]
    assert built["cache"]["type"] == OUR_CLASS
    assert built["is_runtime_cache"] is True
    assert built["isinstance_upstream_name"] is True


def test_labels_come_from_the_running_scheduler(scenarios: Scenarios) -> None:
    """Deployment labels are read from sglang's published runtime context: the
    served model name, prefill engine type and the storage backend."""
    built = scenarios.get("enabled").value()["constructed"]
    assert built["labels"] == {
        "model_name": "org/model-7b",
        "engine_type": "prefill",
        "tp_rank": "0",
        "dp_rank": "0",
        "pp_rank": "0",
        "storage_backend": "file",
    }
    assert built["sources"][0] == "runtime_context"
    assert built["metrics_mode"] == "standalone"


def test_step_hook_runs_after_real_check_hicache_events(scenarios: Scenarios) -> None:
    """Seven real check_hicache_events calls are seven runtime steps; divergence
    checks are due every third step; metrics carry the labels."""
    stepped = scenarios.get("enabled").value()["stepped"]
    assert stepped["entry_steps"] == 7
    assert stepped["runtime_steps"] == 7
    assert stepped["checks"] == 2
    assert stepped["divergence_active"] is True
    assert stepped["members"] == [0]
    assert stepped["hits"] == [True, True, False]
    kv = stepped["cache_after"]["pools"]["kv"]
    assert (kv["entries"], kv["inserts"], kv["queries"], kv["query_hits"]) == (8, 8, 3, 2)
    (line,) = stepped["queries_samples"]
    assert 'engine_type="prefill"' in line and 'model_name="org/model-7b"' in line
    assert re.search(r"\} 3\.0$", line)
    (checks,) = stepped["checks_samples"]
    assert checks.endswith(" 2.0")


def test_second_cache_in_one_process_is_upstreams(scenarios: Scenarios) -> None:
    """Only the first existence cache of a process is observed; a second tree
    gets upstream's own class, and the reason is recorded."""
    second = scenarios.get("enabled").value()["second_tree"]
    assert second["cache_module"] == UPSTREAM_MODULE
    assert "second existence cache" in second["declined"]


def test_disabled_leaves_sglang_untouched(scenarios: Scenarios) -> None:
    """Installed but not enabled: no cache hook is registered, upstream's class
    and check_hicache_events are the originals, the tree builds upstream's cache."""
    r = scenarios.get("disabled").value()
    assert r["status"]["enabled"] is False and r["status"]["cache"] is False
    assert set(r["registry"]) == {ADD, FROM}
    assert r["identity"]["class_module"] == UPSTREAM_MODULE
    assert r["identity"]["urc_binding_is_same"] is True
    assert r["identity"]["step_wrapped"] is False
    assert r["cache_module"] == UPSTREAM_MODULE
    assert r["entry"] is False
    assert r["warnings"] == []


def test_disabled_parses_exactly_like_sglang_without_the_plugin(scenarios: Scenarios) -> None:
    """The parser hooks of a disabled plugin change nothing: the same argv gives
    the same ServerArgs as in a process where sglang did not load the plugin."""
    with_plugin = scenarios.get("disabled").value()
    without = scenarios.get("no_plugin").value()
    assert without["registry"] == {}
    assert without["status"] == {}
    assert with_plugin["parsed"]["repr"] == without["parsed"]["repr"]
    assert with_plugin["parsed"]["extras"] == without["parsed"]["extras"] == []
    assert with_plugin["identity"] == without["identity"]
    assert with_plugin["env_enabled"] is None


def test_missing_target_one_warning_and_untouched(scenarios: Scenarios) -> None:
    """Without check_hicache_events, exactly one warning names the target and the
    class is not replaced either (all or nothing)."""
    r = scenarios.get("missing_target").value()
    assert len(r["warnings"]) == 1
    assert STEP in r["warnings"][0] and "sglang runs unmodified" in r["warnings"][0]
    assert set(r["registry"]) == {ADD, FROM}
    assert r["class_module"] == r["upstream_class_module"] == UPSTREAM_MODULE
    assert r["entry"] is False
    assert r["status"]["cache"] is False


def test_unknown_api_shape_one_warning_and_untouched(scenarios: Scenarios) -> None:
    """An existence cache class of an unknown API shape: one warning, no cache
    hook, the class left as it was."""
    r = scenarios.get("unknown_shape").value()
    assert len(r["warnings"]) == 1 and "API this package does not know" in r["warnings"][0]
    assert set(r["registry"]) == {ADD, FROM}
    assert r["still_unknown"] is True


def test_an_upstream_method_ours_lacks_keeps_upstreams_class(scenarios: Scenarios) -> None:
    """A public method added upstream (and called by its scheduler) that our
    cache does not serve: one warning names it, no cache hook is registered, the
    tree's cache is upstream's and the call answers as upstream's does."""
    r = scenarios.get("upstream_grew").value()
    assert len(r["warnings"]) == 1, r["warnings"]
    assert "hx_future_sweep" in r["warnings"][0]
    assert "upstream's StorageExistenceCache stays" in r["warnings"][0]
    assert set(r["registry"]) == {ADD, FROM}
    assert r["class_module"] == UPSTREAM_MODULE and r["entry"] is False
    assert r["called"] == "upstream's" and r["status"]["cache"] is False


def test_a_removed_buffer_mode_method_leaves_cache_mode_counting(scenarios: Scenarios) -> None:
    """One buffer-mode pipeline method gone: one warning names it and the
    buffer-mode counters; the cache-mode write hooks and the cache stay."""
    r = scenarios.get("buffer_method_removed").value()
    named = [w for w in r["warnings"] if r["removed"] in w]
    assert len(named) == 1 and "buffer-mode write counters" in named[0], r["warnings"]
    hooked = set(r["status"]["write_hooks"])
    assert {WRITE_BACKUP_STORAGE, WRITE_STORAGE} <= hooked <= set(r["registry"])
    assert not any(t.startswith(PIPELINE) for t in hooked)
    assert r["status"]["cache"] is True and CACHE_CLASS in r["registry"]


def test_ours_serve_every_public_name_of_the_installed_upstream() -> None:
    """Every public name of the installed sglang's existence cache (and, on the
    current generation, of the per-pool beliefs its ``pool()`` returns) exists on
    ours, read straight from the wheel: a release that adds one fails here."""
    import sglang.srt.mem_cache.buffer_mode.storage_existence_cache as sec

    from hicache_existence.integrations.sglang import conformance

    upstream = sec.StorageExistenceCache
    ours = conformance.ours_for(GENERATION)
    pairs = [(upstream(max_entries=8), ours(max_entries=8))]
    if GENERATION == "current":
        pairs.append((pairs[0][0].pool("kv"), pairs[0][1].pool("kv")))
    for theirs, mine in pairs:
        public = {n for n in dir(theirs) if not n.startswith("_")}
        assert public, theirs
        assert public <= set(dir(mine)), public - set(dir(mine))
    assert conformance.gaps(GENERATION, upstream) == []


def test_the_installed_sglang_overlaps_nowhere_and_the_detector_reads_its_code() -> None:
    """sglang 0.5.21 and 0.5.23 neither deduplicate cache-mode writes nor emit
    EXTERNAL storage events (``upstream_overlap``), read from the real wheel; the
    detector does read the real functions (their code names are not empty), so a
    release whose write path consults the existence cache fails here first."""
    from hicache_existence.integrations.sglang import targets, upstream_overlap

    overlap = upstream_overlap.detect(targets.resolve)
    assert overlap == upstream_overlap.Overlap(), overlap
    read = 0
    for target in upstream_overlap.DEDUP_PATH:
        try:
            fn = targets.resolve(target)
        except targets.TargetMissing:
            continue
        names = upstream_overlap.code_names(fn)
        assert names, target
        read += 1
    assert read >= 1 if GENERATION == "flat" else read >= 2


def test_real_detokenizer_entry_gets_no_cache_hooks(scenarios: Scenarios) -> None:
    """sglang's own run_detokenizer_process loads the enabled plugin, which
    recognises the detokenizer by its real entry function and registers the
    parser hooks but no cache hooks (a renamed upstream entry fails this)."""
    r = scenarios.get("detokenizer").value()
    assert r["failed_after"] is not None  # the entry ran on past load_plugins()
    if installed_generation() == "flat":
        # sglang 0.5.19-0.5.21's detokenizer entry loads no plugins at all: the
        # plugin never runs there, so it cannot hook anything.
        assert r["status"] == {} and r["cache_hooked"] is False, r
        return
    assert r["status"]["enabled"] is True and r["status"]["flags"] is True
    assert r["status"]["skipped"] == "detokenizer"
    assert r["status"]["cache"] is False and r["cache_hooked"] is False
    assert r["role_here"] is None  # outside that entry, no role is detected


def test_logging_settings_configure_the_package_logger(scenarios: Scenarios) -> None:
    """HICACHE_EXISTENCE_LOGGING__LEVEL=debug and __JSON=1 set the package
    logger's level and JSON handler in the scheduler process, leave the root
    logger alone, and a debug event comes out as one JSON line on stderr."""
    outcome = scenarios.get("logging_settings")
    r = outcome.value()
    assert r["level"] == "DEBUG" and r["propagate"] is False
    assert r["handlers"] == ["_PackageHandler"] and r["root_unchanged"] is True
    lines = [json.loads(x) for x in outcome.stderr.splitlines() if x.startswith("{")]
    probe = [x for x in lines if x.get("event") == "hicache_existence.test_probe"]
    assert probe and probe[0]["level"] == "debug" and probe[0]["probe"] == 1
