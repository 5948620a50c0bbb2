"""``conformance.gaps``: the check that decides whether our existence cache may
stand in for the installed upstream's (the plugin keeps upstream's otherwise)."""

from __future__ import annotations

from typing import Any

from hicache_existence import FlatStorageExistenceCache, StorageExistenceCache
from hicache_existence.integrations.sglang import conformance


def test_ours_have_no_gap_against_themselves() -> None:
    assert conformance.gaps("current", StorageExistenceCache) == []
    assert conformance.gaps("flat", FlatStorageExistenceCache) == []


def test_a_new_public_method_on_the_cache_is_a_gap() -> None:
    class Grown(FlatStorageExistenceCache):
        def sweep(self) -> None: ...

        #: a public attribute, not a method: a gap too
        budget = 3

    assert conformance.gaps("flat", Grown) == ["Grown.budget", "Grown.sweep"]


def test_a_new_public_method_on_the_per_pool_beliefs_is_a_gap() -> None:
    """The current generation's ``pool()`` hands out per-pool objects the
    scheduler calls; their public names are compared too."""

    class Upstream:
        def __init__(self, max_entries: int = 8) -> None:
            self._mine = StorageExistenceCache(max_entries=max_entries)

        def pool(self, name: str) -> Any:
            return Beliefs(self._mine.pool(name))

        def clear(self) -> None: ...

        def clear_inflight(self) -> None: ...

    class Beliefs:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def add(self, hashes: Any) -> None: ...

        def settle_all(self) -> None: ...

    assert conformance.gaps("current", Upstream) == ["Beliefs.inner", "Beliefs.settle_all"]


def test_an_instance_attribute_set_by_upstreams_constructor_is_a_gap() -> None:
    class Upstream(FlatStorageExistenceCache):
        def __init__(self, max_entries: int = 8) -> None:
            super().__init__(max_entries=max_entries)
            self.generation_tag = "x"

    assert conformance.gaps("flat", Upstream) == ["Upstream.generation_tag"]


def test_a_parameter_ours_cannot_take_is_a_gap() -> None:
    class Upstream(FlatStorageExistenceCache):
        def add(self, pool: Any, hashes: Any, *, ttl: float = 0.0) -> None: ...  # type: ignore[override]

        def clear(self, pool: Any = None) -> None: ...  # type: ignore[override]

    found = conformance.gaps("flat", Upstream)
    assert "Upstream.add(ttl)" in found and "Upstream.clear(pool)" in found


def test_a_parameter_ours_requires_and_upstream_never_passes_is_a_gap() -> None:
    class Ours(FlatStorageExistenceCache):
        def clear(self, reason: str) -> None: ...  # type: ignore[override]

    assert conformance.gaps("flat", FlatStorageExistenceCache, Ours) == [
        "FlatStorageExistenceCache.clear(reason (required here only))"
    ]


def test_an_upstream_pool_that_fails_is_a_gap() -> None:
    class Upstream(StorageExistenceCache):
        def pool(self, name: str) -> Any:  # type: ignore[override]
            raise RuntimeError("a new signature")

    assert conformance.gaps("current", Upstream) == ["Upstream.pool('kv') (RuntimeError)"]
