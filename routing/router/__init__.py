"""The KV-aware router: the pure cost policy and its settings (`policy`), the Ray
Serve request routers that feed it (`serve_routers`), session affinity (`affinity`).
The prefix index it reads lives in `kvtransfer.events` (the replicas write it)."""
