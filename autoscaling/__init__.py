"""Goodput-driven autoscaling: the per-pool settings, the signals replicas report,
and the pure policy that turns them into replica counts (no Ray: the Serve
controller and loadgen's simulator run the same code)."""
