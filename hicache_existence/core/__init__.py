"""The cache core: the beliefs themselves and their built-in counters.

Both API generations (``cache``: per pool, current sglang; ``flat``: one LRU over
``(pool, hash)``, the seed's), the LRU index they store beliefs in (``lru``, C
with a pure-Python twin), the advisor's sampler the index feeds (``sampler``),
heal policies, extension protocols (``observers``) and the counters with their
frozen snapshots (``stats``).  Imports nothing above itself and no third-party
package.
"""
