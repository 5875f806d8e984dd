"""Builders for unit tests against REAL vLLM 0.32 scheduler classes (no model run).

Typical use::

    cfg = make_vllm_config(model_dir, connector_module="tests.support.toy_connector",
                           connector_name="ToyConnector")
    sched = make_scheduler(cfg, num_blocks=256)
    req = make_request("r1", prompt_tokens(40), cfg, kv_transfer_params={...})
    sched.add_request(req)
    out, _ = step(sched)                                   # schedule + update_from_output
    step(sched, connector_output=kv_output(finished_recving={req.request_id}))

The vLLM objects are built by ``pushkv/harness/offline.py``, which the
engine-loop benchmark uses too.

What is real: ``VllmConfig`` (from the tiny model dir), ``Scheduler`` with its
``KVCacheManager``/``BlockPool``, the connector built by ``KVConnectorFactory``
from ``kv_connector_module_path``, ``Request`` with the engine's block hasher,
``ModelRunnerOutput``/``KVConnectorOutput``.  What is faked: the worker; `step`
plays the model runner by sampling one fixed token for every request whose
prefill completed in that step.

Notes (vLLM 0.32.0 behaviour these helpers rely on):
- The scheduler accepts any block size; only a real CPU engine needs a multiple
  of 32 (CPU_ATTN kernel).  16 is fine here.
- ``Request.kv_transfer_params`` is lifted from
  ``SamplingParams.extra_args["kv_transfer_params"]`` exactly like the server does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pushkv.harness import offline

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import KVConnectorOutput

__all__ = [
    "DEFAULT_SAMPLED_TOKEN",
    "kv_output",
    "make_kv_cache_config",
    "make_model_runner_output",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "num_free_blocks",
    "prompt_tokens",
    "step",
]

DEFAULT_SAMPLED_TOKEN = offline.SAMPLED_TOKEN  # not EOS (id 0) in the tiny model

# A ``VllmConfig`` for the tiny model with a KV connector, the toy one unless
# ``connector_module``/``connector_name`` say otherwise (``connector_module=None``
# selects ``connector_name`` from vLLM's registry, e.g. ``"NixlConnector"``).
make_vllm_config = functools.partial(
    offline.vllm_config,
    connector_module="tests.support.toy_connector",
    connector_name="ToyConnector",
    kv_role="kv_both",
)

# One ``FullAttentionSpec`` group covering every decoder layer of the model.
make_kv_cache_config = offline.kv_cache_config

# A real v1 ``Scheduler``; its connector (SCHEDULER role), built by
# ``KVConnectorFactory``, is ``scheduler.connector``.
make_scheduler = offline.scheduler


def prompt_tokens(n: int, *, seed: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` deterministic token ids in ``[4, vocab)`` (ids 0-3 are special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


# A real ``Request`` with the engine's block hasher; kv_transfer_params travel
# as the OpenAI server passes them (copied, so a connector may mutate them).
make_request = offline.request


def kv_output(
    *,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
) -> KVConnectorOutput:
    """A ``KVConnectorOutput`` as the (aggregated) workers would report it.

    Contract (vLLM 0.32): a failed async load must be reported in BOTH
    ``failed_recving`` and ``finished_recving`` in the same step.
    """
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_sending=set(finished_sending) or None,
        finished_recving=set(finished_recving) or None,
        failed_recving=set(failed_recving),
        invalid_block_ids=set(invalid_block_ids),
    )


# What the model runner returns for a scheduler output: every scheduled request
# whose prefill is complete after the step samples ``sampled_token``.
make_model_runner_output = offline.runner_output


def step(
    scheduler: Scheduler,
    *,
    connector_output: KVConnectorOutput | None = None,
    sampled_token: int = DEFAULT_SAMPLED_TOKEN,
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """One engine step: ``schedule()`` then ``update_from_output()``.

    ``connector_output`` is what the workers report at the end of this step
    (completions are processed after the step's tokens, as in the engine).
    """
    scheduler_output = scheduler.schedule()
    runner_output = make_model_runner_output(
        scheduler,
        scheduler_output,
        kv_connector_output=connector_output,
        sampled_token=sampled_token,
    )
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def num_free_blocks(scheduler: Scheduler) -> int:
    """Free blocks in the scheduler's block pool (includes evictable cached blocks)."""
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
