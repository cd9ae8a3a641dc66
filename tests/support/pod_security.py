"""Pod Security Standards (Kubernetes' "baseline" and "restricted" profiles, policy version v1.30) as a
checker of rendered pod specs, so unit tests can say which rule a pod breaks without an API server.

Written from the published rules (kubernetes.io/docs/concepts/security/pod-security-standards): each
rule below names the field it checks. `violations(pod_spec, "restricted")` returns one line per broken
rule ("<rule>: <where>"), empty when the pod passes; "restricted" includes every "baseline" rule.
Windows-only fields (hostProcess) and AppArmor/SELinux/sysctls are checked as the standard says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

Level = Literal["baseline", "restricted"]

# baseline: capabilities a container may add.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# restricted: the only capability a container may add (after dropping ALL).
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# restricted: the volume types allowed.
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
POD_SPEC_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def pod_specs(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """("Kind/name", pod spec) of every pod a list of manifests creates (workloads' templates and Pods)."""
    for manifest in manifests:
        kind, name = manifest.get("kind"), (manifest.get("metadata") or {}).get("name")
        if kind == "Pod":
            yield f"Pod/{name}", manifest["spec"]
        elif kind in POD_SPEC_KINDS:
            yield f"{kind}/{name}", manifest["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"CronJob/{name}", manifest["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(field) or []:
            yield f"{field}[{container.get('name')}]", container


def violations(pod: dict[str, Any], level: Level = "restricted") -> list[str]:
    """The rules of `level` that the pod spec breaks, one line each; empty when it passes."""
    found = list(_baseline(pod))
    if level == "restricted":
        found += list(_restricted(pod))
    return found


def _baseline(pod: dict[str, Any]) -> Iterator[str]:
    pod_context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            yield f"host namespaces: spec.{field} is true"
    if (pod_context.get("windowsOptions") or {}).get("hostProcess"):
        yield "hostProcess: spec.securityContext.windowsOptions.hostProcess is true"
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            yield f"hostPath volumes: volumes[{volume.get('name')}]"
    for sysctl in pod_context.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"sysctls: {sysctl.get('name')} is not a safe sysctl"
    yield from _seccomp_not_unconfined("spec.securityContext", pod_context)
    yield from _selinux_and_apparmor("spec.securityContext", pod_context)
    for where, container in _containers(pod):
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            yield f"privileged containers: {where} is privileged"
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            yield f"hostProcess: {where}"
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            yield f"capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}"
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                yield f"host ports: {where} uses hostPort {port['hostPort']}"
        if context.get("procMount", "Default") != "Default":
            yield f"/proc mount type: {where} sets {context['procMount']}"
        yield from _seccomp_not_unconfined(where, context)
        yield from _selinux_and_apparmor(where, context)


def _seccomp_not_unconfined(where: str, context: dict[str, Any]) -> Iterator[str]:
    if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield f"seccomp: {where} sets Unconfined"


def _selinux_and_apparmor(where: str, context: dict[str, Any]) -> Iterator[str]:
    selinux = context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        yield f"SELinux: {where} sets type {selinux['type']}"
    if selinux.get("user") or selinux.get("role"):
        yield f"SELinux: {where} sets a user or role"
    if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
        yield f"AppArmor: {where} sets Unconfined"


def _restricted(pod: dict[str, Any]) -> Iterator[str]:
    pod_context = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        types = set(volume) - {"name"}
        if not types <= RESTRICTED_VOLUME_TYPES:
            yield f"volume types: volumes[{volume.get('name')}] is {sorted(types)}"
    pod_non_root = pod_context.get("runAsNonRoot") is True
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if pod_context.get("runAsUser") == 0:
        yield "running as non-root user: spec.securityContext.runAsUser is 0"
    for where, container in _containers(pod):
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            yield f"privilege escalation: {where} does not set allowPrivilegeEscalation false"
        non_root = context.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            yield f"running as non-root: {where} (nor the pod) sets runAsNonRoot true"
        if context.get("runAsUser") == 0:
            yield f"running as non-root user: {where} sets runAsUser 0"
        seccomp = (context.get("seccompProfile") or {}).get("type")
        if seccomp is None and not pod_seccomp:
            yield f"seccomp: {where} (nor the pod) sets seccompProfile RuntimeDefault or Localhost"
        elif seccomp is not None and seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"seccomp: {where} sets {seccomp}"
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"capabilities: {where} does not drop ALL"
        added = set(capabilities.get("add") or []) - RESTRICTED_CAPABILITIES
        if added:
            yield f"capabilities: {where} adds {sorted(added)}"
