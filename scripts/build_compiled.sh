#!/usr/bin/env bash
# Build pushkv as a wheel with the coordinator's core compiled by mypyc
# (PUSHKV_MYPYC=1, see setup.py) and unpack it into DIR (default
# build/compiled). Skipped when DIR already holds a build of today's sources.
#   bash scripts/build_compiled.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/compiled}
VENV=${PUSHKV_VENV:-.venv}
py="$VENV/bin/python"
# Every packaged source: the copy in DIR holds all packages, not only the core.
want=$(find -L pushkv \
  -name '*.py' -o -name '*.pyi' | sort | xargs cat setup.py pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$out/.pushkv-build" ] && [ "$(cat "$out/.pushkv-build")" = "$want" ]; then
  echo "build_compiled: $out is up to date"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PUSHKV_MYPYC=1 "$py" -m pip --disable-pip-version-check -q wheel --no-deps \
  --no-build-isolation -w "$tmp" .
rm -rf "$out"
"$py" -m pip --disable-pip-version-check -q install --no-deps --target "$out" "$tmp"/*.whl
echo "$want" > "$out/.pushkv-build"
echo "build_compiled: compiled core in $out"
rm -rf build/lib.* build/temp.* build/bdist.*
