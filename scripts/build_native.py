"""Compile the coordinator's core with mypyc into controlplane/.native/.

    python scripts/build_native.py           # build unless the build is fresh
    python scripts/build_native.py --force   # rebuild
    python scripts/build_native.py --clean   # remove it (pure Python again)
    python scripts/build_native.py --check   # exit 0 only if a fresh build exists

Same as `pushkv build-native`. The package picks the build up at import only
while every compiled module's source is unchanged (controlplane/_native.py);
PUSHKV_NATIVE=0 ignores it. Needs mypy (the dev extra) and a C compiler.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["PUSHKV_NATIVE"] = "0"  # this process must not load the build it replaces
    from controlplane import native_build

    raise SystemExit(native_build.main(sys.argv[1:]))
