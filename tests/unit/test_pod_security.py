"""Every pod the operator (and its chart) renders, against Pod Security "restricted" (tests/support/
pod_security.py): the master, the managed etcd, the operator and its `helm test` Pod pass it as rendered;
the replicas break exactly the rules docs/api.md says they do (the GPU engine image runs as root; RDMA
needs capabilities or the host), and pass it whole once the user sets a non-root user.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.chart import render
from tests.support.pod_security import pod_specs, violations
from tests.unit.builders.cases import CASES, OWNER_UID, example_dict

from mooncake_operator.api.resource import MooncakeServing, parse_resource
from mooncake_operator.build.manifests import render_all
from mooncake_operator.build.names import COMPONENT_ETCD, COMPONENT_MASTER, COMPONENT_REPLICA

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NON_ROOT = "running as non-root: containers[vllm] (nor the pod) sets runAsNonRoot true"


def resources() -> dict[str, MooncakeServing]:
    found = {name: build() for name, build in CASES.items()}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        found[path.name] = parse_resource(yaml.safe_load(path.read_text(encoding="utf-8")))
    return found


RESOURCES = resources()


def pods(resource: MooncakeServing) -> dict[str, tuple[str, dict[str, Any]]]:
    """Pod specs by name, with the component label of the workload's pods."""
    out = {}
    manifests = render_all(resource, owner_uid=OWNER_UID)
    by_name = {f"{m['kind']}/{m['metadata']['name']}": m for m in manifests}
    for where, pod in pod_specs(manifests):
        labels = by_name[where]["spec"]["template"]["metadata"]["labels"]
        out[where] = (labels["app.kubernetes.io/component"], pod)
    return out


def engine_rules(resource: MooncakeServing) -> set[str]:
    """The restricted rules docs/api.md says the replicas break for this spec."""
    expected = set()
    context = resource.spec.engine.security_context
    if context is None or context.run_as_non_root is not True:
        expected.add(NON_ROOT)
    rdma = resource.spec.store.rdma
    if rdma is not None and rdma.resource_name is not None:
        added = ["IPC_LOCK", "SYS_RESOURCE"] if rdma.memlock == "Wrapper" else ["IPC_LOCK"]
        expected.add(f"capabilities: containers[vllm] adds {added}")
    return expected


@pytest.mark.parametrize("name", sorted(RESOURCES))
def test_every_pod_but_the_engines_passes_restricted(name: str) -> None:
    rendered = pods(RESOURCES[name])
    assert any(component != COMPONENT_REPLICA for component, _ in rendered.values())
    for where, (component, pod) in rendered.items():
        if component != COMPONENT_REPLICA:
            assert violations(pod) == [], f"{name} {where}"


@pytest.mark.parametrize("name", sorted(RESOURCES))
def test_the_replicas_break_only_what_the_docs_say(name: str) -> None:
    resource = RESOURCES[name]
    rdma = resource.spec.store.rdma
    for where, (component, pod) in pods(resource).items():
        if component != COMPONENT_REPLICA:
            continue
        if rdma is not None and (rdma.host_devices or rdma.host_network):
            # The host's devices or network: not even "baseline" (docs/api.md says "privileged").
            assert violations(pod, "baseline"), f"{name} {where}"
            continue
        if rdma is None or rdma.resource_name is None:
            assert violations(pod, "baseline") == [], f"{name} {where}"
        assert set(violations(pod)) == engine_rules(resource), f"{name} {where}"


def test_the_cpu_example_runs_every_pod_restricted() -> None:
    for where, (_, pod) in pods(RESOURCES["minimax-m2.5-eagle3-cpu.yaml"]).items():
        assert violations(pod) == [], where


def test_a_non_root_engine_with_ha_and_managed_etcd_is_restricted_throughout() -> None:
    """docs/api.md's settings for "restricted", with highly available masters and the managed etcd: a
    namespace that enforces the profile admits every pod."""
    obj = example_dict()
    obj["spec"]["engine"]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "readOnlyRootFilesystem": True,
    }
    obj["spec"]["pod"] = {"securityContext": {"fsGroup": 1000}}
    obj["spec"]["store"]["master"]["highAvailability"] = {
        "enabled": True,
        "etcd": {"managed": {"replicas": 3}},
    }
    rendered = pods(parse_resource(obj))
    assert {component for component, _ in rendered.values()} == {
        COMPONENT_REPLICA,
        COMPONENT_MASTER,
        COMPONENT_ETCD,
    }
    for where, (_, pod) in rendered.items():
        assert violations(pod) == [], where


def test_the_managed_etcd_runs_as_its_data_directorys_owner_with_resources() -> None:
    obj = example_dict()
    obj["spec"]["store"]["master"]["highAvailability"] = {"enabled": True, "etcd": {"managed": {}}}
    etcd = next(pod for component, pod in pods(parse_resource(obj)).values() if component == COMPONENT_ETCD)
    context = etcd["securityContext"]
    # The claim is group-owned by etcd's group, so etcd (not root) can create its data directory there.
    assert context["runAsUser"] == context["fsGroup"] == context["runAsGroup"] != 0
    (container,) = etcd["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    # The user's resources replace the defaults.
    mine = {"requests": {"cpu": "1", "memory": "2Gi"}}
    obj["spec"]["store"]["master"]["highAvailability"]["etcd"]["managed"]["resources"] = mine
    etcd = next(pod for component, pod in pods(parse_resource(obj)).values() if component == COMPONENT_ETCD)
    assert etcd["containers"][0]["resources"] == mine


def test_the_chart_pods_pass_restricted(tmp_path: Path) -> None:
    values = {"test": {"servingName": "minimax-m25", "servingNamespace": "default"}}
    manifests = render(values, tmp_path)
    found = dict(pod_specs(manifests))
    assert {where.split("/")[0] for where in found} == {"Deployment", "Pod"}  # the operator, helm test
    for where, pod in found.items():
        assert violations(pod) == [], where


# --- the checker itself -----------------------------------------------------------------------------------

RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "volumes": [{"name": "data", "emptyDir": {}}],
    "containers": [
        {
            "name": "c",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ],
}


def test_the_checker_passes_a_restricted_pod() -> None:
    assert violations(RESTRICTED_POD) == []


@pytest.mark.parametrize(
    ("change", "rule", "level"),
    [
        (lambda p: p["securityContext"].pop("runAsNonRoot"), "running as non-root", "restricted"),
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccomp", "restricted"),
        (
            lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
            "privilege",
            "restricted",
        ),
        (lambda p: p["containers"][0]["securityContext"].pop("capabilities"), "drop ALL", "restricted"),
        (lambda p: p["containers"][0]["securityContext"].update(runAsUser=0), "non-root user", "restricted"),
        (
            lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False),
            "non-root",
            "restricted",
        ),
        (lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "s"}}), "volume types", "restricted"),
        (
            lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
            "capabilities",
            "baseline",
        ),
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged", "baseline"),
        (lambda p: p.update(hostNetwork=True), "host namespaces", "baseline"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath", "baseline"),
        (lambda p: p["containers"][0].update(ports=[{"hostPort": 80}]), "host ports", "baseline"),
        (
            lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
            "seccomp",
            "baseline",
        ),
        (
            lambda p: p.setdefault("initContainers", []).append({"name": "i"}),
            "initContainers[i]",
            "restricted",
        ),
    ],
)
def test_the_checker_catches_each_rule(change: Any, rule: str, level: str) -> None:
    pod = copy.deepcopy(RESTRICTED_POD)
    change(pod)
    found = violations(pod, "restricted")
    assert any(rule in line for line in found), found
    if level == "baseline":
        assert any(rule in line for line in violations(pod, "baseline"))
    else:
        assert violations(pod, "baseline") == []
