"""Which build of the coordinator's core runs, and that building it leaves the
package importable with no side effects.

scripts/test.sh runs the core's tests twice: from the source tree (pure
Python), and against a wheel built with PUSHKV_MYPYC=1 with
PUSHKV_EXPECT_CORE=compiled, where this test proves the compiled modules are
the ones imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pushkv.controlplane import core_build, rendezvous

ROOT = Path(__file__).resolve().parent.parent


def test_the_expected_build_of_the_core_is_imported() -> None:
    expected = os.environ.get("PUSHKV_EXPECT_CORE", "python")
    assert core_build.core_build() == expected, rendezvous.__file__
    for name in core_build.CORE_MODULES:
        module = sys.modules.get(f"pushkv.controlplane.{name}") or __import__(
            f"pushkv.controlplane.{name}", fromlist=["x"]
        )
        suffix = Path(module.__file__ or "").suffix
        assert (suffix == ".py") == (expected == "python"), module.__file__


def test_every_core_module_exists_as_source() -> None:
    for name in core_build.CORE_MODULES:
        assert (ROOT / "controlplane" / f"{name}.py").is_file(), name


def test_importing_the_agent_and_the_connector_imports_no_coordinator_code() -> None:
    code = (
        "import json, sys, pushkv.agent.runtime, pushkv.vllm_integration.client, "
        "pushkv.vllm_integration.connector, pushkv.router.app, pushkv.relay.server, "
        "pushkv.tools.status; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('pushkv.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "pushkv.agent.runtime" in loaded and "pushkv.vllm_integration.connector" in loaded
    assert [m for m in loaded if m.startswith("pushkv.controlplane")] == []


def test_a_compiled_build_without_the_dependencies_says_what_is_missing() -> None:
    """PUSHKV_MYPYC=1 in an environment that lacks what mypyc type-checks
    against (pip's isolated build has none of it) stops before compiling,
    naming the missing distributions and the commands that work."""
    code = (
        "import importlib.metadata as m, runpy, sys\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name in ('structlog', 'grpc-stubs'):\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "sys.argv = ['setup.py', '--name']\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
    )
    env = {**os.environ, "PUSHKV_MYPYC": "1"}
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode != 0
    assert "lacks structlog, grpc-stubs." in out.stderr, out.stderr
    assert "pip install '.[compile]'" in out.stderr
    assert "--no-build-isolation" in out.stderr
