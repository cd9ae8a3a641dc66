"""Operator-level settings (`mooncake-operator run` flags) and how they become kopf's settings.

These are the operator's own knobs, never fields a resource author controls: where the API server is,
where the probes listen, how often resources are re-checked unchanged, and the replica-endpoint override
that points canaries at URLs other than the per-replica DNS names (tests, the sandbox).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import yaml

from mooncake_operator import safe_yaml
from mooncake_operator.api.admission import refused_node_options
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.network_policy import DEFAULT_OPERATOR_NAMESPACE, REPLICA_INGRESS_DEFAULTS
from mooncake_operator.canary.defaults import DEFAULT_MAX_METRICS_BODY_BYTES, MAX_BODY_BYTES_LIMIT
from mooncake_operator.canary.models import (
    CanaryConfig,
    normalize_base_url,
)
from mooncake_operator.kube.config import KubeConfig

logger = logging.getLogger("mooncake_operator.runtime.settings")

# The client gives up on a watch this long after the server's own timeout, then reconnects.
WATCH_CLIENT_GRACE_SECONDS = 30.0
# The operator's default ceilings on the canary's body caps: 4x the chat default, 2x the metrics default.
# Eight canaries at once each parsing one body at its ceiling need about 8 * 32 MiB * 3 of memory.
DEFAULT_CANARY_MAX_CHAT_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_CANARY_MAX_METRICS_BODY_BYTES = 2 * DEFAULT_MAX_METRICS_BODY_BYTES
MIN_BODY_BYTES = 1024
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # an RFC 1123 label
# A token handed to kopf must outlive kopf's own check of it (see connection_info).
LOGIN_EXPIRY_FLOOR = timedelta(seconds=1)


class SettingsError(ValueError):
    """An operator setting that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # empty: cluster-wide
    kubeconfig: Path | None = None
    context: str | None = None
    # Explicit credentials win over kubeconfig/in-cluster (tests, benchmarks).
    kube: KubeConfig | None = None
    liveness_host: str = "0.0.0.0"  # in a pod the kubelet probes the pod IP
    liveness_port: int = 8080
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9090
    replica_endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Highly available masters' admin URLs per "ns/name", in ordinal order, where the operator cannot
    # resolve the masters' headless Service (an operator outside the cluster, tests).
    master_endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    resync_seconds: float = 600.0  # a safety net: changes arrive through the watches
    max_concurrent_canaries: int = 8
    # One namespace's share of them: a tenant whose replicas never answer cannot take every slot.
    max_concurrent_canaries_per_namespace: int = 2
    # Highly available masters: who leads is asked over HTTP, not watched (a failover need not change a pod).
    leader_check_seconds: float = 30.0
    retry_delay_seconds: float = 10.0
    inconclusive_retry_seconds: float = 60.0
    request_timeout_seconds: float = 30.0
    watch_timeout_seconds: float = 300.0
    # Ceilings on what a resource's spec.canary may ask for: one operator serves every tenant, so no
    # resource may size the operator's memory (a body is held about three times while it is parsed).
    # Where the operator's pods run: the NetworkPolicies admit its pods from this namespace only.
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    canary_max_chat_body_bytes: int = DEFAULT_CANARY_MAX_CHAT_BODY_BYTES
    canary_max_metrics_body_bytes: int = DEFAULT_CANARY_MAX_METRICS_BODY_BYTES
    # Ceiling on spec.canary.timeoutSeconds (one request), and the deadline of a whole run.
    canary_max_timeout_seconds: int = 600
    canary_run_deadline_seconds: float = 3600.0
    # What a resource's pods may ask of the node: a privileged replica (store.rdma.hostDevices) and the
    # node's network (store.rdma.hostNetwork) are off unless the cluster's administrator allows them.
    allow_privileged_engines: bool = False
    allow_host_network: bool = False
    # Who may call the replicas' HTTP port of a resource that lists no spec.networkPolicy.clients:
    # "anyone" (the default, so existing client Services keep working) or "listed-clients" (the operator
    # only until the resource lists its clients: deny by default, for clusters shared by tenants).
    replica_ingress_default: str = "anyone"

    def __post_init__(self) -> None:
        for name in (
            "resync_seconds",
            "leader_check_seconds",
            "retry_delay_seconds",
            "inconclusive_retry_seconds",
            "request_timeout_seconds",
            "watch_timeout_seconds",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name.replace('_', '-')} must be greater than 0")
        if self.max_concurrent_canaries < 1:
            raise SettingsError("max-concurrent-canaries must be at least 1")
        if self.max_concurrent_canaries_per_namespace < 1:
            raise SettingsError("max-concurrent-canaries-per-namespace must be at least 1")
        if self.canary_max_timeout_seconds < 1:
            raise SettingsError("canary-max-timeout-seconds must be at least 1")
        if self.canary_run_deadline_seconds <= 0:
            raise SettingsError("canary-run-deadline-seconds must be greater than 0")
        for name in ("liveness_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise SettingsError(f"{name.replace('_', '-')} must be a port number (0 disables)")
        if self.replica_ingress_default not in REPLICA_INGRESS_DEFAULTS:
            raise SettingsError(
                f"replica-ingress-default must be one of {', '.join(REPLICA_INGRESS_DEFAULTS)}, "
                f"not {self.replica_ingress_default!r}"
            )
        if not _NAMESPACE_RE.fullmatch(self.operator_namespace):
            raise SettingsError(f"operator-namespace {self.operator_namespace!r} is not a namespace name")
        for name in ("canary_max_chat_body_bytes", "canary_max_metrics_body_bytes"):
            if not MIN_BODY_BYTES <= getattr(self, name) <= MAX_BODY_BYTES_LIMIT:
                flag = name.replace("_", "-")
                raise SettingsError(
                    f"{flag} must be between {MIN_BODY_BYTES} and {MAX_BODY_BYTES_LIMIT} bytes"
                )

    def limit_canary(self, config: CanaryConfig) -> tuple[CanaryConfig, list[str]]:
        """`config` with its body caps and request timeout lowered to the operator's ceilings, and a line
        per lowered value."""
        lowered: dict[str, int] = {}
        notes = []
        for field_name, ceiling, spec_field in (
            ("max_chat_body_bytes", self.canary_max_chat_body_bytes, "maxChatBodyBytes"),
            ("max_metrics_body_bytes", self.canary_max_metrics_body_bytes, "maxMetricsBodyBytes"),
        ):
            asked = getattr(config, field_name)
            if asked > ceiling:
                lowered[field_name] = ceiling
                notes.append(
                    f"spec.canary.{spec_field} {asked} lowered to the operator's ceiling {ceiling} "
                    f"(--canary-{field_name.replace('_', '-')})"
                )
        if config.request_timeout_s > self.canary_max_timeout_seconds:
            notes.append(
                f"spec.canary.timeoutSeconds {int(config.request_timeout_s)} lowered to the operator's "
                f"ceiling {self.canary_max_timeout_seconds} (--canary-max-timeout-seconds)"
            )
            updates: dict[str, object] = {
                **lowered,
                "request_timeout_s": float(self.canary_max_timeout_seconds),
            }
        else:
            updates = dict(lowered)
        return (config.model_copy(update=updates) if updates else config), notes

    def refused_options(self, spec: MooncakeServingSpec) -> list[str]:
        """A line per node-level option `spec` asks for that this operator does not allow (nothing is
        applied for such a resource); `render` refuses the same through the same function."""
        return refused_node_options(
            spec,
            allow_privileged_engines=self.allow_privileged_engines,
            allow_host_network=self.allow_host_network,
        )

    @property
    def open_http_by_default(self) -> bool:
        return self.replica_ingress_default == "anyone"

    def kube_config(self) -> KubeConfig:
        """Explicit credentials, else the given kubeconfig, else in-cluster or the default kubeconfig."""
        if self.kube is not None:
            return self.kube
        if self.kubeconfig is not None or self.context is not None:
            return KubeConfig.from_kubeconfig(self.kubeconfig, self.context)
        return KubeConfig.load_default()

    @property
    def liveness_endpoint(self) -> str | None:
        if not self.liveness_port:
            return None
        return f"http://{self.liveness_host}:{self.liveness_port}/healthz"

    def endpoints_for(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.replica_endpoints.get(f"{namespace}/{name}")

    def master_endpoints_for(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.master_endpoints.get(f"{namespace}/{name}")


def parse_replica_endpoints(document: Any, source: str = "replica endpoints") -> dict[str, tuple[str, ...]]:
    """`{"ns/name": [url, ...]}` validated: keys name one resource, values are lists of http(s) URLs."""
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise SettingsError(f'{source}: expected a mapping "<namespace>/<name>": [url, ...]')
    endpoints: dict[str, tuple[str, ...]] = {}
    for key, urls in document.items():
        namespace, slash, name = str(key).partition("/")
        if not slash or not namespace or not name or "/" in name:
            raise SettingsError(f'{source}: key {key!r} must be "<namespace>/<name>"')
        if not isinstance(urls, list) or not urls or not all(isinstance(url, str) for url in urls):
            raise SettingsError(f"{source}: {key} must map to a non-empty list of URLs")
        try:
            endpoints[str(key)] = tuple(normalize_base_url(url) for url in urls)
        except ValueError as error:
            raise SettingsError(f"{source}: {key}: {error}") from error
    return endpoints


def load_replica_endpoints(path: Path) -> dict[str, tuple[str, ...]]:
    try:
        document = safe_yaml.load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise SettingsError(f"replica endpoints {path} is not UTF-8 text: {error}") from error
    except OSError as error:
        raise SettingsError(f"cannot read replica endpoints {path}: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise SettingsError(f"replica endpoints {path} is not valid YAML: {error}") from error
    return parse_replica_endpoints(document, source=str(path))


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """kopf's settings for this operator (called from the startup handler)."""
    # No kopf peering (it pauses every operator of equal priority): `run` elects a leader on a Lease
    # (mooncake_operator.runtime.lease) before kopf starts.
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # The API server parses ?timeoutSeconds= as an integer ("300.0" is a 400 Bad Request).
    settings.watching.server_timeout = int(ours.watch_timeout_seconds)
    settings.watching.client_timeout = ours.watch_timeout_seconds + WATCH_CLIENT_GRACE_SECONDS
    settings.watching.connect_timeout = ours.request_timeout_seconds
    settings.networking.request_timeout = ours.request_timeout_seconds
    settings.networking.connect_timeout = ours.request_timeout_seconds


async def connection_info(config: KubeConfig) -> kopf.ConnectionInfo:
    """kopf's credentials from the same configuration the operator's own client uses. A token from an
    exec plugin carries its expiry: kopf logs in again (the plugin runs again) before it lapses. kopf
    logs in only when it holds no working credentials, so an exec plugin always runs afresh here (a
    cached token may be the one the API server just refused)."""
    token: str | None
    if config.exec_credentials is not None:
        credential = await config.exec_credentials.refresh()
        token, expires = credential.token, credential.expires
        if expires is not None and expires - datetime.now(UTC) < LOGIN_EXPIRY_FLOOR:
            # kopf drops a credential past its expiry the moment it gets one and logs in again: such a
            # plugin (a skewed clock, a slow run) would run in a loop and nothing would be watched.
            logger.warning(
                "exec plugin %s handed out a token that expires at %s, within %s of now: kopf uses it "
                "until the API server refuses it (is this machine's clock ahead of the token issuer's?)",
                config.exec_credentials.plugin.command,
                expires.isoformat(),
                LOGIN_EXPIRY_FLOOR,
            )
            expires = None
    else:
        token, expires = await config.bearer()
    return kopf.ConnectionInfo(
        server=config.server,
        ca_path=str(config.ca_path) if config.ca_path else None,
        ca_data=config.ca_data,
        insecure=config.insecure_skip_tls_verify or None,
        token=token,
        scheme="Bearer" if token else None,
        certificate_path=str(config.client_cert_path) if config.client_cert_path else None,
        certificate_data=config.client_cert_data,
        private_key_path=str(config.client_key_path) if config.client_key_path else None,
        private_key_data=config.client_key_data,
        default_namespace=config.namespace,
        expiration=expires,
    )
