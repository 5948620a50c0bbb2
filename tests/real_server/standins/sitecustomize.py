"""Loads the CPU stand-ins (and, with ``HX_PROBES=1``, the test probes; with
``HX_DRIFT=<case>``, one simulated upstream change, ``hx_drift.py``) into every
Python process of a test server.

sglang spawns its scheduler and detokenizer processes, so a patch made in the
launching process would not reach them; Python imports ``sitecustomize`` at start-up
in every interpreter whose ``sys.path`` holds this directory, which the harness puts
on ``PYTHONPATH``. Nothing is imported here beyond a post-import hook: the patches are
applied when sglang imports the modules they patch.
"""

from __future__ import annotations

import os

if os.environ.get("HX_CPU_STANDINS", "1") != "0":
    import hx_cpu_standins

    hx_cpu_standins.install()
    import hx_swa_attention

    hx_swa_attention.install()
    import hx_mla_standins

    hx_mla_standins.install()
    if os.environ.get("HX_PROBES") == "1":
        import hx_probes

        hx_probes.install()
    if os.environ.get("HX_DRIFT"):
        import hx_drift

        hx_drift.install()
