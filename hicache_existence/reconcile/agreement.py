"""Cross-rank agreement of reconciler verdicts: an element-wise MIN of a fixed-size
integer vector over every TP rank, as upstream does for prefetch hit counts.
``GlooAgreement`` runs it on a dedicated CPU (gloo) group, never the NCCL data
group, importing torch only when constructed; ``InProcessGroup``: threads (tests).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Agreement(Protocol):
    """A MIN all-reduce over the ranks that hold cache replicas."""

    @property
    def world_size(self) -> int: ...

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        """Element-wise MIN of ``values`` over every rank; every rank must call
        it the same number of times with vectors of the same length."""


class SingleRank:
    """The trivial agreement of one rank (no TP): the vector itself."""

    world_size = 1

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        return list(values)


class GlooAgreement:
    """MIN all-reduce over a torch.distributed gloo ``group`` created on every
    rank (``None``: the default group, which must then be gloo)."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        backend = dist.get_backend(group)
        if str(backend) != "gloo":
            raise ValueError(f"group must be a gloo (CPU) group, got backend {backend!r}")
        self._torch = torch
        self._dist = dist
        self._group = group
        self._size = dist.get_world_size(group)

    @classmethod
    def new_group(
        cls, ranks: Sequence[int] | None = None, timeout_s: float = 60.0
    ) -> GlooAgreement:
        """Create a dedicated gloo group (collective: call on every rank)."""
        from datetime import timedelta

        import torch.distributed as dist

        group = dist.new_group(
            ranks=list(ranks) if ranks is not None else None,
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
        )
        return cls(group)

    @property
    def world_size(self) -> int:
        return self._size

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        tensor = self._torch.tensor(list(values), dtype=self._torch.int64)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)
        return [int(x) for x in tensor.tolist()]


class InProcessGroup:
    """A MIN all-reduce among ``world_size`` threads of one process (tests)."""

    def __init__(self, world_size: int, timeout_s: float = 10.0) -> None:
        self.world_size = world_size
        self._timeout = timeout_s
        self._slots: list[list[int] | None] = [None] * world_size
        self._result: list[int] = []
        self._gather = threading.Barrier(world_size, action=self._reduce)
        self._leave = threading.Barrier(world_size)

    def _reduce(self) -> None:
        self._result = [min(col) for col in zip(*(v for v in self._slots if v is not None))]

    def member(self, rank: int) -> InProcessAgreement:
        return InProcessAgreement(self, rank)


@dataclass(frozen=True)
class InProcessAgreement:
    """One thread's handle on an ``InProcessGroup``."""

    group: InProcessGroup
    rank: int

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        g = self.group
        g._slots[self.rank] = list(values)
        g._gather.wait(g._timeout)
        result = list(g._result)
        g._leave.wait(g._timeout)
        return result
