"""The chart's RBAC is exactly the operator's documented permission list (docs/operator.md, "RBAC"):
framework rules in a ClusterRole, application rules cluster-wide or per watched namespace, and nothing
broader (no wildcards, no delete but of replica StatefulSets, no Secrets, no nodes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from tests.support.chart import RELEASE, RELEASE_NAMESPACE, REPO_ROOT, Manifest, by_kind, render

pytestmark = pytest.mark.unit

OPERATOR_DOC = REPO_ROOT / "docs" / "operator.md"
FULLNAME = f"{RELEASE}-mooncake-operator"

# (apiGroup, resource, verb): one permission, "" being the core group.
Permission = tuple[str, str, str]


def documented_tables() -> dict[str, set[Permission]]:
    """The permission tables of the RBAC section, keyed by the paragraph that introduces each
    ("Framework", "Application")."""
    text = OPERATOR_DOC.read_text(encoding="utf-8")
    section = re.search(r"^## RBAC\n(.*?)(?=^## )", text, flags=re.MULTILINE | re.DOTALL)
    assert section, f"{OPERATOR_DOC} has no '## RBAC' section"
    tables: dict[str, set[Permission]] = {}
    heading = None
    for line in section.group(1).splitlines():
        intro = re.match(r"^(Framework|Application|Leader)\b", line)
        if intro:
            heading = intro.group(1)
            tables[heading] = set()
        elif heading and line.startswith("| `"):
            groups, resources, verbs = (cell.strip() for cell in line.strip("|").split("|")[:3])
            for group in re.findall(r"`([^`]*)`", groups):
                for resource in re.findall(r"`([^`]*)`", resources):
                    for verb in re.findall(r"`([^`]*)`", verbs):
                        tables[heading].add((group.strip('"'), resource, verb))
    assert set(tables) == {"Framework", "Application", "Leader"}, (
        f"tables found in {OPERATOR_DOC}: {sorted(tables)}"
    )
    assert all(tables.values()), f"an empty permission table in {OPERATOR_DOC}"
    return tables


def permissions(role: Manifest) -> set[Permission]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def named(manifests: list[Manifest], kind: str, name: str, namespace: str | None = None) -> Manifest:
    found = [
        m
        for m in by_kind(manifests, kind)
        if m["metadata"]["name"] == name and m["metadata"].get("namespace") == namespace
    ]
    assert len(found) == 1, f"{kind} {namespace}/{name}: found {len(found)}"
    return found[0]


def bound_subjects(binding: Manifest) -> list[dict[str, Any]]:
    subjects: list[dict[str, Any]] = binding["subjects"]
    return subjects


SERVICE_ACCOUNT = {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}


def test_cluster_wide_watch_grants_exactly_the_documented_permissions(tmp_path: Path) -> None:
    documented = documented_tables()
    manifests = render({}, tmp_path)
    framework = named(manifests, "ClusterRole", f"{FULLNAME}-framework")
    application = named(manifests, "ClusterRole", f"{FULLNAME}-application")
    assert permissions(framework) == documented["Framework"]
    assert permissions(application) == documented["Application"]
    assert [role["metadata"]["name"] for role in by_kind(manifests, "Role")] == [
        f"{FULLNAME}-leader-election"
    ]
    for role in (framework, application):
        binding = named(manifests, "ClusterRoleBinding", role["metadata"]["name"])
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        }
        assert bound_subjects(binding) == [SERVICE_ACCOUNT]


def test_namespaced_watch_grants_the_application_rules_per_namespace_only(tmp_path: Path) -> None:
    documented = documented_tables()
    manifests = render({"watchNamespaces": ["serving-a", "serving-b"]}, tmp_path)
    assert [r["metadata"]["name"] for r in by_kind(manifests, "ClusterRole")] == [f"{FULLNAME}-framework"]
    assert permissions(by_kind(manifests, "ClusterRole")[0]) == documented["Framework"]
    for namespace in ("serving-a", "serving-b"):
        role = named(manifests, "Role", f"{FULLNAME}-application", namespace)
        assert permissions(role) == documented["Application"]
        binding = named(manifests, "RoleBinding", f"{FULLNAME}-application", namespace)
        assert binding["roleRef"]["kind"] == "Role"
        assert bound_subjects(binding) == [SERVICE_ACCOUNT]
    assert len(by_kind(manifests, "Role")) == 3  # and the leader-election Role


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["serving-a"]}], ids=["cluster", "namespaced"])
def test_leader_election_is_granted_on_leases_in_the_release_namespace_only(
    values: dict[str, Any], tmp_path: Path
) -> None:
    manifests = render(values, tmp_path)
    role = named(manifests, "Role", f"{FULLNAME}-leader-election", RELEASE_NAMESPACE)
    assert permissions(role) == documented_tables()["Leader"]
    assert all(rule["resourceNames"] == [FULLNAME] for rule in role["rules"] if "get" in rule["verbs"])
    binding = named(manifests, "RoleBinding", f"{FULLNAME}-leader-election", RELEASE_NAMESPACE)
    assert bound_subjects(binding) == [SERVICE_ACCOUNT]
    args = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--lease-namespace={RELEASE_NAMESPACE}" in args
    assert f"--lease-name={FULLNAME}" in args  # the release's own Lease


def test_an_existing_service_account_is_bound(tmp_path: Path) -> None:
    manifests = render({"serviceAccount": {"create": False, "name": "platform-operator"}}, tmp_path)
    assert not by_kind(manifests, "ServiceAccount")
    for binding in by_kind(manifests, "ClusterRoleBinding"):
        assert bound_subjects(binding) == [
            {"kind": "ServiceAccount", "name": "platform-operator", "namespace": RELEASE_NAMESPACE}
        ]
    assert by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"] == (
        "platform-operator"
    )


def test_rbac_create_false_renders_no_rbac(tmp_path: Path) -> None:
    manifests = render({"rbac": {"create": False}}, tmp_path)
    assert not [m for m in manifests if m["apiVersion"].startswith("rbac.authorization.k8s.io/")]


@pytest.mark.parametrize(
    "values",
    [{}, {"watchNamespaces": ["serving-a"]}, {"test": {"servingName": "chat"}}],
    ids=["cluster", "namespaced", "helm-test"],
)
def test_nothing_broader_than_needed(values: dict[str, Any], tmp_path: Path) -> None:
    manifests = render(values, tmp_path)
    granted = set().union(
        *(permissions(r) for r in by_kind(manifests, "ClusterRole") + by_kind(manifests, "Role"))
    )
    assert not [p for p in granted if "*" in p], "no wildcards"
    # The two deletes, of children whose owner lives on: a BlueGreen rollout retires a replica
    # StatefulSet; an unset spec.inferencePool removes the pool.
    allowed_deletes = {
        ("apps", "statefulsets", "delete"),
        ("inference.networking.k8s.io", "inferencepools", "delete"),
    }
    assert not [
        p
        for p in granted
        if p[2] in ("delete", "deletecollection", "update", "escalate", "bind", "impersonate")
        and p not in allowed_deletes
    ]
    assert not [
        p for p in granted if p[1] in ("secrets", "nodes", "clusterroles", "roles", "serviceaccounts")
    ]
    assert not [p for p in granted if p[0] in ("kopf.dev", "rbac.authorization.k8s.io")]


def test_the_doc_parser_reads_what_the_doc_says() -> None:
    """Guards the parser itself: a few permissions the operator obviously needs, and one it must not have."""
    tables = documented_tables()
    assert ("serving.mooncake-operator.dev", "mooncakeservings/status", "patch") in tables["Application"]
    assert ("apps", "statefulsets", "create") in tables["Application"]
    assert ("", "events", "create") in tables["Application"]
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in tables["Framework"]
    assert sorted(p for p in tables["Application"] if p[2] == "delete") == [
        ("apps", "statefulsets", "delete"),
        ("inference.networking.k8s.io", "inferencepools", "delete"),
    ]


# --- the helm test Pod: its own account, reading the one resource it proves ---------------------------

TEST_ACCOUNT = f"{FULLNAME}-canary"


@pytest.mark.parametrize(
    ("values", "serving_namespace"),
    [
        ({"servingName": "chat", "servingNamespace": "serving-a"}, "serving-a"),
        ({"servingName": "chat"}, RELEASE_NAMESPACE),
    ],
)
def test_helm_test_may_read_the_resource_it_proves_and_its_pods_and_nothing_else(
    values: dict[str, Any], serving_namespace: str, tmp_path: Path
) -> None:
    manifests = render({"test": values}, tmp_path)
    account = named(manifests, "ServiceAccount", TEST_ACCOUNT, RELEASE_NAMESPACE)
    assert account["automountServiceAccountToken"] is False, "only the test Pod mounts its token"
    role = named(manifests, "Role", TEST_ACCOUNT, serving_namespace)
    assert permissions(role) == {
        ("serving.mooncake-operator.dev", "mooncakeservings", "get"),
        ("apps", "statefulsets", "get"),  # the serving set: controlled by the resource (UID)?
        ("", "pods", "list"),  # its pods: created by that StatefulSet (UID), at which IPs
    }
    assert [rule.get("resourceNames") for rule in role["rules"]] == [["chat"], None, None]
    binding = named(manifests, "RoleBinding", TEST_ACCOUNT, serving_namespace)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": TEST_ACCOUNT,
    }
    assert bound_subjects(binding) == [
        {"kind": "ServiceAccount", "name": TEST_ACCOUNT, "namespace": RELEASE_NAMESPACE}
    ]
    pods = by_kind(manifests, "Pod")
    assert [pod["spec"]["serviceAccountName"] for pod in pods] == [TEST_ACCOUNT]
    # Every other pod keeps the operator's account; none but the test Pod runs as the test's.
    operator_pod = by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]
    assert operator_pod["serviceAccountName"] == FULLNAME


def test_helm_test_with_rbac_create_false_renders_its_account_only(tmp_path: Path) -> None:
    manifests = render({"rbac": {"create": False}, "test": {"servingName": "chat"}}, tmp_path)
    assert not [m for m in manifests if m["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    named(manifests, "ServiceAccount", TEST_ACCOUNT, RELEASE_NAMESPACE)


def test_no_helm_test_account_without_a_serving_name(tmp_path: Path) -> None:
    manifests = render({}, tmp_path)
    assert [m["metadata"]["name"] for m in by_kind(manifests, "ServiceAccount")] == [FULLNAME]
