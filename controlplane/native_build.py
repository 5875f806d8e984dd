"""Compile the coordinator's core with mypyc into <package>/.native/ (see _native).

Works on the package that ``import controlplane`` resolves to: a source tree
(editable install) or an installed copy in site-packages. Needs mypy (the dev
extra) and a C compiler. ``pushkv build-native`` and scripts/build_native.py
run ``main``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from controlplane import _native

PACKAGE = Path(__file__).resolve().parent


def _compile(package: Path, out: Path, modules: Sequence[str]) -> None:
    import pushkv
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped,unused-ignore]

    # The generated protobuf stubs: found through the project's mypy config in a
    # source tree, beside the package in site-packages, else point mypy at them.
    stubs_root = str(Path(next(iter(pushkv.__path__))).parent)
    saved = os.environ.get("MYPYPATH")
    if "site-packages" not in stubs_root and Path(stubs_root) != package.parent:
        os.environ["MYPYPATH"] = stubs_root
    with tempfile.TemporaryDirectory(prefix="pushkv-mypyc-") as tmp:
        cwd = os.getcwd()
        os.chdir(package.parent)  # mypyc names modules by their path relative to here
        try:
            exts = mypycify(
                [f"{package.name}/{m}.py" for m in modules],
                opt_level="3",
                target_dir=str(Path(tmp) / "c"),
            )
            dist = Distribution({"name": "pushkv-native", "ext_modules": exts})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib = str(out)
            cmd.build_temp = str(Path(tmp) / "o")
            cmd.ensure_finalized()
            cmd.run()
        finally:
            os.chdir(cwd)
            if saved is None:
                os.environ.pop("MYPYPATH", None)
            else:
                os.environ["MYPYPATH"] = saved


def build(package: Path = PACKAGE, *, force: bool = False) -> str:
    """Build unless fresh; returns what was done. Raises on a failed compile."""
    target = package / _native.DIRNAME
    if _native.check(package).compiled and not force:
        return f"{target} is up to date"
    t0 = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".native-", dir=package))
    staging.chmod(0o755)
    try:
        # Hash before compiling: a source edited during the build reads as stale.
        sources = {m: _native.source_hash(package / f"{m}.py") for m in _native.MODULES}
        _compile(package, staging, _native.MODULES)
        manifest = {
            "abi": _native.abi_tag(),
            "python": sys.version.split()[0],
            "sources": sources,
        }
        (staging / _native.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    took = time.monotonic() - t0
    return f"compiled {len(_native.MODULES)} modules into {target} in {took:.0f} s"


def clean(package: Path = PACKAGE) -> str:
    target = package / _native.DIRNAME
    shutil.rmtree(target, ignore_errors=True)
    return f"removed {target}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--force", action="store_true", help="rebuild even if fresh")
    g.add_argument("--clean", action="store_true", help="remove the build (pure Python again)")
    g.add_argument(
        "--check", action="store_true", help="only say whether a fresh build exists (exit 1 if not)"
    )


def run(args: argparse.Namespace) -> int:
    if args.check:
        state = _native.check(PACKAGE)
        sys.stdout.write(f"build-native: {'fresh' if state.compiled else 'no'}: {state.detail}\n")
        return 0 if state.compiled else 1
    sys.stdout.write(f"build-native: {clean() if args.clean else build(force=args.force)}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pushkv build-native", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
