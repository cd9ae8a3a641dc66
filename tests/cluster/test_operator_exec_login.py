"""Exec credential plugins against a real API server.

The plugin hands out a different real token (a ServiceAccount's, minted by TokenRequest) on each run,
each declared to expire two seconds later: the operator (kopf's login and its own client share one
plugin cache) must keep reconciling across the expiries, running the plugin again each time.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.cluster.operator_harness import (
    FakeKubelet,
    eventually,
    operator_settings,
    run_operator,
    serving,
    wait_for_phase,
)
from tests.support.apiserver import ControlPlane
from tests.support.fake_vllm import FakeCluster

from mooncake_operator import api
from mooncake_operator.kube import KubeClient, KubeConfig

TOKENS = 12
LIFETIME_S = 2

# Hands out the next token of TOKENS_FILE on each run, expiring LIFETIME_S later; logs each run.
PLUGIN = """\
#!{python}
import datetime, json, os
runs = os.environ["PLUGIN_RUNS"]
count = len(open(runs).read().splitlines()) if os.path.exists(runs) else 0
tokens = open(os.environ["TOKENS_FILE"]).read().split()
with open(runs, "a") as f:
    f.write(json.dumps(os.environ.get("KUBERNETES_EXEC_INFO")) + "\\n")
expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds={lifetime})
status = {{"token": tokens[count % len(tokens)]}}
status["expirationTimestamp"] = expires.strftime("%Y-%m-%dT%H:%M:%SZ")
version = "client.authentication.k8s.io/v1"
print(json.dumps({{"apiVersion": version, "kind": "ExecCredential", "status": status}}))
"""


def grant_cluster_role(plane: ControlPlane, namespace: str, account: str, role: str) -> None:
    with plane.client() as http:
        created = http.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
        )
        assert created.status_code == 201, created.text
        path = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{namespace}-{account}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        }
        bound = http.post(path, json=binding)
        assert bound.status_code == 201, bound.text


def split_kubeconfig(plane: ControlPlane, folder: Path, tokens: list[str]) -> tuple[Path, Path, Path]:
    """The cluster in one file, the exec user (a plugin relative to its file) and context in another."""
    (folder / "cluster").mkdir(parents=True)
    (folder / "user" / "bin").mkdir(parents=True)
    plugin = folder / "user" / "bin" / "token-plugin"
    plugin.write_text(PLUGIN.format(python=sys.executable, lifetime=LIFETIME_S))
    plugin.chmod(0o755)
    (folder / "tokens").write_text("\n".join(tokens))
    runs = folder / "runs"
    cluster_file = folder / "cluster" / "config"
    cluster_file.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "h",
                        "cluster": {"server": plane.server, "certificate-authority": str(plane.ca_path)},
                    }
                ]
            }
        )
    )
    user_file = folder / "user" / "config"
    exec_stanza = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "bin/token-plugin",
        "interactiveMode": "Never",
        "provideClusterInfo": True,
        "env": [
            {"name": "PLUGIN_RUNS", "value": str(runs)},
            {"name": "TOKENS_FILE", "value": str(folder / "tokens")},
        ],
    }
    user_file.write_text(
        yaml.safe_dump(
            {
                "users": [{"name": "plugin-user", "user": {"exec": exec_stanza}}],
                "contexts": [{"name": "laptop", "context": {"cluster": "h", "user": "plugin-user"}}],
                "current-context": "laptop",
            }
        )
    )
    return cluster_file, user_file, runs


def plugin_runs(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


async def test_the_operator_keeps_reconciling_across_exec_token_expiries(
    kube: KubeClient,
    kube_cluster: ControlPlane,
    namespace: str,
    crd: None,
    fakes: FakeCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grant_cluster_role(kube_cluster, namespace, "laptop", "cluster-admin")
    tokens = [kube_cluster.service_account_token(namespace, "laptop") for _ in range(TOKENS)]
    cluster_file, user_file, runs = split_kubeconfig(kube_cluster, tmp_path, tokens)
    monkeypatch.setenv("KUBECONFIG", f"{user_file}:{cluster_file}")
    config = KubeConfig.from_kubeconfig()
    endpoints = {f"{namespace}/demo": tuple(fakes.urls)}
    settings = operator_settings(kube_cluster, namespace, kube=config, replica_endpoints=endpoints)
    with run_operator(settings):
        await kube.create(serving(namespace))
        async with FakeKubelet(kube, namespace):
            await wait_for_phase(kube, namespace, "Ready")
            started = plugin_runs(runs)
            # Several lifetimes later, a change must still be noticed (watch) and acted on (writes).
            await asyncio.sleep(3 * LIFETIME_S)
            for round_ in range(2):
                before = sum(len(r.requests_to("/v1/chat/completions")) for r in fakes.replicas)
                patch = {"metadata": {"annotations": {api.RERUN_CANARY_ANNOTATION: f"r{round_}"}}}
                await kube.patch_merge(api.API_VERSION, api.KIND, "demo", patch, namespace)

                async def rerun_done(
                    before: int = before, value: str = f"r{round_}"
                ) -> dict[str, Any] | None:
                    body = await kube.get(api.API_VERSION, api.KIND, "demo", namespace)
                    posts = sum(len(r.requests_to("/v1/chat/completions")) for r in fakes.replicas)
                    canary = (body.get("status") or {}).get("canary") or {}
                    done = (
                        posts > before
                        and (canary.get("target") or {}).get("rerun") == value
                        and body["status"]["phase"] == "Ready"
                    )
                    return body if done else None

                await eventually(rerun_done, within=60, what=f"canary rerun {round_} with rotated tokens")
                await asyncio.sleep(LIFETIME_S + 0.5)
    assert plugin_runs(runs) >= started + 2, "the plugin was not run again after its tokens expired"
    info = json.loads(json.loads(runs.read_text().splitlines()[0]))
    assert info["spec"]["cluster"]["server"] == kube_cluster.server
    assert info["spec"]["interactive"] is False
