"""vLLM finds PushKVConnector by name through pushkv's `vllm.general_plugins`
entry point (vllm_integration/plugin.py), and a config that still names the
pre-namespace module path fails with the new spelling.

Each case runs in a fresh interpreter, as vLLM's own processes do: the
plugins are loaded once per process, and the old-path finder is process-wide.
The end-to-end tests start their engines with the name alone
(pushkv/harness/vllm_server.pushkv_config)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOAD = """
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

load_general_plugins()
load_general_plugins()  # idempotent, as vLLM may call it more than once
config = KVTransferConfig(kv_connector="PushKVConnector", kv_role="kv_producer"{extra})
cls = KVConnectorFactory.get_connector_class(config)
import sys
print(sys.modules[cls.__module__].__file__)
print(cls.__module__, cls.__name__)
"""


def _run(extra: str = "") -> subprocess.CompletedProcess[str]:
    # Not from the repository's root, where the design's folders
    # (vllm_integration/, ...) would import under their own names too: as
    # from an installed pushkv.
    return subprocess.run(
        [sys.executable, "-c", LOAD.format(extra=extra)],
        cwd=ROOT / "tests",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_entry_point_is_declared() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "pushkv"]
    assert ep.value == "pushkv.vllm_integration.plugin:register"


def test_vllm_loads_the_connector_by_name() -> None:
    """From the install the tests run against: the source tree, or (the
    compiled-core pass, scripts/test.sh) the wheel unpacked on PYTHONPATH,
    whose own entry point then names the connector."""
    out = _run()
    assert out.returncode == 0, out.stderr[-3000:]
    *_, where, line = out.stdout.strip().splitlines()
    assert line.split() == ["pushkv.vllm_integration.connector", "PushKVConnector"]
    if os.environ.get("PUSHKV_EXPECT_CORE") == "compiled":
        wheel = os.environ["PYTHONPATH"].split(os.pathsep)[0]
        assert where.startswith(wheel), (where, wheel)
    else:
        assert where.startswith(str(ROOT)), where


def test_the_new_module_path_still_works() -> None:
    out = _run(', kv_connector_module_path="pushkv.vllm_integration.connector"')
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "PushKVConnector"


def test_the_old_module_path_names_the_new_spelling() -> None:
    out = _run(', kv_connector_module_path="vllm_integration.connector"')
    assert out.returncode != 0
    (last,) = out.stderr.strip().splitlines()[-1:]
    assert last.startswith("ModuleNotFoundError: pushkv's connector moved from ")
    assert '"kv_connector": "PushKVConnector" with no kv_connector_module_path' in last
