"""What the running scheduler says about itself: ranks, model, role, storage.

Read when the existence cache is built (inside ``Scheduler.__init__``), never at
plugin registration: a scheduler process loads plugins before its configuration
is published.  Two sources, each read guarded (an API change degrades to a
default, never an exception in the scheduler): sglang's runtime context, whose
accessors sglang's own metric labels use; then the ``ServerArgs`` record and the
``Scheduler`` found on the calling stack (older releases keep them there).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache_existence.core._validate import is_int
from hicache_existence.exporters.catalog import DeploymentLabels
from hicache_existence.integrations.sglang.flags import FlagValues, stored_values

_MAX_LABEL = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class SchedulerFacts:
    """One scheduler process, as far as labels and wiring need to know."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    model_name: str = ""
    #: ``prefill`` / ``decode`` / ``unified`` (or ``dynamic`` with PD role switch).
    engine_type: str = "unified"
    storage_backend: str = ""
    #: ``buffer_only`` / ``cache``; ``None`` when it could not be read.
    host_memory_mode: str | None = None
    #: ``write_through`` / ``write_through_selective`` / ``write_back`` (cache mode).
    write_policy: str = ""
    hierarchical_cache: bool | None = None
    flags: FlagValues | None = None
    #: Where the facts came from (logged at start-up).
    sources: tuple[str, ...] = field(default_factory=tuple)
    #: The server's HTTP port (0: unknown), naming the instance in a recorded trace.
    port: int = 0
    #: Tokens per page (``--page-size``; 0: unknown), for a recorded trace's header.
    page_size: int = 0

    def labels(self, model_name: str = "", storage_backend: str = "") -> DeploymentLabels:
        """Deployment labels; non-empty arguments (configuration) win."""
        return DeploymentLabels(
            model_name=_label(model_name or self.model_name),
            engine_type=_label(self.engine_type) or "unified",
            tp_rank=self.tp_rank,
            dp_rank=self.dp_rank,
            pp_rank=self.pp_rank,
            storage_backend=_label(storage_backend or self.storage_backend),
        )

    @property
    def process_index(self) -> int:
        """This scheduler's index among the server's schedulers (DP-major)."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank

    @property
    def cache_mode(self) -> bool:
        """Whether HiCache runs in its default host memory mode, ``cache``."""
        return self.hierarchical_cache is not False and self.host_memory_mode == "cache"

    @property
    def buffer_mode(self) -> bool | None:
        """Whether HiCache buffer mode is on (``None``: unknown)."""
        if self.hierarchical_cache is False:
            return False
        if self.host_memory_mode is None:
            return None
        return self.host_memory_mode == "buffer_only"


def _label(value: str) -> str:
    return _CONTROL.sub("", value or "")[-_MAX_LABEL:]


def _read(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _int(value: Any, default: int = 0) -> int:
    return value if is_int(value) and value >= 0 else default


def _str(value: Any) -> str:
    name = getattr(value, "value", value)  # a str enum
    return name if isinstance(name, str) else str(name)


def engine_type_of(mode: Any, role_switch: Any = False) -> str:
    """sglang's ``engine_type`` label from the disaggregation mode."""
    if role_switch is True:
        return "dynamic"
    text = _str(mode).lower()
    return text if text in ("prefill", "decode") else "unified"


_RANKS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank")
#: The runtime context's parts, which name their settings as ``ServerArgs`` does.
_CONTEXT_PARTS = ("get_parallel", "get_serving", "get_disagg", "get_memory")


def gather(frame_depth: int = 40) -> SchedulerFacts:
    """The facts of the scheduler building the cache right now."""
    values: dict[str, Any] = {}
    sources: list[str] = []
    server_args: Any = None

    # Only if sglang already imported it: a context nobody imported was never published.
    rc = sys.modules.get("sglang.srt.runtime_context")
    if rc is not None:
        for part in _CONTEXT_PARTS:
            values.update(_settings(_read(getattr(rc, part, lambda: None)), model_path=False))
        if values:
            sources.append("runtime_context")
        server_args = _read(lambda: rc.get_server_args())

    scheduler, frame_args = _from_stack(frame_depth)
    if server_args is None:
        server_args = frame_args
    if scheduler is not None:
        for name in _RANKS:
            value = getattr(scheduler, name, None)
            if name not in values and isinstance(value, int):
                values[name] = value
        sources.append("scheduler")
    if server_args is not None:
        for key, value in _settings(server_args, model_path=True).items():
            values.setdefault(key, value)
        sources.append("server_args")

    # ``_settings`` typed the strings; ranks may come from the scheduler, unchecked.
    return SchedulerFacts(
        tp_rank=_int(values.get("tp_rank")),
        tp_size=max(1, _int(values.get("tp_size"), 1)),
        pp_rank=_int(values.get("pp_rank")),
        pp_size=max(1, _int(values.get("pp_size"), 1)),
        dp_rank=_int(values.get("dp_rank")),
        model_name=values.get("model_name", ""),
        engine_type=values.get("engine_type") or "unified",
        storage_backend=values.get("storage_backend", ""),
        host_memory_mode=values.get("host_memory_mode"),
        write_policy=values.get("write_policy", ""),
        hierarchical_cache=values.get("hierarchical_cache"),
        flags=stored_values(server_args),
        sources=tuple(sources),
        port=_int(values.get("port")),
        page_size=_int(values.get("page_size")),
    )


def _settings(record: Any, *, model_path: bool) -> dict[str, Any]:
    """What one of sglang's records (``ServerArgs``, or a part of the runtime
    context) says, each value of the type the facts need or left out."""
    out: dict[str, Any] = {}
    if record is None:
        return out

    def get(name: str) -> Any:
        return _read(lambda: getattr(record, name, None))

    for name in (*_RANKS, "port", "page_size"):
        if is_int(value := get(name)):
            out[name] = value
    model = get("served_model_name") or (get("model_path") if model_path else None)
    if isinstance(model, str) and model:
        out["model_name"] = model
    mode = get("disaggregation_mode")
    if mode is not None:
        out["engine_type"] = engine_type_of(mode, get("enable_pd_role_switch"))
    backend = get("hicache_storage_backend")
    if backend is not None:
        out["storage_backend"] = _str(backend)
    for name, key in (
        ("hicache_host_memory_mode", "host_memory_mode"),
        ("hicache_write_policy", "write_policy"),
    ):
        if isinstance(value := get(name), str):
            out[key] = value
    if isinstance(hier := get("enable_hierarchical_cache"), bool):
        out["hierarchical_cache"] = hier
    return out


def _from_stack(depth: int) -> tuple[Any, Any]:
    """The ``Scheduler`` (an object with ``server_args`` and ``tree_cache``-era
    attributes) and a ``server_args`` local found walking up the stack."""
    scheduler: Any = None
    server_args: Any = None
    frame = _read(lambda: sys._getframe(2))
    seen = 0
    while frame is not None and seen < depth and (scheduler is None or server_args is None):
        local = frame.f_locals
        owner = local.get("self")
        if (
            scheduler is None
            and type(owner).__name__.endswith("Scheduler")
            and hasattr(owner, "server_args")
        ):
            scheduler = owner
            if server_args is None:
                server_args = owner.server_args
        if server_args is None:
            candidate = local.get("server_args")
            if candidate is not None and hasattr(candidate, "model_path"):
                server_args = candidate
        frame = frame.f_back
        seen += 1
    return scheduler, server_args
