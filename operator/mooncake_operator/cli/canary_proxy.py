"""`canary --resource` from outside the cluster: reach the replicas through the API server.

A laptop cannot dial `SET-0.NAME-replicas.NS.svc`: those names and the pod network exist only inside the
cluster. The API server's pods proxy subresource (`/api/v1/namespaces/NS/pods/POD:PORT/proxy/...`, what
`kubectl proxy` serves) forwards a request to a pod with the caller's own credentials. The canary then
runs unchanged: the proxy URLs are its replica base URLs (a path prefix is a valid base URL), and one
httpx client carries the API server's TLS settings and the kubeconfig's credentials, so the canary's body
caps, timeouts and URL redaction apply as they do on the direct path.

RBAC: the chat request is a POST (verb `create` on `pods/proxy`), the metrics read a GET (verb `get`).
Both are checked first with a SelfSubjectAccessReview, so missing rights are a clear usage error (exit 3)
rather than an Inconclusive run full of 403 answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

import httpx

from mooncake_operator.kube.client import KubeAuth, KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError, KubeTransportError

# The verbs a proxied request needs: POST /v1/chat/completions is `create`, GET /metrics is `get`.
PROXY_VERBS = ("get", "create")


class ProxyAccessError(Exception):
    """The caller may not reach the replicas through the API server; the message says what to grant."""


def pod_proxy_url(server: str, namespace: str, pod: str, port: int) -> str:
    """The base URL of `pod`'s `port` through the API server's pods proxy subresource."""
    name = quote(f"{pod}:{port}", safe=":")
    return f"{server.rstrip('/')}/api/v1/namespaces/{quote(namespace, safe='')}/pods/{name}/proxy"


def proxy_urls(server: str, namespace: str, pods: Sequence[str], port: int) -> list[str]:
    return [pod_proxy_url(server, namespace, pod, port) for pod in pods]


def proxy_client(config: KubeConfig) -> httpx.AsyncClient:
    """The HTTP client the canary runs with through the API server: its CA and client certificate, the
    kubeconfig's bearer token (an exec plugin's, re-run on 401). No environment proxies: the API server
    is reached as the kubeconfig says, like the operator's own client."""
    return httpx.AsyncClient(verify=config.ssl_context(), auth=KubeAuth(config), trust_env=False)


def _review(namespace: str, verb: str) -> dict[str, object]:
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {
            "resourceAttributes": {
                "namespace": namespace,
                "verb": verb,
                "resource": "pods",
                "subresource": "proxy",
            }
        },
    }


async def check_proxy_access(kube: KubeClient, namespace: str) -> None:
    """Raises ProxyAccessError when the caller lacks `get` or `create` on pods/proxy in `namespace`.

    A cluster that does not answer access reviews (an authorizer that refuses them) is not judged here:
    the run then says what the proxy answered.
    """
    missing: list[str] = []
    for verb in PROXY_VERBS:
        try:
            review = await kube.create(_review(namespace, verb))
        except KubeApiError as error:
            if error.status == 401:
                raise ProxyAccessError(
                    f"the API server did not accept the credentials (401): {error.message}"
                ) from None
            return  # access reviews unavailable: let the proxied requests speak
        except KubeTransportError as error:
            raise ProxyAccessError(f"cannot reach the API server: {error}") from None
        status = review.get("status") or {}
        if not status.get("allowed"):
            missing.append(verb)
    if missing:
        raise ProxyAccessError(
            f"not allowed to {' and '.join(missing)} pods/proxy in namespace {namespace}: outside the "
            "cluster the canary reaches the replicas through the API server's pods proxy, which needs "
            "`get` (metrics) and `create` (chat requests) on pods/proxy there; grant them with a Role "
            "(see docs/canary.md), or run the canary inside the cluster (kubectl run ... -- canary)"
        )
