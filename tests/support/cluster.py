"""scripts/cluster: the product as a user runs it, on a real single-node Kubernetes (kube_node.py).

    python -m tests.support.cluster up [--engine patched|buggy] [--timeout S]
    python -m tests.support.cluster down
    python -m tests.support.cluster kubectl ARGS...

`up` starts the node, binds the tiny models to a local PersistentVolume, `helm install`s the chart
with the operator image built here, `kubectl apply`s examples/minimax-m2.5-eagle3-cpu.yaml with the
engine image built here, and waits until the resource is Ready (exit 0) or CanaryFailed (exit 1);
anything else that goes wrong is a setup error (exit 3). scripts/cluster builds the prerequisites
(Kubernetes binaries, helm, images, tiny models) before calling it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from tests.support import kube_node
from tests.support.kube_node import ROOT, ClusterError, kubectl

from mooncake_operator.api.group import GROUP, PLURAL
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.build.etcd import etcd_stateful_set
from mooncake_sandbox.engine_env import cache_root
from mooncake_sandbox.models import TARGET_REVISIONS, TinyModels, models_dir

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "minimax-m2.5-eagle3-cpu.yaml"
CHART = REPO / "charts" / "mooncake-operator"
RELEASE = "mooncake-operator"
OPERATOR_NAMESPACE = "mooncake-system"
MODELS_CLAIM = "mooncake-tiny-models"
# The example's model paths are under HF_HOME (where the model cache volume is mounted).
MODELS_SUBDIR = "tiny-models"
EXIT_READY, EXIT_CANARY_FAILED, EXIT_SETUP = 0, 1, 3


def log(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def example_resource(engine_image: str) -> dict[str, Any]:
    resource: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    resource["spec"]["engine"]["image"] = engine_image
    return resource


def ha_example_resource(engine_image: str, etcd_image: str) -> dict[str, Any]:
    """The CPU example under its own name (`NAME-ha`) with highly available masters: 3 masters electing
    their leader through the managed etcd (its default single member, `managed: {}` as a user writes it),
    whose image is the one built here (scripts/build-images: Debian's etcd-server), never pulled.

    etcd asks for CPU, as etcd needs on any cluster: without a request it is BestEffort and, on the 2-core
    node under the load and a canary (load average ~14), its requests took over a second, the leader's
    lease keep-alive failed and leadership moved three more times in ten minutes, each failover starting
    the canary again (bench/RESULTS.md, "Faults on real pods")."""
    resource = example_resource(engine_image)
    resource["metadata"]["name"] += "-ha"
    etcd = {"image": etcd_image, "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}}
    resource["spec"]["store"]["master"]["highAvailability"] = {
        "enabled": True,
        "replicas": 3,
        "etcd": {"managed": etcd},
    }
    return resource


def etcd_claims(resource: dict[str, Any]) -> tuple[list[str], str]:
    """The PersistentVolumeClaims the managed etcd's StatefulSet will ask for (CLAIM-STATEFULSET-ORDINAL,
    read from the operator's own rendering), and their requested size."""
    serving = MooncakeServing.model_validate(resource)
    stateful_set = etcd_stateful_set(serving, owner_uid=None)
    spec = stateful_set["spec"]
    claims = [
        f"{template['metadata']['name']}-{stateful_set['metadata']['name']}-{ordinal}"
        for template in spec["volumeClaimTemplates"]
        for ordinal in range(spec["replicas"])
    ]
    sizes = {
        template["spec"]["resources"]["requests"]["storage"] for template in spec["volumeClaimTemplates"]
    }
    (size,) = sizes
    return claims, str(size)


def claim_volumes(claims: Sequence[str], size: str, directory: Path) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume per claim, bound to it in advance. The node has no volume provisioner
    (and no StorageClass): a claim without a class binds only to a volume made for it, as an
    administrator of a cluster without dynamic provisioning would make one. Each volume is a directory
    under `directory` that must exist (`claim_directories` makes it for the workload's user)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": claim},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": "default", "name": claim},
                "hostPath": {"path": str(directory / claim), "type": "Directory"},
            },
        }
        for claim in claims
    ]


def claim_directories(claims: Sequence[str], directory: Path, owner: int) -> None:
    """Each claim's volume directory under `directory`, empty, owned by `owner` (user and group) and
    private to it. The kubelet applies no `fsGroup` to a hostPath volume, so an administrator who makes
    static volumes for a non-root workload (the managed etcd runs as ETCD_USER_ID) hands each one over,
    as local-path's provisioner does by making its directories world-writable."""
    for claim in claims:
        path = directory / claim
        shutil.rmtree(path, ignore_errors=True)  # a volume is fresh: no member of an earlier etcd
        path.mkdir(parents=True, mode=0o700)
        os.chown(path, owner, owner)


def client_model_name() -> str:
    """The model name the customer's clients send: the CPU example's alias, which every revision of the
    tiny target serves (its path, `model.name`, changes with the revision)."""
    aliases: list[str] = example_resource("-")["spec"]["model"]["servedModelNameAliases"]
    return aliases[0]


def target_path(revision: int) -> str:
    """`model.name` of the tiny target at `revision` (1 or 2) as the pods see the models volume: the
    example's revision-1 path, with the sandbox's layout of the revisions (TinyModels.target_for)."""
    revision_one = PurePosixPath(example_resource("-")["spec"]["model"]["name"])
    models_root = revision_one.parent
    relative = TinyModels(Path()).target_for(revision)
    return str(models_root / relative.as_posix())


def models_volume(source: Path) -> list[dict[str, Any]]:
    """A local PersistentVolume holding the tiny models, and the claim the example names."""
    claim_ref = {"namespace": "default", "name": MODELS_CLAIM}
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": MODELS_CLAIM},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": claim_ref,
                "hostPath": {"path": str(source), "type": "Directory"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": claim_ref,
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": MODELS_CLAIM,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def missing_revisions(source: Path) -> list[int]:
    """The tiny target's revisions whose weights are not in the model set at `source`."""
    models = TinyModels(source)
    return [r for r in TARGET_REVISIONS if not (models.target_for(r) / "model.safetensors").exists()]


def install_models() -> None:
    source = models_dir(cache_root())
    if not (source / "manifest.json").exists():
        raise ClusterError(f"tiny models missing in {source}: run `mooncake-operator sandbox prepare`")
    # Every revision of the target goes on the volume: the fault tier rolls the resource from one to the
    # other (target_path).
    missing = missing_revisions(source)
    if missing:
        raise ClusterError(
            f"tiny target revisions {missing} missing in {source}: run `mooncake-operator sandbox prepare`"
        )
    # A copy per cluster: the pods may write next to the weights, the cache stays pristine.
    volume = ROOT / "models"
    shutil.copytree(source, volume / MODELS_SUBDIR)
    # The example's engine runs as uid 1000 (Pod Security "restricted"): the weights must be readable
    # by every user, as on a shared model volume; safetensors writes its files 0600.
    for path in (volume / MODELS_SUBDIR).rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    manifests = {"apiVersion": "v1", "kind": "List", "items": models_volume(volume)}
    kubectl(["apply", "-f", "-"], input=json.dumps(manifests))


def helm_run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """helm against the cluster, whatever its exit code."""
    argv = [str(kube_node.helm_binary()), f"--kubeconfig={kube_node.admin_kubeconfig()}", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def helm(args: Sequence[str]) -> str:
    result = helm_run(args)
    if result.returncode != 0:
        raise ClusterError(f"helm {' '.join(args)} failed: {result.stderr.strip()}\n{result.stdout[-2000:]}")
    return result.stdout


def helm_values(operator_image: str) -> list[str]:
    repository, _, tag = operator_image.rpartition(":")
    return [
        f"--set=image.repository={repository}",
        f"--set=image.tag={tag}",
        # Imported into containerd by scripts/cluster: never pulled.
        "--set=image.pullPolicy=Never",
        # The test Pod reads the resource (canary --resource): model, block size, Eagle and the
        # example's content checks (off: random tiny weights) come from its spec.
        f"--set=test.servingName={example_resource('-')['metadata']['name']}",
        "--set=test.servingNamespace=default",
    ]


def install_operator(operator_image: str) -> None:
    helm(
        [
            "install",
            RELEASE,
            str(CHART),
            f"--namespace={OPERATOR_NAMESPACE}",
            "--create-namespace",
            "--wait",
            "--timeout=5m",
            *helm_values(operator_image),
        ]
    )
    # `helm --wait` waits for the Deployment, not for the CRD it templates; and the API server's discovery
    # lists a CRD a moment after it is Established: until then `kubectl get mcs` finds no such type.
    kubectl(["wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}"])
    kube_node.wait_for(
        f"discovery to list {PLURAL}.{GROUP}",
        lambda: "mcs" in kubectl(["api-resources", f"--api-group={GROUP}", "--no-headers"]).split(),
        60,
    )


def get_serving(name: str, namespace: str = "default") -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        kubectl(["get", "mcs", name, f"--namespace={namespace}", "-o", "json"])
    )
    return document


def check_operator_running() -> None:
    """A crash-looping operator never writes a verdict: say so now, with its log, not after the timeout."""
    pods = json.loads(kubectl(["get", "pods", f"--namespace={OPERATOR_NAMESPACE}", "-o", "json"]))
    for pod in pods["items"]:
        for container in pod["status"].get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff" and container["restartCount"] >= 3:
                name = pod["metadata"]["name"]
                log = kubectl(["logs", f"--namespace={OPERATOR_NAMESPACE}", name, "--previous", "--tail=20"])
                raise ClusterError(f"the operator pod {name} is crash-looping; its last log lines:\n{log}")


def latest_events(namespace: str, count: int) -> str:
    """The namespace's latest `count` events, oldest first, a line each."""
    listing = json.loads(kubectl(["get", "events", "-n", namespace, "-o", "json"]))
    items = sorted(listing["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return "\n".join(
        f"{e.get('lastTimestamp')} {e.get('type')} {e.get('reason')} "
        f"{e['involvedObject'].get('name')}: {e.get('message')} (x{e.get('count')})"
        for e in items[-count:]
    )


def operator_pod_report() -> str:
    """What the operator pods went through, for a failure message: each container's readiness, restarts,
    state and last state (an OOM kill or a liveness kill shows there), the last log lines of a restarted
    container's previous run, the namespace's events, and the kubelet's own lines about the pod (best
    effort: the cluster goes with the session)."""
    listing = json.loads(kubectl(["get", "pods", f"--namespace={OPERATOR_NAMESPACE}", "-o", "json"]))
    lines = []
    for pod in listing["items"]:
        name = pod["metadata"]["name"]
        lines.append(f"pod {name}: phase {pod['status'].get('phase')}")
        for container in pod["status"].get("containerStatuses") or []:
            state, last = json.dumps(container.get("state")), json.dumps(container.get("lastState"))
            lines.append(
                f"  {container['name']}: ready {container.get('ready')}, "
                f"restarts {container.get('restartCount')}, state {state}, last state {last}"
            )
            if container.get("restartCount"):
                try:
                    previous = kubectl(
                        ["logs", f"--namespace={OPERATOR_NAMESPACE}", name, "--previous", "--tail=20"]
                    )
                except ClusterError as error:
                    previous = f"unreadable: {error}"
                lines.append(f"  its previous run's last log lines:\n{previous}")
        try:
            kubelet_lines = [
                line
                for line in kube_node.log_path("kubelet").read_text(errors="replace").splitlines()
                if name in line
            ]
        except OSError as error:
            kubelet_lines = [f"unreadable: {error}"]
        lines.append("  the kubelet's last lines about it:\n" + "\n".join(kubelet_lines[-15:]))
    lines.append(f"events:\n{latest_events(OPERATOR_NAMESPACE, 20)}")
    return "\n".join(lines)


def print_canary_failure(name: str, status: dict[str, Any], namespace: str = "default") -> None:
    """What a failed canary said, per pair, and how the replica pods last ended: the evidence a failed
    node-tier run needs, since its cluster is torn down with the session."""
    canary = status.get("canary") or {}
    print(f"  canary {canary.get('verdict')}: {canary.get('reason')}", file=sys.stderr)
    for pair in canary.get("pairs") or []:
        print(f"    {pair.get('request')}: {pair.get('verdict')}: {pair.get('reason')}", file=sys.stderr)
    listing = json.loads(
        kubectl(["get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}", "-o", "json"])
    )
    for pod in listing["items"]:
        for container in pod["status"].get("containerStatuses") or []:
            ended = (container.get("lastState") or {}).get("terminated") or {}
            print(
                f"  pod {pod['metadata']['name']}: restarts {container.get('restartCount')}, last ended "
                f"{ended.get('reason')} (exit {ended.get('exitCode')})",
                file=sys.stderr,
            )
            if ended:
                previous = kubectl(
                    ["logs", "-n", namespace, pod["metadata"]["name"], "--previous", "--tail=60"]
                )
                print(f"  its last log lines:\n{previous}", file=sys.stderr)


def describe(name: str, namespace: str = "default") -> str:
    """The state a timed-out wait needs to be understood after the session tore the cluster down: the
    resource's status, its pods (scheduling, containers), the namespace's latest events, the operator's
    log tail. Each part is best effort: a part that cannot be read says why."""
    parts: list[str] = []

    def part(title: str, read: Any) -> None:
        try:
            parts.append(f"--- {title}\n{read()}")
        except (ClusterError, KeyError, ValueError) as error:
            parts.append(f"--- {title}: unreadable: {error}")

    def serving() -> str:
        status = get_serving(name, namespace).get("status") or {}
        lines = [f"phase {status.get('phase')}, replicas {status.get('replicas')}"]
        for c in status.get("conditions") or []:
            lines.append(f"{c['type']}={c['status']} {c.get('reason')}: {c.get('message')}")
        canary = status.get("canary") or {}
        lines.append(f"canary {canary.get('verdict')}: {canary.get('reason')}")
        for pair in canary.get("pairs") or []:
            route = f"{pair.get('writer')} -> {pair.get('reader')} {pair.get('request')}"
            lines.append(f"  {route}: {pair.get('verdict')}: {pair.get('reason')}")
        return "\n".join(lines)

    def pods() -> str:
        listing = json.loads(kubectl(["get", "pods", "-n", namespace, "-o", "json"]))
        lines = []
        for pod in listing["items"]:
            conditions = ", ".join(
                f"{c['type']}={c['status']}" + (f" ({c.get('message')})" if c.get("message") else "")
                for c in pod["status"].get("conditions") or []
            )
            lines.append(f"{pod['metadata']['name']}: {pod['status'].get('phase')}; {conditions}")
            for container in pod["status"].get("containerStatuses") or []:
                lines.append(
                    f"  {container['name']}: ready {container.get('ready')}, restarts "
                    f"{container.get('restartCount')}, state {json.dumps(container.get('state'))}"
                )
        return "\n".join(lines)

    def operator_log() -> str:
        return kubectl(
            [
                "logs",
                f"--namespace={OPERATOR_NAMESPACE}",
                "--selector=app.kubernetes.io/name=mooncake-operator,app.kubernetes.io/component=operator",
                "--tail=80",
            ]
        )

    part(f"{namespace}/{name}", serving)
    part(f"pods in {namespace}", pods)
    part(f"events in {namespace}", lambda: latest_events(namespace, 40))
    part("operator log", operator_log)
    part("operator pods", operator_pod_report)
    part("store warnings in the replicas' logs", lambda: replica_store_warnings(name, namespace))
    return "\n".join(parts)


# What vLLM's Mooncake connector and the store client log when a load, a save or a heartbeat fails: the
# cause of a bare HTTP 500 (vLLM fails a request whose KV load failed and logs only this).
_STORE_WARNING = re.compile(
    r"Mooncake|mooncake|lease|master_client|transfer|Traceback|EngineCore|ERROR", re.IGNORECASE
)
_STORE_NOISE = re.compile(r"Failed to get the IP address|UserWarning")


def replica_store_warnings(name: str, namespace: str = "default", per_pod: int = 12) -> str:
    """The last store-related warning and error lines of each replica's engine log (best effort)."""
    listing = json.loads(
        kubectl(
            [
                "get",
                "pods",
                "-n",
                namespace,
                f"--selector=app.kubernetes.io/instance={name},app.kubernetes.io/name=vllm",
                "-o",
                "json",
            ]
        )
    )
    lines = []
    for pod in listing["items"]:
        pod_name = pod["metadata"]["name"]
        try:
            log = kubectl(["logs", "-n", namespace, pod_name, "--tail=5000"])
        except ClusterError as error:
            lines.append(f"{pod_name}: log unreadable: {error}")
            continue
        found = [
            line
            for line in log.splitlines()
            if (" WARNING " in line or " ERROR " in line or line.startswith(("E1", "W1", "Traceback")))
            and _STORE_WARNING.search(line)
            and not _STORE_NOISE.search(line)
        ]
        lines.append(f"{pod_name} ({pod['status'].get('podIP')}): {len(found)} store warning lines")
        lines.extend(f"  {line[:400]}" for line in found[-per_pod:])
    return "\n".join(lines)


def wait_for_verdict(name: str, timeout: float, *, since_spec_change: bool = False) -> str:
    """Prints each change of phase / ready replicas / conditions; returns Ready or CanaryFailed.
    `since_spec_change`: only a verdict on the current spec counts (the operator observed its generation
    and, for Ready, a canary covered the desired revision), not the one from before a patch."""
    deadline = time.monotonic() + timeout
    last = ""
    started = time.monotonic()
    while time.monotonic() < deadline:
        body = get_serving(name)
        status = body.get("status") or {}
        if since_spec_change and not _verdict_on_current_spec(body):
            time.sleep(3)
            continue
        phase = status.get("phase") or "(none)"
        replicas = status.get("replicas") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        line = (
            f"phase {phase}, replicas ready {replicas.get('ready', 0)}/{replicas.get('desired', '?')}, "
            + ", ".join(f"{k}={v}" for k, v in conditions.items())
        )
        if line != last:
            print(f"  [{time.monotonic() - started:5.0f} s] {line}", file=sys.stderr, flush=True)
            last = line
        if conditions.get("Ready") == "True":
            return "Ready"
        if phase == "CanaryFailed":
            print_canary_failure(name, status)
            return "CanaryFailed"
        if phase == "Invalid":  # final until the spec (or the operator) changes: no use waiting
            raise ClusterError(
                f"the operator refused {name}'s spec (is the operator image older than this checkout? "
                f"run scripts/build-images)\n{describe(name)}"
            )
        check_operator_running()
        time.sleep(3)
    raise ClusterError(
        f"{name} neither Ready nor CanaryFailed after {timeout:.0f} s (last: {last})\n{describe(name)}"
    )


def _verdict_on_current_spec(body: dict[str, Any]) -> bool:
    status = body.get("status") or {}
    if status.get("observedGeneration") != body["metadata"]["generation"]:
        return False
    if status.get("phase") == "CanaryFailed":
        return True
    target = (status.get("canary") or {}).get("target") or {}
    return bool(status.get("desiredRevision")) and target.get("revision") == status.get("desiredRevision")


@contextmanager
def node_with_operator() -> Iterator[kube_node.Images]:
    """The node tier's and the fault tier's session: the node up, the models bound, the chart installed
    with the operator image built here; everything stopped afterwards."""
    if os.geteuid() != 0:
        raise ClusterError("the node and fault tiers start containerd and a kubelet: run them as root")
    images = kube_node.read_images()  # fails with `run scripts/build-images`
    kube_node.kube_binaries()
    kube_node.helm_binary()
    session_log = lambda line: print(f"cluster: {line}", flush=True)  # noqa: E731
    try:
        kube_node.up(session_log)
        install_models()
        install_operator(images.operator)
        yield images
    finally:
        kube_node.down(session_log)


def cmd_up(engine: str, timeout: float) -> int:
    images = kube_node.read_images()
    started = time.monotonic()
    try:
        kube_node.up(log)
        log("tiny models on a local PersistentVolume")
        install_models()
        log(f"helm install {RELEASE} (operator image {images.operator})")
        install_operator(images.operator)
        engine_image = images.engine_patched if engine == "patched" else images.engine_buggy
        resource = example_resource(engine_image)
        name = resource["metadata"]["name"]
        log(f"kubectl apply {EXAMPLE.relative_to(REPO)} (engine image {engine_image})")
        kubectl(["apply", "-f", "-"], input=json.dumps(resource))
        verdict = wait_for_verdict(name, timeout)
    except Exception as error:  # any failure before the verdict is a setup error (exit 3), never 1
        if not isinstance(error, ClusterError):
            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        print(
            "the cluster stays up for inspection: scripts/cluster kubectl ...; scripts/cluster down",
            file=sys.stderr,
        )
        return EXIT_SETUP
    print(kubectl(["get", "mcs", "--all-namespaces"]), end="")
    log(f"{name}: {verdict} after {time.monotonic() - started:.0f} s")
    print(
        "reach it with: scripts/cluster kubectl get pods -A   (kubeconfig, inside its network namespace: "
        f"{kube_node.admin_kubeconfig()}); stop it with: scripts/cluster down",
        file=sys.stderr,
    )
    return EXIT_READY if verdict == "Ready" else EXIT_CANARY_FAILED


def cmd_kubectl(args: Sequence[str]) -> int:
    if not kube_node.NETNS_PATH.exists():
        print("error: no cluster is up (scripts/cluster up)", file=sys.stderr)
        return EXIT_SETUP
    binary = kube_node.kube_binaries()["kubectl"]
    argv = kube_node.in_netns_argv([str(binary), f"--kubeconfig={kube_node.admin_kubeconfig()}", *args])
    os.execvp(argv[0], argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the cluster, install the product, wait for the verdict")
    up.add_argument("--engine", choices=("patched", "buggy"), default="patched")
    up.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for Ready/CanaryFailed")
    commands.add_parser("down", help="stop everything up started and undo its changes")
    commands.add_parser(
        "preload-images", help="import the built images into containerd's store (kept between clusters)"
    )
    kubectl_parser = commands.add_parser("kubectl", help="kubectl against the cluster")
    kubectl_parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "up":
        return cmd_up(args.engine, args.timeout)
    if args.command == "down":
        kube_node.down(log)
        return 0
    if args.command == "preload-images":
        try:
            kube_node.preload_images(log)
        except ClusterError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_SETUP
        return 0
    return cmd_kubectl(args.args)


if __name__ == "__main__":
    sys.exit(main())
