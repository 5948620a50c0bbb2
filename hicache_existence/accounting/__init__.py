"""Accounting built on the core's extension points: write accounting
(``writes``), miss-reason memory (``ghosts``) and the capacity advisor
(``advisor``).  Imports only the core and ``config``."""
