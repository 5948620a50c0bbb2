"""A synthetic long-context workload, for the advisor's accuracy checks and benchmarks.

Shaped like long-document serving (code repositories, books, long reports):
documents of 16K-128K tokens are chosen with Zipf popularity; a request either
opens a session on a document (the whole document, then a question) or continues
one of the recent sessions (its previous chain, the answer it got, a new
question), so chains are long, share long prefixes, and grow turn by turn.  Page
hashes are chained SHA-256 hex like SGLang's and deterministic in ``seed``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from hicache_existence.replay.pages import PageRequest, PageTrace, chained, chunk_ends


@dataclass(frozen=True)
class LongContextSpec:
    """Knobs of the workload (pages are 64 tokens, so 256..2048 pages = 16K..128K tokens)."""

    requests: int = 2000
    documents: int = 300
    doc_pages_min: int = 256
    doc_pages_max: int = 2048
    zipf_s: float = 1.1
    #: Probability that a request continues one of the recent sessions.
    follow_up: float = 0.5
    recent_sessions: int = 64
    question_pages: tuple[int, int] = (1, 8)
    answer_pages: tuple[int, int] = (2, 16)
    max_turns: int = 12
    node_pages: int = 8
    #: Milliseconds between requests.
    interval_ms: float = 250.0
    seed: int = 0


def long_context_requests(spec: LongContextSpec | None = None) -> list[PageRequest]:
    """The workload's requests, in arrival order, for pool ``kv``."""
    spec = spec or LongContextSpec()
    rng = random.Random(spec.seed)
    root = hashlib.sha256(f"long-context/{spec.seed}".encode()).digest()
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(spec.documents)]
    docs: dict[int, tuple[tuple[str, ...], bytes]] = {}
    # A session: (pages so far, last digest, turns so far).
    sessions: list[tuple[tuple[str, ...], bytes, int]] = []
    out: list[PageRequest] = []
    for number in range(spec.requests):
        tag = number.to_bytes(8, "little")
        live = sessions[-spec.recent_sessions :]
        if live and rng.random() < spec.follow_up:
            index = len(sessions) - len(live) + rng.randrange(len(live))
            pages, digest, turns = sessions[index]
            answer, digest = chained(digest, b"a" + tag, rng.randint(*spec.answer_pages))
            pages = pages + answer
        else:
            doc = rng.choices(range(spec.documents), weights)[0]
            if doc not in docs:
                length = int(
                    spec.doc_pages_min * (spec.doc_pages_max / spec.doc_pages_min) ** rng.random()
                )
                docs[doc] = chained(root, b"d" + doc.to_bytes(8, "little"), length)
            pages, digest = docs[doc]
            turns, index = 0, -1
        question, digest = chained(digest, b"q" + tag, rng.randint(*spec.question_pages))
        pages = pages + question
        turns += 1
        if index >= 0:
            sessions[index] = (pages, digest, turns)
            if turns >= spec.max_turns:
                sessions.pop(index)
        else:
            sessions.append((pages, digest, turns))
        out.append(
            PageRequest(
                number * spec.interval_ms, "kv", pages, chunk_ends(len(pages), spec.node_pages)
            )
        )
    return out


def long_context_trace(spec: LongContextSpec | None = None) -> PageTrace:
    """The workload as a ``PageTrace`` (64-token pages), ready for ``sweep`` or the benches."""
    spec = spec or LongContextSpec()
    requests = tuple(long_context_requests(spec))
    return PageTrace(f"synthetic-long-context(seed={spec.seed})", "pages", 64, requests)
