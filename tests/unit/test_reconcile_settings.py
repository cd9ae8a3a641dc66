"""Operator settings: the replica-endpoint override, validation, kopf settings, handler outcomes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import kopf
import pytest

from mooncake_operator.cli.main import build_parser
from mooncake_operator.cli.run import lease_settings_from, settings_from
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.reconcile.act.worker import log_outcome
from mooncake_operator.reconcile.decide.actions import Outcome, ReconcileResult
from mooncake_operator.runtime.lease import LeaseSettings
from mooncake_operator.runtime.settings import (
    OperatorSettings,
    SettingsError,
    configure_kopf,
    connection_info,
    load_replica_endpoints,
    parse_replica_endpoints,
)

pytestmark = pytest.mark.unit


def test_replica_endpoints_map_resources_to_urls(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text('default/demo: ["http://127.0.0.1:8001/", "http://127.0.0.1:8002/v1"]\n')
    assert load_replica_endpoints(path) == {
        "default/demo": ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    }


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (["x"], "expected a mapping"),
        ({"demo": ["http://a:1"]}, "key 'demo' must be \"<namespace>/<name>\""),
        ({"ns/demo": "http://a:1"}, "must map to a non-empty list of URLs"),
        ({"ns/demo": ["ftp://a"]}, "must look like http://HOST:PORT"),
    ],
)
def test_bad_replica_endpoints_say_what_to_change(document: object, message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        parse_replica_endpoints(document)


def test_unreadable_endpoint_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read replica endpoints"):
        load_replica_endpoints(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_replica_endpoints(bad)


def test_settings_are_validated() -> None:
    with pytest.raises(SettingsError, match="resync-seconds must be greater than 0"):
        OperatorSettings(resync_seconds=0)
    with pytest.raises(SettingsError, match="metrics-port must be a port number"):
        OperatorSettings(metrics_port=70000)
    assert OperatorSettings(liveness_port=0).liveness_endpoint is None
    assert OperatorSettings().liveness_endpoint == "http://0.0.0.0:8080/healthz"


def test_run_flags_become_settings(tmp_path: Path) -> None:
    endpoints = tmp_path / "e.yaml"
    endpoints.write_text("ns/demo: [http://127.0.0.1:1, http://127.0.0.1:2]\n")
    args = build_parser().parse_args(
        [
            "run",
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--metrics-port",
            "0",
            "--replica-endpoints",
            str(endpoints),
        ]
    )
    settings = settings_from(args)
    assert settings.namespaces == ("a", "b")
    assert settings.metrics_port == 0 and settings.liveness_port == 8080
    assert settings.endpoints_for("ns", "demo") == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert settings.endpoints_for("ns", "other") is None


def test_runs_flag_defaults_are_the_settings_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` restates no default: without flags it yields OperatorSettings() and LeaseSettings' own, and
    its --help shows them."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    args = build_parser().parse_args(["run"])
    assert settings_from(args) == OperatorSettings()
    lease = lease_settings_from(args, OperatorSettings(kube=KubeConfig(server="https://127.0.0.1:1")))
    assert lease == LeaseSettings(namespace="default")
    with pytest.raises(SystemExit):
        build_parser(["run"]).parse_args(["run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "even without a change (default: 600; changes" in shown
    assert f"(default: {LeaseSettings(namespace='x').duration_seconds}). The leader renews" in shown


def test_the_operator_namespace_comes_from_the_flag_else_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert settings_from(build_parser().parse_args(["run"])).operator_namespace == "mooncake-system"
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    assert settings_from(build_parser().parse_args(["run"])).operator_namespace == "ops"
    flagged = build_parser().parse_args(["run", "--operator-namespace", "platform"])
    assert settings_from(flagged).operator_namespace == "platform"
    with pytest.raises(SettingsError, match="operator-namespace 'Not A Namespace' is not a namespace name"):
        OperatorSettings(operator_namespace="Not A Namespace")


def test_kopf_settings() -> None:
    settings = kopf.OperatorSettings()
    configure_kopf(settings, OperatorSettings(watch_timeout_seconds=300, request_timeout_seconds=20))
    assert settings.peering.standalone is True
    assert settings.watching.server_timeout == 300 and settings.watching.client_timeout == 330
    assert settings.networking.request_timeout == 20


def test_connection_info_from_a_token_config(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    config = KubeConfig(server="https://127.0.0.1:6443", token="t", ca_path=ca, namespace="ns")
    info = asyncio.run(connection_info(config))
    assert info.expiration is None
    assert (info.server, info.token, info.scheme, info.ca_path, info.default_namespace) == (
        "https://127.0.0.1:6443",
        "t",
        "Bearer",
        str(ca),
        "ns",
    )


def test_a_worker_logs_each_new_outcome_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mooncake_operator.reconcile")
    waiting = Outcome(ReconcileResult.WAITING, "waiting for pods: 0/2 replicas ready", retry_after=5)
    log_outcome("ns", "demo", waiting, None)
    log_outcome("ns", "demo", waiting, waiting)  # unchanged: not logged again
    log_outcome("ns", "demo", Outcome(ReconcileResult.READY, "serving"), waiting)
    log_outcome("ns", "demo", Outcome(ReconcileResult.ERROR, "HTTP 500 InternalError: etcd", 3), waiting)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "ns/demo waiting: waiting for pods: 0/2 replicas ready; retrying in 5 s"),
        (logging.WARNING, "ns/demo error: HTTP 500 InternalError: etcd; retrying in 3 s"),
    ]
