"""Where the API server is and how to authenticate to it: the pod's service account
(`KubeConfig.in_cluster()`), kubeconfig files (`KubeConfig.from_kubeconfig()`, merged as kubectl
merges $KUBECONFIG), or explicit values (`KubeConfig(server=..., token=...)`).
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import yaml

from mooncake_operator import safe_yaml
from mooncake_operator.kube.errors import KubeConfigError
from mooncake_operator.kube.exec_auth import ExecCredentials

IN_CLUSTER_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and how to authenticate to it.

    `token_path` (in-cluster, or a kubeconfig's tokenFile) is re-read on every request: bound
    tokens are rotated in place.
    `ca_data` / `client_cert_data` / `client_key_data` are PEM bytes (kubeconfig's *-data).
    """

    server: str
    token: str | None = field(default=None, repr=False)  # never in logs
    token_path: Path | None = None
    ca_path: Path | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    client_cert_path: Path | None = None
    client_key_path: Path | None = None
    client_cert_data: bytes | None = field(default=None, repr=False)
    client_key_data: bytes | None = field(default=None, repr=False)
    insecure_skip_tls_verify: bool = False
    namespace: str | None = None
    # A kubeconfig user's exec plugin: runs on demand, caches its token (shared by copies of this config).
    exec_credentials: ExecCredentials | None = field(default=None, compare=False)

    @classmethod
    def in_cluster(
        cls, directory: Path = IN_CLUSTER_DIR, environ: Mapping[str, str] | None = None
    ) -> KubeConfig:
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeConfigError(
                "not in a cluster: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are unset"
            )
        token_path, ca_path = directory / "token", directory / "ca.crt"
        for required in (token_path, ca_path):
            if not required.is_file():
                raise KubeConfigError(
                    f"in-cluster config: {required} is missing (is a service account mounted?)"
                )
        namespace_file = directory / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
        host = f"[{host}]" if ":" in host else host  # IPv6 service address
        return cls(
            server=f"https://{host}:{port}", token_path=token_path, ca_path=ca_path, namespace=namespace
        )

    @classmethod
    def from_kubeconfig(cls, path: Path | None = None, context: str | None = None) -> KubeConfig:
        """Reads a kubeconfig: `path`, else every file $KUBECONFIG lists, merged the way kubectl merges
        them, else ~/.kube/config."""
        if path is not None:
            return Kubeconfigs.load([path], required=True).config(context)
        listed = kubeconfig_paths()
        return Kubeconfigs.load(listed, required=not os.environ.get("KUBECONFIG")).config(context)

    @classmethod
    def load_default(cls) -> KubeConfig:
        """In-cluster when running in a pod, otherwise the default kubeconfig."""
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.in_cluster()
        return cls.from_kubeconfig()

    @property
    def in_cluster_config(self) -> bool:
        """Whether this is a pod's own service account (so the cluster's network is at hand)."""
        return self.token_path is not None and self.token_path.parent == IN_CLUSTER_DIR

    def current_token(self) -> str | None:
        """The static token (token, tokenFile, service account). An exec plugin's is `await bearer()`."""
        if self.exec_credentials is not None:
            raise KubeConfigError("this configuration gets its token from an exec plugin: await bearer()")
        if self.token_path is not None:
            return self.token_path.read_text().strip()
        return self.token

    async def bearer(self) -> tuple[str | None, datetime | None]:
        """The token to send now and when it expires (None: no known expiry)."""
        if self.exec_credentials is not None:
            credential = await self.exec_credentials.get()
            return credential.token, credential.expires
        return self.current_token(), None

    def ssl_context(self) -> ssl.SSLContext:
        if self.insecure_skip_tls_verify:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif self.ca_path is not None or self.ca_data is not None:
            cadata = self.ca_data.decode() if self.ca_data is not None else None
            context = ssl.create_default_context(cafile=self.ca_path, cadata=cadata)
        else:
            context = ssl.create_default_context()
        with _client_cert_files(self) as (cert_path, key_path):
            if cert_path is not None:
                context.load_cert_chain(cert_path, key_path)
        return context


def kubeconfig_paths() -> list[Path]:
    """The files $KUBECONFIG lists (in order, each once), else ~/.kube/config."""
    listed = [Path(p) for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    unique = list(dict.fromkeys(listed))
    return unique or [Path.home() / ".kube" / "config"]


def default_kubeconfig_path() -> Path:
    return kubeconfig_paths()[0]


@dataclass(frozen=True)
class _Named:
    body: Mapping[str, Any]
    base_dir: Path  # relative paths in an entry are relative to the file that defines it
    source: str


@dataclass
class Kubeconfigs:
    """One or more kubeconfig files merged as kubectl merges a KUBECONFIG list: the first file that
    names a cluster, user or context wins; current-context comes from the first file that sets one."""

    clusters: dict[str, _Named] = field(default_factory=dict)
    users: dict[str, _Named] = field(default_factory=dict)
    contexts: dict[str, _Named] = field(default_factory=dict)
    current_context: str | None = None
    sources: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, paths: Iterable[Path], *, required: bool) -> Kubeconfigs:
        """`required`: every file must exist (an explicit --kubeconfig); otherwise missing files of a
        list are skipped, as kubectl does, but at least one must exist."""
        merged = cls()
        paths = list(paths)
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError as error:
                if required:
                    raise KubeConfigError(f"kubeconfig {path} not found") from error
                continue
            except UnicodeDecodeError as error:
                raise KubeConfigError(f"kubeconfig {path} is not UTF-8 text: {error}") from error
            try:
                document = safe_yaml.load(text)
            except yaml.YAMLError as error:
                raise KubeConfigError(f"kubeconfig {path} is not valid YAML: {error}") from error
            if document is None:
                continue  # an empty file, as kubectl accepts
            if not isinstance(document, dict):
                raise KubeConfigError(f"kubeconfig {path} is not a mapping")
            merged.add(document, base_dir=path.parent, source=str(path))
        if not merged.sources:
            raise KubeConfigError(
                f"no kubeconfig found: none of {', '.join(map(str, paths))} exists "
                "(set KUBECONFIG or pass --kubeconfig)"
            )
        return merged

    def add(self, document: Mapping[str, Any], *, base_dir: Path, source: str) -> None:
        self.sources.append(source)
        for key, table, what in (
            ("clusters", self.clusters, "cluster"),
            ("users", self.users, "user"),
            ("contexts", self.contexts, "context"),
        ):
            entries = document.get(key) or []
            if not isinstance(entries, list):
                raise KubeConfigError(f"{source}: {key} must be a list")
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise KubeConfigError(f"{source}: each of {key} needs a name")
                body = entry.get(what)
                if entry["name"] not in table:
                    table[entry["name"]] = _Named(body if isinstance(body, dict) else {}, base_dir, source)
        if self.current_context is None and document.get("current-context"):
            self.current_context = str(document["current-context"])

    @property
    def source(self) -> str:
        return self.sources[0] if len(self.sources) == 1 else "kubeconfig (" + ", ".join(self.sources) + ")"

    def _get(self, table: Mapping[str, _Named], name: str, what: str) -> _Named:
        if name not in table:
            raise KubeConfigError(f"{self.source}: no {what} named {name!r}")
        return table[name]

    def config(self, context: str | None = None) -> KubeConfig:
        """The `KubeConfig` of `context` (default: current-context)."""
        context_name = context or self.current_context
        if not context_name:
            raise KubeConfigError(f"{self.source}: no current-context set and no context given")
        ctx = self._get(self.contexts, context_name, "context").body
        cluster_entry = self._get(self.clusters, str(ctx.get("cluster", "")), "cluster")
        cluster = cluster_entry.body
        user_entry = self._get(self.users, str(ctx["user"]), "user") if ctx.get("user") else None
        user = user_entry.body if user_entry is not None else {}
        source = user_entry.source if user_entry is not None else cluster_entry.source
        if "auth-provider" in user:
            provider = (user.get("auth-provider") or {}).get("name", "")
            raise KubeConfigError(
                f"{source}: user auth-provider {provider!r} is not supported (kubectl dropped it too): "
                "use the exec plugin that replaced it (gke-gcloud-auth-plugin on GKE, kubelogin on AKS "
                "and for OIDC), or a token or client certificate"
            )
        if "username" in user:
            raise KubeConfigError(
                f"{source}: user auth ['username'] (basic auth) is not supported; use a token, a client "
                "certificate or an exec plugin"
            )
        if not cluster.get("server"):
            raise KubeConfigError(f"{cluster_entry.source}: cluster {ctx.get('cluster')!r} has no server")

        def path_of(value: str | None, base_dir: Path) -> Path | None:
            return None if value is None else base_dir / Path(value).expanduser()

        def data_of(value: str | None) -> bytes | None:
            return None if value is None else base64.b64decode(value)

        user_dir = user_entry.base_dir if user_entry is not None else cluster_entry.base_dir
        ca_path = path_of(cluster.get("certificate-authority"), cluster_entry.base_dir)
        ca_data = data_of(cluster.get("certificate-authority-data"))
        exec_credentials = None
        if "exec" in user:
            from mooncake_operator.kube.exec_auth import ExecCredentials, ExecPlugin

            if ca_data is None and ca_path is not None and user["exec"].get("provideClusterInfo"):
                try:
                    plugin_ca: bytes | None = ca_path.read_bytes()
                except OSError as error:
                    raise KubeConfigError(f"{cluster_entry.source}: cannot read {ca_path}: {error}") from None
            else:
                plugin_ca = ca_data
            plugin = ExecPlugin.parse(
                user["exec"], base_dir=user_dir, cluster=cluster, ca_data=plugin_ca, source=source
            )
            exec_credentials = ExecCredentials(plugin)
        token = user.get("token")
        token_file = path_of(user.get("tokenFile"), user_dir) if token is None else None
        return KubeConfig(
            server=str(cluster["server"]).rstrip("/"),
            token=token,
            token_path=token_file,
            ca_path=ca_path,
            ca_data=ca_data,
            client_cert_path=path_of(user.get("client-certificate"), user_dir),
            client_key_path=path_of(user.get("client-key"), user_dir),
            client_cert_data=data_of(user.get("client-certificate-data")),
            client_key_data=data_of(user.get("client-key-data")),
            insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
            namespace=ctx.get("namespace"),
            exec_credentials=exec_credentials,
        )


def kubeconfig_to_config(
    document: Mapping[str, Any], *, base_dir: Path, context: str | None = None, source: str = "kubeconfig"
) -> KubeConfig:
    """Resolves a kubeconfig document's context into a `KubeConfig` (paths relative to base_dir)."""
    merged = Kubeconfigs()
    merged.add(document, base_dir=base_dir, source=source)
    return merged.config(context)


@contextlib.contextmanager
def _client_cert_files(config: KubeConfig) -> Iterator[tuple[str | None, str | None]]:
    """File paths of the client certificate and key: the ssl module only loads files."""
    if config.client_cert_data is None:
        cert = str(config.client_cert_path) if config.client_cert_path else None
        key = str(config.client_key_path) if config.client_key_path else None
        yield cert, key
        return
    if config.client_key_data is None:
        raise KubeConfigError("client-certificate-data needs client-key-data")
    with tempfile.TemporaryDirectory(prefix="kube-client-") as temp:
        cert_path, key_path = Path(temp) / "tls.crt", Path(temp) / "tls.key"
        cert_path.write_bytes(config.client_cert_data)
        key_path.touch(mode=0o600)
        key_path.write_bytes(config.client_key_data)
        yield str(cert_path), str(key_path)
