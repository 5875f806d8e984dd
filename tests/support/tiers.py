"""Test tiers, from what a test starts (tests/conftest.py loads this plugin).

- ``pure``: in-process only: pure code, gRPC servers on port 0, asyncio.
- ``process``: child processes (coordinator, relay and router processes,
  KV hosts, NIXL peers, etcd, network namespaces), NIXL; no vLLM.
- ``vllm``: real vLLM engines, as servers (``VllmServer``) or as objects built
  in this process (``pushkv.harness.offline``, ``tests/support/vllm_harness.py``,
  the tiny models, ``pushkv/harness/tiny_model.py``).

The tier is detected at collection, from the objects that the test's code,
the code of every fixture it requests, and the tests' own helpers that these
call (functions and classes under ``tests``, followed transitively) name: the
STARTERS below, and any object of a pushkv module that itself starts
processes. Each test gets the marker of its tier (``-m "not vllm"`` is the
quick run). A test or module may state a *lower* tier by hand
(``pytestmark = pytest.mark.process``) where detection over-reaches (it names
``VllmServer`` but never starts one); a higher one is refused at collection,
so that no test is hidden in a slower tier.

Detection reads names, so it cannot see everything (a library call that starts
a process on a setting, an import by string): tests/support/tier_guard.py
holds every test to its tier while it runs, and fails it, loudly, when it
starts more than its tier allows.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FunctionType, ModuleType

import pytest
from _pytest.fixtures import FixtureFunctionDefinition

import pushkv
from tests.support import tier_guard


class Tier(enum.IntEnum):
    PURE = 0
    PROCESS = 1
    VLLM = 2

    @property
    def marker(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Verdict:
    tier: Tier
    why: str  # the evidence, e.g. "names pushkv.harness.vllm_server.VllmServer (fixture prefill)"


# Qualified names (module, or module.qualname) that start a vLLM engine; a
# module here covers everything defined in it.
VLLM_STARTERS: tuple[str, ...] = (
    "pushkv.harness.vllm_server.VllmServer",
    "pushkv.harness.vllm_server.PushkvCluster",
    "pushkv.harness.vllm_server.pushkv_server",
    "pushkv.harness.offline",
    "tests.support.vllm_harness",
    "pushkv.harness.tiny_model",  # the tiny models (tests/conftest.py), built for vLLM
    "vllm.config.vllm.VllmConfig",
    "vllm.v1.core.sched.scheduler.Scheduler",
    "vllm.v1.engine",
    "vllm.engine",
    "vllm.entrypoints",
)

# ... that start a child process, or NIXL.
PROCESS_STARTERS: tuple[str, ...] = (
    "subprocess",
    "multiprocessing",
    "concurrent.futures.process",
    "pty",
    "asyncio.subprocess",
    "posix.fork",
    "posix.forkpty",
    "posix.system",
    "posix.posix_spawn",
    "posix.posix_spawnp",
    "pushkv.harness.coordinator",
    "pushkv.harness.etcd",
    "pushkv.harness.kvhost",
    "pushkv.harness.netlink",
    "pushkv.harness.vllm_server",
    "pushkv.net.child",
    "pushkv.agent.nixl_adapter",
    "nixl",
    "nixl_cu12",
)

# Attribute and keyword names that start one: os.fork(), asyncio's
# subprocesses, and a coordinator's partition-host and front children
# (ServerSettings(partition_procs=..., fronts=...)).
PROCESS_NAMES = frozenset(
    {
        "fork",
        "forkpty",
        "posix_spawn",
        "posix_spawnp",
        "create_subprocess_exec",
        "create_subprocess_shell",
        "partition_procs",
        "fronts",
    }
)

# A pushkv module starts processes when it names a process starter or an
# object of such a module; the coordinator (pushkv.controlplane) passes none
# on: it starts children only on the settings named in PROCESS_NAMES.
_NOT_PASSED_ON = ("pushkv.controlplane",)


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def qualname(obj: object) -> str | None:
    """``module`` for a module, ``module.qualname`` for a class or function,
    the class's for any other object."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    if isinstance(obj, functools.partial):
        return qualname(obj.func)
    if isinstance(obj, FixtureFunctionDefinition):
        return qualname(obj._get_wrapped_function())
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}.{name}"
    return None if isinstance(obj, type) else qualname(type(obj))


def _home(obj: object) -> str:
    """The module an object comes from."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    name = qualname(obj) or ""
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else name


# Calls, read in pushkv's sources, that start a process without an import of
# a starter (os.fork(), asyncio's subprocesses).
_SPAWN_CALLS = frozenset(
    {"fork", "forkpty", "posix_spawn", "posix_spawnp", "create_subprocess_exec",
     "create_subprocess_shell"}
)  # fmt: skip


def _pushkv_sources() -> dict[str, Path]:
    """Each pushkv module's source file (the linked design folders included;
    not the generated contract)."""
    root = Path(str(pushkv.__path__[0]))
    sources: dict[str, Path] = {}
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders[:] = [d for d in subfolders if d not in ("__pycache__", "v1")]
        package = ".".join(("pushkv", *Path(folder).relative_to(root).parts))
        for file in files:
            if file.endswith(".py"):
                stem = file.removesuffix(".py")
                sources[package if stem == "__init__" else f"{package}.{stem}"] = Path(folder, file)
    return sources


def _imports(name: str, path: Path, known: Iterable[str]) -> tuple[set[str], str | None]:
    """The modules a source imports, anywhere in it (lazy imports in functions
    too), and a spawning call it makes, if any."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    spawn = None
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            imported.add(base)
            imported.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Attribute) and node.attr in _SPAWN_CALLS:
            spawn = spawn or node.attr
    return {m for m in imported if m in known or not m.startswith("pushkv.")}, spawn


@functools.cache
def process_modules() -> dict[str, str]:
    """Each pushkv module that starts processes, with what of it does: an
    import of a starter, a spawning call, or an import, anywhere in its source,
    of such a module (to a fixpoint, not through the coordinator)."""
    sources = _pushkv_sources()
    graph: dict[str, set[str]] = {}
    found: dict[str, str] = {}
    for name, path in sources.items():
        graph[name], spawn = _imports(name, path, sources)
        starters = sorted(m for m in graph[name] if _under(m, PROCESS_STARTERS))
        if starters or spawn:
            found[name] = f"imports {starters[0]}" if starters else f"calls {spawn}()"
    grown = True
    while grown:
        grown = False
        for name, imported in graph.items():
            via = sorted(m for m in imported if m in found and not _under(m, _NOT_PASSED_ON))
            if name not in found and via:
                found[name], grown = f"imports {via[0]}", True
    return found


def tier_of_object(obj: object) -> tuple[Tier, str]:
    """The tier an object named by test code puts the test in, and why."""
    q = qualname(obj)
    if q is None:
        return Tier.PURE, ""
    if _under(q, VLLM_STARTERS):
        return Tier.VLLM, f"names {q}"
    if _under(q, PROCESS_STARTERS):
        return Tier.PROCESS, f"names {q}"
    home = _home(obj)
    if home.startswith("pushkv."):
        via = process_modules().get(home)
        if via:
            return Tier.PROCESS, f"names {q}, whose module {via}"
    return Tier.PURE, ""


def _code_names(code: CodeType) -> Iterator[tuple[str, bool]]:
    """(name, resolvable) for each global/attribute name of ``code`` and its
    nested functions, and each keyword name of its calls (not resolvable)."""
    for name in code.co_names:
        yield name, True
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _code_names(const)
        elif isinstance(const, tuple) and all(isinstance(c, str) for c in const):
            for name in const:
                yield name, False


def _functions_of(obj: object, own: frozenset[str]) -> Iterator[FunctionType]:
    """The functions to read for an object of the tests' own code."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, FixtureFunctionDefinition):
        yield from _functions_of(obj._get_wrapped_function(), own)
    elif isinstance(obj, functools.partial):
        yield from _functions_of(obj.func, own)
    elif isinstance(obj, FunctionType):
        yield obj
        inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)
        if inner is not None:
            yield from _functions_of(inner, own)
    elif inspect.ismethod(obj):
        yield from _functions_of(obj.__func__, own)
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if not _under(klass.__module__, own):
                continue
            for attr in vars(klass).values():
                value = attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr
                if isinstance(value, property):
                    yield from (f for f in (value.fget, value.fset) if isinstance(f, FunctionType))
                elif isinstance(value, FunctionType):
                    yield value


def _ours(obj: object, own: frozenset[str]) -> bool:
    """Whether ``obj`` is the tests' own code (the ``tests`` package, the test's
    module, a conftest), to be read rather than judged."""
    home = _home(obj)
    return _under(home, own) and not _under(home, VLLM_STARTERS)


class _Reader:
    """Reads the code reachable from a test, keeping the highest tier seen."""

    def __init__(self, own: frozenset[str]) -> None:
        self.tier, self.why = Tier.PURE, ""
        self._own = own
        self._seen: set[int] = set()

    def see(self, tier: Tier, why: str) -> None:
        if tier > self.tier:
            self.tier, self.why = tier, why

    def object(self, obj: object, where: str) -> None:
        if id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if _ours(obj, self._own):
            for func in _functions_of(obj, self._own):
                self.function(func, where)
            return
        tier, why = tier_of_object(obj)
        if tier:
            self.see(tier, f"{why} ({where})")

    def function(self, func: FunctionType, where: str) -> None:
        if id(func.__code__) in self._seen:
            return
        self._seen.add(id(func.__code__))
        scope, at = func.__globals__, f"{where}: {func.__qualname__}"
        names = list(_code_names(func.__code__))
        # `import a.b` and `from a import b` inside a function: its code names a.b, or a and b.
        packages = [n for n, _ in names if n.startswith("pushkv")]
        imported = [f"{p}.{n}" for p in packages for n, _ in names] + packages
        for module in imported:
            if module in process_modules():
                self.see(
                    Tier.PROCESS, f"imports {module}, which {process_modules()[module]} ({at})"
                )
        for name, resolvable in names:
            if name in PROCESS_NAMES:
                self.see(Tier.PROCESS, f"names {name} ({at})")
            if _under(name, VLLM_STARTERS):  # import vllm.entrypoints... inside a function
                self.see(Tier.VLLM, f"imports {name} ({at})")
            elif _under(name, PROCESS_STARTERS):
                self.see(Tier.PROCESS, f"imports {name} ({at})")
            if resolvable and name in scope:
                self.object(scope[name], at)


# pytest's and its plugins' own fixtures (tmp_path, monkeypatch, ...): not read.
_PLUGINS = ("_pytest", "pytest", "pytest_asyncio", "pytest_timeout", "hypothesis")


def detect(item: pytest.Item) -> Verdict:
    """The tier of a test from what its code and its fixtures' code name."""
    info = getattr(item, "_fixtureinfo", None)
    fixtures = []
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and not _under(_home(defs[-1].func), _PLUGINS):
            fixtures.append((name, defs[-1].func))  # the last definition is the one used
    module = getattr(item, "module", None)
    own = {"tests", "conftest", *(_home(func) for _, func in fixtures)}
    if module is not None:
        own.add(module.__name__)
    reader = _Reader(frozenset(own))
    for name, func in fixtures:
        if _under(_home(func), VLLM_STARTERS):
            reader.see(Tier.VLLM, f"requests fixture {name} ({qualname(func)})")
        reader.object(func, f"fixture {name}")
    obj = getattr(item, "obj", None)
    if obj is not None:
        reader.object(obj, "the test")
    cls = getattr(item, "cls", None)
    if cls is not None:
        reader.object(cls, "its class")
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        reader.object(value, "a parameter")
    return Verdict(reader.tier, reader.why or "names nothing that starts a process")


def _explicit(item: pytest.Item) -> Tier | None:
    """The tier a marker on the test, its class or its module states."""
    names = {m.name for m in item.iter_markers() if m.name in {t.marker for t in Tier}}
    if len(names) > 1:
        raise pytest.UsageError(f"{item.nodeid}: more than one tier marker: {sorted(names)}")
    return Tier[names.pop().upper()] if names else None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tiers",
        action="store_true",
        help="print each collected test's tier (pure, process, vllm) and why",
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    refused: list[str] = []
    for item in items:
        verdict = detect(item)
        stated = _explicit(item)
        if stated is not None and stated > verdict.tier:
            refused.append(
                f"  {item.nodeid}: marked {stated.marker}, detected {verdict.tier.marker}"
                f" ({verdict.why})"
            )
            continue
        if stated is not None and stated < verdict.tier:
            verdict = Verdict(stated, f"marked {stated.marker} (detected: {verdict.why})")
        else:
            item.add_marker(verdict.tier.marker)
        item.stash[tier_guard.TIER] = (verdict.tier.marker, verdict.why)
        if config.getoption("tiers"):
            config.get_terminal_writer().line(
                f"{verdict.tier.marker:8} {item.nodeid}  ({verdict.why})"
            )
    if refused:
        raise pytest.UsageError(
            "a tier marker may only lower the detected tier (tests/support/tiers.py):"
            " detection puts a test in the tier of what it starts, so a test is never"
            " kept out of the quick run by hand. Remove the marker:\n" + "\n".join(refused)
        )


def pytest_configure(config: pytest.Config) -> None:
    tier_guard.install()


# The run-time side: the guard's hooks, registered with this plugin.
pytest_runtest_protocol = tier_guard.pytest_runtest_protocol
pytest_runtest_makereport = tier_guard.pytest_runtest_makereport

__all__ = ["PROCESS_STARTERS", "VLLM_STARTERS", "Tier", "Verdict", "detect", "tier_of_object"]
