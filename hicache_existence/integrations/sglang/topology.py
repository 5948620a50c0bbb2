"""Which ranks hold replicas of this cache, and the dedicated groups over them.

``UnifiedRadixCache.check_hicache_events`` MIN-reduces its queue sizes over the
attention-CP and attention-TP groups (or the TP group when neither spans more
than one rank) and, unless buffer mode runs with pipeline parallelism, hands the
result down the PP group: the ranks connected that way are the replicas whose
caches must be equal.

Every rank must call ``new_group`` for every set in the same order, yet knows
only its own groups.  So the first step all-gathers each rank's neighbours once
(over a temporary gloo group of the world); every rank computes the same
connected components and creates, for each, a gloo group for the divergence
checks and one for the reconciler's agreements (never the NCCL data group nor
sglang's CPU groups, whose collective order must stay untouched).  The groups do
not depend on a rank's own settings (whether any member reconciles rides the same
all-gather), so differently configured ranks still meet in the divergence
checker's start-up handshake, which reports the difference.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hicache_existence.reconcile.agreement import Agreement, GlooAgreement
from hicache_existence.replicas.divergence import (
    CheckGroup,
    GroupError,
    InProcessWorld,
    TorchGlooGroup,
)

logger = logging.getLogger("hicache_existence.integrations.sglang")


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except Exception:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _group_ranks(dist: Any, group: Any) -> list[int]:
    if group is None:
        return []
    try:
        if int(dist.get_world_size(group=group)) <= 1:
            return []
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:
        return []


def replica_neighbours(tree_cache: Any, dist: Any) -> set[int]:
    """Global ranks this rank's ``check_hicache_events`` reduces with (itself included),
    following ``UnifiedRadixCache._all_reduce`` / ``_all_reduce_attn_groups``."""
    me = int(dist.get_rank())
    out = {me}
    reduced = False
    for name in ("attn_cp_group", "attn_tp_group"):
        ranks = _group_ranks(dist, getattr(tree_cache, name, None))
        if ranks:
            out.update(ranks)
            reduced = True
    if not reduced and int(getattr(tree_cache, "tp_world_size", 1) or 1) > 1:
        out.update(_group_ranks(dist, getattr(tree_cache, "tp_group", None)))
    pp_size = int(getattr(tree_cache, "pp_size", 1) or 1)
    buffer_only = getattr(tree_cache, "host_memory_mode", "cache") == "buffer_only"
    if pp_size > 1 and not buffer_only:
        out.update(_group_ranks(dist, getattr(tree_cache, "pp_group", None)))
    return out


def components(adjacency: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Connected components of the undirected graph ``adjacency[i][j] != 0``,
    each sorted, in order of their smallest rank (the same on every rank)."""
    n = len(adjacency)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, row in enumerate(adjacency):
        for j, flag in enumerate(row[:n]):
            if flag:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return [tuple(groups[root]) for root in sorted(groups)]


@dataclass
class ReplicaGroups:
    """The dedicated groups of this rank's replica set."""

    members: tuple[int, ...]
    divergence: CheckGroup
    agreement: Agreement | None


def single(timeout_s: float) -> ReplicaGroups:
    """One replica: the checker compares with itself, verdicts need no agreement."""
    return ReplicaGroups((0,), InProcessWorld(1, timeout_s=timeout_s).group(0), None)


#: Base of the names our groups take in torch's group counter (``_private_names``).
_PRIVATE_BASE = 1 << 48
_private_next = 0


@contextlib.contextmanager
def _private_names() -> Any:
    """Name our groups outside torch's group counter and restore it after: a rank
    without the package (or one that declined) never calls ``build``, and every
    later default-synchronised ``new_group`` of sglang's (e.g. the storage sync
    groups of a runtime attach) must still find the same name on every rank."""
    global _private_next
    from torch.distributed import distributed_c10d as c10d

    world: Any = getattr(c10d, "_world", None)
    saved = getattr(world, "group_count", None)
    if not isinstance(saved, int):  # a torch without the counter: names as they come
        yield
        return
    world.group_count = _PRIVATE_BASE + _private_next
    try:
        yield
    finally:
        _private_next = world.group_count - _PRIVATE_BASE
        world.group_count = saved


def build(tree_cache: Any, timeout_s: float, *, agreement: bool) -> ReplicaGroups:
    """Create the groups (collective over the whole default group: every rank
    must call it at the same point, once, whatever its settings); ``agreement``:
    this rank reconciles, so it gets its set's agreement group."""
    dist = _dist()
    if dist is None or int(dist.get_world_size()) <= 1:
        return single(timeout_s)
    with _private_names():
        return _build(dist, tree_cache, timeout_s, agreement=agreement)


def _build(dist: Any, tree_cache: Any, timeout_s: float, *, agreement: bool) -> ReplicaGroups:
    import torch

    world = int(dist.get_world_size())
    me = int(dist.get_rank())
    timeout = timedelta(seconds=timeout_s)
    row = [0] * (world + 1)  # neighbours, then whether this rank reconciles
    for rank in replica_neighbours(tree_cache, dist):
        if 0 <= rank < world:
            row[rank] = 1
    row[world] = int(agreement)
    scratch = dist.new_group(backend="gloo", timeout=timeout)
    try:
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=scratch)
        gathered = [[int(v) for v in r.tolist()] for r in rows]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(scratch)
    own: ReplicaGroups | None = None
    # Every rank creates every multi-rank set's groups, in the same order.
    for part in components([r[:world] for r in gathered]):
        if len(part) < 2:
            continue
        group = TorchGlooGroup.create(part, timeout_s=timeout_s)
        agreement_group = (
            dist.new_group(ranks=list(part), backend="gloo", timeout=timeout)
            if any(gathered[rank][world] for rank in part)
            else None
        )
        if me in part and group is not None:
            with_agreement = agreement and agreement_group is not None
            own = ReplicaGroups(
                part, group, GlooAgreement(agreement_group) if with_agreement else None
            )
    return own if own is not None else single(timeout_s)


def unbuilt(timeout_s: float, reason: str) -> ReplicaGroups:
    """The groups of a rank whose replica groups could not be built (typically a
    peer without the package): the divergence checker records one failed handshake
    and stops, visibly, instead of comparing the rank with itself; reconciler
    verdicts stay local."""
    dist = _dist()
    me = int(dist.get_rank()) if dist is not None else 0
    return ReplicaGroups((me,), UnavailableGroup(me, timeout_s, reason), None)


class DeferredGroup:
    """A ``CheckGroup`` whose real group is set on the first step (the checker
    is built with the cache, before the groups can exist)."""

    def __init__(self, timeout_s: float) -> None:
        self.rank = 0
        self.size = 1
        self.ranks: tuple[int, ...] = (0,)
        self.timeout_s = float(timeout_s)
        self._target: CheckGroup | None = None

    def bind(self, group: CheckGroup) -> None:
        self._target = group
        self.rank, self.size, self.ranks = group.rank, group.size, tuple(group.ranks)

    def _group(self) -> CheckGroup:
        if self._target is None:
            self.bind(InProcessWorld(1, timeout_s=self.timeout_s).group(0))
        assert self._target is not None
        return self._target

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        return self._group().all_reduce_max(values)

    def all_gather(self, values: Sequence[int]) -> list[list[int]]:
        return self._group().all_gather(values)


class UnavailableGroup(DeferredGroup):
    """A ``CheckGroup`` that could not be built: every collective raises."""

    def __init__(self, rank: int, timeout_s: float, reason: str) -> None:
        super().__init__(timeout_s)
        self.ranks = (rank,)
        self._reason = reason

    def _group(self) -> CheckGroup:
        raise GroupError(f"the replica group could not be built: {self._reason}")


class DeferredAgreement:
    """An ``Agreement`` whose group is set on the first step; one rank until then."""

    def __init__(self) -> None:
        self._target: Agreement | None = None

    def bind(self, agreement: Agreement | None) -> None:
        self._target = agreement

    @property
    def world_size(self) -> int:
        return 1 if self._target is None else int(self._target.world_size)

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        if self._target is None:
            return list(values)
        return self._target.min_reduce(values)
