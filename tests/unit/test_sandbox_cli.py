"""`mooncake-operator sandbox`: arguments, the canary it runs, and the exit code of every outcome."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mooncake_operator.canary import policy
from mooncake_operator.canary.request import reference_request
from mooncake_operator.cli.main import build_parser
from mooncake_sandbox import (
    EngineMode,
    MasterDownError,
    Prepared,
    ReplicaDiedError,
    SandboxOptions,
    SandboxSetupError,
    command,
)
from mooncake_sandbox.engine_env import EngineEnv
from mooncake_sandbox.models import TinyModels
from mooncake_sandbox.runtime import canary_spec

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> Any:
    return build_parser().parse_args(["sandbox", *argv])


def test_defaults_run_the_patched_engine_on_two_eagle_replicas() -> None:
    args = _parse()
    assert (args.action, args.engine, args.replicas, args.no_speculative, args.json) == (
        "run",
        "patched",
        2,
        False,
        False,
    )


def test_every_option_parses() -> None:
    args = _parse("run", "--engine", "buggy", "--replicas", "3", "--no-speculative", "--json", "--keep-logs")
    assert (args.engine, args.replicas, args.no_speculative, args.json, args.keep_logs) == (
        "buggy",
        3,
        True,
        True,
        True,
    )
    assert _parse("prepare").action == "prepare"


@pytest.mark.parametrize(
    "argv", [["--replicas", "1"], ["--replicas", "x"], ["--engine", "fixed"], ["stop"], ["--bogus"]]
)
def test_usage_errors_exit_3_not_2_which_means_inconclusive(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        _parse(*argv)
    assert caught.value.code == command.ExitCode.USAGE_OR_ENVIRONMENT
    assert "error:" in capsys.readouterr().err


def test_one_replica_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--replicas", "1")
    assert "one writes the prefix, another reads it" in capsys.readouterr().err


@pytest.mark.parametrize("speculative", [True, False])
def test_sandbox_canary_is_the_customer_request_content_checks_off_exact_hit(speculative: bool) -> None:
    # The operator's builder applied to the sandbox's spec: one rule for both (issue 13).
    spec = canary_spec(speculative=speculative, block_size=32)
    config = policy.canary_config(spec, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert config.request == reference_request()
    assert config.expectations == []
    assert (config.block_size, config.eagle, config.pairs) == (32, speculative, "ring")
    assert config.request_timeout_s == 300.0
    assert config.expected_external_hit_tokens is None  # computed per pair from the prompt tokens


@pytest.fixture
def prepared(tmp_path: Path) -> Prepared:
    return Prepared(cache=tmp_path, env=EngineEnv(tmp_path / "venv"), models=TinyModels(tmp_path), builds={})


@pytest.mark.parametrize(
    ("error", "code", "prefix"),
    [
        (SandboxSetupError("mooncake_master did not start"), 3, "setup error: "),
        (MasterDownError("the Mooncake master is not running"), 3, "setup error: "),
        (ReplicaDiedError("replica-B exited"), 1, "replica died: "),
        (KeyboardInterrupt(), 130, "interrupted"),
        (asyncio.CancelledError(), 143, "terminated"),
    ],
)
def test_each_outcome_has_its_exit_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prepared: Prepared,
    error: BaseException,
    code: int,
    prefix: str,
) -> None:
    async def failing(*args: object) -> int:
        raise error

    monkeypatch.setattr(command, "_main", failing)

    result = command.run_sandbox(
        SandboxOptions(engine=EngineMode.BUGGY), prepared, as_json=True, isolated=True
    )

    outcome = json.loads(capsys.readouterr().out)
    assert result == code == outcome["exit_code"]
    assert outcome["error"].startswith(prefix)
    assert (outcome["engine"], outcome["network_namespace"]) == ("buggy", True)


def test_a_setup_error_during_prepare_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing_prepare(*args: object, **kwargs: object) -> Prepared:
        raise SandboxSetupError("pip install failed")

    monkeypatch.setattr(command, "prepare", failing_prepare)

    assert _parse("prepare").func(_parse("prepare")) == 3
    assert "setup error: pip install failed" in capsys.readouterr().err


def test_the_revision_change_scenario_and_store_isolation_parse() -> None:
    assert (_parse().scenario, _parse().store_isolation) == ("canary", "on")
    args = _parse("--scenario", "revision-change", "--store-isolation", "off")
    assert (args.scenario, args.store_isolation) == ("revision-change", "off")
    with pytest.raises(SystemExit) as caught:
        _parse("--store-isolation", "maybe")
    assert caught.value.code == command.ExitCode.USAGE_OR_ENVIRONMENT


def test_the_revision_change_scenario_refuses_ha_masters(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("--scenario", "revision-change", "--master-ha")
    assert args.func(args) == command.ExitCode.USAGE_OR_ENVIRONMENT
    assert "drop --master-ha" in capsys.readouterr().err


def test_perturb_reader_parses_into_the_sandbox_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse().perturb_reader is None
    args = _parse("--perturb-reader", "0.2")
    assert args.perturb_reader == 0.2
    seen: list[SandboxOptions] = []
    monkeypatch.setattr(command, "prepare", lambda engines, log: None)
    monkeypatch.setattr(command, "_enter_private_netns", lambda: True)
    monkeypatch.setattr(command, "run_sandbox", lambda options, *a, **k: seen.append(options) or 0)
    assert args.func(args) == 0
    assert (seen[0].perturb_nats, seen[0].perturbed) == (0.2, (1,))


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "11", "x"])
def test_perturb_reader_refuses_nonsense(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _parse("--perturb-reader", value)
    assert caught.value.code == command.ExitCode.USAGE_OR_ENVIRONMENT
    assert "--perturb-reader" in capsys.readouterr().err


def test_perturb_reader_is_refused_in_the_revision_change_scenario(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("--scenario", "revision-change", "--perturb-reader", "0.1")
    assert args.func(args) == command.ExitCode.USAGE_OR_ENVIRONMENT
    assert "--perturb-reader applies to the canary scenario" in capsys.readouterr().err


def test_the_reasoning_options_parse_into_the_sandbox_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (_parse().reasoning_model, _parse().reasoning_parser) == (False, None)
    args = _parse("--reasoning-model", "--reasoning-parser", "minimax_m2")
    seen: list[SandboxOptions] = []
    monkeypatch.setattr(command, "prepare", lambda engines, log: None)
    monkeypatch.setattr(command, "_enter_private_netns", lambda: True)
    monkeypatch.setattr(command, "run_sandbox", lambda options, *a, **k: seen.append(options) or 0)
    assert args.func(args) == 0
    assert (seen[0].reasoning_model, seen[0].reasoning_parser) == (True, "minimax_m2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--reasoning-parser", "minimax_m2"), "--reasoning-parser needs --reasoning-model"),
        (("--reasoning-model", "--perturb-reader", "0.2"), "--perturb-reader perturbs a copy"),
        (("--reasoning-model", "--scenario", "revision-change"), "applies to the canary scenario"),
        (("--reasoning-model", "--reasoning-parser", "x --trust-remote-code"), "vLLM parser name"),
    ],
)
def test_the_reasoning_options_refuse_what_cannot_run(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(*argv)
    assert args.func(args) == command.ExitCode.USAGE_OR_ENVIRONMENT
    assert message in capsys.readouterr().err
