"""A real Kubernetes control plane on 127.0.0.1 for the cluster tier and the benchmarks.

Starts etcd, kube-apiserver (TLS with throw-away certificates, token authentication, RBAC)
and optionally kube-controller-manager (garbage collection, namespace deletion, service
accounts). The binaries come from `scripts/build-kube` (kube-*) and Debian's etcd-server.

    with start_control_plane() as cp:
        cp.server, cp.ca_path, cp.admin_token, cp.kubeconfig
        token = cp.service_account_token("ns", "sa")

Everything listens on 127.0.0.1 only; `stop()` terminates, by pid, exactly the processes it
started and removes its temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from mooncake_sandbox.engine_env import cache_root

KUBE_VERSION = "1.20.2"
# scripts/build-kube's KUBE_BUILD: the version plus our local source patch level.
KUBE_BUILD = f"{KUBE_VERSION}-mo1"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "harness-admin"
# What the operator's tests need from the controller-manager: owned objects are garbage
# collected, deleted namespaces are emptied, and every namespace gets a `default`
# ServiceAccount with a token Secret (the ServiceAccount admission plugin requires both
# before it admits a Pod). The workload controllers create the pods of Deployments and
# StatefulSets (they stay Pending: no scheduler, no kubelet; tests set their status), so the
# operator's readiness checks, pod replacement and rolling updates run as in a cluster. The
# endpoints controller lists, per Service, the pods it routes to (those with an IP and a node), so a
# test can read who receives a Service's traffic.
DEFAULT_CONTROLLERS: tuple[str, ...] = (
    "endpoint",
    "garbagecollector",
    "namespace",
    "serviceaccount",
    "serviceaccount-token",
    "deployment",
    "replicaset",
    "statefulset",
)
_LOG_TAIL_LINES = 40


class ControlPlaneError(RuntimeError):
    """The control plane could not be started (missing binaries, a component died, timeout)."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path


def find_binaries() -> Binaries:
    """Locates the binaries, or fails saying which command provides them."""
    kube_bin = cache_root() / "kube" / KUBE_BUILD / "bin"
    etcd = shutil.which("etcd")
    if etcd is None:
        raise ControlPlaneError(
            "etcd not found on PATH: run scripts/bootstrap (installs Debian's etcd-server)"
        )
    found = Binaries(
        etcd=Path(etcd),
        kube_apiserver=kube_bin / "kube-apiserver",
        kube_controller_manager=kube_bin / "kube-controller-manager",
    )
    missing = [
        str(p) for p in (found.kube_apiserver, found.kube_controller_manager) if not os.access(p, os.X_OK)
    ]
    if missing:
        raise ControlPlaneError(f"missing {', '.join(missing)}: run scripts/build-kube")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _openssl(command: str, *extra: str, cwd: Path) -> None:
    """Runs `openssl COMMAND EXTRA...`; COMMAND is split on spaces (file names here have none)."""
    argv = ["openssl", *command.split(), *extra]
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ControlPlaneError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _issue_certificate(directory: Path, stem: str, subject: str, extensions: str, days: int = 2) -> None:
    """Writes `stem`.key and `stem`.crt, signed by ca.crt/ca.key in `directory`."""
    (directory / f"{stem}.ext").write_text(extensions)
    _openssl(f"genrsa -out {stem}.key 2048", cwd=directory)
    _openssl(f"req -new -key {stem}.key -out {stem}.csr", "-subj", subject, cwd=directory)
    sign = f"x509 -req -in {stem}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days {days}"
    _openssl(sign, "-extfile", f"{stem}.ext", "-out", f"{stem}.crt", cwd=directory)


def generate_certificates(directory: Path, extra_sans: Sequence[str] = (), days: int = 2) -> None:
    """A throw-away CA, a serving certificate for 127.0.0.1/localhost (plus `extra_sans`, e.g.
    "IP:10.96.0.1"), and the service-account key."""
    _openssl("genrsa -out ca.key 2048", cwd=directory)
    _openssl(f"req -x509 -new -key ca.key -days {days} -out ca.crt", "-subj", "/CN=harness-ca", cwd=directory)
    sans = ",".join(["IP:127.0.0.1", "DNS:localhost", "DNS:kubernetes.default.svc", *extra_sans])
    _issue_certificate(
        directory,
        "server",
        "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        days=days,
    )
    _openssl("genrsa -out sa.key 2048", cwd=directory)
    _openssl("rsa -in sa.key -pubout -out sa.pub", cwd=directory)


def kubeconfig_document(server: str, ca_path: Path, token: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "harness", "cluster": {"server": server, "certificate-authority": str(ca_path)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "harness", "user": user}}],
        "current-context": user,
    }


@dataclass
class ControlPlane:
    """A running control plane. `stop()` is idempotent."""

    server: str
    ca_path: Path
    admin_token: str
    kubeconfig: Path
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _stopped: bool = False

    def client(self, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        """A synchronous httpx client for the API server (admin unless a token is given)."""
        return httpx.Client(
            base_url=self.server,
            verify=ssl.create_default_context(cafile=self.ca_path),
            headers={"Authorization": f"Bearer {token or self.admin_token}"},
            timeout=timeout,
        )

    def service_account_token(
        self,
        namespace: str,
        name: str,
        *,
        expiration_seconds: int = 3600,
        bound_object: Mapping[str, str] | None = None,
    ) -> str:
        """A bound token for an existing ServiceAccount, minted through the TokenRequest API.

        `bound_object` (a Secret's or Pod's kind, apiVersion, name and uid in the same namespace): the
        API server accepts the token only while that object exists."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if bound_object is not None:
            spec["boundObjectRef"] = dict(bound_object)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        with self.client() as http:
            response = http.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", json=body)
        if response.status_code != 201:
            raise ControlPlaneError(
                f"TokenRequest for {namespace}/{name} failed: HTTP {response.status_code} {response.text}"
            )
        token: str = response.json()["status"]["token"]
        return token

    def issue_client_certificate(self, user: str, groups: Sequence[str] = ()) -> tuple[Path, Path]:
        """A client certificate (CN=user, O=groups) signed by the cluster CA: (cert path, key path)."""
        certs = self.ca_path.parent
        stem = f"client-{secrets.token_hex(4)}"
        subject = "".join(f"/O={group}" for group in groups) + f"/CN={user}"
        extensions = "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
        _issue_certificate(certs, stem, subject, extensions, days=1)
        return certs / f"{stem}.crt", certs / f"{stem}.key"

    def write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        """A kubeconfig for this server authenticating with `token` (e.g. a ServiceAccount's)."""
        path.write_text(yaml.safe_dump(kubeconfig_document(self.server, self.ca_path, token, user)))
        return path

    def log_path(self, component: str) -> Path:
        return self.workdir / f"{component}.log"

    def detach(self) -> dict[str, int]:
        """Lets the processes outlive this Python process (scripts/cluster's `up` exits, the cluster
        stays): no atexit stop. Returns {component: pid}; stopping is then the caller's job."""
        atexit.unregister(self.stop)
        self._stopped = True
        return {name: process.pid for name, process in self.processes.items()}

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        # Reverse start order: the controller-manager and the API server need etcd to exit cleanly.
        for name in reversed(list(self.processes)):
            _terminate(self.processes[name])
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _spawn(plane: ControlPlane, name: str, argv: Sequence[str]) -> None:
    log = plane.log_path(name).open("wb")
    with log:
        # A session of its own: a Ctrl-C in the terminal that started a detached plane does not reach it.
        plane.processes[name] = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=plane.workdir,
            start_new_session=True,
        )


def _wait_until(plane: ControlPlane, name: str, probe: Callable[[], bool], deadline: float) -> None:
    """Polls `probe()` until it returns True; fails early, with the log, if the process died."""
    process = plane.processes[name]
    while True:
        if process.poll() is not None:
            raise ControlPlaneError(
                f"{name} exited with {process.returncode}; last log lines:\n{_log_tail(plane.log_path(name))}"
            )
        with contextlib.suppress(httpx.HTTPError, OSError):
            if probe():
                return
        if time.monotonic() > deadline:
            raise ControlPlaneError(
                f"{name} not ready in time; last log lines:\n{_log_tail(plane.log_path(name))}"
            )
        time.sleep(0.2)


def _etcd_argv(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        str(binary),
        "--name=harness",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=harness={peer}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-level=warn",
    ]


def _apiserver_argv(
    binary: Path,
    certs: Path,
    etcd_port: int,
    secure_port: int,
    address: str = "127.0.0.1",
    authorization_modes: Sequence[str] = ("RBAC",),
) -> list[str]:
    return [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--bind-address={address}",
        f"--secure-port={secure_port}",
        "--insecure-port=0",
        # The advertise address only fills the `kubernetes` Service's endpoints; with the
        # reconciler off nothing is written, and nothing looks for a default route. A node
        # (scripts/cluster) passes its own address and turns the reconciler on: pods reach the
        # API through that Service.
        f"--advertise-address={address}",
        "--endpoint-reconciler-type=none" if address == "127.0.0.1" else "--endpoint-reconciler-type=lease",
        f"--tls-cert-file={certs / 'server.crt'}",
        f"--tls-private-key-file={certs / 'server.key'}",
        f"--client-ca-file={certs / 'ca.crt'}",
        f"--token-auth-file={certs / 'tokens.csv'}",
        f"--authorization-mode={','.join(authorization_modes)}",
        "--anonymous-auth=false",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-signing-key-file={certs / 'sa.key'}",
        f"--service-account-key-file={certs / 'sa.pub'}",
        "--profiling=false",
    ]


def _controller_manager_argv(
    binary: Path, certs: Path, kubeconfig: Path, controllers: Sequence[str]
) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        # No serving at all: 1.20 has an insecure port (default 10252) and a secure one on 0.0.0.0.
        "--port=0",
        "--secure-port=0",
        f"--controllers={','.join(controllers)}",
        "--use-service-account-credentials=false",
        "--leader-elect=false",
        f"--service-account-private-key-file={certs / 'sa.key'}",
        f"--root-ca-file={certs / 'ca.crt'}",
        "--profiling=false",
    ]


def _scratch_dir() -> Path:
    # etcd fsyncs every write: on tmpfs that costs nothing, which keeps the tests quick.
    shm = Path("/dev/shm")
    parent = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="mooncake-kube-", dir=parent))


def start_control_plane(
    *,
    controller_manager: bool = True,
    controllers: Sequence[str] = DEFAULT_CONTROLLERS,
    timeout: float = 90.0,
    address: str = "127.0.0.1",
    port: int | None = None,
    workdir: Path | None = None,
    extra_sans: Sequence[str] = (),
    extra_tokens: Sequence[tuple[str, str, Sequence[str]]] = (),
    apiserver_args: Sequence[str] = (),
    controller_manager_args: Sequence[str] = (),
    kubelet_client: bool = False,
    authorization_modes: Sequence[str] = ("RBAC",),
) -> ControlPlane:
    """Starts etcd + kube-apiserver (+ kube-controller-manager) and waits until they are ready.

    The defaults are the cluster tier's: everything on 127.0.0.1 in a temporary directory. A node
    (tests/support/kube_node.py) serves the API on its own address from `workdir`, with
    `extra_tokens` ((token, user, groups), e.g. the kubelet's) and extra component flags."""
    binaries = find_binaries()
    if workdir is None:
        workdir = _scratch_dir()
    else:
        workdir.mkdir(parents=True)
    certs = workdir / "pki"
    certs.mkdir()
    admin_token = secrets.token_hex(24)
    server = f"https://{address}:{port or free_port()}"
    plane = ControlPlane(
        server=server,
        ca_path=certs / "ca.crt",
        admin_token=admin_token,
        kubeconfig=workdir / "admin.kubeconfig",
        workdir=workdir,
    )
    # A caller that forgets stop(), or an interrupted test run, still leaves no servers behind.
    atexit.register(plane.stop)
    try:
        generate_certificates(certs, extra_sans)
        tokens = [(admin_token, ADMIN_USER, ("system:masters",)), *extra_tokens]
        (certs / "tokens.csv").write_text(
            "".join(f'{token},{user},{user},"{",".join(groups)}"\n' for token, user, groups in tokens)
        )
        plane.write_kubeconfig(plane.kubeconfig, admin_token, ADMIN_USER)
        deadline = time.monotonic() + timeout

        etcd_port = free_port()
        _spawn(plane, "etcd", _etcd_argv(binaries.etcd, workdir / "etcd", etcd_port, free_port()))
        _wait_until(
            plane, "etcd", lambda: httpx.get(f"http://127.0.0.1:{etcd_port}/health").is_success, deadline
        )

        secure_port = int(server.rsplit(":", 1)[1])
        argv = _apiserver_argv(
            binaries.kube_apiserver, certs, etcd_port, secure_port, address, authorization_modes
        )
        if kubelet_client:
            # logs/exec/port-forward: the API server calls kubelets with a certificate of this CA.
            _issue_certificate(
                certs,
                "kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
                "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
            )
            argv += [
                f"--kubelet-client-certificate={certs / 'kubelet-client.crt'}",
                f"--kubelet-client-key={certs / 'kubelet-client.key'}",
            ]
        _spawn(plane, "kube-apiserver", [*argv, *apiserver_args])
        with plane.client(timeout=5.0) as http:
            _wait_until(plane, "kube-apiserver", lambda: http.get("/readyz").is_success, deadline)

        if controller_manager:
            argv = _controller_manager_argv(
                binaries.kube_controller_manager, certs, plane.kubeconfig, controllers
            )
            _spawn(plane, "kube-controller-manager", [*argv, *controller_manager_args])
            if "serviceaccount" in controllers:
                # The `default` ServiceAccount appearing is the controller-manager's first visible work.
                with plane.client(timeout=5.0) as http:
                    probe = lambda: http.get("/api/v1/namespaces/default/serviceaccounts/default").is_success  # noqa: E731
                    _wait_until(plane, "kube-controller-manager", probe, deadline)
    except BaseException:
        plane.stop()
        raise
    return plane


@contextlib.contextmanager
def control_plane(**kwargs: Any) -> Iterator[ControlPlane]:
    plane = start_control_plane(**kwargs)
    try:
        yield plane
    finally:
        plane.stop()
