"""Exec credential plugins against a real API server.

The plugin hands out a different real token (a ServiceAccount's, minted by TokenRequest) on each run,
each declared to expire two seconds later: the operator (kopf's login and its own client share one
plugin cache) must keep reconciling across the expiries, running the plugin again each time.

A token can also stop working before the expiry the plugin declared (revoked, or the login behind it
ended). The tests bind each token to a Secret of its own (TokenRequest's boundObjectRef) and delete the
Secret: from then on the API server itself answers 401 to that token, exactly as it does to any
revoked credential, while the plugin still declares it valid for an hour. So only a 401 can make the
plugin run again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
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

from mooncake_operator.api.group import API_VERSION, KIND, RERUN_CANARY_ANNOTATION
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError

TOKENS = 12
LIFETIME_S = 2
# What the plugin declares in the revocation tests: far beyond the test, so only a 401 runs it again.
DECLARED_LIFETIME_S = 3600
# kube-apiserver caches a token's successful authentication for 10 s: a revoked one works until then.
REVOKED_WITHIN_S = 30.0
WATCH_S = 3.0  # the revoked operator's watch timeout: kopf's watch reconnects (and meets the 401) quickly

# Hands out the next token of TOKENS_FILE on each run, expiring LIFETIME_S later (to the microsecond:
# whole seconds would leave as little as one, less than a loaded machine's plugin run); logs each run.
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
status["expirationTimestamp"] = expires.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
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


def split_kubeconfig(
    plane: ControlPlane, folder: Path, tokens: list[str], lifetime_s: int = LIFETIME_S
) -> tuple[Path, Path, Path]:
    """The cluster in one file, the exec user (a plugin relative to its file) and context in another."""
    (folder / "cluster").mkdir(parents=True)
    (folder / "user" / "bin").mkdir(parents=True)
    plugin = folder / "user" / "bin" / "token-plugin"
    plugin.write_text(PLUGIN.format(python=sys.executable, lifetime=lifetime_s))
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


def revocable_tokens(plane: ControlPlane, namespace: str, account: str, count: int) -> list[str]:
    """`count` tokens of `account`, token i bound to the Secret `binding-i` (see `revoke`)."""
    tokens = []
    with plane.client() as http:
        for index in range(count):
            manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"binding-{index}"}}
            created = http.post(f"/api/v1/namespaces/{namespace}/secrets", json=manifest)
            assert created.status_code == 201, created.text
            bound = {"apiVersion": "v1", "kind": "Secret", "name": f"binding-{index}"}
            bound["uid"] = created.json()["metadata"]["uid"]
            tokens.append(plane.service_account_token(namespace, account, bound_object=bound))
    return tokens


def revoke(plane: ControlPlane, namespace: str, tokens: list[str], indexes: range) -> None:
    """Deletes the Secrets tokens[indexes] are bound to, and waits until the API server refuses each."""
    with plane.client() as http:
        for index in indexes:
            deleted = http.delete(f"/api/v1/namespaces/{namespace}/secrets/binding-{index}")
            assert deleted.status_code == 200, deleted.text
    probe = f"/api/v1/namespaces/{namespace}/serviceaccounts/default"
    for index in indexes:
        deadline = time.monotonic() + REVOKED_WITHIN_S
        with plane.client(token=tokens[index]) as http:
            while (status := http.get(probe).status_code) != 401:
                assert status == 200, f"token {index}: HTTP {status}"
                assert time.monotonic() < deadline, f"token {index} still accepted {REVOKED_WITHIN_S}s on"
                time.sleep(0.5)


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
                patch = {"metadata": {"annotations": {RERUN_CANARY_ANNOTATION: f"r{round_}"}}}
                await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)

                async def rerun_done(
                    before: int = before, value: str = f"r{round_}"
                ) -> dict[str, Any] | None:
                    body = await kube.get(API_VERSION, KIND, "demo", namespace)
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


async def test_a_token_revoked_before_its_declared_expiry_runs_the_plugin_once_more(
    kube_cluster: ControlPlane, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grant_cluster_role(kube_cluster, namespace, "laptop", "cluster-admin")
    tokens = revocable_tokens(kube_cluster, namespace, "laptop", 3)
    cluster_file, user_file, runs = split_kubeconfig(kube_cluster, tmp_path, tokens, DECLARED_LIFETIME_S)
    monkeypatch.setenv("KUBECONFIG", f"{user_file}:{cluster_file}")
    async with KubeClient(KubeConfig.from_kubeconfig()) as client:
        await client.get("v1", "ServiceAccount", "default", namespace)
        assert plugin_runs(runs) == 1
        await asyncio.to_thread(revoke, kube_cluster, namespace, tokens, range(1))

        # One request: a 401 for token 0, the plugin runs once (token 1), the same request is retried.
        got = await client.get("v1", "ServiceAccount", "default", namespace)
        assert got["metadata"]["name"] == "default"
        assert plugin_runs(runs) == 2
        assert client.counts.by_verb["get"] == 2
        await client.get("v1", "ServiceAccount", "default", namespace)  # token 1 is cached again
        assert plugin_runs(runs) == 2

        # The plugin hands out a revoked token again: the second 401 is the answer, not a loop.
        await asyncio.to_thread(revoke, kube_cluster, namespace, tokens, range(1, 3))
        with pytest.raises(KubeApiError) as raised:
            await client.get("v1", "ServiceAccount", "default", namespace)
        assert raised.value.status == 401
        assert "ran again after a first 401: its fresh token was refused too" in raised.value.message
        assert plugin_runs(runs) == 3


async def test_the_operator_keeps_reconciling_after_its_token_is_revoked(
    kube: KubeClient,
    kube_cluster: ControlPlane,
    namespace: str,
    crd: None,
    fakes: FakeCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grant_cluster_role(kube_cluster, namespace, "operator", "cluster-admin")
    tokens = revocable_tokens(kube_cluster, namespace, "operator", 8)
    cluster_file, user_file, runs = split_kubeconfig(kube_cluster, tmp_path, tokens, DECLARED_LIFETIME_S)
    monkeypatch.setenv("KUBECONFIG", f"{user_file}:{cluster_file}")
    endpoints = {f"{namespace}/demo": tuple(fakes.urls)}
    # Short watches: kopf's reconnects, with the token it holds, within seconds of the revocation.
    settings = operator_settings(
        kube_cluster,
        namespace,
        kube=KubeConfig.from_kubeconfig(),
        replica_endpoints=endpoints,
        watch_timeout_seconds=WATCH_S,
    )
    with run_operator(settings) as running:
        await kube.create(serving(namespace))
        async with FakeKubelet(kube, namespace):
            await wait_for_phase(kube, namespace, "Ready")
            # The operator's own watches next reconnect in ten minutes (reads come from its cache), so
            # kopf's watch meets the 401 first: its login must not hand back the cached token, which
            # nothing has refreshed yet (kopf refuses credentials it saw fail, and would stop watching).
            running.runtime.cache.watch_timeout_seconds = 600
            await asyncio.sleep(WATCH_S + 1)
            handed_out = plugin_runs(runs)
            await asyncio.to_thread(revoke, kube_cluster, namespace, tokens, range(handed_out))
            await asyncio.sleep(2 * WATCH_S)  # kopf's watch has reconnected since, and met a 401
            before = sum(len(r.requests_to("/v1/chat/completions")) for r in fakes.replicas)
            patch = {"metadata": {"annotations": {RERUN_CANARY_ANNOTATION: "after-revocation"}}}
            await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)

            async def rerun_done() -> dict[str, Any] | None:
                body = await kube.get(API_VERSION, KIND, "demo", namespace)
                posts = sum(len(r.requests_to("/v1/chat/completions")) for r in fakes.replicas)
                canary = (body.get("status") or {}).get("canary") or {}
                done = (
                    posts > before
                    and (canary.get("target") or {}).get("rerun") == "after-revocation"
                    and body["status"]["phase"] == "Ready"
                )
                return body if done else None

            # The rerun is seen only through kopf's watch, and acted on through the operator's client.
            await eventually(rerun_done, within=60, what="a canary rerun after the token was revoked")
    output = running.runner.output
    # kopf logged in again after its 401, and the login handed it a working token, not the revoked one.
    assert "Re-authentication has finished." in output, output[-3000:]
    assert "Ran out of valid credentials" not in output, output[-3000:]
    assert plugin_runs(runs) > handed_out
