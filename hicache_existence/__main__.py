"""``python -m hicache_existence``: the same CLI as the console script."""

import sys

from hicache_existence.cli import main

sys.exit(main())
