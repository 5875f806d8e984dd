"""`pushkv bench serving`: pushkv against vLLM's own NIXL connectors on real vLLM.

One invocation runs, with the same locally built model, the same prompts and
the same load generator:

- ``pull``: vLLM ``NixlConnector`` (pull), with the standard sequential proxy
  (prefill, relay the returned ``kv_transfer_params``, then decode);
- ``vllm-push``: vLLM ``NixlPushConnector``, with concurrent dispatch of both legs;
- ``pushkv``: pushkv's connector, coordinator and ``pushkv router``;
- ``single``: one engine, no disaggregation (reference line).

Core layout: the prefill engine's worker on core 0 and the decode engine's on
core 1 for every disaggregated system (``VLLM_CPU_OMP_THREADS_BIND``); the
single engine on core 0. With ``--prefill-tp 2`` (pushkv and pull only) the
prefill engine runs TP2, its ranks' workers on cores 0 and 1, into the TP1
decode engine on core 1; the single engine stays TP1. vLLM's NIXL connectors
re-pin their workers to the last core of each NUMA node; a ``sitecustomize`` shim on every server's
``PYTHONPATH`` (``vllm_patches``) skips that call for those two baselines,
exactly as in ``shared/reference/vllm-push-cpu.md``, and gives every system's
NIXL agents pushkv's agent's UCX backend parameters; every server gets the same
UCX environment (``deployment``). The installed vLLM is not modified.

Load: Poisson arrivals at each rate, random-token prompts of uniformly random
length, a fixed output length (``ignore_eos``), streamed, so TTFT is the time
to the first streamed token at the client and TPOT is (last - first) / (n - 1).

Each system's servers start once per scenario and run all rates. Scenarios:
``nocache`` (prefix caching off on every engine, isolating the transfer) and
``prefixhit`` (prefix caching on; the decode engine, or the single engine, is
first warmed with the very prompts of the rate, so it has a full prefix hit and
only the tail is transferred).

Modules: ``config`` (systems, settings), ``workload`` (prompts, arrivals, the
client), ``processes`` (helper processes, /proc and /metrics readings),
``vllm_patches`` (what the sitecustomize shim applies), ``deployment`` (each
system's processes), ``proxy`` (the baselines' proxies), ``measure`` (one
system's run), ``results``, ``report`` and ``main`` (the command line).

This package's ``__init__`` imports nothing: the shim imports
``pushkv.bench.serving.vllm_patches`` at every server process's start.
"""
