import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
