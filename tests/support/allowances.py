"""Coordinator flags for the vLLM end-to-end tests whose TP2 or PP2 engines
share this machine's 2 cores: starvation allowances, one place for all.

The workers busy-poll vLLM's shared-memory queues on oversubscribed cores,
and a worker's main thread holding the GIL while the OS runs another process
keeps the agent's threads from running: agents have been seen silent for 20 s
and, once, for 60 s (a TP2 prefill rank in a fresh-clone run of the whole
suite; the stall dumps showed torch.compile on the first large batch).
- An agent silent past its lease keeps its registration while its
  connection answers the coordinator's keepalive pings
  (CoreSettings.silent_agent_s, docs/reliability.md "An agent in a process
  that starves it"): its transfers wait and it posts once a heartbeat is
  answered again. The product's default (30 s) bounds a stuck process; these
  modules allow 180 s.
- The coordinator starves too: its event loop has stalled for up to 20 s in
  a fresh-clone run (TP2 into TP2, 6 vLLM processes on 2 cores). Its agents
  then hear nothing for that long, leave a stream silent past the lease,
  and the coordinator, back, finds their leases over. So these modules keep
  a lease of `lease_s` (20 or 60 s) as well; the both-cores-loaded bursts
  passed 5 runs in a row on the default 5 s lease (the stop-55 note), with an
  agent stalled 6.1 s.
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


def starved_coordinator_flags(lease_s: int) -> tuple[str, ...]:
    """`pushkv coordinator` flags with the allowances above and `lease_s`."""
    return (
        "--lease-s",
        str(lease_s),
        "--silent-agent-s",
        "180",
        "--write-timeout-s",
        "120",
        "--rendezvous-timeout-s",
        "180",
        "--log-level",
        "WARNING",
    )
