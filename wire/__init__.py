"""What every side needs to speak the contract (proto/pushkv): TLS channels and
the meaning of the coordinator's status codes. Below the coordinator, the agent
and the vLLM integration alike; imports nothing of theirs."""
