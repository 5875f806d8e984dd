"""Patches the serving benchmark applies inside its vLLM servers' processes.

The installed vLLM and NIXL are not modified: :func:`sitecustomize` writes a
two-line ``sitecustomize.py`` that imports this module and calls :func:`apply`;
the benchmark puts it on the ``PYTHONPATH`` of a system's servers, so it runs at
the start of every process of those servers (API server, EngineCore, worker).
Only the standard library is imported here: this runs before anything else.

- :func:`unpin_nixl_workers`: vLLM's NIXL connectors re-pin their worker to the
  last core of each NUMA node; this skips that call (the logic of
  ``shared/reference/vllm-push-cpu.md``), so the workers keep the benchmark's
  core layout.
- :func:`ucx_backend_defaults`: every UCX backend a NIXL agent creates gets
  these parameters unless its creator passed them itself. The benchmark passes
  pushkv's agent's (``pushkv.agent.nixl_adapter.DEFAULT_UCX_PARAMS``), so vLLM's NIXL
  connectors, which pass none of them, run UCX as pushkv's agent does.
- :func:`no_progress_thread` (a control, not vLLM's default): NIXL agents are
  built without their UCX progress thread (``nixl_agent_config.enable_prog_thread``),
  which otherwise spins on the engine's own core. vLLM 0.32 offers no setting
  for it; the worker then progresses UCX when it polls its transfers each step,
  as pushkv's agent does.
- :func:`bound_shm_spin` (``--vllm-spin-ms``): vLLM 0.32's shm message queues
  (EngineCore <-> worker) busy-poll with sched_yield for 1 s after each read
  (``SpinCondition``'s ``busy_loop_s``, hard-coded) before they block on a
  notification socket. On 2 cores, a spinning EngineCore shares the other
  engine's worker core. This bounds that window.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Final

Patch = Callable[[ModuleType], None]

# Where NIXL's Python API lives: the meta package aliases the variant it loads.
NIXL_API_MODULES: Final = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
SHM_QUEUE_MODULE: Final = "vllm.distributed.device_communicators.shm_broadcast"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs patches on a module right after it is imported, by wrapping the
    loader that the other finders return for it."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patches = self.patches.get(fullname)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def patched_exec(module: ModuleType) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)

        setattr(loader, "exec_module", patched_exec)  # noqa: B010 (an instance attribute)
        return spec


_after_import = _AfterImport()


def after_import(names: Iterable[str], patch: Patch) -> None:
    """``patch(module)`` right after any module in ``names`` is imported."""
    for name in names:
        _after_import.patches.setdefault(name, []).append(patch)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def unpin_nixl_workers() -> None:
    """Skip the NIXL worker's "last core per NUMA node" ``sched_setaffinity``."""
    original = os.sched_setaffinity

    def sched_setaffinity(pid: int, cpus: Iterable[int]) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if "kv_connector" in caller and "nixl" in caller:
            return None  # the NIXL connector's pin
        return original(pid, cpus)

    os.sched_setaffinity = sched_setaffinity


def ucx_backend_defaults(params: Mapping[str, str]) -> None:
    """UCX backends get ``params`` unless their creator passed them."""
    defaults = dict(params)

    def patch(api: ModuleType) -> None:
        cls = api.nixl_agent
        create = cls.create_backend

        def create_backend(
            self: Any, backend: str, initParams: Mapping[str, str] | None = None
        ) -> None:
            given = dict(initParams or {})
            create(self, backend, {**defaults, **given} if backend == "UCX" else given)

        cls.create_backend = create_backend

    after_import(NIXL_API_MODULES, patch)


def no_progress_thread() -> None:
    """NIXL agents are built without their UCX progress thread."""

    def patch(api: ModuleType) -> None:
        cls = api.nixl_agent_config
        init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.enable_pthread = False

        cls.__init__ = __init__

    after_import(NIXL_API_MODULES, patch)


def bound_shm_spin(spin_s: float) -> None:
    """vLLM's shm message queues busy-poll ``spin_s`` seconds after a read, not 1 s."""

    def patch(module: ModuleType) -> None:
        cls = module.SpinCondition
        init = cls.__init__

        def __init__(
            self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1
        ) -> None:
            init(self, is_reader, context, notify_address, busy_loop_s=spin_s)

        cls.__init__ = __init__

    after_import((SHM_QUEUE_MODULE,), patch)


def apply(
    *,
    unpin: bool = False,
    noprog: bool = False,
    spin_ms: float | None = None,
    ucx_params: Mapping[str, str] | None = None,
) -> None:
    """The patches a server was given (what the sitecustomize shim calls)."""
    if unpin:
        unpin_nixl_workers()
    if ucx_params:
        ucx_backend_defaults(ucx_params)
    if noprog:
        no_progress_thread()
    if spin_ms is not None:
        bound_shm_spin(spin_ms / 1000)


def sitecustomize(
    *,
    unpin: bool,
    noprog: bool = False,
    spin_ms: float | None = None,
    ucx_params: Mapping[str, str] | None = None,
) -> str:
    """The sitecustomize.py a system's vLLM servers get ("": none)."""
    if not (unpin or noprog or spin_ms is not None or ucx_params):
        return ""
    args = (
        f"unpin={unpin!r}, noprog={noprog!r}, spin_ms={spin_ms!r}, "
        f"ucx_params={dict(ucx_params) if ucx_params else None!r}"
    )
    return f"from pushkv.bench.serving.vllm_patches import apply\n\napply({args})\n"
