"""``hicache-existence doctor``: a live deployment's series, diagnosed (docs/doctor.md).

``diagnosis`` does no I/O (readings in, a ranked report out), so it is tested without
a network; ``scrape`` is the HTTP side; the command line is ``commands.doctor``.
"""
