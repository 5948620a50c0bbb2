"""Heal policies: how a storage verdict corrects one pool's beliefs.

Upstream's ``PoolBeliefPolicy`` contract, so sglang code calling a policy on our
``PoolBeliefs`` behaves identically.  The verdict inputs (``hit_pages``, ``evidence``)
are already MIN-reduced across TP ranks by the caller: that keeps replicas identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hicache_existence.core import _validate, lru


class _Beliefs(Protocol):
    def add(self, hashes: Sequence[str]) -> None: ...

    def invalidate_beyond(self, hashes: Sequence[str], keep_pages: int) -> None: ...


class PoolBeliefPolicy:
    """How a pool's keys sit on a node's page-hash chain, hence how a rank-agreed
    hit-query boundary or a transfer's delivered page count heals its beliefs."""

    def heal_from_query(
        self,
        beliefs: _Beliefs,
        chain: Sequence[str],
        keys: Sequence[str],
        hit_pages: int,
        *,
        evidence: bool,
    ) -> None:
        raise NotImplementedError

    def heal_from_transfer(
        self, beliefs: _Beliefs, keys: Sequence[str], delivered_pages: int
    ) -> None:
        """A transfer delivered only ``delivered_pages``: the rest is not stored."""
        delivered = _validate.count(delivered_pages, "delivered_pages")
        beliefs.invalidate_beyond(lru.page_hashes(keys, "keys"), delivered)


class ChainPagesPolicy(PoolBeliefPolicy):
    """One key per chain page (ALL_PAGES): every rank verified the chain up to the agreed
    boundary, so beyond it is invalidated and, with evidence, up to it is learnt."""

    def heal_from_query(
        self,
        beliefs: _Beliefs,
        chain: Sequence[str],
        keys: Sequence[str],
        hit_pages: int,
        *,
        evidence: bool,
    ) -> None:
        # Validate first: a policy either heals completely or changes nothing.
        hit = _validate.count(hit_pages, "hit_pages")
        pages = lru.page_hashes(chain, "chain")
        beliefs.invalidate_beyond(pages, hit)
        if evidence:
            beliefs.add(pages[:hit])


class TrailingWindowPolicy(PoolBeliefPolicy):
    """A trailing window of the chain (TRAILING_PAGES, e.g. SWA, Mamba): a rank verified only
    the window at its own boundary, so queries only invalidate; acks and fills teach presence."""

    def heal_from_query(
        self,
        beliefs: _Beliefs,
        chain: Sequence[str],
        keys: Sequence[str],
        hit_pages: int,
        *,
        evidence: bool,
    ) -> None:
        hit = _validate.count(hit_pages, "hit_pages")
        beliefs.invalidate_beyond(lru.page_hashes(chain, "chain"), hit)


def default_belief_policy(hit_policy: object) -> PoolBeliefPolicy:
    """Built-in policy for an unclaimed pool: trailing-window pools only invalidate, others
    heal as chain pages.  ``hit_policy``: sglang's ``PoolHitPolicy`` (str enum) or value."""
    if hit_policy == "trailing_pages":
        return TrailingWindowPolicy()
    return ChainPagesPolicy()
