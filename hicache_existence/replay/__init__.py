"""Trace replay: what hit ratio and how many L3 writes would each cap give?

``trace`` reads and validates traces (Mooncake JSONL or the project's own page
format), ``pages`` turns Mooncake blocks into SGLang-shaped page-hash chains,
``mattson`` computes the exact belief-only hit-ratio curve in one pass, ``model``
replays the buffer-mode write path through the real cache classes (over ``l3``),
``fleet`` runs it as N instances, ``sweep`` runs a set of caps (over cores) and
``report`` prints and writes the results.  See docs/replay.md.
"""
