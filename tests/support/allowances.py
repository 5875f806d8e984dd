"""Coordinator flags for the vLLM end-to-end tests whose TP2 or PP2 engines
share this machine's 2 cores: starvation allowances, one place for all.

The workers busy-poll vLLM's shared-memory queues on oversubscribed cores,
and a worker's main thread holding the GIL while the OS runs another process
keeps the agent's threads from running: agents have been seen silent for 20 s
and, once, for 60 s (a TP2 prefill rank in a fresh-clone run of the whole
suite; the stall dumps showed torch.compile on the first large batch).
- The lease stays the default 5 s. An agent silent past it keeps its
  registration while its connection answers the coordinator's keepalive pings
  (CoreSettings.silent_agent_s, docs/reliability.md "An agent in a process
  that starves it"): its transfers wait and it posts once a heartbeat is
  answered again. The product's default (30 s) bounds a stuck process; these
  modules allow 180 s.
- A write timeout longer than the default 15 s keeps such a stall from failing
  the order the starved rank holds (120 s, past the longest stall seen).
- The rendezvous timeout (default 60 s) bounds how long an armed transfer
  waits for its prefill. A burst's decode legs register at once and wait while
  the prefill engine works through every prompt: test_tp_vllm's 22 took over
  60 s with one more busy process on the machine (2 of 22 expired armed and
  were recomputed), so 180 s.

These tests prove the mappings; tests/test_tp_faults.py and the rank-kill
tests prove the leases."""

from __future__ import annotations


def starved_coordinator_flags() -> tuple[str, ...]:
    """`pushkv coordinator` flags with the allowances above."""
    return (
        "--silent-agent-s",
        "180",
        "--write-timeout-s",
        "120",
        "--rendezvous-timeout-s",
        "180",
        "--log-level",
        "WARNING",
    )
