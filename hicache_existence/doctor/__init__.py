"""``hicache-existence doctor``: a live deployment's series, diagnosed.

Three parts, so that the diagnosis can be tested without a network:

* ``exposition``: a small, strict parser of the Prometheus text format (garbage
  from the network is an ``ExpositionError``, never an exception of another kind);
* ``diagnosis``: readings (two sets of parsed samples per instance) in, figures and
  ranked findings out; no I/O;
* ``scrape``: the HTTP side, a server's metrics endpoint read twice, or the same
  series read from a Prometheus server's HTTP API; bounded reads, no pickle.

The command line is ``hicache_existence.commands.doctor``; docs/doctor.md lists
every finding.
"""
