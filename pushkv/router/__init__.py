"""`pushkv router`: the OpenAI-compatible front that dispatches both legs of a
request at once. It speaks HTTP to the engines and the contract to the
coordinator, and imports no vLLM."""
