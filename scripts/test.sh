#!/usr/bin/env bash
# Set up (if needed) and run every check: generated-code drift, ruff, mypy, pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rendezvous`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PUSHKV_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error UCX_NET_DEVICES=lo

echo "== generated protobuf code"
python scripts/gen_proto.py --check
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"
mypy controlplane agent vllm_integration scripts
echo "== pytest (compiled core)"
PUSHKV_NATIVE=1 python -m pytest -ra "$@"
if [ $# -eq 0 ]; then
  echo "== pytest (the core as pure Python)"
  PUSHKV_NATIVE=0 python -m pytest -q tests/test_rendezvous.py tests/test_server.py \
    tests/test_batching.py tests/test_fuzz.py tests/test_native.py tests/test_status_cli.py \
    tests/test_metrics.py tests/test_security.py
fi
