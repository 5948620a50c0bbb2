"""``hicache-existence doctor``: a live deployment's series, diagnosed.

Its parts, so that the diagnosis can be tested without a network:

* ``exposition``: a small, strict parser of the Prometheus text format (garbage
  from the network is an ``ExpositionError``, never an exception of another kind);
* ``judgements``: every finding and alert declared once (severity, ratio,
  threshold, guard, fix) with the one ``Settings`` object; dashboards/build.py
  renders the alerts and the docs tables from it;
* ``figures``: the series read (names from the catalog), aggregated over ranks;
* ``rules``: the findings, each judged by its declaration; ``model``: the report;
* ``diagnosis``: readings in, a ranked report out; no I/O;
* ``scrape``: the HTTP side, a server's metrics endpoint read twice, or the same
  series read from a Prometheus server's HTTP API; bounded reads, no pickle.

The command line is ``hicache_existence.commands.doctor``; docs/doctor.md lists
every finding.
"""
