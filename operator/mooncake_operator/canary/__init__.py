"""Warm/cold canary: proof that an answer computed from a prefix loaded from the store equals the cold one.

Nothing of Kubernetes: it runs against any vLLM replicas (httpx, pydantic, prometheus_client's text
parser). Import its modules directly: this package module imports nothing, so `canary --help` (which
reads `defaults`) starts without loading pydantic or httpx.
"""
