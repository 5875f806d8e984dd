"""What every side needs to speak the contract (proto/pushkv): TLS channels,
the meaning of the coordinator's status codes, and the rule that pairs a
prefill with a decode engine. Below the coordinator, the agent and the vLLM
integration alike; imports nothing of theirs."""
