"""Sub-commands of the ``hicache-existence`` CLI, one module each.

Each module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; ``hicache_existence.cli`` lists them explicitly.
"""
