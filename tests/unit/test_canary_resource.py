"""`mooncake-operator canary --resource`: which set it proves, with which config, and every way the
resource can be unreadable (exit 3 with the reason, never a traceback). The API server is a loopback
HTTP server answering what each test says; the canary's replica runs are covered by test_canary_cli."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mooncake_operator.api import resource as api
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.build import names as render
from mooncake_operator.canary import policy as canary_policy
from mooncake_operator.canary.models import CanaryResult, ExitCode, PairResult, Verdict
from mooncake_operator.cli.canary import with_how_flags
from mooncake_operator.cli.canary_resource import (
    ResourceError,
    ResourceRef,
    effective_result,
    parse_ref,
    pod_urls,
    proven_replica_pods,
    resource_canary,
    serving_set,
)
from mooncake_operator.cli.main import build_parser, main

pytestmark = pytest.mark.unit


def serving(name: str = "chat", namespace: str = "serving-a", **status: Any) -> dict[str, Any]:
    obj = reference_deployment().to_wire()
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"]["replicas"] = 3
    obj["spec"]["engine"]["port"] = 8080
    if status:
        obj["status"] = status
    return obj


def blue_green(**rollout: Any) -> api.MooncakeServing:
    obj = serving(rollout={"strategy": "BlueGreen", **rollout})
    obj["spec"]["rollout"] = {"strategy": "BlueGreen"}
    return api.parse_resource(obj)


# --- the pure resolution -------------------------------------------------------------------------------


def controller(kind: str, uid: str) -> list[dict[str, Any]]:
    return [{"kind": kind, "name": "x", "uid": uid, "controller": True}]


def test_only_pods_the_serving_sets_statefulset_created_are_proven() -> None:
    """Issue 21, item 8: the StatefulSet must be the resource's (UID), each pod the StatefulSet's (UID);
    inside the cluster each is dialled at its IP, not by a DNS name a foreign pod can share."""
    obj = serving()
    obj["metadata"]["uid"] = "uid-chat"
    resource = api.parse_resource(obj)
    stateful_set = {"metadata": {"uid": "sts", "ownerReferences": controller("MooncakeServing", "uid-chat")}}

    def pod(name: str, uid: str = "sts", ip: str | None = "10.0.0.1") -> dict[str, Any]:
        status = {"podIP": ip} if ip else {}
        return {
            "metadata": {"name": name, "ownerReferences": controller("StatefulSet", uid)},
            "status": status,
        }

    ours = [pod("chat-replica-0"), pod("chat-replica-1", ip="fd00::2"), pod("chat-replica-2", ip=None)]
    # Listed first, with the labels and a replica's name: another set's pod is not proven.
    proven = proven_replica_pods(
        resource, "chat-replica", stateful_set, [pod("chat-replica-0", "sts-x"), *ours]
    )
    assert [p.name for p in proven] == ["chat-replica-0", "chat-replica-1", "chat-replica-2"]
    assert [p.url(8080) for p in proven[:2]] == ["http://10.0.0.1:8080", "http://[fd00::2]:8080"]
    with pytest.raises(ResourceError, match="chat-replica-2 has no IP yet"):
        proven[2].url(8080)
    with pytest.raises(ResourceError, match=r"share an address \(http://10.0.0.1:8080\)"):
        pod_urls([proven[0], proven[0]], 8080)
    with pytest.raises(ResourceError, match="chat-replica-1 not found among the pods"):
        proven_replica_pods(
            resource, "chat-replica", stateful_set, [ours[0], pod("chat-replica-1", "sts-x"), ours[2]]
        )
    foreign_set = {"metadata": {"uid": "sts", "ownerReferences": controller("MooncakeServing", "uid-other")}}
    with pytest.raises(ResourceError, match="is not controlled by MooncakeServing serving-a/chat"):
        proven_replica_pods(resource, "chat-replica", foreign_set, ours)
    with pytest.raises(ResourceError, match="StatefulSet serving-a/chat-replica of MooncakeServing"):
        proven_replica_pods(resource, "chat-replica", None, ours)


def test_without_a_recorded_set_the_default_set_is_proven() -> None:
    resource = api.parse_resource(serving())
    planned = resource_canary(resource)
    assert planned.serving_set == "chat-replica"
    assert planned.config.replicas == [
        f"http://chat-replica-{i}.chat-replicas.serving-a.svc:8080" for i in range(3)
    ]
    assert planned.notes == ()


def test_after_a_blue_green_switch_the_recorded_serving_set_is_proven() -> None:
    resource = blue_green(servingSet="chat-r0a1b2c3")
    planned = resource_canary(resource)
    assert planned.serving_set == "chat-r0a1b2c3"
    assert planned.config.replicas == render.replica_urls(resource, "chat-r0a1b2c3")
    assert planned.config.replicas[0] == "http://chat-r0a1b2c3-0.chat-replicas.serving-a.svc:8080"


def test_a_candidate_being_proven_is_not_the_serving_set() -> None:
    resource = blue_green(servingSet="chat-replica", candidateSet="chat-r9f8e7d6", candidatePhase="Canary")
    planned = resource_canary(resource)
    assert serving_set(resource) == "chat-replica"
    assert all("chat-replica-" in url for url in planned.config.replicas)
    assert planned.notes and "candidate set chat-r9f8e7d6" in planned.notes[0]


def test_the_config_is_the_operators() -> None:
    obj = serving()
    obj["spec"]["canary"].update({"pairs": "first", "timeoutSeconds": 42, "requireExternalHit": False})
    resource = api.parse_resource(obj)
    planned = resource_canary(resource)
    assert planned.config == canary_policy.canary_config(resource.spec, render.replica_urls(resource))
    assert planned.config.block_size == resource.spec.engine.block_size
    assert planned.config.eagle is (resource.spec.speculative is not None)
    assert planned.config.request["model"] == resource.spec.model.name
    assert (planned.config.pairs, planned.config.request_timeout_s) == ("first", 42)
    assert planned.require_external_hit is False


def test_proving_a_resource_needs_neither_the_reconcile_package_nor_kopf() -> None:
    """The canary's policy from a spec lives beside the API: `canary --resource` (and the sandbox) load
    no reconciler and no kopf to build the operator's config and read its verdict."""
    code = (
        "import sys\n"
        "from mooncake_operator.api import resource as api\n"
        "from mooncake_operator.cli.canary_resource import effective_result, resource_canary\n"
        "from mooncake_operator.api.examples import reference_deployment\n"
        "obj = reference_deployment().to_wire()\n"
        "obj['metadata'] = {'name': 'chat', 'namespace': 'ns'}\n"
        "resource_canary(api.parse_resource(obj))\n"
        "loaded = [m for m in sys.modules if m == 'kopf' or m.startswith('mooncake_operator.reconcile')]\n"
        "print(sorted(loaded))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_a_resource_the_canary_cannot_prove_is_a_clear_error() -> None:
    obj = serving()
    obj["spec"]["replicas"] = 1
    obj["spec"]["canary"] = {"enabled": False}
    with pytest.raises(ResourceError, match="serving-a/chat cannot be proven: replicas"):
        resource_canary(api.parse_resource(obj))


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("ns/chat", "other", ResourceRef("ns", "chat")),
        ("chat", "from-kubeconfig", ResourceRef("from-kubeconfig", "chat")),
        ("chat", None, ResourceRef("default", "chat")),
    ],
)
def test_the_namespace_is_given_else_the_kubeconfigs_else_default(
    text: str, default: str | None, expected: ResourceRef
) -> None:
    assert parse_ref(text, default) == expected


@pytest.mark.parametrize("text", ["/chat", "ns/", "a/b/c", ""])
def test_malformed_references_are_refused(text: str) -> None:
    with pytest.raises(ResourceError, match="give NAME or NAMESPACE/NAME"):
        parse_ref(text, None)


def test_how_flags_override_the_resource_only_when_given() -> None:
    planned = resource_canary(api.parse_resource(serving()))
    parser = build_parser()
    kept = with_how_flags(planned.config, parser.parse_args(["canary", "--resource", "chat"]))
    assert kept == planned.config
    changed = with_how_flags(
        planned.config,
        parser.parse_args(["canary", "--resource", "chat", "--timeout", "7", "--retries", "0"]),
    )
    assert (changed.request_timeout_s, changed.connect_retries) == (7, 0)
    assert changed.model_copy(update={"request_timeout_s": 300.0, "connect_retries": 3}) == planned.config


def test_the_put_wait_comes_from_the_spec_unless_put_wait_is_given() -> None:
    obj = serving()
    obj["spec"]["canary"]["putWaitSeconds"] = 25
    planned = resource_canary(api.parse_resource(obj))
    assert planned.config.put_wait_s == 25
    parser = build_parser()
    kept = with_how_flags(planned.config, parser.parse_args(["canary", "--resource", "chat"]))
    assert kept.put_wait_s == 25
    given = with_how_flags(
        planned.config, parser.parse_args(["canary", "--resource", "chat", "--put-wait", "3"])
    )
    assert given.put_wait_s == 3


def unproven_run(*, only_load_unproven: bool = True) -> CanaryResult:
    urls = ["http://a:1", "http://b:1"]
    pair = PairResult(
        index=0,
        writer=urls[0],
        reader=urls[1],
        cache_salt="s",
        verdict=Verdict.INCONCLUSIVE,
        reasons=["no external hit"],
        answers_equal=True,
        only_load_unproven=only_load_unproven,
    )
    return CanaryResult(
        run_id="r",
        verdict=Verdict.INCONCLUSIVE,
        reason="no external hit",
        replicas=urls,
        pairs_mode="first",
        pairs=[pair],
        expectations=[],
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        wall_s=1.0,
        request_latency_s=1.0,
    )


def test_the_exit_status_follows_the_operators_effective_verdict() -> None:
    run = unproven_run()
    assert effective_result(run, require_external_hit=True).exit_code == ExitCode.INCONCLUSIVE
    passed = effective_result(run, require_external_hit=False)
    assert passed.verdict is Verdict.PASSED
    assert passed.exit_code == ExitCode.PASSED
    assert passed.reason.startswith("passed without a proven external hit (requireExternalHit: false)")


def test_requiring_no_external_hit_never_passes_an_unproven_reference_or_comparison() -> None:
    """requireExternalHit: false forgives the reader's load only: a cold answer not shown to be cold, or
    content that could not be judged, stays Inconclusive."""
    run = unproven_run(only_load_unproven=False)
    assert effective_result(run, require_external_hit=False).verdict is Verdict.INCONCLUSIVE


# --- the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--block-size", "16"],
        ["--block-size", "0"],
        ["--eagle"],
        ["--model", "m"],
        ["--request", "chat.json"],
        ["--expect", "e.yaml"],
        ["--no-expect"],
        ["--expected-hit", "128"],
        ["--pairs", "ring"],
        ["--no-expect", "--pairs", "first"],
    ],
)
def test_flags_that_say_what_to_prove_are_refused_with_resource(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["canary", "--resource", "ns/chat", *flags]) == ExitCode.USAGE_OR_ENVIRONMENT
    err = capsys.readouterr().err
    named = [flag for flag in flags if flag.startswith("--")]
    assert f"{', '.join(named)} cannot be given with --resource: the resource says what to prove" in err


def test_replica_and_resource_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["canary", "--resource", "chat", "--replica", "http://a:1", "--replica", "http://b:1"])
    assert exited.value.code == ExitCode.USAGE_OR_ENVIRONMENT
    assert "not allowed with argument" in capsys.readouterr().err


def test_kubeconfig_without_resource_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--context", "x"]
    assert main(args) == ExitCode.USAGE_OR_ENVIRONMENT
    assert "--kubeconfig and --context only apply with --resource" in capsys.readouterr().err


@dataclass
class FakeApi:
    """Answers every GET with `status` and `body`; records the paths asked."""

    status: int = 200
    body: Any = None
    paths: list[str] = field(default_factory=list)


@pytest.fixture
def fake_api() -> Iterator[tuple[FakeApi, str]]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.paths.append(self.path)
            payload = json.dumps(state.body).encode()
            self.send_response(state.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def kubeconfig(tmp_path: Path, server: str, namespace: str | None = "serving-a") -> Path:
    context: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace:
        context["namespace"] = namespace
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "ctx",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "ctx", "context": context}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(document))
    return path


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message}


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, status_body(404, "NotFound", 'mooncakeservings "chat" not found'), "serving-a/chat not found"),
        (401, status_body(401, "Unauthorized", "Unauthorized"), "did not accept the credentials (401)"),
        (
            403,
            status_body(403, "Forbidden", "cannot get resource"),
            "not allowed to get mooncakeservings.serving.mooncake-operator.dev in namespace serving-a",
        ),
        (
            500,
            status_body(500, "InternalError", "etcd down"),
            "reading MooncakeServing serving-a/chat failed",
        ),
        (200, {"apiVersion": "v1", "kind": "ConfigMap"}, "MooncakeServing serving-a/chat is invalid"),
    ],
)
def test_an_unreadable_resource_exits_3_with_the_reason(
    status: int,
    body: Any,
    message: str,
    fake_api: tuple[FakeApi, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state, server = fake_api
    state.status, state.body = status, body
    config = kubeconfig(tmp_path, server)
    assert main(["canary", "--resource", "chat", "--kubeconfig", str(config)]) == 3
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    # No namespace given: the kubeconfig context's.
    assert state.paths == [
        "/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/serving-a/mooncakeservings/chat"
    ]


def test_a_resource_with_the_canary_off_and_one_replica_exits_3(
    fake_api: tuple[FakeApi, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, server = fake_api
    state.body = serving(namespace="other")
    state.body["spec"]["replicas"] = 1
    state.body["spec"]["canary"] = {"enabled": False}
    config = kubeconfig(tmp_path, server, namespace=None)
    assert main(["canary", "--resource", "other/chat", "--kubeconfig", str(config)]) == 3
    assert "MooncakeServing other/chat cannot be proven" in capsys.readouterr().err
    assert state.paths == [
        "/apis/serving.mooncake-operator.dev/v1alpha1/namespaces/other/mooncakeservings/chat"
    ]


def test_an_unreachable_api_server_or_missing_kubeconfig_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert main(["canary", "--resource", "chat", "--kubeconfig", str(kubeconfig(tmp_path, closed))]) == 3
    assert "cannot reach the API server" in capsys.readouterr().err
    assert main(["canary", "--resource", "chat", "--kubeconfig", str(tmp_path / "none")]) == 3
    err = capsys.readouterr().err
    assert "not found" in err
    assert "Traceback" not in err
