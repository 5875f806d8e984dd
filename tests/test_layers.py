"""The import contracts in pyproject.toml ([tool.importlinter]) hold for the
tree, and a deliberately wrong import breaks them: each case copies the
`pushkv` tree (its links to the design's folders followed), adds one bad
module, and runs `lint-imports` on the copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "pushkv", dest / "pushkv", ignore=ignore)  # links followed
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_packages"]  # the section this test relies on
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(where / "pyproject.toml")],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    out = _lint(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "source", "contract"),
    [
        ("agent/_bad.py", "import pushkv.controlplane.rendezvous\n", "contract-only"),
        ("vllm_integration/_bad.py", "from pushkv.controlplane import errors\n", "contract-only"),
        ("router/_bad.py", "from pushkv.controlplane import errors\n", "contract-only"),
        ("tools/_bad.py", "from pushkv.controlplane import timeline\n", "contract-only"),
        ("controlplane/_bad.py", "import pushkv.agent.runtime\n", "coordinator-alone"),
        ("net/_bad.py", "import pushkv.agent.events\n", "layers"),
        ("rules/_bad.py", "import pushkv.net.tls\n", "layers"),
        ("agent/_bad.py", "import pushkv.vllm_integration.params\n", "layers"),
        ("vllm_integration/_bad.py", "import pushkv.harness.tiny_model\n", "layers"),
        ("controlplane/_bad.py", "import nixl\n", "nixl-in-agent"),
        ("agent/_bad.py", "import vllm\n", "vllm-in-integration"),
        ("router/_bad.py", "import vllm\n", "vllm-in-integration"),
        ("agent/_bad.py", "import controlplane\n", "one-namespace"),
    ],
    ids=[
        "agent-imports-coordinator",
        "connector-imports-coordinator",
        "router-imports-coordinator",
        "tools-import-coordinator",
        "coordinator-imports-agent",
        "net-imports-agent",
        "rules-import-net",
        "agent-imports-connector",
        "product-imports-harness",
        "coordinator-imports-nixl",
        "agent-imports-vllm",
        "router-imports-vllm",
        "agent-imports-an-old-top-level-name",
    ],
)
def test_a_wrong_import_breaks_a_contract(
    tmp_path: Path, module: str, source: str, contract: str
) -> None:
    _copy_tree(tmp_path)
    (tmp_path / "pushkv" / module).write_text(f'"""A deliberately wrong import."""\n\n{source}')
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    names = {c["id"]: c["name"] for c in config["contracts"]}
    text = " ".join(out.stdout.split())  # lint-imports wraps long names
    assert f"{names[contract]} BROKEN" in text, out.stdout
    assert text.count("BROKEN") == 1, out.stdout  # that contract alone
