"""Sub-commands of the ``hicache-existence`` CLI, one module each exposing ``NAME``,
``HELP``, ``add_arguments(parser)`` and ``run(args) -> int`` (listed in ``cli``).
"""
