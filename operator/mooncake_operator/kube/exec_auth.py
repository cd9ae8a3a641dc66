"""Exec credential plugins (a kubeconfig user's `exec:`), run the way client-go runs them.

EKS (`aws eks get-token`), GKE (`gke-gcloud-auth-plugin`), AKS (`kubelogin`) and OIDC logins hand out
short-lived tokens through such a plugin: a program that prints an `ExecCredential` JSON document.
`ExecPlugin` is the parsed `exec:` stanza; `ExecCredentials` runs it, caches the token until its
`expirationTimestamp`, runs it at most once at a time (one lock), and runs it again when the API server
answers 401 to the token it handed out.

Plugins that return only a client certificate are refused: the HTTPS connection's certificate is fixed
when the client is built, so a rotating one cannot be honoured without rebuilding it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from mooncake_operator.kube.errors import KubeConfigError

EXEC_V1: Final = "client.authentication.k8s.io/v1"
EXEC_V1BETA1: Final = "client.authentication.k8s.io/v1beta1"
EXEC_V1ALPHA1: Final = "client.authentication.k8s.io/v1alpha1"
SUPPORTED_VERSIONS: Final = (EXEC_V1, EXEC_V1BETA1)
# The cluster extension handed to a plugin as spec.cluster.config (provideClusterInfo).
CLUSTER_EXTENSION: Final = "client.authentication.k8s.io/exec"
INTERACTIVE_MODES: Final = ("Never", "IfAvailable", "Always")
_STDERR_TAIL: Final = 2000


class ExecPluginError(KubeConfigError):
    """The exec plugin is misconfigured, missing, failed, or printed something that is no credential."""


@dataclass(frozen=True)
class ExecCredential:
    token: str = field(repr=False)
    expires: datetime | None  # None: valid until the API server answers 401


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig's `user.exec`, resolved (command path, cluster info)."""

    api_version: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    install_hint: str | None = None
    interactive_mode: str = "IfAvailable"
    # spec.cluster for KUBERNETES_EXEC_INFO when provideClusterInfo is set, else None.
    cluster: Mapping[str, Any] | None = None

    @classmethod
    def parse(
        cls,
        stanza: Any,
        *,
        base_dir: Path,
        cluster: Mapping[str, Any],
        ca_data: bytes | None,
        source: str,
    ) -> ExecPlugin:
        """`stanza` is the kubeconfig's `user.exec`; `cluster` the context's cluster and `ca_data` its CA
        (read from certificate-authority when given as a file: plugins get it as data)."""
        where = f"{source}: user exec"
        if not isinstance(stanza, dict):
            raise ExecPluginError(f"{where} must be a mapping")
        api_version = stanza.get("apiVersion")
        if api_version == EXEC_V1ALPHA1:
            raise ExecPluginError(
                f"{where}: apiVersion {EXEC_V1ALPHA1} was removed from Kubernetes (1.24); "
                f"update the plugin and use {EXEC_V1} or {EXEC_V1BETA1}"
            )
        if api_version not in SUPPORTED_VERSIONS:
            raise ExecPluginError(
                f"{where}: apiVersion {api_version!r} is not supported; use {EXEC_V1} or {EXEC_V1BETA1}"
            )
        command = stanza.get("command")
        if not isinstance(command, str) or not command:
            raise ExecPluginError(f"{where}: command is required")
        # Like kubectl: a relative path with a separator is relative to the kubeconfig's folder; a bare
        # name is looked up on PATH.
        if os.sep in command and not os.path.isabs(command):
            command = str(base_dir / command)
        args = stanza.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ExecPluginError(f"{where}: args must be a list of strings")
        env: list[tuple[str, str]] = []
        for entry in stanza.get("env") or []:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
                raise ExecPluginError(f"{where}: each env entry needs a name and a value")
            env.append((entry["name"], str(entry.get("value", ""))))
        mode = stanza.get("interactiveMode")
        if mode is None:
            if api_version == EXEC_V1:
                # As client-go: v1 makes the kubeconfig say whether the plugin may read stdin.
                raise ExecPluginError(
                    f"{where}: interactiveMode must be set for {EXEC_V1} (Never, IfAvailable or Always)"
                )
            mode = "IfAvailable"
        if mode not in INTERACTIVE_MODES:
            raise ExecPluginError(
                f"{where}: interactiveMode {mode!r} is not one of {', '.join(INTERACTIVE_MODES)}"
            )
        hint = stanza.get("installHint")
        return cls(
            api_version=api_version,
            command=command,
            args=tuple(args),
            env=tuple(env),
            install_hint=hint if isinstance(hint, str) and hint.strip() else None,
            interactive_mode=mode,
            cluster=exec_cluster(cluster, ca_data) if stanza.get("provideClusterInfo") else None,
        )

    def exec_info(self, interactive: bool) -> str:
        """KUBERNETES_EXEC_INFO, in client-go's field order."""
        spec: dict[str, Any] = {}
        if self.cluster is not None:
            spec["cluster"] = dict(self.cluster)
        spec["interactive"] = interactive
        document = {"kind": "ExecCredential", "apiVersion": self.api_version, "spec": spec}
        return json.dumps(document, separators=(",", ":"))


def exec_cluster(cluster: Mapping[str, Any], ca_data: bytes | None) -> dict[str, Any]:
    """spec.cluster of KUBERNETES_EXEC_INFO: the fields client-go passes, empty ones left out."""
    result: dict[str, Any] = {"server": str(cluster.get("server") or "")}
    if cluster.get("tls-server-name"):
        result["tls-server-name"] = cluster["tls-server-name"]
    if cluster.get("insecure-skip-tls-verify"):
        result["insecure-skip-tls-verify"] = True
    if ca_data:
        result["certificate-authority-data"] = base64.b64encode(ca_data).decode()
    if cluster.get("proxy-url"):
        result["proxy-url"] = cluster["proxy-url"]
    if cluster.get("disable-compression"):
        result["disable-compression"] = True
    for extension in cluster.get("extensions") or []:
        if isinstance(extension, dict) and extension.get("name") == CLUSTER_EXTENSION:
            result["config"] = extension.get("extension")
    return result


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # closed
        return False


class ExecCredentials:
    """Runs one plugin on demand and caches its token. Share one per API server configuration.

    `clock` and `stdin_is_terminal` are injectable for tests. `runs` counts plugin runs.
    """

    def __init__(
        self,
        plugin: ExecPlugin,
        *,
        clock: Callable[[], datetime] = _utcnow,
        stdin_is_terminal: Callable[[], bool] = _stdin_is_terminal,
    ) -> None:
        self.plugin = plugin
        self.runs = 0
        self._clock = clock
        self._stdin_is_terminal = stdin_is_terminal
        self._cached: ExecCredential | None = None
        # One lock per event loop (an asyncio.Lock is bound to the loop it first waits in).
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            lock = self._locks[loop] = asyncio.Lock()
        return lock

    def _valid(self, credential: ExecCredential | None) -> bool:
        return credential is not None and (credential.expires is None or self._clock() < credential.expires)

    async def get(self) -> ExecCredential:
        """The cached credential while it is valid, else a fresh one (the plugin runs once for all
        callers waiting here)."""
        if self._valid(self._cached):
            assert self._cached is not None
            return self._cached
        async with self._lock():
            if not self._valid(self._cached):
                self._cached = await self._run()
            assert self._cached is not None
            return self._cached

    async def refresh(self) -> ExecCredential:
        """A fresh credential, whatever the cache holds: kopf logs in only when it has none that works
        (its first login, an expiry, or a 401 it saw), so a cached token may be the one refused."""
        async with self._lock():
            self._cached = await self._run()
            return self._cached

    async def after_unauthorized(self, sent_token: str) -> ExecCredential:
        """The API server refused `sent_token` (401): a fresh credential, unless another request
        already got one since (then that one)."""
        async with self._lock():
            if self._cached is None or self._cached.token == sent_token:
                self._cached = await self._run()
            return self._cached

    async def _run(self) -> ExecCredential:
        plugin = self.plugin
        terminal = self._stdin_is_terminal()
        if plugin.interactive_mode == "Always" and not terminal:
            raise ExecPluginError(
                f"exec plugin {plugin.command} needs a terminal (interactiveMode: Always) but standard "
                "input is not one; run the command in a terminal, or log in first so it need not ask"
            )
        interactive = terminal and plugin.interactive_mode != "Never"
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": plugin.exec_info(interactive)}
        self.runs += 1
        try:
            process = await asyncio.create_subprocess_exec(
                plugin.command,
                *plugin.args,
                env=env,
                stdin=None if interactive else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                # An interactive plugin prompts on stderr: let the user see it.
                stderr=None if interactive else asyncio.subprocess.PIPE,
            )
        except FileNotFoundError:
            hint = f"\n{plugin.install_hint.strip()}" if plugin.install_hint else ""
            raise ExecPluginError(f"exec plugin {plugin.command!r} not found{hint}") from None
        except PermissionError:
            raise ExecPluginError(f"exec plugin {plugin.command!r} is not executable") from None
        stdout, stderr = await process.communicate()
        if process.returncode != 0:
            detail = (stderr or b"").decode(errors="replace").strip()[-_STDERR_TAIL:]
            raise ExecPluginError(
                f"exec plugin {plugin.command} exited with status {process.returncode}"
                + (f": {detail}" if detail else "")
            )
        return parse_credential(stdout, plugin)


def parse_credential(output: bytes, plugin: ExecPlugin) -> ExecCredential:
    """The ExecCredential a plugin printed; ExecPluginError naming what is wrong otherwise."""
    name = plugin.command
    try:
        document = json.loads(output)
    except ValueError as error:
        raise ExecPluginError(f"exec plugin {name} printed no valid JSON ExecCredential: {error}") from None
    if not isinstance(document, dict) or document.get("kind") != "ExecCredential":
        raise ExecPluginError(f"exec plugin {name} printed no ExecCredential (kind must be ExecCredential)")
    if document.get("apiVersion") != plugin.api_version:
        raise ExecPluginError(
            f"exec plugin {name} is configured for {plugin.api_version} but returned apiVersion "
            f"{document.get('apiVersion')!r}"
        )
    status = document.get("status")
    if not isinstance(status, dict):
        raise ExecPluginError(f"exec plugin {name} returned an ExecCredential without a status")
    token = status.get("token")
    if not isinstance(token, str) or not token:
        if status.get("clientCertificateData") or status.get("clientKeyData"):
            raise ExecPluginError(
                f"exec plugin {name} returned a client certificate; mooncake-operator supports exec "
                "plugins that return a token (status.token) only: use a token-issuing plugin, or put "
                "the certificate in the kubeconfig (client-certificate-data, client-key-data)"
            )
        raise ExecPluginError(f"exec plugin {name} returned no status.token")
    return ExecCredential(token=token, expires=_expiry(status.get("expirationTimestamp"), name))


def _expiry(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        raise ExecPluginError(
            f"exec plugin {name}: expirationTimestamp {value!r} is not an RFC 3339 time"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
