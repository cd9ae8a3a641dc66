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
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from tests.support import kube_node
from tests.support.kube_node import ROOT, ClusterError, kubectl

from mooncake_sandbox.engine_env import cache_root
from mooncake_sandbox.models import models_dir

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


def install_models() -> None:
    source = models_dir(cache_root())
    if not (source / "manifest.json").exists():
        raise ClusterError(f"tiny models missing in {source}: run `mooncake-operator sandbox prepare`")
    # A copy per cluster: the pods may write next to the weights, the cache stays pristine.
    volume = ROOT / "models"
    shutil.copytree(source, volume / MODELS_SUBDIR)
    # The example's engine runs as uid 1000 (Pod Security "restricted"): the weights must be readable
    # by every user, as on a shared model volume; safetensors writes its files 0600.
    for path in (volume / MODELS_SUBDIR).rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    manifests = {"apiVersion": "v1", "kind": "List", "items": models_volume(volume)}
    kubectl(["apply", "-f", "-"], input=json.dumps(manifests))


def helm(args: Sequence[str]) -> str:
    argv = [str(kube_node.helm_binary()), f"--kubeconfig={kube_node.admin_kubeconfig()}", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
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

    def events() -> str:
        listing = json.loads(kubectl(["get", "events", "-n", namespace, "-o", "json"]))
        items = sorted(listing["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return "\n".join(
            f"{e.get('lastTimestamp')} {e.get('type')} {e.get('reason')} "
            f"{e['involvedObject'].get('name')}: {e.get('message')} (x{e.get('count')})"
            for e in items[-40:]
        )

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
    part(f"events in {namespace}", events)
    part("operator log", operator_log)
    return "\n".join(parts)


def wait_for_verdict(name: str, timeout: float) -> str:
    """Prints each change of phase / ready replicas / conditions; returns Ready or CanaryFailed."""
    deadline = time.monotonic() + timeout
    last = ""
    started = time.monotonic()
    while time.monotonic() < deadline:
        status = get_serving(name).get("status") or {}
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
        check_operator_running()
        time.sleep(3)
    raise ClusterError(
        f"{name} neither Ready nor CanaryFailed after {timeout:.0f} s (last: {last})\n{describe(name)}"
    )


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
    kubectl_parser = commands.add_parser("kubectl", help="kubectl against the cluster")
    kubectl_parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "up":
        return cmd_up(args.engine, args.timeout)
    if args.command == "down":
        kube_node.down(log)
        return 0
    return cmd_kubectl(args.args)


if __name__ == "__main__":
    sys.exit(main())
