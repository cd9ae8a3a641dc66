"""Fake API servers for unit tests of the operator's runtime: `runtime_answering(handler)` starts a runtime
whose watches report nothing and whose first lists find nothing (unless `lists`), every other request
going to `handler`; `InMemoryApi` is such a handler holding objects, for tests of a whole reconcile."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.kinds import SERVING_KIND
from mooncake_operator.reconcile.act.core import Runtime
from mooncake_operator.runtime.settings import OperatorSettings

Handler = Callable[[httpx.Request], httpx.Response]
CONFIG = KubeConfig(server="https://127.0.0.1:6443", token="t")


def quiet_watches(handler: Handler, *, lists: bool = False) -> httpx.MockTransport:
    """`handler` behind watches that report nothing and (unless `lists`) first lists that find nothing."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("watch") == "true":
            return httpx.Response(200, content=b"")
        if request.url.params.get("limit") and not lists:  # the watch cache's first list
            return httpx.Response(200, json={"items": [], "metadata": {"resourceVersion": "1"}})
        return handler(request)

    return httpx.MockTransport(answer)


def runtime_answering(handler: Handler, *, lists: bool = False, **settings: Any) -> Runtime:
    """A started runtime (watching namespace "ns", no metrics port unless `settings` say otherwise) whose
    API server is `quiet_watches(handler)`; the caller closes it."""
    kube = KubeClient(CONFIG, transport=quiet_watches(handler, lists=lists), kinds=[SERVING_KIND])
    return Runtime.start(
        OperatorSettings(**{"kube": CONFIG, "namespaces": ("ns",), "metrics_port": 0, **settings}), kube
    )


class InMemoryApi:
    """An in-memory API server for a whole reconcile: objects by path (`put`), label-selected lists, pod
    label patches, a status subresource that can be made to fail (`fail_status`); other writes are echoed.
    Requests are recorded as (method, path). `runtime_answering(api.handle, lists=True)` serves it."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_status = False

    def put(self, path: str, obj: dict[str, Any]) -> None:
        self.objects[path] = obj

    def handle(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        self.requests.append((method, path))
        if method == "GET" and path in self.objects:
            return httpx.Response(200, json=self.objects[path])
        if method == "GET" and not request.url.params.get("limit"):
            return httpx.Response(404, json={"kind": "Status", "reason": "NotFound", "code": 404})
        if method == "GET":
            selector = request.url.params.get("labelSelector")
            wanted = dict(item.split("=", 1) for item in selector.split(",")) if selector else {}
            items = [
                obj
                for key, obj in sorted(self.objects.items())
                if key.startswith(path + "/")
                and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            ]
            return httpx.Response(200, json={"items": items, "metadata": {"resourceVersion": "1"}})
        if method == "PATCH" and path.endswith("/status") and self.fail_status:
            failure = {"kind": "Status", "reason": "InternalError", "message": "etcd timeout", "code": 500}
            return httpx.Response(500, json=failure)
        if method == "PATCH" and "/pods/" in path:
            labels = json.loads(request.content)["metadata"]["labels"]
            self.objects[path]["metadata"]["labels"].update(labels)
            return httpx.Response(200, json=self.objects[path])
        if method in ("PATCH", "POST"):
            return httpx.Response(200, json=json.loads(request.content))
        if method == "DELETE" and path in self.objects:
            return httpx.Response(200, json=self.objects.pop(path))
        raise AssertionError(f"unexpected {method} {path}")
