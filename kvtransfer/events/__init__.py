"""KV events between the replicas that emit them and the routers that mirror them:
the per-replica event log (`log`), the prefix index (`prefix_index`, in-process or
Redis) and its settings (`config`). Prefill publishes, routing consumes; both import
this package, so the contract lives here, below them."""
