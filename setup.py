"""Build hook: with PUSHKV_MYPYC=1 the coordinator's core is compiled by mypyc
into the wheel (as mypy and black ship theirs); otherwise pushkv is pure Python.

    PUSHKV_MYPYC=1 pip install .          # compiled core (needs a C compiler)
    pip install .                         # pure Python, same behaviour

Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import os
import runpy

from setuptools import setup

ext_modules = []
if os.environ.get("PUSHKV_MYPYC") == "1":
    from mypyc.build import mypycify

    modules = runpy.run_path("controlplane/core_build.py")["CORE_MODULES"]
    os.environ["MYPYPATH"] = "proto"  # the generated contract's stubs
    ext_modules = mypycify([f"controlplane/{m}.py" for m in modules], opt_level="3")

setup(ext_modules=ext_modules)
