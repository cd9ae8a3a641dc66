"""An in-memory API server for unit tests of the operator's runtime: the watch cache's watches report
nothing and its first lists find nothing (unless `lists`), and every other request goes to `handler`."""

from __future__ import annotations

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
