"""What the operator's cluster tests share: the CRD, a small resource, a stand-in kubelet, the operator.

Pods never run here (no scheduler, no kubelet). `FakeKubelet` plays the kubelet's part the operator can
see: it marks pods Running and Ready (or not), and can bump a container's restart count. The replicas
the canary talks to are loopback fake vLLM servers (tests.support.fake_vllm), mapped to the resource
through the operator's replica-endpoint setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
from kopf.testing import KopfRunner
from tests.support.apiserver import ControlPlane
from tests.support.cpu_stalls import stalled_seconds_since
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.api import crd
from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.build.names import COMPONENT_REPLICA, LABEL_COMPONENT, LABEL_INSTANCE
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError
from mooncake_operator.reconcile.act.core import Runtime
from mooncake_operator.runtime.handlers import RuntimeHolder, build_registry
from mooncake_operator.runtime.settings import OperatorSettings

T = TypeVar("T")
TEST_MANAGER = "operator-tests"
CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    # The test API server is Kubernetes 1.20: PodDisruptionBudget only in policy/v1beta1.
    ("policy/v1beta1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


async def install_crd(kube: KubeClient) -> None:
    """Apply the generated CRD and wait until the API serves the resource."""
    await kube.apply(crd.custom_resource_definition(), field_manager=TEST_MANAGER)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", crd.CRD_NAME)
        conditions = (found.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"CRD {crd.CRD_NAME} not established in 30s")


def serving(namespace: str, name: str = "demo", **spec_changes: Any) -> dict[str, Any]:
    """A small valid MooncakeServing whose canary matches the fake replicas (block 32, Eagle-3)."""
    spec: dict[str, Any] = {
        "model": {"name": "MiniMaxAI/MiniMax-M2.5", "revision": "r1"},
        "engine": {"image": "registry.invalid/vllm-mooncake:fixed", "blockSize": 32},
        "speculative": {"method": "eagle3", "model": "draft/eagle3", "revision": "d1"},
        "replicas": 2,
        "store": {"globalSegmentSize": "1GB", "localBufferSize": "512MB"},
        # The operator's flow is under test here, not the block-boundary suite (unit-tested with the fake
        # replicas' /tokenize): one request per pair keeps these tests' pairs and counts as they read.
        "canary": {"timeoutSeconds": 10, "suite": []},
    }
    for key, value in spec_changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_status(
    pod: dict[str, Any], *, ready: bool, restarts: int = 0, ip: str | None = None
) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    flag = "True" if ready else "False"
    containers = (pod.get("spec") or {}).get("containers") or []
    addresses = {"podIP": ip, "podIPs": [{"ip": ip}]} if ip else {}
    return {
        **addresses,
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now},
        ],
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": restarts,
                "started": ready,
                "state": {"running": {"startedAt": now}},
            }
            for container in containers
        ],
    }


@dataclass
class FakeKubelet:
    """Marks the namespace's pods Ready, except those `hold` names; runs as a background task.

    With `modes_by_image`, it also makes fake replica i behave as the image of pod NAME-replica-<i>
    says (e.g. a buggy engine image corrupts warm answers), so a rollout or a rollback changes what the
    canary sees exactly when the pods change.

    With `node`, it binds each pod to that (absent) node and gives it an IP from the documentation range
    192.0.2.0/24 (never routed; nothing is sent there), so the endpoints controller lists it: a Service's
    Endpoints then show which pods it routes to. A bound pod's deletion waits for its kubelet, so it also
    finishes deleting pods (grace period 0), as a kubelet does once the containers stopped.
    """

    kube: KubeClient
    namespace: str
    hold: set[str] = field(default_factory=set)
    fakes: FakeCluster | None = None
    modes_by_image: dict[str, Mode] = field(default_factory=dict)
    resource: str = "demo"
    period_s: float = 0.1
    node: str | None = None
    _task: asyncio.Task[None] | None = None
    _node_api: httpx.AsyncClient | None = None
    _ips: int = 0

    def _follow_image(self, pod: dict[str, Any]) -> None:
        prefix = f"{self.resource}-replica-"
        name = pod["metadata"]["name"]
        if self.fakes is None or not self.modes_by_image or not name.startswith(prefix):
            return
        ordinal = int(name.removeprefix(prefix))
        image = pod["spec"]["containers"][0]["image"]
        if ordinal < len(self.fakes):
            self.fakes[ordinal].mode = self.modes_by_image.get(image, Mode.CORRECT)

    async def mark(self, pod: dict[str, Any], *, ready: bool, restarts: int = 0) -> None:
        name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        if self.node is not None and ip is None:
            self._ips += 1
            ip = f"192.0.2.{self._ips % 250 + 1}"
        await self.kube.patch_status(
            "v1", "Pod", name, pod_status(pod, ready=ready, restarts=restarts, ip=ip), self.namespace
        )

    async def _bind(self, pod: dict[str, Any]) -> None:
        """What the scheduler does: POST the pod's `binding` subresource."""
        if self._node_api is None or (pod.get("spec") or {}).get("nodeName"):
            return
        name = pod["metadata"]["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": self.namespace, "uid": pod["metadata"]["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        }
        response = await self._node_api.post(
            f"/api/v1/namespaces/{self.namespace}/pods/{name}/binding", json=binding
        )
        if response.status_code not in (200, 201, 404, 409):
            raise AssertionError(f"binding {name}: HTTP {response.status_code} {response.text}")

    async def _finish_deletion(self, pod: dict[str, Any]) -> None:
        """What the kubelet does once a bound pod's containers stopped: delete it for good."""
        if self._node_api is None or not (pod.get("spec") or {}).get("nodeName"):
            return
        name = pod["metadata"]["name"]
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": pod["metadata"]["uid"]}}
        await self._node_api.request(
            "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", json=options
        )

    async def step(self) -> None:
        for pod in await self.kube.list("v1", "Pod", self.namespace):
            if pod["metadata"].get("deletionTimestamp"):
                await self._finish_deletion(pod)
                continue
            if pod["metadata"]["name"] in self.hold:
                continue
            self._follow_image(pod)
            if not is_ready(pod):
                with contextlib.suppress(KubeApiError):  # the pod was replaced meanwhile
                    await self._bind(pod)
                    await self.mark(pod, ready=True)

    async def _loop(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.period_s)

    async def restart_container(self, pod_name: str) -> None:
        """What a crashed and restarted container looks like: the restart count goes up."""
        pod = await self.kube.get("v1", "Pod", pod_name, self.namespace)
        restarts = sum(int(s.get("restartCount", 0)) for s in pod["status"].get("containerStatuses") or [])
        await self.mark(pod, ready=True, restarts=restarts + 1)

    async def __aenter__(self) -> FakeKubelet:
        if self.node is not None:
            config = self.kube.config
            self._node_api = httpx.AsyncClient(
                base_url=config.server,
                verify=config.ssl_context(),
                headers={"Authorization": f"Bearer {config.current_token()}"},
                trust_env=False,
            )
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._node_api is not None:
            await self._node_api.aclose()


def operator_settings(plane: ControlPlane, namespace: str, **changes: Any) -> OperatorSettings:
    base = OperatorSettings(
        namespaces=(namespace,),
        kube=KubeConfig(server=plane.server, token=plane.admin_token, ca_path=plane.ca_path),
        liveness_port=0,
        metrics_port=0,
        # The default's order of magnitude: every reaction a test waits for must come from the watches.
        resync_seconds=600.0,
        leader_check_seconds=1.0,  # fake masters change leader without a pod event
        retry_delay_seconds=0.5,
        inconclusive_retry_seconds=2.0,
        request_timeout_seconds=10.0,
        watch_timeout_seconds=30.0,
    )
    return replace(base, **changes)


@dataclass
class RunningOperator:
    holder: RuntimeHolder
    runner: KopfRunner

    @property
    def runtime(self) -> Runtime:
        return self.holder.get()

    def writes(self) -> int:
        return self.runtime.kube.counts.writes


@contextlib.contextmanager
def run_operator(settings: OperatorSettings) -> Iterator[RunningOperator]:
    """kopf's KopfRunner with this operator's registry; waits until the runtime exists."""
    holder = RuntimeHolder()
    args = ["run", "--standalone", *(f"--namespace={ns}" for ns in settings.namespaces)]
    if settings.liveness_endpoint:
        args.append(f"--liveness={settings.liveness_endpoint}")
    with KopfRunner(args, registry=build_registry(settings, holder), timeout=60) as runner:
        deadline = time.monotonic() + 30
        while holder.runtime is None:
            if runner.future.done() or time.monotonic() > deadline:
                raise AssertionError(f"the operator did not start: {runner.future.result().output[-3000:]}")
            time.sleep(0.05)
        yield RunningOperator(holder, runner)


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, within: float = 30.0, what: str = "condition"
) -> T:
    """Polls `probe` until it returns something truthy; fails with `what` after `within` seconds of
    this machine's running time: a CPU stall inside the wait (seen up to a minute beside CI's e2e tier)
    froze what it waits for too, so it extends the deadline by its length."""
    started, deadline = time.time(), time.monotonic() + within
    last: T | None = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() >= deadline + stalled_seconds_since(started):
            break
        await asyncio.sleep(0.1)
    stalled = stalled_seconds_since(started)
    beside = f" (plus {stalled:.1f} s of CPU stalls)" if stalled else ""
    raise AssertionError(f"timed out after {within}s{beside} waiting for {what}; last: {last!r}")


async def get_serving(kube: KubeClient, namespace: str, name: str = "demo") -> dict[str, Any]:
    return await kube.get(API_VERSION, KIND, name, namespace)


async def wait_for_phase(
    kube: KubeClient, namespace: str, phase: str, name: str = "demo", within: float = 30.0
) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        body = await get_serving(kube, namespace, name)
        return body if (body.get("status") or {}).get("phase") == phase else None

    try:
        return await eventually(probe, within=within, what=f"phase {phase}")
    except AssertionError as error:
        body = await get_serving(kube, namespace, name)
        raise AssertionError(f"{error}\nstatus: {body.get('status')}") from None


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


async def children(kube: KubeClient, namespace: str, name: str = "demo") -> dict[str, dict[str, Any]]:
    """Every object labelled as this resource's, by "Kind/name" (pods and events excluded)."""
    found = {}
    selector = f"{LABEL_INSTANCE}={name}"
    for api_version, kind in CHILD_KINDS:
        for item in await kube.list(api_version, kind, namespace, label_selector=selector):
            found[f"{kind}/{item['metadata']['name']}"] = item
    return found


async def replica_pods(kube: KubeClient, namespace: str, name: str = "demo") -> list[dict[str, Any]]:
    selector = f"{LABEL_INSTANCE}={name},{LABEL_COMPONENT}={COMPONENT_REPLICA}"
    pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
    return sorted(pods, key=lambda pod: pod["metadata"]["name"])


async def events(kube: KubeClient, namespace: str, name: str = "demo") -> list[dict[str, Any]]:
    items = await kube.list("v1", "Event", namespace)
    mine = [
        e for e in items if e["involvedObject"].get("kind") == KIND and e["involvedObject"]["name"] == name
    ]
    # Creation order: etcd revisions grow (timestamps have one-second resolution).
    return sorted(mine, key=lambda e: int(e["metadata"]["resourceVersion"]))


def deep(obj: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(obj)
