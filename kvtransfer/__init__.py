"""Moving KV blocks between replicas: handoff messages, leases, layout fingerprints, backends.

Knows nothing of HTTP, routing or Ray Serve; the prefill and decode deployments call
``export_kv`` / ``pull_kv`` (``kvtransfer.handoff``), a ``LeaseTable`` and a backend
from ``make_backend``.
"""
