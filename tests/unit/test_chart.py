"""The helm chart, offline: lint, rendering with default and non-default values, every object valid
Kubernetes, the values schema refusing bad values, the CRD copy in step with the generated CRD, and
the Deployment and helm test Pod agreeing with the CLI they run.

helm comes from scripts/fetch-helm; without it these tests fail saying so.
"""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tests.support.chart import (
    CHART_DIR,
    RELEASE,
    RELEASE_NAMESPACE,
    REPO_ROOT,
    SERVICE_MONITOR_API,
    Manifest,
    by_kind,
    is_helm_test_hook,
    only,
    operator_container,
    render,
    render_failure,
    run_helm,
    values_file,
)

from mooncake_operator.api.crd import CRD_FILENAME, chart_template
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.cli.canary import UsageError, refuse_what_flags, with_how_flags
from mooncake_operator.cli.canary_resource import resource_canary
from mooncake_operator.cli.main import build_parser

pytestmark = pytest.mark.unit

# The oldest and newest schemas kubernetes-validate ships; Kubernetes 1.20 itself is the cluster tier's
# API server (tests/cluster/test_chart_install.py dry-runs every object there).
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
FULLNAME = f"{RELEASE}-mooncake-operator"

# Every value the chart has, set to something other than its default.
NON_DEFAULT_VALUES: dict[str, Any] = {
    "image": {
        "repository": "registry.internal/ops/mooncake-operator",
        "tag": "0.1.0-rc1",
        "pullPolicy": "Always",
    },
    "imagePullSecrets": [{"name": "regcred"}],
    "fullnameOverride": "mco",
    "watchNamespaces": ["serving-a", "serving-b"],
    "serviceAccount": {"create": True, "name": "mco-operator", "annotations": {"team": "inference"}},
    "operator": {
        "livenessPort": 8181,
        "maxConcurrentCanaries": 3,
        "leaderCheckSeconds": 7.5,
        "leaseDurationSeconds": 45,
        "extraArgs": ["--resync-seconds=60"],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
    },
    "livenessProbe": {
        "initialDelaySeconds": 5,
        "periodSeconds": 10,
        "timeoutSeconds": 2,
        "failureThreshold": 5,
    },
    "metrics": {
        "enabled": True,
        "port": 9191,
        "service": {"type": "ClusterIP", "port": 8443, "annotations": {"scrape": "yes"}},
        "serviceMonitor": {
            "enabled": True,
            "interval": "15s",
            "scrapeTimeout": "5s",
            "labels": {"release": "prom"},
        },
    },
    "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
    "podAnnotations": {"example.com/owner": "inference"},
    "podLabels": {"team": "inference"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                        ]
                    }
                ]
            }
        }
    },
    "test": {
        "servingName": "minimax-m25",
        "servingNamespace": "serving-a",
        "extraArgs": ["--timeout=600", "--retries", "5"],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
    },
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "non-default": NON_DEFAULT_VALUES,
    "metrics-off-no-rbac": {
        "metrics": {"enabled": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
    },
}


def api_versions_for(values: dict[str, Any]) -> tuple[str, ...]:
    wants_monitor = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    return (SERVICE_MONITOR_API,) if wants_monitor else ()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    """Each value set rendered once for the module (helm takes a fraction of a second per run)."""
    out = {}
    for name, values in VALUE_SETS.items():
        out[name] = render(values, tmp_path_factory.mktemp(name), api_versions=api_versions_for(values))
    return out


def deployment_args(manifests: list[Manifest]) -> list[str]:
    args: list[str] = operator_container(manifests)["args"]
    return args


# --- lint and rendering ------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_is_clean(value_set: str, tmp_path: Path) -> None:
    values = copy.deepcopy(VALUE_SETS[value_set])
    if api_versions_for(values):
        # `helm lint` cannot be told the cluster has the monitoring API; the ServiceMonitor is checked below.
        values["metrics"]["serviceMonitor"]["enabled"] = False
    args = ["lint", "--strict", str(CHART_DIR)]
    if values:
        args += ["--values", str(values_file(values, tmp_path))]
    result = run_helm(args).check()
    assert "0 chart(s) failed" in result.stdout


def test_default_render_is_the_operator_and_nothing_optional(rendered: dict[str, list[Manifest]]) -> None:
    kinds = sorted(m["kind"] for m in rendered["defaults"])
    assert kinds == sorted(
        [
            "CustomResourceDefinition",  # a template kept on uninstall
            "ServiceAccount",
            "Service",
            "Deployment",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Role",  # leader election
            "RoleBinding",
        ]
    )
    assert not [m for m in rendered["defaults"] if is_helm_test_hook(m)], (
        "no test Pod without test.servingName"
    )
    for manifest in rendered["defaults"]:
        if manifest["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert manifest["metadata"]["namespace"] == RELEASE_NAMESPACE, manifest["metadata"]


def test_the_crd_is_a_template_kept_on_uninstall(tmp_path: Path) -> None:
    """A template (upgraded with the chart), not crds/ (installed once, never upgraded), and never deleted
    by helm: `helm.sh/resource-policy: keep`."""
    assert not (CHART_DIR / "crds").exists(), "helm would install crds/ once and never upgrade it"
    (crd,) = by_kind(render({}, tmp_path), "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "mooncakeservings.serving.mooncake-operator.dev"
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    labels = crd["metadata"]["labels"]
    assert (
        labels["app.kubernetes.io/version"]
        == yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    )
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    expected = yaml.safe_load((REPO_ROOT / "crds" / CRD_FILENAME).read_text(encoding="utf-8"))
    assert crd["spec"] == expected["spec"]
    assert not by_kind(render({"crds": {"install": False}}, tmp_path), "CustomResourceDefinition")


def validatable(manifests: list[Manifest]) -> list[tuple[str, Manifest]]:
    """Objects of built-in kinds (the ServiceMonitor is a CRD kind kubernetes-validate has no schema for)."""
    return [(f"{m['kind']}/{m['metadata']['name']}", m) for m in manifests if m["kind"] != "ServiceMonitor"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(
    rendered: dict[str, list[Manifest]], value_set: str, version: str
) -> None:
    objects = validatable(rendered[value_set])
    assert objects
    for label, manifest in objects:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{value_set}: {label} is not valid Kubernetes {version}: {error}") from None


def test_offline_validation_catches_a_misspelt_field(rendered: dict[str, list[Manifest]]) -> None:
    deployment = only(rendered["defaults"], "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


# --- the operator Deployment -------------------------------------------------------------------------


def test_one_operator_replaced_not_rolled(rendered: dict[str, list[Manifest]]) -> None:
    spec = only(rendered["defaults"], "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("value_set", ["defaults", "non-default"])
def test_liveness_probe_calls_the_operators_healthz(
    rendered: dict[str, list[Manifest]], value_set: str
) -> None:
    container = operator_container(rendered[value_set])
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    expected = VALUE_SETS[value_set].get("operator", {}).get("livenessPort", 8080)
    assert port["containerPort"] == expected
    assert f"--liveness-port={expected}" in container["args"]


def test_runs_non_root_read_only_without_privileges(rendered: dict[str, list[Manifest]]) -> None:
    pod = only(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert next(v for v in pod["volumes"] if v["name"] == tmp["name"])["emptyDir"]["medium"] == "Memory"


def test_resource_requests_are_set(rendered: dict[str, list[Manifest]]) -> None:
    resources = operator_container(rendered["defaults"])["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]


def test_operator_arguments_are_accepted_by_the_cli(rendered: dict[str, list[Manifest]]) -> None:
    """The chart passes the flags of the operator contract; the real parser must accept every one."""
    for value_set in ("defaults", "non-default"):
        parsed = build_parser().parse_args(deployment_args(rendered[value_set]))
        assert parsed.command == "run"


def test_operator_tuning_values_become_run_flags(rendered: dict[str, list[Manifest]]) -> None:
    """`operator.maxConcurrentCanaries`, `operator.leaderCheckSeconds` and `operator.leaseDurationSeconds`
    reach the Deployment as the flags `run` reads; with the chart's defaults the operator gets exactly the
    CLI's own defaults."""
    cli_defaults = build_parser().parse_args(["run"])
    defaults = build_parser().parse_args(deployment_args(rendered["defaults"]))
    assert "--max-concurrent-canaries=8" in deployment_args(rendered["defaults"])
    # The NetworkPolicies admit the operator from its own namespace only: the chart says which it is.
    namespace = only(rendered["defaults"], "Deployment")["metadata"]["namespace"]
    assert f"--operator-namespace={namespace}" in deployment_args(rendered["defaults"])
    assert (
        defaults.max_concurrent_canaries,
        defaults.leader_check_seconds,
        defaults.lease_duration_seconds,
    ) == (
        cli_defaults.max_concurrent_canaries,
        cli_defaults.leader_check_seconds,
        cli_defaults.lease_duration_seconds,
    )
    assert "--lease-duration-seconds=15" in deployment_args(rendered["defaults"])
    non_default = build_parser().parse_args(deployment_args(rendered["non-default"]))
    assert (
        non_default.max_concurrent_canaries,
        non_default.leader_check_seconds,
        non_default.lease_duration_seconds,
    ) == (3, 7.5, 45)


def test_chart_defaults_of_run_flags_are_the_clis() -> None:
    """values.yaml states the defaults (so `helm show values` shows them); they must stay the CLI's."""
    operator_values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["operator"]
    cli_defaults = build_parser().parse_args(["run"])
    assert operator_values["maxConcurrentCanaries"] == cli_defaults.max_concurrent_canaries
    assert operator_values["canaryMaxChatBodyBytes"] == cli_defaults.canary_max_chat_body_bytes
    assert (
        operator_values["maxConcurrentCanariesPerNamespace"]
        == cli_defaults.max_concurrent_canaries_per_namespace
    )
    assert operator_values["canaryMaxTimeoutSeconds"] == cli_defaults.canary_max_timeout_seconds
    assert operator_values["canaryRunDeadlineSeconds"] == cli_defaults.canary_run_deadline_seconds
    assert operator_values["canaryMaxMetricsBodyBytes"] == cli_defaults.canary_max_metrics_body_bytes
    assert operator_values["leaderCheckSeconds"] == cli_defaults.leader_check_seconds
    assert operator_values["leaseDurationSeconds"] == cli_defaults.lease_duration_seconds
    assert operator_values["livenessPort"] == cli_defaults.liveness_port


def test_namespace_watch_list_becomes_namespace_flags(rendered: dict[str, list[Manifest]]) -> None:
    assert not [a for a in deployment_args(rendered["defaults"]) if a.startswith("--namespace")]
    assert [a for a in deployment_args(rendered["non-default"]) if a.startswith("--namespace")] == [
        "--namespace=serving-a",
        "--namespace=serving-b",
    ]


def test_non_default_values_reach_the_deployment(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["non-default"]
    deployment = only(manifests, "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert deployment["metadata"]["name"] == "mco"
    assert container["image"] == "registry.internal/ops/mooncake-operator:0.1.0-rc1"
    assert container["imagePullPolicy"] == "Always"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["serviceAccountName"] == "mco-operator"
    accounts = {m["metadata"]["name"]: m for m in by_kind(manifests, "ServiceAccount")}
    assert sorted(accounts) == ["mco-canary", "mco-operator"]  # the operator's, helm test's
    assert accounts["mco-operator"]["metadata"]["annotations"] == {"team": "inference"}
    assert container["args"][-1] == "--resync-seconds=60"
    assert {"name": "TZ", "value": "UTC"} in container["env"]
    assert "--metrics-port=9191" in container["args"]
    assert pod["metadata"]["labels"]["team"] == "inference"
    assert pod["metadata"]["annotations"] == {"example.com/owner": "inference"}
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    assert container["livenessProbe"]["failureThreshold"] == 5


def test_default_image_tag_is_the_app_version(rendered: dict[str, list[Manifest]]) -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert operator_container(rendered["defaults"])["image"].endswith(f"/operator:{chart['appVersion']}")


# The grammar of an image reference (the distribution project's reference grammar, as the kubelet and
# container runtimes parse it): [host[:port]/]path[:tag][@algorithm:hex].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?/)?"
IMAGE_REFERENCE = re.compile(
    rf"^{_HOST}{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@sha256:[a-f0-9]{{64}})?$"
)
DIGEST = "sha256:" + "4f" * 32


def test_the_reference_grammar_refuses_what_the_runtime_would() -> None:
    assert IMAGE_REFERENCE.match("registry:5000/ops/operator:0.2.0")
    assert IMAGE_REFERENCE.match(f"registry.internal/ops/operator@{DIGEST}")
    # What repository@digest:tag (the chart's earlier join) gave: a tag after the digest.
    assert not IMAGE_REFERENCE.match(f"registry.internal/ops/operator@{DIGEST}:0.2.0")
    assert not IMAGE_REFERENCE.match("Not A Valid Ref!!")


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ({}, "registry.example.com/mooncake-operator/operator:{version}"),
        ({"tag": "0.2.0-rc1"}, "registry.example.com/mooncake-operator/operator:0.2.0-rc1"),
        ({"repository": "registry:5000/ops/operator"}, "registry:5000/ops/operator:{version}"),
        ({"digest": DIGEST}, f"registry.example.com/mooncake-operator/operator@{DIGEST}"),
        ({"tag": "0.2.0", "digest": DIGEST}, f"registry.example.com/mooncake-operator/operator@{DIGEST}"),
    ],
    ids=["default", "tag", "registry-port", "digest", "digest-wins-over-tag"],
)
def test_the_operator_image_is_a_valid_reference_by_tag_or_digest(
    image: dict[str, str], expected: str, tmp_path: Path
) -> None:
    """The operator's and the helm test Pod's image: one valid reference, pinned by digest when given."""
    version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    values = {"image": image, "test": {"servingName": "chat"}}
    manifests = render(values, tmp_path)
    images = {operator_container(manifests)["image"], canary_pod(manifests)["spec"]["containers"][0]["image"]}
    assert images == {expected.format(version=version)}
    assert all(IMAGE_REFERENCE.match(reference) for reference in images), images


def test_each_release_leads_with_its_own_lease(tmp_path: Path) -> None:
    """Two releases in one namespace (each watching its own namespaces) take different Leases: the second
    no longer idles behind the first's. The Role lets each touch only its own."""
    releases = (("team-a", "team-a-mooncake-operator"), ("mooncake-operator", "mooncake-operator"))
    for release, fullname in releases:
        args = ["template", release, str(CHART_DIR), "--namespace", RELEASE_NAMESPACE]
        manifests = [m for m in yaml.safe_load_all(run_helm(args).check().stdout) if m]
        assert f"--lease-name={fullname}" in operator_container(manifests)["args"]
        roles = by_kind(manifests, "Role")
        (role,) = [m for m in roles if m["metadata"]["name"].endswith("-leader-election")]
        named = [rule["resourceNames"] for rule in role["rules"] if "resourceNames" in rule]
        assert named == [[fullname]]


def test_chart_and_package_versions_agree() -> None:
    from mooncake_operator import __version__

    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__, "bump Chart.yaml appVersion with the package version"
    assert chart["version"] == chart["appVersion"], "the chart's version moves with the operator's"


def test_the_changelog_has_a_section_per_release_the_newest_first() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", changelog, flags=re.MULTILINE)
    assert releases and releases[0] == chart["version"], f"CHANGELOG.md's newest section: {releases[:1]}"
    assert len(releases) == len(set(releases)), releases
    parsed = [tuple(int(part) for part in release.split(".")) for release in releases]
    assert parsed == sorted(parsed, reverse=True), releases


# --- metrics -----------------------------------------------------------------------------------------


def test_metrics_service_selects_the_operator_pod_only(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["non-default"]
    service = only(manifests, "Service")
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= pod_labels.items()
    test_pod = next(m for m in manifests if is_helm_test_hook(m))
    assert not selector.items() <= test_pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    metrics_port = next(p for p in operator_container(manifests)["ports"] if p["name"] == "metrics")
    assert metrics_port["containerPort"] == 9191
    assert service["spec"]["ports"][0]["port"] == 8443


def test_metrics_disabled_means_port_zero_and_no_service(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["metrics-off-no-rbac"]
    assert "--metrics-port=0" in deployment_args(manifests)
    assert not by_kind(manifests, "Service")
    assert [p["name"] for p in operator_container(manifests)["ports"]] == ["liveness"]


def test_service_monitor_is_off_by_default_and_scrapes_the_metrics_service(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    assert not by_kind(render({}, tmp_path, api_versions=(SERVICE_MONITOR_API,)), "ServiceMonitor")
    manifests = rendered["non-default"]
    monitor = only(manifests, "ServiceMonitor")
    service = only(manifests, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s", "honorLabels": True}
    ]
    assert monitor["metadata"]["labels"]["release"] == "prom"


# --- values that must be refused ---------------------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("unknown top-level value", {"replicaCount": 2}, "Additional property replicaCount is not allowed"),
    ("misspelt nested value", {"metrics": {"enable": True}}, "Additional property enable is not allowed"),
    ("pull policy", {"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ("empty repository", {"image": {"repository": ""}}, "image.repository"),
    ("port out of range", {"metrics": {"port": 70000}}, "metrics.port"),
    ("port as text", {"operator": {"livenessPort": "8080"}}, "operator.livenessPort"),
    ("namespace not a DNS label", {"watchNamespaces": ["Serving_A"]}, "watchNamespaces"),
    ("namespace twice", {"watchNamespaces": ["a", "a"]}, "watchNamespaces"),
    ("serving name not a DNS label", {"test": {"servingName": "My.Serving"}}, "test.servingName"),
    # The resource says these now; a release that still sets them is told, not silently ignored.
    ("removed test.blockSize", {"test": {"servingName": "x", "blockSize": 16}}, "blockSize is not allowed"),
    ("removed test.replicas", {"test": {"servingName": "x", "replicas": 2}}, "replicas is not allowed"),
    ("bad quantity", {"resources": {"requests": {"memory": "lots"}}}, "resources.requests.memory"),
    ("bad scrape interval", {"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
    ("empty extra argument", {"operator": {"extraArgs": [""]}}, "operator.extraArgs"),
    ("no canary allowed", {"operator": {"maxConcurrentCanaries": 0}}, "operator.maxConcurrentCanaries"),
    ("fractional canaries", {"operator": {"maxConcurrentCanaries": 1.5}}, "operator.maxConcurrentCanaries"),
    ("leader check never", {"operator": {"leaderCheckSeconds": 0}}, "operator.leaderCheckSeconds"),
    ("lease too short", {"operator": {"leaseDurationSeconds": 5}}, "operator.leaseDurationSeconds"),
    ("lease too long", {"operator": {"leaseDurationSeconds": 3601}}, "operator.leaseDurationSeconds"),
    ("fractional lease", {"operator": {"leaseDurationSeconds": 7.5}}, "operator.leaseDurationSeconds"),
    ("digest without algorithm", {"image": {"digest": "4f" * 32}}, "image.digest"),
    ("short digest", {"image": {"digest": "sha256:abc"}}, "image.digest"),
    ("tag with a digest", {"image": {"tag": "sha256:" + "4f" * 32}}, "image.tag"),
    ("repository with a space", {"image": {"repository": "registry example/op"}}, "image.repository"),
    (
        "relative runbook base",
        {"monitoring": {"prometheusRule": {"runbookBaseUrl": "docs/runbooks.md"}}},
        "monitoring.prometheusRule.runbookBaseUrl",
    ),
    (
        "first-rollout warning not a duration",
        {"monitoring": {"prometheusRule": {"firstRolloutWarningAfter": "two hours"}}},
        "monitoring.prometheusRule.firstRolloutWarningAfter",
    ),
    # Checks the templates make (a schema cannot see the cluster or relate two values this way).
    (
        "service monitor without the monitoring API",
        {"metrics": {"serviceMonitor": {"enabled": True}}},
        "the cluster has no monitoring.coreos.com/v1 ServiceMonitor",
    ),
    (
        "service monitor without metrics",
        {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
        "metrics.serviceMonitor.enabled needs metrics.enabled",
    ),
    (
        "digest in the repository",
        {"image": {"repository": "registry.internal/ops/operator@sha256:" + "4f" * 32}},
        'image.repository "registry.internal/ops/operator@sha256:4f4f',
    ),
    (
        "no ServiceAccount to run as",
        {"serviceAccount": {"create": False}},
        "serviceAccount.name is required when serviceAccount.create is false",
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), [(v, m) for _, v, m in REFUSED], ids=[i for i, _, _ in REFUSED]
)
def test_bad_values_are_refused_with_a_clear_message(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    assert message in render_failure(values, tmp_path)


def test_the_monitoring_api_check_is_what_refuses_the_service_monitor(tmp_path: Path) -> None:
    values = {"metrics": {"serviceMonitor": {"enabled": True}}}
    assert only(render(values, tmp_path, api_versions=(SERVICE_MONITOR_API,)), "ServiceMonitor")


def test_values_file_and_schema_document_the_same_keys() -> None:
    """Every value in values.yaml is in the schema and vice versa (top two levels)."""
    import json

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert set(schema["properties"]) - {"global"} == set(values)
    for key, value in values.items():
        if isinstance(value, dict) and "properties" in schema["properties"][key]:
            assert set(schema["properties"][key]["properties"]) == set(value), key


# --- helm test: the canary against a named MooncakeServing -------------------------------------------


def canary_pod(manifests: list[Manifest]) -> Manifest:
    pods = [m for m in manifests if is_helm_test_hook(m)]
    assert len(pods) == 1, pods
    return pods[0]


def canary_args(pod: Manifest) -> list[str]:
    args: list[str] = pod["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize(
    ("values", "resource"),
    [
        ({"servingName": "minimax-m25", "servingNamespace": "default"}, "default/minimax-m25"),
        ({"servingName": "chat"}, f"{RELEASE_NAMESPACE}/chat"),  # the release's namespace
    ],
)
def test_helm_test_names_the_resource_and_nothing_it_says(
    values: dict[str, Any], resource: str, tmp_path: Path
) -> None:
    """The resource is the one source of truth: no replica URL, block size, model or port in the Pod."""
    assert canary_args(canary_pod(render({"test": values}, tmp_path))) == [
        "canary",
        "--json",
        f"--resource={resource}",
    ]


def test_helm_test_pod_is_a_test_hook_that_runs_the_canary_cli(rendered: dict[str, list[Manifest]]) -> None:
    pod = canary_pod(rendered["non-default"])
    annotations = pod["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "test"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    # It reads the resource: its own account's token, mounted in this Pod only (test_chart_rbac.py).
    assert spec["serviceAccountName"] == "mco-canary"
    assert spec["automountServiceAccountToken"] is True
    container = spec["containers"][0]
    assert container["image"] == operator_container(rendered["non-default"])["image"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["resources"] == NON_DEFAULT_VALUES["test"]["resources"]
    assert pod["metadata"]["name"] == "mco-canary-minimax-m25"
    operator_spec = only(rendered["non-default"], "Deployment")["spec"]["template"]["spec"]
    assert operator_spec["serviceAccountName"] != spec["serviceAccountName"]


def test_helm_test_arguments_are_a_valid_canary_run(rendered: dict[str, list[Manifest]]) -> None:
    """The real canary parser accepts the Pod's arguments: the resource, and how patiently to prove it
    (extraArgs), applied over the operator's own config for that resource."""
    parsed: argparse.Namespace = build_parser().parse_args(canary_args(canary_pod(rendered["non-default"])))
    assert (parsed.json, parsed.resource) == (True, "serving-a/minimax-m25")
    refuse_what_flags(parsed)
    resource = reference_deployment()
    planned = resource_canary(resource)
    config = with_how_flags(planned.config, parsed)
    assert (config.request_timeout_s, config.connect_retries) == (600, 5)
    assert config.replicas == planned.config.replicas
    assert config.block_size == resource.spec.engine.block_size


def test_extra_args_that_say_what_to_prove_fail_the_run(tmp_path: Path) -> None:
    values = {"test": {"servingName": "chat", "extraArgs": ["--block-size=16"]}}
    parsed = build_parser().parse_args(canary_args(canary_pod(render(values, tmp_path))))
    with pytest.raises(UsageError, match="--block-size cannot be given with --resource"):
        refuse_what_flags(parsed)


# --- CRDs --------------------------------------------------------------------------------------------


def test_chart_crd_template_is_the_generated_crd() -> None:
    root_files = sorted((REPO_ROOT / "crds").glob("*.yaml"))
    assert [path.name for path in root_files] == [CRD_FILENAME], "crds/ must hold exactly the generated CRD"
    template = CHART_DIR / "templates" / "crds.yaml"
    assert template.read_text(encoding="utf-8") == chart_template(
        root_files[0].read_text(encoding="utf-8")
    ), "the chart's templates/crds.yaml differs from crds/: run scripts/sync-chart-crds"


def test_chart_template_refuses_what_helm_would_misread() -> None:
    with pytest.raises(ValueError, match="template action"):
        chart_template("apiVersion: v1\nmetadata:\n  name: x\nspec:\n  description: '{{ x }}'\n")
    with pytest.raises(ValueError, match="one top-level metadata"):
        chart_template("apiVersion: v1\nspec: {}\n")
