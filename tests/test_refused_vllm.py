"""A real vLLM engine with pushkv does not start on a KV cache pushkv cannot transfer exactly.

The model is the tiny Llama with every layer a sliding-window layer (as in
Mistral-7B-v0.1): vLLM 0.32 gives it one KV cache group of
``SlidingWindowSpec``, even with the hybrid KV cache manager off, and frees
blocks outside the window; the connector must refuse it at engine start, and
the server log must say why and what to do instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.vllm_server import VllmServer, pushkv_config
from tests.support.vllm_fixtures import tiny_model_dir_fixture  # noqa: F401

pytestmark = pytest.mark.e2e

WINDOW = 64
START_TIMEOUT_S = 300.0


def all_sliding_window_model(tiny: Path, out: Path) -> Path:
    """The tiny Llama's weights with every layer a sliding-window layer."""
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config["sliding_window"] = WINDOW
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_engine_with_a_sliding_window_group_does_not_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = all_sliding_window_model(tiny_model_dir, tmp_path / "swa")
    # The refusal comes before any coordinator call: nothing listens on port 9.
    config = pushkv_config("kv_producer", "P-refused", "127.0.0.1:9", "http://127.0.0.1:9")
    config["kv_connector_extra_config"]["register_timeout_s"] = 1
    server = VllmServer(model, "refused", kv_transfer_config=config, max_model_len=256).start()
    try:
        assert server.proc is not None
        rc = server.proc.wait(START_TIMEOUT_S)  # the engine must exit, not become healthy
    finally:
        server.stop()
    assert server.log_path is not None
    log = server.log_path.read_text(errors="replace")
    assert rc != 0, log[-4000:]
    for part in (
        "PushKVConnector cannot transfer this KV cache exactly",
        "sliding-window attention as its own KV cache group",
        f"SlidingWindowSpec(sliding_window={WINDOW})",
        "--disable-sliding-window",
    ):
        assert part in log, f"{part!r} not in the server log:\n{log[-4000:]}"
