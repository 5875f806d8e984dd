#!/usr/bin/env bash
# Set up (if needed) and run every check: generated-code drift, ruff, mypy, the
# import layers, the whole pytest suite, and the coordinator's core tests again
# against a wheel whose core mypyc compiled.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rendezvous`.
# `--fast` first: the same checks, then the pytest tiers `pure` and `process`
# only (-m "not vllm": no vLLM engine; tests/support/tiers.py), on 2 workers.
# The full run is those tiers so, then the vLLM tier (-m vllm) on one worker.
# Every pytest run ends with its 25 slowest tests (--durations=25).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
VENV=${PUSHKV_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
export PATH="$VENV/bin:$PATH" NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error UCX_NET_DEVICES=lo

echo "== generated protobuf code"
python scripts/gen_proto.py --check
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"
mypy pushkv scripts tests setup.py
echo "== import layers (import-linter)"
lint-imports
# Built before pytest (cached while the sources are unchanged), so that code
# mypyc cannot compile fails in the first minute, in --fast too.
echo "== the coordinator's core compiled by mypyc (PUSHKV_MYPYC=1 wheel)"
bash scripts/build_compiled.sh build/compiled
if [ "$fast" = 1 ]; then
  echo "== pytest: the pure and process tiers (no vLLM), on 2 workers"
  # 2 workers (pytest-xdist; `-n N` after --fast overrides): these tiers wait on
  # child processes and sockets more than they compute. The vLLM tier pins
  # engines to cores, so the full run stays on one.
  python -m pytest -ra -m "not vllm" -n 2 --durations=25 "$@"
  exit
fi
if [ $# -gt 0 ]; then
  echo "== pytest"
  python -m pytest -ra --durations=25 "$@"
  exit
fi
# The whole suite in two runs: the pure and process tiers on 2 workers, as
# --fast, then the vLLM tier on one (it pins engines to cores). Both run
# whatever the first gives; the command fails if either failed.
failed=0
echo "== pytest: the pure and process tiers (no vLLM), on 2 workers"
python -m pytest -ra -m "not vllm" -n 2 --durations=25 || failed=1
echo "== pytest: the vLLM tier"
python -m pytest -ra -m vllm --durations=25 || failed=1
[ "$failed" = 0 ]
echo "== pytest: the coordinator's core compiled by mypyc (PUSHKV_MYPYC=1 wheel)"
# -P and --import-mode=append: the compiled copy in build/compiled comes
# before the source tree on sys.path.
PUSHKV_EXPECT_CORE=compiled PYTHONPATH="$PWD/build/compiled" python -P -m pytest -q \
  --import-mode=append -p no:cacheprovider \
  tests/test_core_build.py tests/test_rendezvous.py tests/test_adoption.py tests/test_resubmission.py \
  tests/test_armed_orders.py \
  tests/test_server.py \
  tests/test_batching.py tests/test_fuzz.py tests/test_status_cli.py \
  tests/test_metrics.py tests/test_security.py tests/test_relay.py tests/test_relay_submit.py \
  tests/test_order_size.py tests/test_plugin.py
