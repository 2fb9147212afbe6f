import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# As `duet` does (cluster/cli.py): no idle plain workers prestarted for the tests' clusters.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# A Serve router sends a request to the replica its policy chose only if that replica
# answers a queue-length probe within this deadline (Serve's default 0.1 s), else it
# falls back to the policy's next choice. On 2 shared cores a replica that has just
# computed a prefill can miss 0.1 s, which overrode the KV-aware router's choice in
# test_kv_routing.py; tests call through routers in this process (the driver).
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
