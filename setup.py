"""Build hook: with PUSHKV_MYPYC=1 the coordinator's core is compiled by mypyc
into the wheel (as mypy and black ship theirs); otherwise pushkv is pure Python.

    pip install .                         # pure Python, same behaviour
    pip install '.[compile]'              # then, for the compiled core
    PUSHKV_MYPYC=1 pip install --no-build-isolation --no-deps --force-reinstall .

mypyc type-checks the core against pushkv's dependencies and their stubs, so
the compiled build runs in an environment that has them (the `compile` extra),
not in pip's isolated one: without them it stops here, saying which are missing.

Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import os
import re
import runpy
import tomllib
from importlib.metadata import PackageNotFoundError, version

from setuptools import setup


def missing_for_mypyc() -> list[str]:
    """The distributions mypyc's type check needs that this environment lacks."""
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["compile"]]
    # A requirement with an environment marker (uvloop) is not needed to type-check.
    names = [re.split(r"[<>=!~\[ ]", w, maxsplit=1)[0] for w in wanted if ";" not in w]
    missing = []
    for name in names:
        try:
            version(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


ext_modules = []
if os.environ.get("PUSHKV_MYPYC") == "1":
    if missing := missing_for_mypyc():
        raise SystemExit(
            "PUSHKV_MYPYC=1: mypyc type-checks the core against pushkv's dependencies, "
            f"and this build environment lacks {', '.join(missing)}. Install them first "
            "(pip install '.[compile]'), then build without isolation: PUSHKV_MYPYC=1 pip "
            "install --no-build-isolation --no-deps --force-reinstall ."
        )
    from mypyc.build import mypycify

    modules = runpy.run_path("controlplane/core_build.py")["CORE_MODULES"]
    # Through the namespace's link (pushkv/controlplane): the modules compile
    # as pushkv.controlplane.*.
    ext_modules = mypycify([f"pushkv/controlplane/{m}.py" for m in modules], opt_level="3")

setup(ext_modules=ext_modules)
