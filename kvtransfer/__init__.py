"""Moving KV blocks between replicas: handoff messages, leases, layout fingerprints, backends.

Knows nothing of HTTP, routing or Ray Serve. A prefill replica owns a `KVExporter`
and a decode replica a `KVImporter` (``kvtransfer.handoff``), each over a backend from
``kvtransfer.backends.backend_for``; every message between them and the gateway is in
``kvtransfer.messages``.
"""
