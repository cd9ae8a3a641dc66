"""`canary --resource` outside the cluster: the replicas through the API server's pods proxy.

A fake API server (plain HTTP, in a thread) serves the MooncakeServing, answers access reviews and
forwards `pods/POD:PORT/proxy/...` to fake vLLM replicas, as kube-apiserver does for `kubectl proxy`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.canary.models import CanaryConfig, CanaryResult, Verdict
from mooncake_operator.cli.canary_proxy import pod_proxy_url
from mooncake_operator.cli.main import main
from mooncake_operator.kube.config import KubeConfig

pytestmark = pytest.mark.unit

PROXY = re.compile(r"^/api/v1/namespaces/serving-a/pods/chat-replica-(\d+):8080/proxy(/.*)$")


SET_UID = "uid-chat-replica"


def owned_by(kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    return [{"apiVersion": "x", "kind": kind, "name": name, "uid": uid, "controller": True}]


def replica_pods(set_uid: str = SET_UID) -> list[dict[str, Any]]:
    """The pods the serving set's StatefulSet created (its controller reference)."""
    return [
        {
            "metadata": {
                "name": f"chat-replica-{i}",
                "ownerReferences": owned_by("StatefulSet", "chat-replica", set_uid),
            },
            "status": {"podIP": f"10.1.0.{i + 1}"},
        }
        for i in range(2)
    ]


@dataclass
class FakeApiServer:
    replicas: list[str]
    pods: list[dict[str, Any]] = field(default_factory=replica_pods)
    port: int = 8080  # the resource's spec.engine.port
    allowed_verbs: set[str] = field(default_factory=lambda: {"get", "create"})
    proxied: list[str] = field(default_factory=list)
    reviews: list[dict[str, Any]] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    url: str = ""


def serving(port: int = 8080) -> dict[str, Any]:
    obj = reference_deployment().to_wire()
    obj["metadata"] = {"name": "chat", "namespace": "serving-a", "uid": "uid-chat"}
    obj["spec"]["replicas"] = 2
    obj["spec"]["engine"]["port"] = port
    return obj


@pytest.fixture
def api_server() -> Iterator[tuple[FakeApiServer, FakeCluster]]:
    with FakeCluster.start(2, block_size=reference_deployment().spec.engine.block_size) as cluster:
        state = FakeApiServer(replicas=cluster.urls)

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                state.tokens.add(self.headers.get("Authorization", ""))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxied = PROXY.match(self.path)
                if proxied:
                    state.proxied.append(f"{self.command} {self.path}")
                    target = state.replicas[int(proxied.group(1))] + proxied.group(2)
                    headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                    answer = httpx.request(self.command, target, content=body, headers=headers, timeout=30)
                    self._answer(answer.status_code, answer.content, answer.headers.get("content-type", ""))
                elif self.path.endswith("/selfsubjectaccessreviews"):
                    review = json.loads(body)
                    state.reviews.append(review["spec"]["resourceAttributes"])
                    verb = review["spec"]["resourceAttributes"]["verb"]
                    review["status"] = {"allowed": verb in state.allowed_verbs}
                    self._answer(201, json.dumps(review).encode())
                elif self.path.endswith("/namespaces/serving-a/mooncakeservings/chat"):
                    self._answer(200, json.dumps(serving(state.port)).encode())
                elif self.path == "/apis/apps/v1/namespaces/serving-a/statefulsets/chat-replica":
                    metadata = {"name": "chat-replica", "uid": SET_UID}
                    metadata["ownerReferences"] = owned_by("MooncakeServing", "chat", "uid-chat")
                    self._answer(200, json.dumps({"metadata": metadata}).encode())
                elif self.path.startswith("/api/v1/namespaces/serving-a/pods?"):
                    self._answer(200, json.dumps({"metadata": {}, "items": state.pods}).encode())
                else:
                    self._answer(404, b'{"kind":"Status","reason":"NotFound","message":"nothing here"}')

            do_GET = do_POST = _handle

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        state.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield state, cluster
        finally:
            server.shutdown()
            server.server_close()
            thread.join()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    document = {
        "current-context": "laptop",
        "clusters": [{"name": "eks", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {"token": "laptop-token"}}],
        "contexts": [{"name": "laptop", "context": {"cluster": "eks", "user": "me"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(document))
    return path


def test_the_pod_proxy_url_is_the_api_servers() -> None:
    assert pod_proxy_url("https://api.example:443/", "ns", "chat-replica-0", 8000) == (
        "https://api.example:443/api/v1/namespaces/ns/pods/chat-replica-0:8000/proxy"
    )


def test_outside_the_cluster_the_canary_proves_the_replicas_through_the_api_server(
    api_server: tuple[FakeApiServer, FakeCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, _ = api_server
    config = kubeconfig(tmp_path, state.url)
    code = main(["canary", "--resource", "chat", "-n", "serving-a", "--kubeconfig", str(config), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err + captured.out
    result = json.loads(captured.out)
    assert result["verdict"] == "Passed"
    assert "through the API server's pods proxy (chat-replica-0, chat-replica-1)" in captured.err
    # Chat requests and the suite's /tokenize (POST) and metrics reads (GET) all went through the
    # proxy, with the user's token.
    assert {line.split(" ", 1)[0] for line in state.proxied} == {"GET", "POST"}
    assert {re.sub(r"replica-\d", "replica-N", line.split(" ", 1)[1]) for line in state.proxied} == {
        "/api/v1/namespaces/serving-a/pods/chat-replica-N:8080/proxy/metrics",
        "/api/v1/namespaces/serving-a/pods/chat-replica-N:8080/proxy/v1/chat/completions",
        "/api/v1/namespaces/serving-a/pods/chat-replica-N:8080/proxy/tokenize",
    }
    assert state.tokens == {"Bearer laptop-token"}
    assert [review["verb"] for review in state.reviews] == ["get", "create"]
    assert all(
        (r["namespace"], r["resource"], r["subresource"]) == ("serving-a", "pods", "proxy")
        for r in state.reviews
    )


def test_the_body_caps_apply_through_the_proxy(
    api_server: tuple[FakeApiServer, FakeCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, _ = api_server
    config = str(kubeconfig(tmp_path, state.url))
    args = ["canary", "--resource", "serving-a/chat", "--kubeconfig", config, "--max-metrics-bytes", "1024"]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 2  # the metrics pages are larger than 1 KiB: Inconclusive, never read further
    assert "1024" in out


def test_missing_proxy_rights_exit_3_naming_what_to_grant(
    api_server: tuple[FakeApiServer, FakeCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, _ = api_server
    state.allowed_verbs = {"get"}
    code = main(
        ["canary", "--resource", "serving-a/chat", "--kubeconfig", str(kubeconfig(tmp_path, state.url))]
    )
    err = capsys.readouterr().err
    assert code == 3
    assert "not allowed to create pods/proxy in namespace serving-a" in err
    assert "`create` (chat requests) on pods/proxy" in err
    assert state.proxied == []  # nothing was sent to the replicas


def test_namespace_flag_and_a_different_namespace_in_the_reference_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(kubeconfig(tmp_path, "http://127.0.0.1:1"))
    assert main(["canary", "--resource", "a/chat", "-n", "b", "--kubeconfig", config]) == 3
    assert "names namespace a but -n says b" in capsys.readouterr().err
    assert main(["canary", "--replica", "http://a:1", "--replica", "http://b:1", "-n", "x"]) == 3
    assert "-n/--namespace only applies with --resource" in capsys.readouterr().err


def test_a_pod_of_the_replicas_name_that_the_statefulset_did_not_create_is_never_dialled(
    api_server: tuple[FakeApiServer, FakeCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21, item 8: a foreign pod under a replica's name (the real one deleted, another created in
    its place before the StatefulSet could) is not the resource's: exit 3, nothing sent to it."""
    state, _ = api_server
    state.pods = [replica_pods()[0], replica_pods(set_uid="uid-someone-elses")[1]]
    code = main(
        ["canary", "--resource", "serving-a/chat", "--kubeconfig", str(kubeconfig(tmp_path, state.url))]
    )
    err = capsys.readouterr().err
    assert code == 3, err
    assert "replica pod(s) chat-replica-1 not found among the pods StatefulSet chat-replica created" in err
    assert state.proxied == []


def test_inside_the_cluster_the_canary_dials_the_proven_pods_ips(
    api_server: tuple[FakeApiServer, FakeCluster],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod's own service account (as `helm test` runs): no proxy, no access review; the run's replicas
    are the proven pods' IPs (the documentation addresses of `replica_pods`, so the run is recorded, not
    sent), never a DNS name; a pod under a replica's name that another StatefulSet created is skipped."""
    state, _ = api_server
    state.pods = [replica_pods(set_uid="uid-someone-elses")[0], *replica_pods()]
    runs: list[list[str]] = []

    async def recorded(config: CanaryConfig, client: object = None, progress: object = None) -> CanaryResult:
        runs.append(list(config.replicas))
        return CanaryResult(
            run_id="r",
            verdict=Verdict.PASSED,
            reason="recorded",
            replicas=list(config.replicas),
            pairs_mode="first",
            pairs=[],
            expectations=[],
            started_at=datetime(2026, 1, 1, tzinfo=UTC),
            wall_s=0.0,
            request_latency_s=0.0,
        )

    monkeypatch.setattr(KubeConfig, "in_cluster_config", property(lambda self: True))
    monkeypatch.setattr("mooncake_operator.canary.runner.run_canary", recorded)
    config = str(kubeconfig(tmp_path, state.url))
    assert main(["canary", "--resource", "serving-a/chat", "--kubeconfig", config]) == 0, capsys.readouterr()
    assert runs == [["http://10.1.0.1:8080", "http://10.1.0.2:8080"]]
    assert state.proxied == [] and state.reviews == []
