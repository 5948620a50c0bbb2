"""``hicache-existence doctor``: a live deployment's series, diagnosed (docs/doctor.md).

The diagnosis (``diagnosis``: readings in, a ranked report out) does no I/O, so it
is tested without a network; ``scrape`` is the HTTP side.  CONTRIBUTING.md's layout
names every module's part; the command line is ``hicache_existence.commands.doctor``.
"""
