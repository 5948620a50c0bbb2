"""Trace replay: what hit ratio and how many L3 writes would each cap give?

``trace`` reads and validates traces (Mooncake JSONL or the project's own page
format), ``pages`` turns Mooncake blocks into SGLang-shaped page-hash chains,
``mattson`` computes the exact belief-only hit-ratio curve in one pass, ``model``
replays the buffer-mode write path through the real cache classes (over ``l3``),
``fleet`` runs it as N instances, ``sweep`` runs a set of caps (over cores) and
``report`` prints and writes the results.  See docs/replay.md.
"""

from hicache_existence.replay.mattson import BeliefCurve, belief_only_curves
from hicache_existence.replay.model import ModelConfig, ModelResult, run_model
from hicache_existence.replay.pages import PageRequest, PageTrace, expand
from hicache_existence.replay.sweep import SweepResult, format_cap, parse_caps, sweep
from hicache_existence.replay.trace import Trace, TraceError, read_trace

__all__ = [
    "BeliefCurve",
    "ModelConfig",
    "ModelResult",
    "PageRequest",
    "PageTrace",
    "SweepResult",
    "Trace",
    "TraceError",
    "belief_only_curves",
    "expand",
    "format_cap",
    "parse_caps",
    "read_trace",
    "run_model",
    "sweep",
]
