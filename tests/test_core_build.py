"""Which build of the coordinator's core runs, and that building it leaves the
package importable with no side effects.

scripts/test.sh runs the core's tests twice: from the source tree (pure
Python), and against a wheel built with PUSHKV_MYPYC=1 with
PUSHKV_EXPECT_CORE=compiled, where this test proves the compiled modules are
the ones imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from controlplane import core_build, rendezvous

ROOT = Path(__file__).resolve().parent.parent


def test_the_expected_build_of_the_core_is_imported() -> None:
    expected = os.environ.get("PUSHKV_EXPECT_CORE", "python")
    assert core_build.core_build() == expected, rendezvous.__file__
    for name in core_build.CORE_MODULES:
        module = sys.modules.get(f"controlplane.{name}") or __import__(
            f"controlplane.{name}", fromlist=["x"]
        )
        suffix = Path(module.__file__ or "").suffix
        assert (suffix == ".py") == (expected == "python"), module.__file__


def test_every_core_module_exists_as_source() -> None:
    for name in core_build.CORE_MODULES:
        assert (ROOT / "controlplane" / f"{name}.py").is_file(), name


def test_importing_the_agent_and_the_connector_imports_no_coordinator_code() -> None:
    code = (
        "import sys, agent.runtime, vllm_integration.client, vllm_integration.router; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'controlplane'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
