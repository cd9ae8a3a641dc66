"""A small typed async client for the Kubernetes API: every request the operator makes itself.

kopf watches the MooncakeServings; this client lists and watches the children and pods for the watch
cache, applies children (server-side apply, one field manager), patches labels and status, posts events,
keeps the leader Lease and asks discovery which versions are served. It counts its requests so tests
and benchmarks can assert that a reconcile with nothing to change writes nothing.

Configuration comes from the pod's service account (`KubeConfig.in_cluster()`), a kubeconfig
file (`KubeConfig.from_kubeconfig()`), or explicit values (`KubeConfig(server=..., token=...)`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import tempfile
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx
import yaml

from mooncake_operator import safe_yaml

if TYPE_CHECKING:
    from mooncake_operator.kube_exec import ExecCredentials

Manifest = dict[str, Any]
ManifestList = list[Manifest]

IN_CLUSTER_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
APPLY_PATCH: Final = "application/apply-patch+yaml"
MERGE_PATCH: Final = "application/merge-patch+json"
_LIST_PAGE_SIZE: Final = 500
_EVENT_MESSAGE_LIMIT: Final = 1024
WATCH_READ_GRACE_SECONDS: Final = 30.0
MAX_IN_FLIGHT: Final = 32


class KubeError(Exception):
    """Base of every error this client raises."""


class KubeConfigError(KubeError):
    """The client cannot be configured (no kubeconfig, unsupported auth, missing files)."""


class KubeTransportError(KubeError):
    """The API server could not be reached, or did not answer in time."""


class KubeApiError(KubeError):
    """The API server answered with an error status; `message` is the server's own words (a 401 with an
    exec plugin adds that a fresh token was refused too)."""

    def __init__(
        self, status: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.details: Mapping[str, Any] = details or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


# --------------------------------------------------------------------------- configuration


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
            from mooncake_operator.kube_exec import ExecCredentials, ExecPlugin

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


# --------------------------------------------------------------------------- resource paths


@dataclass(frozen=True)
class ResourceKind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool

    @property
    def base_path(self) -> str:
        return f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"


def _kinds(*kinds: ResourceKind) -> dict[tuple[str, str], ResourceKind]:
    return {(k.api_version, k.kind): k for k in kinds}


# The built-in kinds the operator, its chart and its tests touch. Custom kinds are passed to KubeClient
# (it knows nothing of the API it serves; `crd.SERVING_KIND` is the MooncakeServing).
KNOWN_KINDS: Final[Mapping[tuple[str, str], ResourceKind]] = _kinds(
    ResourceKind("v1", "Namespace", "namespaces", namespaced=False),
    ResourceKind("v1", "ConfigMap", "configmaps", namespaced=True),
    ResourceKind("v1", "Secret", "secrets", namespaced=True),
    ResourceKind("v1", "Service", "services", namespaced=True),
    ResourceKind("v1", "Endpoints", "endpoints", namespaced=True),
    ResourceKind("v1", "Pod", "pods", namespaced=True),
    ResourceKind("v1", "ServiceAccount", "serviceaccounts", namespaced=True),
    ResourceKind("v1", "Event", "events", namespaced=True),
    ResourceKind("apps/v1", "Deployment", "deployments", namespaced=True),
    ResourceKind("apps/v1", "StatefulSet", "statefulsets", namespaced=True),
    ResourceKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", namespaced=True),
    # Kubernetes before 1.21 (the cluster tests' 1.20 API server) serves it only in policy/v1beta1.
    ResourceKind("policy/v1beta1", "PodDisruptionBudget", "poddisruptionbudgets", namespaced=True),
    ResourceKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", namespaced=True),
    ResourceKind("coordination.k8s.io/v1", "Lease", "leases", namespaced=True),
    ResourceKind(
        "authorization.k8s.io/v1", "SelfSubjectAccessReview", "selfsubjectaccessreviews", namespaced=False
    ),
    ResourceKind("rbac.authorization.k8s.io/v1", "Role", "roles", namespaced=True),
    ResourceKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", namespaced=True),
    ResourceKind("rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", namespaced=False),
    ResourceKind(
        "rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", namespaced=False
    ),
    ResourceKind(
        "apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False
    ),
)


def resource_path(
    kind: ResourceKind,
    *,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection, an object, or an object's subresource.

    A namespaced kind's collection without a namespace is the collection across all namespaces.
    """
    if kind.namespaced and not namespace and name:
        raise ValueError(f"{kind.kind} is namespaced: a namespace is required")
    if not kind.namespaced and namespace:
        raise ValueError(f"{kind.kind} is cluster-scoped: got namespace {namespace!r}")
    if subresource and not name:
        raise ValueError("a subresource needs an object name")
    parts = [kind.base_path]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(kind.plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


# --------------------------------------------------------------------------- the client

READ_VERBS: Final = frozenset({"get", "list"})
# Not a write either: a watch reads a stream of changes (counted apart from reads).
STREAM_VERBS: Final = frozenset({"watch"})


@dataclass
class RequestCounts:
    """Requests made, by verb (get, list, watch, create, apply, patch, patch_status, delete).

    `writes` counts requests that may persist a change; dry runs are counted apart.
    """

    by_verb: Counter[str] = field(default_factory=Counter)
    dry_runs: int = 0

    @property
    def reads(self) -> int:
        return sum(n for verb, n in self.by_verb.items() if verb in READ_VERBS)

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.by_verb.items() if verb not in READ_VERBS | STREAM_VERBS)

    def snapshot(self) -> RequestCounts:
        return RequestCounts(by_verb=Counter(self.by_verb), dry_runs=self.dry_runs)

    def since(self, earlier: RequestCounts) -> RequestCounts:
        return RequestCounts(
            by_verb=self.by_verb - earlier.by_verb, dry_runs=self.dry_runs - earlier.dry_runs
        )


class KubeAuth(httpx.Auth):
    """Bearer token of a `KubeConfig` on every request. An exec plugin's token is fetched (cached) before
    each request; when the API server answers 401 to it, the plugin runs once more and the request is
    sent once more, as client-go does. A second 401 is the caller's answer."""

    def __init__(self, config: KubeConfig) -> None:
        self._config = config

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._config.current_token()  # static tokens only: exec plugins run in async_auth_flow
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token, _ = await self._config.bearer()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        plugin = self._config.exec_credentials
        if response.status_code == 401 and plugin is not None and token:
            fresh = await plugin.after_unauthorized(token)
            request.headers["Authorization"] = f"Bearer {fresh.token}"
            yield request


def _error_from(response: httpx.Response, config: KubeConfig | None = None) -> KubeApiError:
    try:
        body = response.json()
    except ValueError:
        body = None
    details = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason = str(body.get("reason") or response.reason_phrase)
        message = str(body.get("message") or response.text)
        details = body.get("details")
    else:
        reason, message = response.reason_phrase, response.text.strip() or "(empty body)"
    if response.status_code == 401 and config is not None and config.exec_credentials is not None:
        # KubeAuth has already run the plugin again after the first 401: say so, or users re-run by hand.
        command = config.exec_credentials.plugin.command
        message += f" (exec plugin {command} ran again after a first 401: its fresh token was refused too)"
    return KubeApiError(response.status_code, reason, message, details)


def _kind_and_namespace(obj: Mapping[str, Any]) -> tuple[str, str, str | None]:
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not (isinstance(api_version, str) and isinstance(kind, str)):
        raise ValueError(f"manifest needs apiVersion and kind; got {api_version!r} {kind!r}")
    return api_version, kind, (obj.get("metadata") or {}).get("namespace")


def _meta(obj: Mapping[str, Any]) -> tuple[str, str, str, str | None]:
    """apiVersion, kind, name, namespace of a manifest; fails clearly when one is missing."""
    metadata = obj.get("metadata") or {}
    api_version, kind, name = obj.get("apiVersion"), obj.get("kind"), metadata.get("name")
    if not (isinstance(api_version, str) and isinstance(kind, str) and isinstance(name, str)):
        raise ValueError(
            f"manifest needs apiVersion, kind and metadata.name; got {api_version!r} {kind!r} {name!r}"
        )
    return api_version, kind, name, metadata.get("namespace")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeClient:
    """Async API client. Use as `async with KubeClient(config) as kube:` or call `aclose()`.

    `transport` lets tests inject an httpx transport; `kinds` are the custom kinds it serves besides the
    built-in ones (KNOWN_KINDS). `on_write`, when set, is called with the object each successful apply,
    patch or create returned (the operator's watch cache absorbs its own writes with it, so the next
    reconcile never reads something older).
    """

    def __init__(
        self,
        config: KubeConfig,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        kinds: Iterable[ResourceKind] = (),
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.config = config
        self.counts = RequestCounts()
        self.timeout = timeout
        self.on_write: Callable[[Manifest], None] | None = None
        # At most this many requests in flight (watches apart): with a thousand resources reconciling at
        # once, the rest wait here in a FIFO, not in httpx's connection pool, whose queue costs
        # O(waiting x connections) per finished request (measured: it saturated the operator's CPU).
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._kinds = {**KNOWN_KINDS, **_kinds(*kinds)}
        self._http = httpx.AsyncClient(
            base_url=config.server,
            verify=config.ssl_context(),
            auth=KubeAuth(config),
            # Requests wait for a slot in `_in_flight` (below), so the pool itself never queues.
            timeout=httpx.Timeout(timeout, pool=None),
            transport=transport,
            headers={"Accept": "application/json", "User-Agent": "mooncake-operator"},
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def kind(self, api_version: str, kind: str) -> ResourceKind:
        try:
            return self._kinds[(api_version, kind)]
        except KeyError:
            known = ", ".join(sorted(f"{v}/{k}" for v, k in self._kinds))
            raise ValueError(f"unknown kind {api_version}/{kind}; known: {known}") from None

    def _object_path(self, obj: Mapping[str, Any], subresource: str | None = None) -> str:
        api_version, kind, name, namespace = _meta(obj)
        return resource_path(
            self.kind(api_version, kind), namespace=namespace, name=name, subresource=subresource
        )

    async def _request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        dry_run: bool = False,
    ) -> Manifest:
        query = dict(params or {})
        if dry_run:
            query["dryRun"] = "All"
            self.counts.dry_runs += 1
        else:
            self.counts.by_verb[verb] += 1
        content = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": content_type}
        try:
            async with self._in_flight:
                response = await self._http.request(
                    method, path, params=query, content=content, headers=headers
                )
        except httpx.HTTPError as error:
            raise KubeTransportError(f"{method} {path}: {error!r}") from error
        if response.is_error:
            raise _error_from(response, self.config)
        result: Manifest = response.json() if response.content else {}
        if self.on_write is not None and verb not in READ_VERBS and not dry_run and result.get("kind"):
            self.on_write(result)
        return result

    # ---- reads

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Manifest:
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        return await self._request("get", "GET", path)

    async def served_versions(self, group: str) -> list[str]:
        """The versions the API server serves of an API group (discovery), e.g. ["v1", "v1beta1"];
        [] when it does not serve the group at all."""
        try:
            found = await self._request("get", "GET", f"/apis/{group}")
        except KubeApiError as error:
            if error.not_found:
                return []
            raise
        return [str(entry.get("version")) for entry in found.get("versions") or []]

    async def get_or_none(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> Manifest | None:
        try:
            return await self.get(api_version, kind, name, namespace)
        except KubeApiError as error:
            if error.not_found:
                return None
            raise

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> ManifestList:
        """All matching objects (every page), each with its apiVersion and kind filled in."""
        return [
            item
            async for item in self._iter_list(api_version, kind, namespace, label_selector, field_selector)
        ]

    async def list_snapshot(
        self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> tuple[ManifestList, str]:
        """All matching objects and the collection's resourceVersion, from which a watch continues."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {"limit": str(_LIST_PAGE_SIZE)}
        if label_selector:
            params["labelSelector"] = label_selector
        items: ManifestList = []
        version = ""
        while True:
            page = await self._request("list", "GET", path, params=params)
            # Every page of one paginated list is served from the same snapshot: the first names it.
            version = version or str((page.get("metadata") or {}).get("resourceVersion") or "")
            items += [{"apiVersion": api_version, "kind": kind, **item} for item in page.get("items") or []]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, version
            params["continue"] = token

    async def watch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        resource_version: str,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[Manifest]:
        """Watch events (`{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`) after
        `resource_version`, until the server ends the stream after `timeout_seconds`."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(timeout_seconds)),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        self.counts.by_verb["watch"] += 1
        # The server ends the stream; the client's read timeout only catches a server that went silent.
        timeout = httpx.Timeout(self.timeout, read=timeout_seconds + WATCH_READ_GRACE_SECONDS, pool=None)
        try:
            async with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if response.is_error:
                    await response.aread()
                    raise _error_from(response, self.config)
                async for line in response.aiter_lines():
                    if line.strip():
                        event: Manifest = json.loads(line)
                        obj = event.get("object")
                        if isinstance(obj, dict) and event.get("type") != "ERROR":
                            obj.setdefault("apiVersion", api_version)
                            obj.setdefault("kind", kind)
                        yield event
        except httpx.HTTPError as error:
            raise KubeTransportError(f"watch {path}: {error!r}") from error

    async def _iter_list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        label_selector: str | None,
        field_selector: str | None,
    ) -> AsyncIterator[Manifest]:
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {"limit": str(_LIST_PAGE_SIZE)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        while True:
            page = await self._request("list", "GET", path, params=params)
            for item in page.get("items") or []:
                yield {"apiVersion": api_version, "kind": kind, **item}
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return
            params["continue"] = token

    # ---- writes

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True, dry_run: bool = False
    ) -> Manifest:
        """Server-side apply: creates or updates the fields this manager owns; returns the object."""
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        path = self._object_path(obj)
        # JSON is YAML: the apply-patch content type accepts a JSON body.
        return await self._request(
            "apply", "PATCH", path, params=params, body=obj, content_type=APPLY_PATCH, dry_run=dry_run
        )

    async def create(
        self, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
    ) -> Manifest:
        """POST to the collection (metadata.generateName works); fails with 409 if it exists."""
        api_version, kind, namespace = _kind_and_namespace(obj)
        path = resource_path(self.kind(api_version, kind), namespace=namespace)
        params = {"fieldManager": field_manager} if field_manager else None
        return await self._request("create", "POST", path, params=params, body=obj, dry_run=dry_run)

    async def patch_merge(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
        dry_run: bool = False,
    ) -> Manifest:
        """JSON merge patch (RFC 7386): maps merge, lists are replaced, null deletes a key."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        params = {"fieldManager": field_manager} if field_manager else None
        return await self._request(
            "patch", "PATCH", path, params=params, body=patch, content_type=MERGE_PATCH, dry_run=dry_run
        )

    async def patch_status(
        self,
        api_version: str,
        kind: str,
        name: str,
        status: Mapping[str, Any],
        namespace: str | None = None,
        *,
        field_manager: str | None = None,
        resource_version: str | None = None,
    ) -> Manifest:
        """Merge-patches `.status` through the status subresource.

        With `resource_version`, the patch applies only to that version of the object: the API server
        answers 409 Conflict (`KubeApiError.conflict`) when it changed since (optimistic concurrency).
        """
        path = resource_path(
            self.kind(api_version, kind), namespace=namespace, name=name, subresource="status"
        )
        params = {"fieldManager": field_manager} if field_manager else None
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._request(
            "patch_status", "PATCH", path, params=params, body=body, content_type=MERGE_PATCH
        )

    async def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation_policy: str = "Background",
        missing_ok: bool = False,
        uid: str | None = None,
    ) -> None:
        """`uid`: delete only that object (a precondition: another one of the same name is a 409)."""
        path = resource_path(self.kind(api_version, kind), namespace=namespace, name=name)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": propagation_policy,
        }
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("delete", "DELETE", path, body=body)
        except KubeApiError as error:
            if not (missing_ok and error.not_found):
                raise

    async def create_event(
        self,
        involved: Mapping[str, Any],
        *,
        reason: str,
        message: str,
        type: str = "Normal",
        component: str = "mooncake-operator",
    ) -> Manifest:
        """Posts a core/v1 Event about `involved` (a full object as read from the API)."""
        return await self.create(
            event_manifest(involved, reason=reason, message=message, type=type, component=component)
        )


def event_manifest(
    involved: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    type: str,
    component: str,
) -> Manifest:
    """A core/v1 Event for `involved`, in its namespace (or `default` for cluster-scoped objects)."""
    if type not in ("Normal", "Warning"):
        raise ValueError(f"event type must be Normal or Warning, got {type!r}")
    api_version, kind, name, namespace = _meta(involved)
    metadata = involved.get("metadata") or {}
    reference = {"apiVersion": api_version, "kind": kind, "name": name}
    if namespace:
        reference["namespace"] = namespace
    for key in ("uid", "resourceVersion"):
        if metadata.get(key):
            reference[key] = metadata[key]
    now = _now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": namespace or "default"},
        "involvedObject": reference,
        "reason": reason,
        "message": message[:_EVENT_MESSAGE_LIMIT],  # kubectl describe shows one line; keep it readable
        "type": type,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
