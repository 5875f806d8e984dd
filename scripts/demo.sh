#!/usr/bin/env bash
# Set up (if needed) and run the local demo on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PUSHKV_VENV:-.venv}
export NIXL_LOG_LEVEL=WARN UCX_LOG_LEVEL=error UCX_NET_DEVICES=lo
exec "$VENV/bin/pushkv" demo "$@"
