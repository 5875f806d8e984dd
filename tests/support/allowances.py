"""Coordinator flags for the vLLM end-to-end tests whose TP2 or PP2 engines
share this machine's 2 cores: starvation allowances, one place for all.

The workers busy-poll vLLM's shared-memory queues on oversubscribed cores.
- A lease longer than the default 5 s keeps a starved agent thread's late
  heartbeat from failing every transfer of its engine. 20 s was seen to lapse
  once in a full CI run (a decode rank's agent silent for 20 s while 4 TP
  workers shared the 2 cores), and once with the PP2 prefill's 2 workers and
  the decode worker, so the TP2-into-TP2 and PP2 modules take 60 s. 60 s
  lapsed once too (a TP2 prefill rank's agent, in a fresh-clone run of the
  whole suite): the mapping tests then let by the transfers a lapse failed,
  only where the prefill agent logged that its process starved it
  (tests/support/serving.split_starved), and the engines dump their threads'
  stacks after such a stall with PUSHKV_TEST_HANG_DUMP_S set
  (pushkv/harness/vllm_server.pushkv_config).
- A write timeout longer than the default 15 s does the same for a starved
  rank's DONE report.
- The rendezvous timeout (default 60 s) bounds how long an armed transfer
  waits for its prefill. A burst's decode legs register at once and wait while
  the prefill engine works through every prompt: test_tp_vllm's 22 took over
  60 s with one more busy process on the machine (2 of 22 expired armed and
  were recomputed), so 180 s.

These tests prove the mappings; tests/test_tp_faults.py and the rank-kill
tests prove the leases."""

from __future__ import annotations


def starved_coordinator_flags(lease_s: int) -> tuple[str, ...]:
    """`pushkv coordinator` flags with the allowances above and `lease_s`."""
    return (
        "--lease-s",
        str(lease_s),
        "--write-timeout-s",
        "60",
        "--rendezvous-timeout-s",
        "180",
        "--log-level",
        "WARNING",
    )
