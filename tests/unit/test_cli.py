"""The command line's conventions: one exit-status table, usage errors exit 3, lazy command imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mooncake_operator import exit_codes
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.canary.models import ExitCode
from mooncake_operator.cli.main import COMMANDS, build_parser, main

pytestmark = pytest.mark.unit


def test_the_canarys_exit_codes_are_the_clis_table() -> None:
    assert (ExitCode.PASSED, ExitCode.FAILED, ExitCode.INCONCLUSIVE, ExitCode.USAGE_OR_ENVIRONMENT) == (
        exit_codes.SUCCESS,
        exit_codes.FAILED,
        exit_codes.INCONCLUSIVE,
        exit_codes.USAGE,
    )
    assert ExitCode.INTERNAL_ERROR == exit_codes.INTERNAL_ERROR == 70


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_shows_the_exit_status_table(
    command: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "exit status" in out
    assert "inconclusive" in out and "3" in out and "70" in out


def test_each_commands_summary_is_its_modules() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert helps == COMMANDS


@pytest.mark.parametrize(
    "argv",
    [["no-such-command"], ["render"], ["crd", "--bogus"], ["canary"], ["run", "--resync-seconds", "x"], []],
)
def test_usage_errors_exit_3_for_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == exit_codes.USAGE
    assert "error:" in capsys.readouterr().err


def test_help_and_the_light_commands_import_only_what_they_need() -> None:
    # Importing every command module cost 1.5 s of CPU before any command started.
    probe = (
        "import sys\nfrom mooncake_operator.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "heavy = ('pydantic', 'kopf', 'httpx', 'mooncake_operator.api', 'mooncake_operator.canary.')\n"
        "light = {'mooncake_operator.canary.defaults'}  # imports nothing; `canary --help` shows them\n"
        "print(sorted({m.split('.')[0] if not m.startswith('mooncake') else m for m in sys.modules "
        "if m.startswith(heavy) and m not in light}), file=sys.stderr)\n"
    )
    for argv in (["--help"], ["crd", "--help"], ["render", "--help"], ["canary", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True
        )
        assert done.stderr.strip() == "[]", (argv, done.stderr)
    # canary --replica needs the canary (pydantic, httpx), not the API models nor the API client: a
    # refused connection ends the run (exit 2, Inconclusive) after importing all the path needs.
    argv = ["canary", "--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:10", "--retries", "0"]
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True)
    loaded = done.stderr.strip().splitlines()[-1]
    assert "mooncake_operator.canary.runner" in loaded and "httpx" in loaded, done.stderr
    assert "kopf" not in loaded and "mooncake_operator.api" not in loaded, loaded
    assert "mooncake_operator.kube" not in loaded, loaded


def test_render_namespace_sets_it_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = reference_deployment().to_wire()
    document["metadata"] = {"name": "chat"}
    path = tmp_path / "mcs.yaml"
    path.write_text(yaml.safe_dump(document))
    assert main(["render", "-f", str(path), "-n", "serving-a"]) == 0
    manifests = [m for m in yaml.safe_load_all(capsys.readouterr().out) if m]
    assert {m["metadata"].get("namespace") for m in manifests} == {"serving-a"}
    assert main(["render", "-f", str(path)]) == 0
    assert {m["metadata"].get("namespace") for m in yaml.safe_load_all(capsys.readouterr().out) if m} == {
        "default"
    }
    document["metadata"]["namespace"] = "other"
    path.write_text(json.dumps(document))
    assert main(["render", "-f", str(path), "-n", "serving-a"]) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert "metadata.namespace is 'other' but -n says 'serving-a'" in err


def test_renders_help_default_operator_namespace_is_the_builders() -> None:
    from mooncake_operator.build.network_policy import DEFAULT_OPERATOR_NAMESPACE, REPLICA_INGRESS_DEFAULTS
    from mooncake_operator.cli import render as render_command

    assert render_command.DEFAULT_OPERATOR_NAMESPACE == DEFAULT_OPERATOR_NAMESPACE
    assert render_command.REPLICA_INGRESS_DEFAULTS == REPLICA_INGRESS_DEFAULTS
