"""The Kubernetes API client the operator, `canary --resource` and the tests use (kopf keeps its own).

`errors` (what it raises), `config` (kubeconfig and in-cluster settings), `exec_auth` (kubeconfig exec
plugins), `kinds` (kinds and REST paths), `events` (Event manifests), `client` (KubeClient).
"""
