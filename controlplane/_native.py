"""Selects the compiled (mypyc) build of the coordinator's core, when there is a fresh one.

``pushkv build-native`` (controlplane/native_build.py) compiles the modules in ``MODULES`` into
``controlplane/.native/`` and records the SHA-256 of each source there. At
import, ``controlplane/__init__.py`` calls ``activate``: it puts that folder
first on the package's ``__path__`` only if every recorded hash matches the
source beside it, so an edited module never runs as its stale compiled copy.

``PUSHKV_NATIVE`` chooses: ``auto`` (default: compiled if fresh, else pure
Python), ``0`` (always pure Python), ``1`` (compiled or an ImportError that
says why: for CI and benchmarks).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

# The plain-Python core: typed, no gRPC; what the hot path of a rendezvous runs.
MODULES = (
    "domain",
    "errors",
    "settings",
    "validation",
    "transfer",
    "registry",
    "timeline",
    "rendezvous",
    "convert",
    "runtime",
    "calls",
    "auth",
)
DIRNAME = ".native"
MANIFEST = "manifest.json"
ENV = "PUSHKV_NATIVE"


class NativeState(NamedTuple):
    compiled: bool
    detail: str  # why not, or where from


def abi_tag() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(package_dir: Path) -> NativeState:
    """Whether ``package_dir/.native`` holds a usable build of today's sources."""
    native = package_dir / DIRNAME
    try:
        manifest = json.loads((native / MANIFEST).read_text())
    except FileNotFoundError:
        return NativeState(False, "not built")
    except (OSError, ValueError) as exc:
        return NativeState(False, f"unreadable {DIRNAME}/{MANIFEST}: {exc}")
    if manifest.get("abi") != abi_tag():
        return NativeState(False, f"built for {manifest.get('abi')}, this is {abi_tag()}")
    sources = manifest.get("sources", {})
    if sorted(sources) != sorted(MODULES):
        return NativeState(False, "built for another module list: rebuild")
    for mod, digest in sources.items():
        src = package_dir / f"{mod}.py"
        if not any((native / "controlplane").glob(f"{mod}.*.so")):
            return NativeState(False, f"{mod} missing from the build: rebuild")
        if not src.exists() or source_hash(src) != digest:
            return NativeState(False, f"{mod}.py changed since the build: rebuild")
    return NativeState(True, str(native))


def activate(package_path: list[str]) -> NativeState:
    """Put a fresh compiled build ahead of the sources; called by the package's __init__."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ImportError(f"{ENV}={mode!r}: expected auto, 0 or 1")
    if mode == "0":
        return NativeState(False, f"{ENV}=0")
    package_dir = Path(package_path[0])
    state = check(package_dir)
    if not state.compiled:
        if mode == "1":
            raise ImportError(
                f"{ENV}=1 but the compiled core is unusable: {state.detail}; "
                f"build it with `{ENV}=0 pushkv build-native`"
            )
        return state
    native = package_dir / DIRNAME
    _load_support(native)
    package_path.insert(0, str(native / "controlplane"))
    return state


def _load_support(native: Path) -> None:
    """Load mypyc's shared support module (``<hash>__mypyc``, at the top of the
    build) by its path. Never via sys.path: ``native`` holds a ``controlplane/``
    folder, and a child process that inherits sys.path (multiprocessing's spawn)
    would import that folder as a namespace package instead of this package."""
    for so in native.glob(f"*__mypyc{abi_tag()}"):
        name = so.name[: -len(abi_tag())]
        if name not in sys.modules:
            loader = importlib.machinery.ExtensionFileLoader(name, str(so))
            spec = importlib.util.spec_from_file_location(name, so, loader=loader)
            if spec is None:
                raise ImportError(f"cannot load {so}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            loader.exec_module(module)
