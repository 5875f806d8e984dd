"""Engine-loop cost of the pushkv connector: time its hooks spend on vLLM's engine thread.

Runs a prefill engine and a decode engine, each in its own process, each made of:

- a REAL vLLM 0.32 ``Scheduler`` (``KVCacheManager``, ``Request``, block hasher)
  whose KV connector, built by vLLM's ``KVConnectorFactory``, is
  ``PushKVConnector`` in the SCHEDULER role (with its coordinator client thread);
- a ``PushKVConnector`` in the WORKER role over real KV tensors in the CPU
  layout, whose embedded agent WRITEs the KV over NIXL/UCX for real;

against a real coordinator process. The model is played by this module: every
scheduled request whose prompt is complete samples one token, and a busy step
sleeps ``--forward-ms`` (the GIL is free then, as in a real forward). The
worker calls follow ``kv_connector_model_runner_mixin._get_kv_connector_output``:
bind metadata, start_load_kv, (forward), wait_for_save, get_transfer_results,
get_block_ids_with_load_errors, clear metadata; an empty step sleeps 1 ms as
``EngineCore`` does.

Two loads, both by default (``--load``):

- ``poisson``: open loop. Request i arrives at the i-th point of a Poisson
  process of ``--rate`` requests/s (seeded, the same schedule on both engines,
  as a router dispatching both legs at once would give), whether or not
  earlier ones have finished; ``--inflight`` is vLLM's ``max_num_seqs``. At the
  default rate (200/s) the decode engine runs about 190 requests, and a step sees
  the arrivals and departures a serving engine sees.
- ``closed``: each engine keeps ``--inflight`` requests in flight. Requests
  that start together finish together, so arrivals and departures come in
  waves of dozens per step: a stress test of the per-request hooks.

Each runs until ``--requests`` transfers have completed. Every hook call is timed with
``time.perf_counter_ns``; per engine step the scheduler-side and worker-side
totals are kept apart and summed. Steps are split into busy steps (tokens
scheduled: the forward waits for them) and idle steps (nothing scheduled; the
worker's ``get_finished`` may then wait up to ``idle_wait_ms`` for an agent
event on purpose, instead of letting the engine spin).

Each load runs twice, alternated: with pushkv, then with the floor connector
(``pushkv/bench/floor_connector.py``: pushkv's request flow and no work),
so the report can tell vLLM's cost of calling any Python connector on this
machine from pushkv's own (``--connector`` runs one of them).

As in vLLM, each process freezes its start-up heap (``freeze_gc_heap``) before
the loop, so a full garbage collection does not rescan torch and vLLM.

Differences from a real engine, all pessimistic for pushkv: the scheduler and
worker halves share one process and one GIL (in vLLM, EngineCore and the
worker are separate processes), and this box has 2 cores for both engines, the
coordinator and anything else running.

Usage: ``python -m pushkv.bench.hooks [--inflight 256] [--requests 1024]``

Modules: ``config`` (settings, workload, vLLM objects), ``timer`` (the hook
timer), ``engines`` (one engine and its worker, both loads), ``micro``
(``--micro``), ``report`` and ``main`` (the command line).
"""
