"""mooncake-operator: vLLM replicas sharing a Mooncake KV store, proven by a warm/cold canary."""

__version__ = "0.2.0"
