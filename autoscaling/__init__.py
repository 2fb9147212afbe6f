"""Goodput-driven autoscaling: the per-pool settings, the signals replicas report,
and the pure policy that turns them into replica counts, beside the rule that
places each request's prefill (`placement`; no Ray: the Serve controller, the
gateway and loadgen's simulators run the same code)."""
