"""`canary --resource` as a user runs it from a laptop: the CLI on the host with a kubeconfig (not the
in-cluster one), a user holding only the documented RBAC, the replicas reached through the API server's
pods proxy subresource.

Runs before test_product_on_a_node.py (file order): it applies the same example resource and waits for
Ready, so the product tests then find it Ready; the operator is still installed (the product file ends
with `helm uninstall`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from tests.support import cluster, kube_node
from tests.support.kube_node import kubectl

NAME = "minimax-m25"
NAMESPACE = "default"
ACCOUNT = "canary-laptop"
VERDICT_TIMEOUT = 1200.0
CLI_TIMEOUT = 600.0


def laptop_kubeconfig(folder: Path) -> Path:
    """The admin kubeconfig's cluster (server, CA) with the ServiceAccount's token as its only user."""
    admin = yaml.safe_load(kube_node.admin_kubeconfig().read_text())
    # TokenRequest (kubectl 1.20 has no `create token`): a bound token, as a laptop's login would hold.
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600},
    }
    path = f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token"
    minted = json.loads(kubectl(["create", f"--raw={path}", "-f", "-"], input=json.dumps(request)))
    token = minted["status"]["token"]
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [
            {
                "name": "laptop",
                "context": {"cluster": admin["clusters"][0]["name"], "user": ACCOUNT, "namespace": NAMESPACE},
            }
        ],
        "current-context": "laptop",
    }
    path = folder / "laptop.kubeconfig"
    path.write_text(yaml.safe_dump(document))
    return path


def canary(kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    # The installed CLI as a separate process: no in-cluster environment, only the kubeconfig.
    argv = [sys.executable, "-m", "mooncake_operator.cli", "canary", "--resource", NAME, "--json"]
    return subprocess.run(
        argv,
        env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "HOME": str(kubeconfig.parent)},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def test_canary_resource_from_outside_through_the_pods_proxy(
    node_cluster: kube_node.Images, tmp_path: Path
) -> None:
    kubectl(["apply", "-f", "-"], input=json.dumps(cluster.example_resource(node_cluster.engine_patched)))
    kubectl(["create", "serviceaccount", ACCOUNT, f"--namespace={NAMESPACE}"])
    # The RBAC docs/canary.md documents for the outside path, first without pods/proxy.
    kubectl(
        [
            "create",
            "role",
            ACCOUNT,
            f"--namespace={NAMESPACE}",
            "--verb=get",
            "--resource=mooncakeservings.serving.mooncake-operator.dev",
        ]
    )
    kubectl(
        [
            "create",
            "rolebinding",
            ACCOUNT,
            f"--namespace={NAMESPACE}",
            f"--role={ACCOUNT}",
            f"--serviceaccount={NAMESPACE}:{ACCOUNT}",
        ]
    )
    # Proving the pods it dials (docs/canary.md: both paths): the StatefulSet, and the pods' owners.
    proving = [
        {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    patch = json.dumps([{"op": "add", "path": "/rules/-", "value": rule} for rule in proving])
    kubectl(["patch", "role", ACCOUNT, f"--namespace={NAMESPACE}", "--type=json", f"--patch={patch}"])
    kubeconfig = laptop_kubeconfig(tmp_path)
    assert cluster.wait_for_verdict(NAME, VERDICT_TIMEOUT) == "Ready"

    refused = canary(kubeconfig)
    assert refused.returncode == 3, refused.stderr
    assert "pods/proxy" in refused.stderr and f"namespace {NAMESPACE}" in refused.stderr, refused.stderr
    # Nothing is judged without the rights: --json prints the setup error, no verdict.
    error = json.loads(refused.stdout)
    assert error["exitCode"] == 3 and error["error"]["kind"] == "setup", error
    assert "verdict" not in error and "pods/proxy" in error["error"]["message"], error

    rule = {"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get", "create"]}
    patch = json.dumps([{"op": "add", "path": "/rules/-", "value": rule}])
    kubectl(["patch", "role", ACCOUNT, f"--namespace={NAMESPACE}", "--type=json", f"--patch={patch}"])
    done = canary(kubeconfig)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "through the API server's pods proxy" in done.stderr, done.stderr
    result = json.loads(done.stdout)
    assert result["verdict"] == "Passed", result["reason"]
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"].rstrip("/")
    pods = sorted(
        pod["metadata"]["name"]
        for pod in json.loads(
            kubectl(
                [
                    "get",
                    "pods",
                    f"--namespace={NAMESPACE}",
                    f"--selector=app.kubernetes.io/instance={NAME},app.kubernetes.io/name=vllm",
                    "-o",
                    "json",
                ]
            )
        )["items"]
    )
    port = cluster.example_resource("-")["spec"]["engine"].get("port", 8000)  # the API's default
    assert sorted(result["replicas"]) == [
        f"{server}/api/v1/namespaces/{NAMESPACE}/pods/{pod}:{port}/proxy" for pod in pods
    ]
    assert all(pair["external_hit_tokens"] > 0 for pair in result["pairs"]), result["pairs"]
    for kind in ("rolebinding", "role", "serviceaccount"):
        kubectl(["delete", kind, ACCOUNT, f"--namespace={NAMESPACE}"])
