"""The request path up to a replica: `routing.openai` (the OpenAI gateway and its
prefill→decode pipeline) and `routing.router` (the KV-aware replica choice)."""
