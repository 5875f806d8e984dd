"""Compile the coordinator's core with mypyc into controlplane/.native/.

    python scripts/build_native.py           # build unless the build is fresh
    python scripts/build_native.py --force   # rebuild
    python scripts/build_native.py --clean   # remove it (pure Python again)

The package picks the build up at import only while every compiled module's
source is unchanged (controlplane/_native.py); PUSHKV_NATIVE=0 ignores it.
Needs mypy (the dev extra) and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "controlplane"
ENV = "PUSHKV_NATIVE"


def build(out: Path, modules: tuple[str, ...]) -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped,unused-ignore]

    with tempfile.TemporaryDirectory(prefix="pushkv-mypyc-") as tmp:
        cwd = os.getcwd()
        os.chdir(ROOT)  # mypyc names modules by their path relative to here
        try:
            exts = mypycify(
                [f"controlplane/{m}.py" for m in modules],
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--force", action="store_true", help="rebuild even if fresh")
    p.add_argument("--clean", action="store_true", help="remove the build")
    args = p.parse_args(argv)
    os.environ[ENV] = "0"  # this process must not load the build it replaces
    from controlplane import _native as native

    target = PACKAGE / native.DIRNAME
    if args.clean:
        shutil.rmtree(target, ignore_errors=True)
        sys.stdout.write(f"build_native: removed {target.relative_to(ROOT)}\n")
        return 0
    state = native.check(PACKAGE)
    if state.compiled and not args.force:
        sys.stdout.write(f"build_native: {target.relative_to(ROOT)} is up to date\n")
        return 0
    modules = native.MODULES
    t0 = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".native-", dir=PACKAGE))
    staging.chmod(0o755)
    try:
        # Hash before compiling: a source edited during the build reads as stale.
        sources = {m: native.source_hash(PACKAGE / f"{m}.py") for m in modules}
        build(staging, modules)
        manifest = {
            "abi": native.abi_tag(),
            "python": sys.version.split()[0],
            "sources": sources,
        }
        (staging / native.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    sys.stdout.write(
        f"build_native: compiled {len(modules)} modules into {target.relative_to(ROOT)} "
        f"in {time.monotonic() - t0:.0f} s\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
