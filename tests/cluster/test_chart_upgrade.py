"""The chart's CRD upgrade path and the scale subresource on a real kube-apiserver (1.20).

The chart as released before (CRD in its crds/ directory, which helm installs once and never upgrades) is
installed, a MooncakeServing created, and the chart of this checkout (CRD as a template kept on uninstall)
`helm upgrade --take-ownership`d over it: the CRD changes (new fields are stored, not pruned; the scale
subresource appears), the resource survives untouched, and `helm uninstall` leaves the CRD and the resource.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.cluster.operator_harness import install_crd, serving
from tests.support.apiserver import ControlPlane
from tests.support.chart import CHART_DIR, REPO_ROOT, run_helm

from mooncake_operator.api import crd
from mooncake_operator.api.engine_flags import DEFAULT_GPUS_PER_NODE
from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.api.spec import MAX_REPLICAS
from mooncake_operator.build.names import replica_selector_string
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.errors import KubeApiError
from mooncake_operator.kube.kinds import resource_path

# The chart as main released it before the CRD became a template: its CRD sits in crds/.
PREVIOUS_CHART_COMMIT = "d081296c3c96382d0a32e5fb120bce245bc1427d"
CRD_API = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
MANAGER = "mooncake-upgrade-test"


def previous_chart(directory: Path) -> Path:
    """charts/mooncake-operator at PREVIOUS_CHART_COMMIT, extracted from git."""
    done = subprocess.run(
        [
            "git",
            "-C",
            str(REPO_ROOT),
            "archive",
            "--format=tar",
            PREVIOUS_CHART_COMMIT,
            "charts/mooncake-operator",
        ],
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, (
        f"the previous chart ({PREVIOUS_CHART_COMMIT}) is not in this clone (a shallow clone? fetch it): "
        f"{done.stderr.decode(errors='replace')}"
    )
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(directory, filter="data")
    chart = directory / "charts" / "mooncake-operator"
    assert (chart / "crds").is_dir(), "the previous chart must carry its CRD in crds/"
    return chart


async def delete_crd(kube: KubeClient) -> None:
    """No CRD: the previous chart's install creates its own (deleting it deletes every MooncakeServing,
    so the other tests' fixtures apply it again)."""
    await kube.delete(*CRD_API, crd.CRD_NAME, missing_ok=True)
    deadline = time.monotonic() + 60
    while await kube.get_or_none(*CRD_API, crd.CRD_NAME) is not None:
        assert time.monotonic() < deadline, "the CRD was not deleted in 60 s"
        await asyncio.sleep(0.2)


async def established(kube: KubeClient) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        found = await kube.get(*CRD_API, crd.CRD_NAME)
        conditions = (found.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return found
        assert time.monotonic() < deadline, "the CRD is not Established after 30 s"
        await asyncio.sleep(0.2)


async def test_helm_upgrade_from_the_crds_directory_chart_upgrades_the_crd_and_keeps_resources(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    env = {"KUBECONFIG": str(kube_cluster.kubeconfig)}
    release = f"r{uuid.uuid4().hex[:8]}"
    await delete_crd(kube)
    try:
        run_helm(
            ["install", release, str(previous_chart(tmp_path)), "--namespace", namespace], env=env
        ).check()
        before = await established(kube)
        assert "scale" not in before["spec"]["versions"][0]["subresources"], "the previous CRD had no /scale"
        created = await kube.create(serving(namespace, "kept"), field_manager=MANAGER)

        # The previous release does not own the CRD (crds/ is not part of a release): helm says so ...
        refused = run_helm(["upgrade", release, str(CHART_DIR), "--namespace", namespace], env=env)
        assert refused.returncode != 0
        assert "invalid ownership metadata" in refused.stderr, refused.stderr
        # ... and adopts it when told to, once (docs/install.md#upgrading).
        upgrade = ["upgrade", release, str(CHART_DIR), "--namespace", namespace, "--take-ownership"]
        run_helm(upgrade, env=env).check()
        after = await established(kube)
        assert after["spec"]["versions"][0]["subresources"]["scale"] == crd.SCALE_SUBRESOURCE
        assert after["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert after["metadata"]["annotations"]["meta.helm.sh/release-name"] == release

        kept = await kube.get(API_VERSION, KIND, "kept", namespace)
        assert kept["metadata"]["uid"] == created["metadata"]["uid"]
        # Unchanged but for the defaults of fields the new schema adds (applied on read, as the models do).
        assert parse_resource(kept).spec == parse_resource(created).spec
        assert kept["spec"]["engine"]["gpusPerNode"] == DEFAULT_GPUS_PER_NODE
        assert "gpusPerNode" not in created["spec"]["engine"]
        # A field only the new CRD knows is stored (the previous schema prunes it). The API server
        # switches to an updated schema asynchronously: patch until it does.
        deadline = time.monotonic() + 30
        while True:
            patched = await kube.patch_merge(
                API_VERSION, KIND, "kept", {"spec": {"pod": {"drainSeconds": 600}}}, namespace
            )
            if (patched["spec"].get("pod") or {}).get("drainSeconds") == 600:
                break
            assert time.monotonic() < deadline, f"the new schema still prunes spec.pod: {patched['spec']}"
            await asyncio.sleep(0.2)

        # A later upgrade needs no flag: the release owns the CRD now.
        run_helm(["upgrade", release, str(CHART_DIR), "--namespace", namespace], env=env).check()
    finally:
        run_helm(["uninstall", release, "--namespace", namespace], env=env)
    assert await kube.get_or_none(*CRD_API, crd.CRD_NAME) is not None, "helm uninstall deleted the CRD"
    survivor = await kube.get(API_VERSION, KIND, "kept", namespace)
    assert survivor["metadata"]["uid"] == created["metadata"]["uid"]
    # Leave the CRD as the other tests apply it.
    await install_crd(kube)


async def scale(kube: KubeClient, namespace: str, name: str, method: str = "GET", body: Any = None) -> Any:
    """The scale subresource, as `kubectl scale` (a merge patch of spec.replicas) and HPAs use it."""
    path = resource_path(kube.kind(API_VERSION, KIND), namespace=namespace, name=name, subresource="scale")
    content_type = "application/merge-patch+json"
    return await kube._request("scale", method, path, body=body, content_type=content_type)


async def test_kubectl_scale_writes_spec_replicas_and_reads_the_status(
    kube: KubeClient, namespace: str
) -> None:
    await install_crd(kube)
    await kube.create(serving(namespace, "scaled"), field_manager=MANAGER)
    resource = parse_resource(await kube.get(API_VERSION, KIND, "scaled", namespace))
    await kube.patch_status(
        API_VERSION,
        KIND,
        "scaled",
        {"replicas": {"desired": 2, "ready": 2}, "selector": replica_selector_string(resource)},
        namespace,
    )
    deadline = time.monotonic() + 30
    while True:  # the scale endpoint follows a CRD update asynchronously
        try:
            current = await scale(kube, namespace, "scaled")
            break
        except KubeApiError as error:
            assert error.not_found and time.monotonic() < deadline, error
            await asyncio.sleep(0.2)
    assert current["kind"] == "Scale"
    assert current["spec"]["replicas"] == 2
    assert current["status"] == {
        "replicas": 2,
        "selector": "app.kubernetes.io/component=engine,app.kubernetes.io/instance=scaled",
    }
    await scale(kube, namespace, "scaled", "PATCH", {"spec": {"replicas": 4}})
    after = await kube.get(API_VERSION, KIND, "scaled", namespace)
    assert after["spec"]["replicas"] == 4
    assert after["metadata"]["generation"] == 2  # a spec change: the operator rolls it out and proves it
    with pytest.raises(KubeApiError) as caught:
        await scale(kube, namespace, "scaled", "PATCH", {"spec": {"replicas": MAX_REPLICAS + 1}})
    assert caught.value.status == 422
