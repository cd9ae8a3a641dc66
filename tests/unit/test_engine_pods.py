"""Engine pods a security review accepts (issue 24): security contexts, identity, graceful drain, the
escape hatches and their refusals, served-model-name aliases, and the GPU arithmetic of extraArgs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tests.support.pod_security import violations

from mooncake_operator.api.examples import reference_deployment_yaml
from mooncake_operator.api.kube_types import GPU_RESOURCE
from mooncake_operator.api.replica_pod import HF_HOME_PATH, RESERVED_MOUNT_PATHS, RESERVED_VOLUMES
from mooncake_operator.api.resource import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.build.engine_args import replica_launch
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import ENGINE_CONTAINER
from mooncake_operator.build.replicas import (
    DRAIN_SCRIPT,
    DRAIN_SETTLE_SECONDS,
    ENGINE_SHUTDOWN_SECONDS,
    EPHEMERAL_STORAGE,
    replica_stateful_set,
    store_memory_bytes,
)

pytestmark = pytest.mark.unit

OWNER_UID = "5b0c1d7e-0000-4000-8000-000000000024"


def example(**spec_changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(reference_deployment_yaml())
    for path, value in spec_changes.items():
        node = obj["spec"]
        *parents, last = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return obj


def stateful_set(resource: MooncakeServing) -> dict[str, Any]:
    return replica_stateful_set(resource, owner_uid=OWNER_UID)


def pod_spec(resource: MooncakeServing) -> dict[str, Any]:
    spec: dict[str, Any] = stateful_set(resource)["spec"]["template"]["spec"]
    return spec


def engine(resource: MooncakeServing) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(resource)["containers"][0]
    assert container["name"] == ENGINE_CONTAINER
    return container


def refused(obj: dict[str, Any]) -> str:
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    return str(caught.value)


# --- security contexts ------------------------------------------------------------------------------------


def test_default_engine_pod_is_hardened_and_meets_pod_security_baseline() -> None:
    resource = parse_resource(example())
    pod = pod_spec(resource)
    container = engine(resource)
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {
        "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
    }
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    # Pod Security "baseline": no host namespaces, hostPath, privileged, added capabilities or host ports.
    assert not any(key in pod for key in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in volume for volume in pod["volumes"])
    assert "privileged" not in container["securityContext"]
    assert "add" not in container["securityContext"]["capabilities"]
    assert all("hostPort" not in port for port in container["ports"])


def test_hf_home_and_caches_are_off_root_on_writable_volumes() -> None:
    container = engine(parse_resource(example()))
    env = {item["name"]: item.get("value") for item in container["env"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert env["HF_HOME"] == "/var/cache/huggingface" == HF_HOME_PATH
    assert mounts[env["HF_HOME"]] == "hf-cache"
    assert mounts["/tmp"] == "tmp"
    for key in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert env[key].startswith("/tmp/")
    assert not any(value and value.startswith("/root") for value in env.values())


def test_user_contexts_replace_defaults_field_by_field() -> None:
    obj = example(
        engine__securityContext={"runAsUser": 1000, "runAsNonRoot": True, "readOnlyRootFilesystem": True},
        pod={"securityContext": {"fsGroup": 1000, "runAsUser": 1000}},
    )
    resource = parse_resource(obj)
    assert engine(resource)["securityContext"] == {
        "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
        "runAsUser": 1000,
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
    }
    assert pod_spec(resource)["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1000,
        "fsGroup": 1000,
    }


def test_privileged_is_not_settable_on_the_engine() -> None:
    assert "privileged" in refused(example(engine__securityContext={"privileged": True}))


def rdma_obj(**rdma: Any) -> dict[str, Any]:
    obj = example()
    obj["spec"]["store"].update({"protocol": "rdma", "deviceName": "mlx5_0", "rdma": rdma})
    return obj


def test_rdma_keeps_its_capabilities_on_top_of_the_users() -> None:
    obj = rdma_obj(resourceName="rdma/ib")
    obj["spec"]["engine"]["securityContext"] = {"capabilities": {"drop": ["ALL"], "add": ["NET_RAW"]}}
    context = engine(parse_resource(obj))["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["NET_RAW", "IPC_LOCK", "SYS_RESOURCE"]}
    runtime = engine(parse_resource(rdma_obj(resourceName="rdma/ib", memlock="Runtime")))
    assert runtime["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_rdma_host_devices_run_privileged_and_refuse_no_escalation() -> None:
    context = engine(parse_resource(rdma_obj(hostDevices=True)))["securityContext"]
    assert context["privileged"] is True
    assert "allowPrivilegeEscalation" not in context  # the API server refuses it next to privileged
    obj = rdma_obj(hostDevices=True)
    obj["spec"]["engine"]["securityContext"] = {"allowPrivilegeEscalation": False}
    assert "engine.securityContext.allowPrivilegeEscalation" in refused(obj)


# --- identity and runtime ---------------------------------------------------------------------------------


def test_service_account_and_runtime_class() -> None:
    resource = parse_resource(
        example(pod={"serviceAccountName": "weights-reader", "runtimeClassName": "nvidia"})
    )
    pod = pod_spec(resource)
    assert pod["serviceAccountName"] == "weights-reader"
    assert pod["automountServiceAccountToken"] is False
    assert pod["runtimeClassName"] == "nvidia"
    mounted = parse_resource(
        example(pod={"serviceAccountName": "weights-reader", "automountServiceAccountToken": True})
    )
    assert pod_spec(mounted)["automountServiceAccountToken"] is True


def test_token_mount_needs_a_named_service_account() -> None:
    message = refused(example(pod={"automountServiceAccountToken": True}))
    assert "pod.automountServiceAccountToken needs pod.serviceAccountName" in message


# --- graceful drain ---------------------------------------------------------------------------------------


def test_pre_stop_drains_within_the_budget_and_grace_matches() -> None:
    resource = parse_resource(example(pod={"drainSeconds": 900}))
    command = engine(resource)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python3", "-c", DRAIN_SCRIPT]
    assert command[3:] == [str(resource.spec.engine.port), "900", str(DRAIN_SETTLE_SECONDS)]
    assert pod_spec(resource)["terminationGracePeriodSeconds"] == 900 + ENGINE_SHUTDOWN_SECONDS
    default = parse_resource(example())
    assert pod_spec(default)["terminationGracePeriodSeconds"] == 300 + ENGINE_SHUTDOWN_SECONDS


def test_after_the_pre_stop_the_grace_outlasts_the_engines_own_drain_and_teardown() -> None:
    # SIGTERM comes after the preStop, with at least ENGINE_SHUTDOWN_SECONDS of the grace left: the engine
    # drains for --shutdown-timeout, then closes its store client (up to 5 s for queued puts) and exits
    # before the kubelet's SIGKILL, so its store segment is unmounted, not left to the master's client TTL.
    argv = engine(parse_resource(example()))["command"]
    shutdown_timeout = int(argv[argv.index("--shutdown-timeout") + 1])
    assert shutdown_timeout > 0  # vLLM's 0 aborts in-flight requests and force-kills the workers
    assert shutdown_timeout + 5 + 5 <= ENGINE_SHUTDOWN_SECONDS  # drain, queued puts, the rest


class _Metrics(BaseHTTPRequestHandler):
    busy_until = 0.0

    def do_GET(self) -> None:
        running = 1 if time.monotonic() < type(self).busy_until else 0
        body = (
            "# HELP vllm:num_requests_running x\n"
            f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
            'vllm:num_requests_waiting{model_name="m"} 0.0\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[int, type[_Metrics]]]:
    handler = type("Metrics", (_Metrics,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def run_drain(port: int, budget: float, settle: float = 0) -> float:
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", DRAIN_SCRIPT, str(port), str(budget), str(settle)],
        check=True,
        timeout=30,
    )
    return time.monotonic() - started


def test_drain_waits_for_in_flight_requests(metrics_server: tuple[int, type[_Metrics]]) -> None:
    port, handler = metrics_server
    handler.busy_until = time.monotonic() + 2.5
    elapsed = run_drain(port, budget=20)
    assert 2.5 <= elapsed < 8


def test_drain_stops_at_its_budget(metrics_server: tuple[int, type[_Metrics]]) -> None:
    port, handler = metrics_server
    handler.busy_until = time.monotonic() + 60
    assert 2 <= run_drain(port, budget=2) < 6


def test_drain_ends_when_the_engine_is_gone() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), _Metrics) as closed:
        port = closed.server_address[1]  # bound, then closed: nothing listens there
    assert run_drain(port, budget=20) < 5


# --- escape hatches ---------------------------------------------------------------------------------------

EXTRAS = {
    "volumes": [
        {"name": "weights-creds", "secret": {"secretName": "s3-creds"}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
    ],
    "volumeMounts": [
        {"name": "weights-creds", "mountPath": "/etc/creds", "readOnly": True},
        {"name": "scratch", "mountPath": "/scratch"},
    ],
    "sidecars": [{"name": "log-shipper", "image": "shipper:1", "ports": [{"containerPort": 9100}]}],
    "initContainers": [
        {"name": "prefetch", "image": "prefetch:1", "args": ["--to", "/var/cache/huggingface"]}
    ],
}


def test_extras_are_added_after_the_operators() -> None:
    resource = parse_resource(example(pod=dict(EXTRAS)))
    pod = pod_spec(resource)
    assert [c["name"] for c in pod["containers"]] == ["vllm", "log-shipper"]
    assert pod["initContainers"] == EXTRAS["initContainers"]
    assert pod["volumes"][-2:] == EXTRAS["volumes"]
    assert engine(resource)["volumeMounts"][-2:] == EXTRAS["volumeMounts"]


def test_the_production_pod_validates_against_kubernetes_schemas() -> None:
    obj = example(
        pod={
            **EXTRAS,
            "serviceAccountName": "sa",
            "runtimeClassName": "nvidia",
            "securityContext": {"fsGroup": 1},
        },
        engine__securityContext={"readOnlyRootFilesystem": True, "runAsNonRoot": True, "runAsUser": 1000},
    )
    manifests = render_all(parse_resource(obj), owner_uid=OWNER_UID)
    for version in ("1.25.0", "1.37.0"):
        for manifest in manifests:
            kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (
            {"volumes": [{"name": "hf-cache", "emptyDir": {}}]},
            "pod.volumes: hf-cache is a volume the operator",
        ),
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "pod.volumes: tmp is a volume the operator"),
        (
            {"volumes": [{"name": "x", "emptyDir": {}, "secret": {"secretName": "s"}}]},
            "exactly one volume source",
        ),
        ({"volumes": [{"name": "x"}]}, "exactly one volume source"),
        ({"volumes": [{"name": "Bad_Name", "emptyDir": {}}]}, "pod.volumes: every entry needs a name"),
        (
            {"volumes": [{"name": "x", "emptyDir": {}}, {"name": "x", "emptyDir": {}}]},
            "pod.volumes: names must be unique; repeated: x",
        ),
        (
            {"volumeMounts": [{"name": "dshm", "mountPath": "/x"}]},
            "pod.volumeMounts: dshm is not in pod.volumes",
        ),
        (
            {
                "volumes": [{"name": "x", "emptyDir": {}}],
                "volumeMounts": [{"name": "x", "mountPath": "/tmp"}],
            },
            "/tmp would cover /tmp",
        ),
        (
            {
                "volumes": [{"name": "x", "emptyDir": {}}],
                "volumeMounts": [{"name": "x", "mountPath": "/var/cache"}],
            },
            "/var/cache would cover /var/cache/huggingface",
        ),
        (
            {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "rel"}]},
            "mountPath must be absolute",
        ),
        ({"sidecars": [{"name": "vllm", "image": "x:1"}]}, "vllm is the engine container"),
        ({"sidecars": [{"name": "a"}]}, "pod.sidecars a: image is required"),
        (
            {"sidecars": [{"name": "a", "image": "x"}], "initContainers": [{"name": "a", "image": "x"}]},
            "share names: a",
        ),
        (
            {"initContainers": [{"name": "a", "image": "x", "securityContext": {"privileged": True}}]},
            "pod.initContainers a: securityContext.privileged is refused",
        ),
        (
            {"sidecars": [{"name": "a", "image": "x", "ports": [{"containerPort": 8000}]}]},
            "pod.sidecars a: port 8000 is engine.port",
        ),
    ],
)
def test_escape_hatches_refuse_what_the_operator_manages(pod: dict[str, Any], expected: str) -> None:
    assert expected in refused(example(pod=pod))


def test_reserved_names_and_paths_are_what_the_renderer_mounts() -> None:
    obj = rdma_obj(hostDevices=True)
    obj["spec"]["store"]["master"]["highAvailability"] = {
        "enabled": True,
        "etcd": {"external": {"endpoints": ["etcd:2379"], "tls": {"caSecretRef": {"name": "ca"}}}},
    }
    container = engine(parse_resource(obj))
    names = {volume["name"] for volume in pod_spec(parse_resource(obj))["volumes"]} | {"hf-cache"}
    paths = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert names == RESERVED_VOLUMES
    assert paths == RESERVED_MOUNT_PATHS


# --- served model names -----------------------------------------------------------------------------------


def test_aliases_follow_the_model_name_which_the_canary_asks() -> None:
    obj = example(model__servedModelNameAliases=["minimax", "default"])
    resource = parse_resource(obj)
    argv = list(replica_launch(resource.spec, master_address="m:1").argv)
    at = argv.index("--served-model-name")
    assert argv[at : at + 4] == ["--served-model-name", resource.spec.model.name, "minimax", "default"]
    assert (
        "--served-model-name" not in replica_launch(parse_resource(example()).spec, master_address="m:1").argv
    )


@pytest.mark.parametrize("aliases", [["a", "a"], ["MiniMaxAI/MiniMax-M2.5"], [" a"], [""]])
def test_bad_aliases_are_refused(aliases: list[str]) -> None:
    assert "model.servedModelNameAliases" in refused(example(model__servedModelNameAliases=aliases))


def test_served_model_name_stays_managed_in_extra_args() -> None:
    assert "--served-model-name" in refused(example(engine__extraArgs=["--served-model-name", "x"]))


# --- GPU arithmetic ---------------------------------------------------------------------------------------


def gpus(resource: MooncakeServing) -> str:
    value: str = engine(resource)["resources"]["limits"][GPU_RESOURCE]
    return value


@pytest.mark.parametrize(
    "args",
    [["-pp", "2"], ["--pipeline-parallel-size=2"], ["--pipeline-parallel-size", "2"], ["--pipeline", "2"]],
)
def test_pipeline_parallel_is_counted_into_gpus_and_store_memory(args: list[str]) -> None:
    plain = parse_resource(example())
    piped = parse_resource(example(engine__extraArgs=args))
    assert gpus(plain) == "4"
    assert gpus(piped) == "8"
    assert store_memory_bytes(piped.spec) == 2 * store_memory_bytes(plain.spec)


@pytest.mark.parametrize("args", [["-pp", "two"], ["-pp"], ["--pipeline-parallel-size=0"], ["-pp", "²"]])
def test_bad_pipeline_sizes_are_refused(args: list[str]) -> None:
    assert "needs a positive whole number of pipeline stages" in refused(example(engine__extraArgs=args))


@pytest.mark.parametrize(
    "args",
    [
        ["-dp", "2"],
        ["--data-parallel-size=2"],
        ["--data-parallel-size-local", "2"],
        ["-dpl", "2"],
        ["--data-par", "2"],
    ],
)
def test_data_parallel_is_refused(args: list[str]) -> None:
    assert "a replica is one data-parallel rank" in refused(example(engine__extraArgs=args))


def test_tensor_parallel_is_bounded_by_gpus_per_node() -> None:
    message = refused(example(engine__tensorParallelSize=16))
    assert "engine.gpusPerNode (8)" in message
    assert "engine.gpusPerNode (8)" in refused(example(engine__extraArgs=["-pp", "4"]))
    assert gpus(parse_resource(example(engine__tensorParallelSize=16, engine__gpusPerNode=16))) == "16"


def test_production_example_keeps_weights_on_a_claim_per_replica() -> None:
    resource = parse_resource(example())
    assert resource.spec.model.cache.volume_claim_template is not None
    requests = engine(resource)["resources"]["requests"]
    assert requests[EPHEMERAL_STORAGE] == "10Gi"  # the /tmp scratch alone: the weights are on the claim
    claims = stateful_set(resource)["spec"]["volumeClaimTemplates"]
    assert claims[0]["spec"]["resources"]["requests"]["storage"] == "600Gi"


# --- Pod Security Standards (tests/support/pod_security.py: the rules as kubernetes.io states them)


def pod_security_violations(template: dict[str, Any]) -> dict[str, list[str]]:
    """What keeps a pod template from each level: {"baseline": [...], "restricted": [...]}."""
    spec = template["spec"]
    return {level: violations(spec, level) for level in ("baseline", "restricted")}


def template_of(obj: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = stateful_set(parse_resource(obj))["spec"]["template"]
    return template


def test_the_default_engine_pod_is_baseline_and_restricted_but_for_the_user() -> None:
    violations = pod_security_violations(template_of(example()))
    assert violations == {
        "baseline": [],
        "restricted": ["running as non-root: containers[vllm] (nor the pod) sets runAsNonRoot true"],
    }


def test_a_non_root_engine_pod_is_restricted() -> None:
    obj = example(
        engine__securityContext={"runAsNonRoot": True, "runAsUser": 1000, "readOnlyRootFilesystem": True},
        pod={"securityContext": {"fsGroup": 1000}},
    )
    assert pod_security_violations(template_of(obj)) == {"baseline": [], "restricted": []}


def test_rdma_pods_need_the_privileged_level_and_say_why() -> None:
    device_plugin = pod_security_violations(template_of(rdma_obj(resourceName="rdma/ib")))
    assert device_plugin["baseline"] == ["capabilities: containers[vllm] adds ['IPC_LOCK', 'SYS_RESOURCE']"]
    host = rdma_obj(hostDevices=True, hostNetwork=True)
    host_violations = pod_security_violations(template_of(host))["baseline"]
    assert host_violations == [
        "host namespaces: spec.hostNetwork is true",
        "hostPath volumes: volumes[rdma-devices]",
        "privileged containers: containers[vllm] is privileged",
    ]
