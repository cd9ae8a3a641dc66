"""Pure parts of scripts/cluster: the DNS stand-in's records, the node's configuration, the example."""

from __future__ import annotations

import pytest
import yaml
from tests.support import cluster, kube_node
from tests.support.cluster_dns import hosts_entries, render_hosts

from mooncake_operator.api import MANAGED_ENGINE_FLAGS, MooncakeServing

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
