"""Regenerate (or, with --check, verify) the Python code for proto/pushkv/v1.

Run: python scripts/gen_proto.py [--check]

Sources live at proto/pushkv/v1/*.proto and are compiled with proto/ as the only
include root, so the generated modules import as `pushkv.v1.*` with no path
rewriting. The generator is pinned (grpcio-tools==1.76.0, mypy-protobuf) so the
output is reproducible and stays importable on protobuf>=6.31.1 runtimes.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PKG = Path("pushkv") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = exe if exe.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf")
    return str(found)


def generate(out_root: Path) -> list[Path]:
    sources = sorted((PROTO_ROOT / PKG).glob("*.proto"))
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    return sorted(p for p in (out_root / PKG).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if checked-in code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / PKG).mkdir(parents=True)
        fresh = generate(out)
        target = PROTO_ROOT / PKG
        if args.check:
            stale = [
                p.name
                for p in fresh
                if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name, False)
            ]
            extra = {p.name for p in target.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
            extra -= {p.name for p in fresh}
            if stale or extra:
                sys.stderr.write(
                    f"generated protobuf code is stale: {sorted(stale)} {sorted(extra)}\n"
                    "run: python scripts/gen_proto.py\n"
                )
                return 1
            sys.stdout.write("generated protobuf code is up to date\n")
            return 0
        for p in fresh:
            shutil.copyfile(p, target / p.name)
            sys.stdout.write(f"wrote {(target / p.name).relative_to(ROOT)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
