"""The cache core: the beliefs and their built-in counters.

Both API generations (``cache``: per pool, current sglang; ``flat``: the seed's one LRU
over ``(pool, hash)``), their ``lru`` index (C with a pure-Python twin), the advisor's
``sampler``, heal ``policies``, extension protocols (``observers``) and the counters
with frozen snapshots (``stats``).  Imports nothing above itself, no third-party package.
"""
