"""vLLM's plugin hook: `PushKVConnector` by name.

pyproject.toml declares `register` under the `vllm.general_plugins` entry
point, which vLLM calls in each process it starts before any connector is
built. So `--kv-transfer-config '{"kv_connector":"PushKVConnector", ...}'`
needs no `kv_connector_module_path`.

A config written for the old layout (`"kv_connector_module_path":
"vllm_integration.connector"`) would fail with a bare `No module named
'vllm_integration'`; `register` also adds a finder, consulted only after every
other, that fails that import naming the new spelling instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

CONNECTOR_NAME = "PushKVConnector"
MODULE_PATH = "pushkv.vllm_integration.connector"
OLD_MODULE_PATH = "vllm_integration.connector"


class _MovedConnector(importlib.abc.MetaPathFinder):
    """Fails an import of the connector's pre-namespace path with the fix."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in ("vllm_integration", OLD_MODULE_PATH):
            raise ModuleNotFoundError(
                f"pushkv's connector moved from {OLD_MODULE_PATH!r}: name it "
                f'"kv_connector": "{CONNECTOR_NAME}" with no kv_connector_module_path '
                f"(or kv_connector_module_path {MODULE_PATH!r})",
                name=fullname,
            )
        return None


def register() -> None:
    """Called by vLLM (perhaps more than once per process): idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    if not any(isinstance(f, _MovedConnector) for f in sys.meta_path):
        sys.meta_path.append(_MovedConnector())
