"""Pure parts of scripts/cluster: the DNS stand-in's records, the node's configuration, the example."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from tests.support import cluster, cluster_dns, kube_node
from tests.support.cluster_dns import hosts_entries, render_hosts

from mooncake_operator.api.engine_flags import MANAGED_ENGINE_FLAGS
from mooncake_operator.api.resource import MooncakeServing
from mooncake_sandbox.models import TinyModels

pytestmark = pytest.mark.unit


def service(name: str, cluster_ip: str, namespace: str = "default") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterIP": cluster_ip}}


def endpoints(name: str, addresses: list[dict[str, str]], namespace: str = "default") -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": namespace}, "subsets": [{"addresses": addresses}]}


def test_dns_names_the_product_uses() -> None:
    services = [service("m-master", "10.96.0.20"), service("m-replicas", "None")]
    eps = [
        endpoints("m-master", [{"ip": "10.244.0.5"}]),
        endpoints(
            "m-replicas",
            [
                {"ip": "10.244.0.6", "hostname": "m-replica-0"},
                {"ip": "10.244.0.7", "hostname": "m-replica-1"},
            ],
        ),
    ]
    assert hosts_entries(services, eps) == [
        ("10.244.0.6", "m-replica-0.m-replicas.default.svc.cluster.local"),
        ("10.244.0.6", "m-replicas.default.svc.cluster.local"),
        ("10.244.0.7", "m-replica-1.m-replicas.default.svc.cluster.local"),
        ("10.244.0.7", "m-replicas.default.svc.cluster.local"),
        ("10.96.0.20", "m-master.default.svc.cluster.local"),
    ]


def test_dns_hosts_file_is_stable_and_skips_services_without_endpoints() -> None:
    services = [service("b", "None"), service("a", "10.96.0.9", "x")]
    text = render_hosts(hosts_entries(services, []))
    assert text == "10.96.0.9 a.x.svc.cluster.local\n"
    assert render_hosts(hosts_entries(list(reversed(services)), [])) == text


def test_kubelet_runs_with_the_settings_this_machine_needs() -> None:
    argv = kube_node.kubelet_argv(
        kube_node.KubeBinaries(kube_node.ROOT), kube_node.ROOT / "k", kube_node.ROOT / "ca"
    )
    for flag in (
        "--cgroup-driver=cgroupfs",
        f"--cgroup-root=/{kube_node.CGROUP_ROOT}",
        "--fail-swap-on=false",
        "--oom-score-adj=0",
        f"--max-open-files={kube_node.NOFILE}",
        f"--cluster-dns={kube_node.NODE_IP}",
        "--anonymous-auth=false",
    ):
        assert flag in argv


def test_containerd_never_pulls_the_sandbox_image_and_keeps_oom_scores() -> None:
    config = kube_node.containerd_config("localhost/mooncake-cluster/pause:abc")
    assert 'sandbox_image = "localhost/mooncake-cluster/pause:abc"' in config
    assert "restrict_oom_score_adj = true" in config
    assert "SystemdCgroup = false" in config


def test_preloading_fills_the_store_the_cluster_reads_and_runs_nothing_else() -> None:
    cluster_config = tomllib.loads(kube_node.containerd_config("localhost/mooncake-cluster/pause:abc"))
    preload_config = tomllib.loads(kube_node.store_only_containerd_config())
    # The same image store and socket (import_images talks to it) as the cluster's containerd ...
    assert preload_config["root"] == cluster_config["root"]
    assert preload_config["grpc"]["address"] == str(kube_node.CONTAINERD_SOCKET)
    # ... but no CRI: it starts no pods, configures no network, mounts nothing outside its state.
    assert preload_config["disabled_plugins"] == ["io.containerd.grpc.v1.cri"]
    assert preload_config["state"] == cluster_config["state"]


def test_cni_has_no_masquerade_out_of_the_namespace() -> None:
    plugin = kube_node.cni_config()["plugins"][0]
    assert plugin["ipMasq"] is False
    assert plugin["ipam"]["ranges"] == [[{"subnet": kube_node.POD_CIDR}]]


def test_cpu_example_is_valid_and_uses_the_models_volume() -> None:
    resource = MooncakeServing.model_validate(yaml.safe_load(cluster.EXAMPLE.read_text()))
    assert resource.spec.model.cache.existing_claim == cluster.MODELS_CLAIM
    assert resource.spec.model.name.startswith(f"/var/cache/huggingface/{cluster.MODELS_SUBDIR}/")
    assert resource.spec.speculative is not None
    assert not set(resource.spec.engine.extra_args) & set(MANAGED_ENGINE_FLAGS)
    assert cluster.example_resource("img:1")["spec"]["engine"]["image"] == "img:1"


def test_every_cpu_substitution_is_commented() -> None:
    text = cluster.EXAMPLE.read_text()
    # One `CPU:` comment per substituted setting (model, cache, image, tp, block size, eager, env,
    # resources, draft, store sizes, master resources, content checks).
    assert text.count("# CPU:") >= 12


def test_revision_paths_are_where_the_volume_puts_the_tiny_targets_revisions() -> None:
    assert cluster.target_path(1) == cluster.example_resource("-")["spec"]["model"]["name"]
    assert cluster.target_path(2) == f"/var/cache/huggingface/{cluster.MODELS_SUBDIR}/revision-2/target"
    with pytest.raises(ValueError, match="revisions"):
        cluster.target_path(3)


def test_clients_send_a_name_every_revision_serves() -> None:
    resource = MooncakeServing.model_validate(yaml.safe_load(cluster.EXAMPLE.read_text()))
    assert cluster.client_model_name() in resource.spec.model.served_model_name_aliases
    assert cluster.client_model_name() != resource.spec.model.name


def test_a_model_set_without_the_second_revision_is_refused(tmp_path: Path) -> None:
    models = TinyModels(tmp_path)
    for revision in (1, 2):
        models.target_for(revision).mkdir(parents=True)
        (models.target_for(revision) / "model.safetensors").write_bytes(b"weights")
    assert cluster.missing_revisions(tmp_path) == []
    (models.target_for(2) / "model.safetensors").unlink()
    assert cluster.missing_revisions(tmp_path) == [2]


def test_models_volume_binds_only_the_examples_claim() -> None:
    volume, claim = cluster.models_volume(kube_node.ROOT / "models")
    assert volume["spec"]["claimRef"] == {"namespace": "default", "name": cluster.MODELS_CLAIM}
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]
    assert claim["spec"]["storageClassName"] == volume["spec"]["storageClassName"] == ""


def test_helm_values_never_pull_and_prove_the_example() -> None:
    values = cluster.helm_values("localhost/mooncake-cluster/operator:0123")
    assert "--set=image.repository=localhost/mooncake-cluster/operator" in values
    assert "--set=image.tag=0123" in values
    assert "--set=image.pullPolicy=Never" in values
    assert "--set=test.servingName=minimax-m25" in values
    assert "--set=test.servingNamespace=default" in values
    # The canary's settings are the resource's (canary --resource): the chart no longer has them.
    assert [v for v in values if v.startswith("--set=test.")] == [
        "--set=test.servingName=minimax-m25",
        "--set=test.servingNamespace=default",
    ]


IMAGES_ENV = """PAUSE_IMAGE=r/pause:1
OPERATOR_IMAGE=r/operator:2
ENGINE_PATCHED_IMAGE=r/engine-patched:3
ENGINE_BUGGY_IMAGE=r/engine-buggy:4
ETCD_IMAGE=r/etcd:5
"""


def test_images_env_gives_every_image_the_node_imports() -> None:
    images = kube_node.parse_images(IMAGES_ENV, kube_node.ROOT / "images.env")
    assert images.etcd == "r/etcd:5"
    assert images.all() == ["r/pause:1", "r/operator:2", "r/engine-patched:3", "r/engine-buggy:4", "r/etcd:5"]


def test_images_env_of_an_older_build_says_to_build_again() -> None:
    older = "\n".join(line for line in IMAGES_ENV.splitlines() if not line.startswith("ETCD_IMAGE="))
    with pytest.raises(kube_node.ClusterError, match=r"lacks ETCD_IMAGE: run scripts/build-images"):
        kube_node.parse_images(older, kube_node.ROOT / "images.env")


def test_build_images_writes_the_keys_the_node_reads() -> None:
    script = (cluster.REPO / "scripts" / "build-images").read_text()
    written = script.split('cat >"$OUT.tmp" <<EOF\n', 1)[1].split("\nEOF\n", 1)[0]
    assert {line.split("=", 1)[0] for line in written.splitlines()} == set(kube_node.IMAGES_ENV_KEYS.values())


def test_ha_example_has_three_masters_and_the_managed_etcd_built_here() -> None:
    resource = cluster.ha_example_resource("img:1", "etcd:2")
    serving = MooncakeServing.model_validate(resource)
    ha = serving.spec.store.master.high_availability
    assert ha.enabled and ha.replicas == 3 and ha.enable_oplog
    managed = ha.etcd.managed_or_default()
    assert managed is not None and managed.image == "etcd:2" and managed.replicas == 1
    assert serving.metadata.name == "minimax-m25-ha"
    assert cluster.example_resource("img:1")["metadata"]["name"] == "minimax-m25"  # the example untouched
    assert "highAvailability" not in cluster.example_resource("img:1")["spec"]["store"]["master"]


def test_etcd_claims_get_volumes_bound_to_them_in_advance() -> None:
    claims, size = cluster.etcd_claims(cluster.ha_example_resource("img:1", "etcd:2"))
    assert (claims, size) == (["data-minimax-m25-ha-etcd-0"], "1Gi")
    (volume,) = cluster.claim_volumes(claims, size, kube_node.ROOT / "volumes")
    spec = volume["spec"]
    assert spec["claimRef"] == {"namespace": "default", "name": "data-minimax-m25-ha-etcd-0"}
    # The rendered claim names no class: it binds only to a volume without one.
    assert spec["storageClassName"] == "" and spec["capacity"] == {"storage": "1Gi"}
    assert spec["accessModes"] == ["ReadWriteOnce"]
    assert spec["hostPath"] == {
        "path": str(kube_node.ROOT / "volumes" / "data-minimax-m25-ha-etcd-0"),
        "type": "Directory",  # made by claim_directories, for the etcd's user: the kubelet makes none
    }
    kubernetes_validate.validate(volume, "1.25.0", strict=True)


def test_dns_resolves_the_names_highly_available_masters_use() -> None:
    """The masters' and etcd members' names (what the operator, the masters and the store clients dial)
    from the rendered headless Services and Endpoints as the endpoints controller writes them for
    StatefulSet pods (hostname = pod name); every pod listed, ready or not (publishNotReadyAddresses)."""
    from mooncake_operator.build.etcd import etcd_service, etcd_stateful_set, managed_etcd_endpoints
    from mooncake_operator.build.master import master_stateful_set, masters_headless_service
    from mooncake_operator.build.names import master_pod_urls

    serving = MooncakeServing.model_validate(cluster.ha_example_resource("img:1", "etcd:2"))
    headless = [
        masters_headless_service(serving, owner_uid=None),
        etcd_service(serving, owner_uid=None),
    ]
    assert all(s["spec"]["publishNotReadyAddresses"] for s in headless)
    sets = {
        master_stateful_set(serving, owner_uid=None)["spec"]["serviceName"]: "minimax-m25-ha-master",
        etcd_stateful_set(serving, owner_uid=None)["spec"]["serviceName"]: "minimax-m25-ha-etcd",
    }
    eps = [
        endpoints(service, [{"ip": f"10.244.0.{10 * n + i}", "hostname": f"{pods}-{i}"} for i in range(3)])
        for n, (service, pods) in enumerate(sets.items())
    ]
    names = {name for _, name in hosts_entries(headless, eps)}
    dialled = [url.split("//", 1)[1].rsplit(":", 1)[0] for url in master_pod_urls(serving)]
    dialled += [endpoint.rsplit(":", 1)[0] for endpoint in managed_etcd_endpoints(serving)]
    assert len(dialled) == 4
    assert {f"{host}.cluster.local" for host in dialled} <= names


def test_claim_directories_are_fresh_and_handed_to_the_workloads_user(tmp_path: Path) -> None:
    stale = tmp_path / "data-etcd-0" / "member"
    stale.mkdir(parents=True)
    (stale / "wal").write_text("an earlier etcd's member")
    owner = os.getuid()  # any user the test may hand a directory to; the fault tier passes ETCD_USER_ID

    cluster.claim_directories(["data-etcd-0", "data-etcd-1"], tmp_path, owner)

    for claim in ("data-etcd-0", "data-etcd-1"):
        made = (tmp_path / claim).stat()
        assert not any((tmp_path / claim).iterdir()), f"{claim} kept an earlier volume's files"
        assert (made.st_uid, made.st_gid, stat.S_IMODE(made.st_mode)) == (owner, owner, 0o700)


def test_the_dns_feeder_signals_dnsmasq_only_once_it_handles_sighup(tmp_path: Path) -> None:
    # A slow starter: SIGHUP before its handler is in place would end it (the default action).
    mark = tmp_path / "reloaded"
    slow = (
        "import signal, sys, time\n"
        "time.sleep(0.5)\n"
        "signal.signal(signal.SIGHUP, lambda *_: open(sys.argv[1], 'w').close())\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", slow, str(mark)])
    try:
        cluster_dns.reload(child.pid, timeout=20)
        deadline = time.monotonic() + 10
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists() and child.poll() is None
    finally:
        child.kill()
        child.wait()
    with pytest.raises(SystemExit, match="is gone"):
        cluster_dns.reload(child.pid, timeout=1)
