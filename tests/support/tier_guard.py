"""Holds each running test to its tier (tests/support/tiers.py detects it).

While a test runs (its setup, call and teardown), a ``pure`` test that starts
a child process, or a test not in the ``vllm`` tier that starts a vLLM engine,
raises :class:`TierViolation` at the start, and its report fails with the rule
even where the test caught the exception. Hooked:

- child processes: ``subprocess.Popen`` (asyncio's default loop uses it too),
  asyncio's ``create_subprocess_exec``/``_shell`` (uvloop spawns without
  Popen), ``multiprocessing`` processes, ``os.fork``/``forkpty``/``system``/
  ``posix_spawn``;
- vLLM engines: ``VllmServer.start``, a child whose command line runs vLLM,
  and ``VllmConfig`` built in this process (what every engine object needs,
  ``pushkv.harness.offline`` included), patched when vLLM's config module loads.

Not seen: a vLLM engine that a child process starts (a grandchild).
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import multiprocessing.process
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Coroutine, Generator, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest
from pytest import TestReport

from pushkv.harness.vllm_server import VllmServer

# (tier, why) of each collected test; tests/support/tiers.py sets it.
TIER = pytest.StashKey[tuple[str, str]]()
_BROKEN = pytest.StashKey[list[str]]()  # the rules a test broke, in order
_REPORTED = pytest.StashKey[int]()  # how many of them a report carries already
_RANK = {"pure": 0, "process": 1, "vllm": 2}
_HOW = {
    "process": (
        "A test is in the `process` tier when its code, a fixture it requests or a"
        " helper of the tests they call names what starts one (tests/support/tiers.py"
        " PROCESS_STARTERS, or a pushkv module that starts processes): name the starter"
        " in the test, or add the entry point that started it to PROCESS_STARTERS."
    ),
    "vllm": (
        "A test is in the `vllm` tier when its code, a fixture it requests or a helper of"
        " the tests they call names what starts a vLLM engine (tests/support/tiers.py"
        " VLLM_STARTERS: VllmServer, pushkv_server, PushkvCluster, pushkv.harness.offline,"
        " tests/support/vllm_harness.py, the tiny-model fixtures): request or name one,"
        " or add the entry point that started it to VLLM_STARTERS."
    ),
}


class _State:
    item: pytest.Item | None = None  # the test running now (setup, call, teardown)
    installed = False


_state = _State()


@contextlib.contextmanager
def exempt() -> Iterator[None]:
    """pytest's own work around a test (a failed test's report, which asks
    py-spy for the stacks of the engines left running) starts what it needs,
    whatever the test's tier."""
    item, _state.item = _state.item, None
    try:
        yield
    finally:
        _state.item = item


class TierViolation(RuntimeError):
    """A test started more than its tier allows."""


def _refuse(what: str, needs: str) -> None:
    item = _state.item
    if item is None or TIER not in item.stash:
        return
    tier, why = item.stash[TIER]
    if _RANK[tier] >= _RANK[needs]:
        return
    text = (
        f"tier rule broken: {item.nodeid} is in the `{tier}` tier ({why}), but it {what};"
        f" only a `{needs}` test may. {_HOW[needs]}"
    )
    item.stash.setdefault(_BROKEN, []).append(text)
    raise TierViolation(text)


def _argv(args: object) -> list[str]:
    if isinstance(args, str | bytes | os.PathLike):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)  # a shell command, or a program alone
        except ValueError:
            return text.split()
    if isinstance(args, Sequence):
        return [os.fsdecode(a) if isinstance(a, bytes | os.PathLike) else str(a) for a in args]
    return [repr(args)]


def _runs_vllm(argv: list[str]) -> bool:
    """`vllm ...`, or `python -m vllm...` (the servers' entry points)."""
    if argv and os.path.basename(argv[0]) == "vllm":
        return True
    return any(
        flag == "-m" and (module == "vllm" or module.startswith("vllm."))
        for flag, module in itertools.pairwise(argv)
    )


def _child(args: object) -> None:
    argv = _argv(args)
    command = " ".join(argv)[:200]
    if _runs_vllm(argv):
        _refuse(f"starts a vLLM engine ({command})", "vllm")
    _refuse(f"starts a child process ({command})", "process")


def _wrap(owner: Any, name: str, check: Callable[..., None]) -> None:
    original = getattr(owner, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    guarded.tier_guard = True  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def _wrap_async(owner: Any, name: str, check: Callable[..., None]) -> None:
    original: Callable[..., Coroutine[Any, Any, Any]] = getattr(owner, name)

    async def guarded(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return await original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def _vllm_config_check(*_: Any, **__: Any) -> None:
    _refuse("builds a vLLM engine's VllmConfig in this process", "vllm")


def _guard_vllm_config(module: ModuleType) -> None:
    config = getattr(module, "VllmConfig", None)
    if config is not None and not getattr(config.__init__, "tier_guard", False):
        _wrap(config, "__init__", _vllm_config_check)


class _OnVllmConfig(importlib.abc.MetaPathFinder):
    """Guards ``VllmConfig`` once vLLM's config module has run."""

    NAME = "vllm.config.vllm"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)  # one module, once
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _guard_vllm_config(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Hook the ways to start a process or a vLLM engine (once per session)."""
    if _state.installed:
        return
    _state.installed = True
    _wrap(subprocess.Popen, "_execute_child", lambda _self, args, *_, **__: _child(args))
    for module in (asyncio, asyncio.subprocess):
        _wrap_async(
            module, "create_subprocess_exec", lambda program, *args, **_: _child([program, *args])
        )
        _wrap_async(module, "create_subprocess_shell", lambda cmd, **_: _child(cmd))
    _wrap(
        multiprocessing.process.BaseProcess,
        "start",
        lambda process: _refuse(
            f"starts a child process (multiprocessing: {process.name})", "process"
        ),
    )
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            _wrap(os, name, lambda *args, _name=name, **_: _child([f"os.{_name}", *args[:1]]))
    _wrap(
        VllmServer,
        "start",
        lambda server: _refuse(f"starts a vLLM server (VllmServer {server.name!r})", "vllm"),
    )
    if _OnVllmConfig.NAME in sys.modules:
        _guard_vllm_config(sys.modules[_OnVllmConfig.NAME])
    else:
        sys.meta_path.insert(0, _OnVllmConfig())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    _state.item = item
    try:
        return (yield)
    finally:
        _state.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, TestReport, TestReport]:
    """A broken tier rule fails the report, even where the test caught the error."""
    report = yield
    broken = item.stash.get(_BROKEN, [])
    new = broken[item.stash.get(_REPORTED, 0) :]
    if new:
        item.stash[_REPORTED] = len(broken)
        text = "\n".join(new)
        if report.failed:
            report.sections.append(("tier rule", text))
        else:
            report.outcome = "failed"
            report.longrepr = text
    return report
