"""Exec credential plugins, run as client-go runs them, with script plugins; KUBECONFIG lists merged."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig, kubeconfig_to_config
from mooncake_operator.kube.errors import KubeApiError, KubeConfigError
from mooncake_operator.kube.exec_auth import (
    EXEC_V1,
    EXEC_V1BETA1,
    ExecCredentials,
    ExecPlugin,
    ExecPluginError,
)
from mooncake_operator.runtime.settings import connection_info

pytestmark = pytest.mark.unit

CA_PEM = b"-----BEGIN CERTIFICATE-----\nnot-parsed-here\n-----END CERTIFICATE-----\n"

# A plugin that records its KUBERNETES_EXEC_INFO, argv and environment, and prints a credential whose
# token counts its runs ("tok-1", "tok-2", ...). PLUGIN_* variables (from the kubeconfig's env) steer it.
PLUGIN = """\
#!{python}
import json, os, sys, time
state = os.environ["PLUGIN_STATE"]
runs = len(open(state).read().splitlines()) + 1 if os.path.exists(state) else 1
with open(state, "a") as f:
    f.write(json.dumps({{"info": os.environ.get("KUBERNETES_EXEC_INFO"), "argv": sys.argv[1:],
                        "stdin_tty": os.isatty(0), "greeting": os.environ.get("GREETING")}}) + "\\n")
time.sleep(float(os.environ.get("PLUGIN_SLEEP", "0")))
mode = os.environ.get("PLUGIN_MODE", "ok")
if mode == "fail":
    print("error: the SSO session has expired; run aws sso login", file=sys.stderr)
    sys.exit(253)
if mode == "garbage":
    print("Please log in at https://example.invalid")
    sys.exit(0)
status = {{"token": os.environ.get("PLUGIN_TOKEN", "tok-%d" % runs)}}
if os.environ.get("PLUGIN_EXPIRES"):
    status["expirationTimestamp"] = os.environ["PLUGIN_EXPIRES"]
if mode == "cert":
    status = {{"clientCertificateData": "pem", "clientKeyData": "pem"}}
version = os.environ.get("PLUGIN_VERSION", "{version}")
print(json.dumps({{"apiVersion": version, "kind": "ExecCredential", "status": status}}))
"""


def write_plugin(directory: Path, version: str = EXEC_V1, name: str = "plugin") -> Path:
    path = directory / name
    path.write_text(PLUGIN.format(python=sys.executable, version=version))
    path.chmod(0o755)
    return path


def kubeconfig(
    directory: Path,
    *,
    exec_stanza: dict[str, Any],
    cluster: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"exec": exec_stanza}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "current-context": "ctx",
    }


def stanza(state: Path, version: str = EXEC_V1, command: str = "./plugin", **extra: Any) -> dict[str, Any]:
    env = [{"name": "PLUGIN_STATE", "value": str(state)}]
    env += [{"name": key, "value": value} for key, value in extra.pop("env", {}).items()]
    body: dict[str, Any] = {"apiVersion": version, "command": command, "env": env, **extra}
    if version == EXEC_V1:
        body.setdefault("interactiveMode", "Never")
    return body


def runs(state: Path) -> list[dict[str, Any]]:
    if not state.exists():
        return []
    return [json.loads(line) for line in state.read_text().splitlines()]


def config_of(tmp_path: Path, exec_stanza: dict[str, Any], **kw: Any) -> KubeConfig:
    return kubeconfig_to_config(kubeconfig(tmp_path, exec_stanza=exec_stanza, **kw), base_dir=tmp_path)


def credentials(config: KubeConfig) -> ExecCredentials:
    assert config.exec_credentials is not None
    return config.exec_credentials


# --------------------------------------------------------------------------- KUBERNETES_EXEC_INFO


@pytest.mark.parametrize("version", [EXEC_V1, EXEC_V1BETA1])
def test_exec_info_without_cluster_info_is_exactly_client_gos(tmp_path: Path, version: str) -> None:
    write_plugin(tmp_path, version)
    state = tmp_path / "state"
    config = config_of(tmp_path, stanza(state, version, args=["token", "-i", "demo"]))
    token, expires = asyncio.run(config.bearer())
    assert (token, expires) == ("tok-1", None)
    [run] = runs(state)
    assert run["info"] == (
        '{"kind":"ExecCredential","apiVersion":"' + version + '","spec":{"interactive":false}}'
    )
    assert run["argv"] == ["token", "-i", "demo"]
    assert run["stdin_tty"] is False


@pytest.mark.parametrize("version", [EXEC_V1, EXEC_V1BETA1])
def test_exec_info_with_cluster_info_carries_server_ca_data_proxy_and_extension(
    tmp_path: Path, version: str
) -> None:
    write_plugin(tmp_path, version)
    state = tmp_path / "state"
    (tmp_path / "ca.crt").write_bytes(CA_PEM)  # a CA file reaches the plugin as data, like client-go
    cluster = {
        "server": "https://eks.example.invalid",
        "certificate-authority": "ca.crt",
        "proxy-url": "http://proxy.invalid:3128",
        "extensions": [
            {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "sts", "n": 1}},
            {"name": "other", "extension": {"ignored": True}},
        ],
    }
    config = config_of(tmp_path, stanza(state, version, provideClusterInfo=True), cluster=cluster)
    asyncio.run(config.bearer())
    [run] = runs(state)
    ca = base64.b64encode(CA_PEM).decode()
    assert run["info"] == (
        '{"kind":"ExecCredential","apiVersion":"' + version + '","spec":{"cluster":{'
        '"server":"https://eks.example.invalid","certificate-authority-data":"' + ca + '",'
        '"proxy-url":"http://proxy.invalid:3128","config":{"audience":"sts","n":1}},"interactive":false}}'
    )


def test_args_and_env_reach_the_plugin_and_a_bare_command_is_looked_up_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_plugin(bin_dir, name="aws-like")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    state = tmp_path / "state"
    config = config_of(tmp_path, stanza(state, command="aws-like", args=["eks"], env={"GREETING": "hi"}))
    asyncio.run(config.bearer())
    [run] = runs(state)
    assert (run["argv"], run["greeting"]) == (["eks"], "hi")


def test_a_relative_command_with_a_slash_is_relative_to_the_kubeconfig_folder(tmp_path: Path) -> None:
    folder = tmp_path / "kube"
    (folder / "bin").mkdir(parents=True)
    write_plugin(folder / "bin")
    state = tmp_path / "state"
    (folder / "config").write_text(
        yaml.safe_dump(kubeconfig(folder, exec_stanza=stanza(state, command="bin/plugin")))
    )
    config = KubeConfig.from_kubeconfig(folder / "config")
    assert credentials(config).plugin.command == str(folder / "bin" / "plugin")
    assert asyncio.run(config.bearer())[0] == "tok-1"


# --------------------------------------------------------------------------- interactive modes


def test_never_and_if_available_without_a_terminal_give_the_plugin_no_stdin(tmp_path: Path) -> None:
    write_plugin(tmp_path, EXEC_V1BETA1)
    state = tmp_path / "state"
    # v1beta1 defaults to IfAvailable, as client-go does
    config = config_of(tmp_path, stanza(state, EXEC_V1BETA1))
    assert credentials(config).plugin.interactive_mode == "IfAvailable"
    asyncio.run(ExecCredentials(credentials(config).plugin, stdin_is_terminal=lambda: False).get())
    never = ExecPlugin(**{**credentials(config).plugin.__dict__, "interactive_mode": "Never"})
    asyncio.run(ExecCredentials(never, stdin_is_terminal=lambda: True).get())  # a terminal, but Never
    assert [json.loads(run["info"])["spec"]["interactive"] for run in runs(state)] == [False, False]
    assert [run["stdin_tty"] for run in runs(state)] == [False, False]


def test_if_available_on_a_terminal_says_interactive(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    plugin = credentials(config_of(tmp_path, stanza(state, interactiveMode="IfAvailable"))).plugin
    asyncio.run(ExecCredentials(plugin, stdin_is_terminal=lambda: True).get())
    assert json.loads(runs(state)[0]["info"])["spec"] == {"interactive": True}


def test_always_without_a_terminal_is_a_clear_error_and_the_plugin_never_runs(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    plugin = credentials(config_of(tmp_path, stanza(state, interactiveMode="Always"))).plugin
    with pytest.raises(ExecPluginError, match=r"needs a terminal \(interactiveMode: Always\)"):
        asyncio.run(ExecCredentials(plugin, stdin_is_terminal=lambda: False).get())
    assert runs(state) == []


# --------------------------------------------------------------------------- refusals and failures


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"apiVersion": "client.authentication.k8s.io/v1alpha1"}, r"v1alpha1 was removed .* use .*v1 or"),
        ({"apiVersion": "example.com/v9"}, r"apiVersion 'example.com/v9' is not supported"),
        ({"interactiveMode": None}, r"interactiveMode must be set for client.authentication.k8s.io/v1"),
        ({"interactiveMode": "Sometimes"}, r"interactiveMode 'Sometimes' is not one of Never"),
        ({"command": ""}, r"command is required"),
    ],
)
def test_bad_exec_stanzas_are_refused_when_the_kubeconfig_is_read(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    body = {**stanza(tmp_path / "state"), **change}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(ExecPluginError, match=message):
        config_of(tmp_path, body)


def test_auth_provider_is_refused_naming_the_plugins_that_replaced_it(tmp_path: Path) -> None:
    document = kubeconfig(tmp_path, exec_stanza={})
    document["users"] = [{"name": "u", "user": {"auth-provider": {"name": "gcp"}}}]
    with pytest.raises(KubeConfigError, match=r"auth-provider 'gcp'.*gke-gcloud-auth-plugin.*kubelogin"):
        kubeconfig_to_config(document, base_dir=tmp_path)


def test_a_missing_command_shows_the_install_hint(tmp_path: Path) -> None:
    hint = "aws-iam-authenticator is required: see the EKS user guide"
    config = config_of(tmp_path, stanza(tmp_path / "state", command="no-such-plugin-xyz", installHint=hint))
    with pytest.raises(
        ExecPluginError, match=r"'no-such-plugin-xyz' not found\naws-iam-authenticator is required"
    ):
        asyncio.run(config.bearer())


def test_a_failing_plugin_reports_its_exit_status_and_stderr(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    config = config_of(tmp_path, stanza(tmp_path / "state", env={"PLUGIN_MODE": "fail"}))
    with pytest.raises(ExecPluginError, match=r"exited with status 253: error: the SSO session has expired"):
        asyncio.run(config.bearer())


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PLUGIN_MODE": "garbage"}, r"printed no valid JSON ExecCredential"),
        ({"PLUGIN_VERSION": EXEC_V1BETA1}, r"configured for client.authentication.k8s.io/v1 but returned"),
        ({"PLUGIN_MODE": "cert"}, r"returned a client certificate; .* token"),
        ({"PLUGIN_EXPIRES": "tomorrow"}, r"expirationTimestamp 'tomorrow' is not an RFC 3339 time"),
    ],
)
def test_output_that_is_no_usable_credential_is_refused(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    write_plugin(tmp_path)
    config = config_of(tmp_path, stanza(tmp_path / "state", env=env))
    with pytest.raises(ExecPluginError, match=message):
        asyncio.run(config.bearer())


# --------------------------------------------------------------------------- caching


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def test_the_token_is_cached_until_its_expiration_timestamp(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    clock = FakeClock()
    plugin = credentials(
        config_of(tmp_path, stanza(state, env={"PLUGIN_EXPIRES": "2026-12-02T03:15:00Z"}))
    ).plugin
    creds = ExecCredentials(plugin, clock=clock)

    async def token() -> str:
        return (await creds.get()).token

    assert asyncio.run(token()) == "tok-1"
    assert (asyncio.run(creds.get())).expires == datetime(2026, 12, 2, 3, 15, tzinfo=UTC)
    clock.now += timedelta(minutes=14, seconds=59)
    assert asyncio.run(token()) == "tok-1"
    clock.now += timedelta(seconds=1)  # at the expiration timestamp: expired
    assert asyncio.run(token()) == "tok-2"
    assert creds.runs == 2


def test_fifty_concurrent_requests_run_the_plugin_once(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    config = config_of(tmp_path, stanza(state, env={"PLUGIN_SLEEP": "0.3"}))
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(200, json={"kind": "Namespace", "metadata": {"name": "x"}})

    async def main() -> None:
        async with KubeClient(config, transport=httpx.MockTransport(handler)) as kube:
            await asyncio.gather(*(kube.get("v1", "Namespace", "x") for _ in range(50)))

    asyncio.run(main())
    assert len(runs(state)) == 1
    assert seen == ["Bearer tok-1"] * 50


def unauthorized_until(accepted: str, seen: list[str | None]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {accepted}":
            status = {
                "kind": "Status",
                "status": "Failure",
                "reason": "Unauthorized",
                "message": "Unauthorized",
            }
            return httpx.Response(401, json=status)
        return httpx.Response(200, json={"kind": "Namespace", "metadata": {"name": "x"}})

    return handler


def test_a_401_runs_the_plugin_once_more_and_retries_once(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    config = config_of(tmp_path, stanza(state))  # no expiry: only a 401 makes it run again
    seen: list[str | None] = []

    async def main() -> None:
        async with KubeClient(
            config, transport=httpx.MockTransport(unauthorized_until("tok-2", seen))
        ) as kube:
            await kube.get("v1", "Namespace", "x")
            await kube.get("v1", "Namespace", "x")  # the fresh token is cached

    asyncio.run(main())
    assert seen == ["Bearer tok-1", "Bearer tok-2", "Bearer tok-2"]
    assert len(runs(state)) == 2


def test_a_second_401_is_the_answer(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    state = tmp_path / "state"
    config = config_of(tmp_path, stanza(state))
    seen: list[str | None] = []

    async def main() -> None:
        async with KubeClient(
            config, transport=httpx.MockTransport(unauthorized_until("never", seen))
        ) as kube:
            await kube.get("v1", "Namespace", "x")

    with pytest.raises(KubeApiError) as raised:
        asyncio.run(main())
    assert raised.value.status == 401
    assert seen == ["Bearer tok-1", "Bearer tok-2"]
    # Says that the plugin already ran again, so nobody re-runs the command hoping for a fresh token.
    plugin = tmp_path / "plugin"
    expected = (
        f"Unauthorized (exec plugin {plugin} ran again after a first 401: its fresh token was refused too)"
    )
    assert raised.value.message == expected
    assert len(runs(state)) == 2


def test_a_static_token_is_not_retried_on_401(tmp_path: Path) -> None:
    seen: list[str | None] = []

    async def main() -> None:
        config = KubeConfig(server="https://127.0.0.1:6443", token="static")
        async with KubeClient(
            config, transport=httpx.MockTransport(unauthorized_until("never", seen))
        ) as kube:
            await kube.get("v1", "Namespace", "x")

    with pytest.raises(KubeApiError) as raised:
        asyncio.run(main())
    assert seen == ["Bearer static"]
    assert raised.value.message == "Unauthorized"


def test_kopf_login_gets_the_plugins_token_and_its_expiry(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    config = config_of(tmp_path, stanza(tmp_path / "state", env={"PLUGIN_EXPIRES": "2030-01-01T00:15:00Z"}))
    info = asyncio.run(connection_info(config))
    assert (info.token, info.scheme, info.default_namespace) == ("tok-1", "Bearer", "team")
    assert info.expiration == datetime(2030, 1, 1, 0, 15, tzinfo=UTC)
    # kopf logs in again only without working credentials (expired, or refused with 401): a fresh run.
    assert asyncio.run(connection_info(config)).token == "tok-2"
    assert asyncio.run(config.bearer())[0] == "tok-2"  # the operator's own client shares the cache


def test_kopf_login_keeps_a_token_handed_out_already_expired_until_it_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # kopf would drop it at once and log in again, in a loop: it gets no expiry, and a warning says why.
    write_plugin(tmp_path)
    config = config_of(tmp_path, stanza(tmp_path / "state", env={"PLUGIN_EXPIRES": "2020-01-01T00:00:00Z"}))
    with caplog.at_level("WARNING", logger="mooncake_operator.runtime.settings"):
        info = asyncio.run(connection_info(config))
    assert (info.token, info.expiration) == ("tok-1", None)
    assert "expires at 2020-01-01T00:00:00+00:00" in caplog.text
    assert "clock ahead" in caplog.text


# --------------------------------------------------------------------------- KUBECONFIG lists


def write(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_kubeconfig_list_merges_like_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cluster lives in one file (with a CA relative to it), the user in another (token file
    # relative to it); a duplicate name in a later file loses; current-context from the first that sets one.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "ca.crt").write_bytes(CA_PEM)
    (tmp_path / "b" / "token").write_text("from-b\n")
    first = write(
        tmp_path / "a" / "config",
        {
            "clusters": [
                {"name": "c", "cluster": {"server": "https://one:6443", "certificate-authority": "ca.crt"}}
            ],
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "ns-a"}}],
        },
    )
    second = write(
        tmp_path / "b" / "config",
        {
            "clusters": [{"name": "c", "cluster": {"server": "https://two:6443"}}],
            "users": [{"name": "u", "user": {"tokenFile": "token"}}],
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "ns-b"}}],
            "current-context": "ctx",
        },
    )
    third = write(tmp_path / "c" / "config", {"current-context": "other"})
    monkeypatch.setenv("KUBECONFIG", f"{first}:{tmp_path / 'missing'}:{second}:{third}")
    config = KubeConfig.from_kubeconfig()
    assert (config.server, config.ca_path, config.namespace) == (
        "https://one:6443",
        tmp_path / "a" / "ca.crt",
        "ns-a",
    )
    assert config.current_token() == "from-b"
    monkeypatch.setenv("KUBECONFIG", f"{third}:{second}")
    with pytest.raises(KubeConfigError, match=r"no context named 'other'"):
        KubeConfig.from_kubeconfig()


def test_a_kubeconfig_list_without_any_existing_file_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'x'}:{tmp_path / 'y'}")
    with pytest.raises(KubeConfigError, match=r"no kubeconfig found: none of .*x, .*y exists"):
        KubeConfig.from_kubeconfig()
    with pytest.raises(KubeConfigError, match=r"kubeconfig .*absent not found"):
        KubeConfig.from_kubeconfig(tmp_path / "absent")


# --------------------------------------------------------------------------- the kubernetes package as oracle


ORACLE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-oracle" / "bin" / "python"
# Run in the oracle venv (scripts/bootstrap): the kubernetes client reads the kubeconfig, runs the plugin.
ORACLE = """
import json, sys
from kubernetes import client, config
c = client.Configuration()
config.load_kube_config(config_file=sys.argv[1], client_configuration=c)
print(json.dumps({"host": c.host, "ca": open(c.ssl_ca_cert).read(), "token": c.api_key["BearerToken"]}))
"""


def test_the_kubernetes_package_reads_the_same_server_ca_and_token(tmp_path: Path) -> None:
    assert ORACLE_PYTHON.exists(), "the kubeconfig oracle venv is missing: run scripts/bootstrap"
    folder = tmp_path / "kube"
    (folder / "bin").mkdir(parents=True)
    write_plugin(folder / "bin", EXEC_V1BETA1)
    exec_stanza = stanza(
        tmp_path / "state",
        EXEC_V1BETA1,
        command="./bin/plugin",
        args=["token"],
        provideClusterInfo=True,
        env={"PLUGIN_TOKEN": "k8s-aws-v1.abc"},
    )
    cluster = {
        "server": "https://abc.gr7.us-west-2.eks.amazonaws.example:443/",
        "certificate-authority-data": base64.b64encode(CA_PEM).decode(),
    }
    path = folder / "config"
    path.write_text(yaml.safe_dump(kubeconfig(folder, exec_stanza=exec_stanza, cluster=cluster)))

    ours = KubeConfig.from_kubeconfig(path)
    token, _ = asyncio.run(ours.bearer())
    oracle = subprocess.run(
        [str(ORACLE_PYTHON), "-c", ORACLE, str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    theirs = json.loads(oracle.stdout)
    assert ours.server == theirs["host"].rstrip("/")
    assert ours.ca_data == theirs["ca"].encode()
    assert f"Bearer {token}" == theirs["token"] == "Bearer k8s-aws-v1.abc"
    assert len(runs(tmp_path / "state")) == 2  # each ran the plugin itself
