"""`mooncake-operator canary` through the CLI entry point, against loopback fake replicas."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from tests.support.adversarial_replicas import BenignTie
from tests.support.fake_vllm import FakeCluster, Mode

from mooncake_operator.canary.models import Comparison, ComparisonMode
from mooncake_operator.canary.request import reference_request
from mooncake_operator.cli.canary import build_config
from mooncake_operator.cli.main import build_parser, main

pytestmark = pytest.mark.unit


def replica_args(urls: list[str]) -> list[str]:
    return [argument for url in urls for argument in ("--replica", url)]


def test_passing_replicas_print_a_table_and_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2) as cluster:
        code = main(["canary", *replica_args(cluster.urls), "--block-size", "32", "--eagle"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("canary ")
    # Two pairs, each running the request and the four block-boundary requests.
    assert ": Passed — all 10 pairs" in out
    assert "(block size 32, Eagle)" in out
    assert f"{cluster.urls[0]} -> {cluster.urls[1]}  Passed" in out
    assert "cost: 20 chat requests (5 per pair: request, block-end, block-plus-one, block-minus-one" in out
    assert out.rstrip().endswith("exit 0")


def test_json_output_is_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.US_EAST]) as cluster:
        code = main(["canary", *replica_args(cluster.urls), "--pairs", "first", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1
    assert result["verdict"] == "Failed"
    assert result["pairs"][0]["mismatch"]["position"] == 15
    assert result["pairs"][0]["warm"]["text"].startswith('{"region": "us-east"')


def test_failed_pairs_show_both_answers(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.PARAPHRASE]) as cluster:
        code = main(["canary", *replica_args(cluster.urls), "--pairs", "first"])
    out = capsys.readouterr().out
    assert code == 1
    assert '  cold answer: \'{"region": "us-west"' in out
    assert "  warm answer: 'I keep the deployment record" in out
    assert "  - warm answer: text before the JSON object" in out


def test_inconclusive_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2, modes=[Mode.CORRECT, Mode.NEVER_LOADS]) as cluster:
        assert main(["canary", *replica_args(cluster.urls)]) == 2
    assert "Inconclusive" in capsys.readouterr().out


def test_an_unreachable_replica_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with FakeCluster.start(1) as cluster:
        assert main(["canary", "--replica", cluster.urls[0], "--replica", closed, "--retries", "0"]) == 3
    assert "cannot connect to" in capsys.readouterr().out


def test_request_model_and_expectation_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "chat.json"
    request.write_text(json.dumps({**reference_request(), "model": "placeholder"}))
    expect = tmp_path / "expect.yaml"
    expect.write_text(
        "- kind: json_field_equals\n  field: replica\n  value: 4\n- kind: not_contains\n  text: us-east\n"
    )
    with FakeCluster.start(2, model="tiny") as cluster:
        args = ["canary", *replica_args(cluster.urls), "--request", str(request), "--expect", str(expect)]
        assert main([*args, "--model", "tiny"]) == 0
        out = capsys.readouterr().out
        checks = "the JSON field named like 'replica' equals 4; the answer does not contain 'us-east'"
        assert f"expectations: {checks}" in out
        assert main(args) == 1  # the request's own model is not served
    assert "The model `placeholder` does not exist." in capsys.readouterr().out


def test_no_expect_turns_content_checks_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "chat.yaml"
    request.write_text(
        f"model: {reference_request()['model']}\nmessages:\n  - role: user\n    content: {'x ' * 80}\n"
    )
    with FakeCluster.start(2) as cluster:
        assert main(["canary", *replica_args(cluster.urls), "--request", str(request)]) == 1
        assert main(["canary", *replica_args(cluster.urls), "--request", str(request), "--no-expect"]) == 0
    out = capsys.readouterr().out
    assert "expectations: off (content checks disabled)" in out
    assert "warning: content checks off" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica", "http://127.0.0.1:9"], "give at least two --replica URLs"),
        (["--replica", "http://127.0.0.1:9", "--replica", "127.0.0.1:10"], "must look like http://HOST:PORT"),
        (["--request", "/nonexistent/chat.json"], "cannot read /nonexistent/chat.json"),
        (["--eagle"], "eagle needs block_size"),
    ],
)
def test_usage_errors_exit_3_with_an_actionable_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = (
        [] if "--replica" in args else ["--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:10"]
    )
    assert main(["canary", *defaults, *args]) == 3
    assert message in capsys.readouterr().err


def test_bad_expectation_files_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect = tmp_path / "expect.yaml"
    expect.write_text("- kind: json_values_include\n  values: []\n")
    args = [
        "canary",
        "--replica",
        "http://127.0.0.1:9",
        "--replica",
        "http://127.0.0.1:10",
        "--expect",
        str(expect),
    ]
    assert main(args) == 3
    assert "0.json_values_include.values: List should have at least 1 item" in capsys.readouterr().err
    expect.write_text("- kind: [unclosed\n")
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"is neither JSON nor YAML: {expect}:2:1: " in err, err  # the file, its line and column


@pytest.mark.parametrize(
    "args",
    [
        ["--replica", "http://a:1", "--replica", "http://b:1", "--bogus"],
        ["--replica", "http://a:1", "--replica", "http://b:1", "--timeout", "soon"],
        ["--replica", "http://a:1", "--replica", "http://b:1", "--pairs", "all"],
        ["--replica", "http://a:1", "--replica", "http://b:1", "--block-size", "32", "--expected-hit", "128"],
        ["--replica", "http://a:1", "--replica", "http://b:1", "--expect", "x", "--no-expect"],
        [],
    ],
)
def test_argument_errors_exit_3_not_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["canary", *args])
    assert exited.value.code == 3
    assert "mooncake-operator canary: error:" in capsys.readouterr().err


def test_help_documents_exit_codes_and_expectations(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["canary", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "exit status: 0 passed, 1 failed, 2 inconclusive, 3 usage or environment error" in out
    assert "kind: json_values_include" in out
    assert "--block-size N" in out


# --- hostile input: URLs, files, crashes ------------------------------------------------------------------


def test_credentials_in_replica_urls_are_redacted_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2) as cluster:
        secret_urls = [url.replace("http://", "http://admin:s3cret@") for url in cluster.urls]
        assert main(["canary", *replica_args(secret_urls), "--pairs", "first"]) == 0
        assert main(["canary", *replica_args(secret_urls), "--pairs", "first", "--json"]) == 0
        closed = secret_urls[1].rsplit(":", 1)[0] + ":9"
        main(["canary", "--replica", secret_urls[0], "--replica", closed, "--retries", "0", "--json"])
        main(["canary", "--replica", secret_urls[0], "--replica", secret_urls[0]])
    out, err = capsys.readouterr()
    assert "s3cret" not in out + err
    assert "admin" not in out + err
    assert "http://***@127.0.0.1:" in out


def test_no_output_of_any_run_names_a_replicas_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    """Every message that could quote a URL or a body: the default suite's /tokenize error (it named
    `http://user:secret@host` before), a 500 whose body quotes the request's basic-auth credentials, a
    failed /detokenize, an unreachable replica; as a table and as JSON."""
    with FakeCluster.start(2, kinds=[BenignTie, BenignTie]) as cluster:
        secret_urls = [url.replace("http://", "http://admin:s3cret@") for url in cluster.urls]
        for replica in cluster:
            replica.echo_auth = True
        cluster[0].tokenize_status = 500  # the default suite cannot be built
        for flags in ([], ["--json"]):
            main(["canary", *replica_args(secret_urls), "--block-size", "32", "--eagle", *flags])
        cluster[0].tokenize_status = 200
        cluster[0].detokenize_status = 500  # a benign tie whose shared text cannot be decoded
        for flags in ([], ["--json"]):
            main(["canary", *replica_args(secret_urls), "--pairs", "first", *flags])
        cluster[1].mode = Mode.HTTP_500
        for flags in ([], ["--json"]):
            main(["canary", *replica_args(secret_urls), "--pairs", "first", *flags])
        closed = secret_urls[1].rsplit(":", 1)[0] + ":9"
        for flags in ([], ["--json"]):
            main(["canary", "--replica", secret_urls[0], "--replica", closed, "--retries", "0", *flags])
    out, err = capsys.readouterr()
    # The messages are shown, their credentials not.
    for shown in (
        "tokenizer unavailable",
        "detokenize failed",
        "EngineCore encountered an issue",
        "cannot connect",
    ):
        assert shown in out, shown
    assert "s3cret" not in out + err
    assert "admin" not in out + err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://[::1", "is malformed"),
        ("http://127.0.0.1:99999", "is malformed"),
        ("http://127.0.0.1:8000/?x=1", "must not carry a query string"),
        ("http://127.0.0.1:8000/base#frag", "must not carry a query string or fragment"),
    ],
)
def test_malformed_replica_urls_are_usage_errors(
    url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["canary", "--replica", "http://127.0.0.1:9", "--replica", url]) == 3
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("HTTP://127.0.0.1:8000", "http://127.0.0.1:8000/"),
        ("http://LocalHost:8000", "http://localhost:8000/v1"),
        ("http://replica", "http://replica:80"),
        ("https://replica:443", "HTTPS://REPLICA"),
        ("http://u:p@replica:8000", "http://replica:8000"),
    ],
)
def test_one_replica_written_two_ways_is_a_duplicate(
    first: str, second: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["canary", "--replica", first, "--replica", second]) == 3
    assert "each replica must be listed once" in capsys.readouterr().err


def test_a_path_prefix_is_kept_for_both_endpoints() -> None:
    from mooncake_operator.canary.models import normalize_base_url

    assert normalize_base_url("HTTP://Gateway:80/Replica-A/v1/") == "http://gateway/Replica-A"
    assert normalize_base_url("http://[::1]:8000") == "http://[::1]:8000"


@pytest.mark.parametrize("option", ["--request", "--expect"])
def test_a_non_utf8_input_file_is_a_usage_error(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "input.yaml"
    path.write_bytes(b"model: caf\xe9\n")
    assert (
        main(
            [
                "canary",
                "--replica",
                "http://127.0.0.1:9",
                "--replica",
                "http://127.0.0.1:10",
                option,
                str(path),
            ]
        )
        == 3
    )
    err = capsys.readouterr().err
    assert f"{path} is not UTF-8 text" in err
    assert "Traceback" not in err


def test_a_lone_surrogate_in_an_answer_prints_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeCluster.start(2) as cluster:
        cluster[1].payload_filter = lambda payload: {**payload, "model": "bad \ud800 name"}
        code = main(["canary", *replica_args(cluster.urls), "--pairs", "first", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1
    assert "\\ud800" in result["reason"]


def test_a_crash_is_an_internal_error_not_a_failed_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr("mooncake_operator.canary.runner.run_canary", broken)
    assert main(["canary", "--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:10"]) == 70
    err = capsys.readouterr().err
    assert "internal error" in err
    assert "RuntimeError: a defect" in err


def test_exit_code_3_means_the_same_in_canary_and_sandbox(capsys: pytest.CaptureFixture[str]) -> None:
    from mooncake_operator.canary.models import ExitCode
    from mooncake_sandbox import command as sandbox

    assert sandbox.ExitCode is ExitCode
    helps = []
    for command in ("canary", "sandbox"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps.append(" ".join(capsys.readouterr().out.split()))
    for text in helps:
        assert "3 usage or environment error (nothing was judged" in text
        assert "70 internal error" in text


def test_cap_and_connect_options_reach_the_config() -> None:
    from mooncake_operator.cli.canary import build_config
    from mooncake_operator.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "canary",
            "--replica",
            "http://a:1",
            "--replica",
            "http://b:1",
            "--max-chat-bytes",
            "8388608",
            "--max-metrics-bytes",
            "33554432",
            "--connect-timeout",
            "2.5",
            "--put-wait",
            "30",
        ]
    )
    config = build_config(args)
    assert (config.max_chat_body_bytes, config.max_metrics_body_bytes) == (8388608, 33554432)
    assert config.connect_timeout_s == 2.5
    assert config.put_wait_s == 30


@pytest.mark.parametrize("value", ["-1", "301", "nan"])
def test_a_put_wait_out_of_range_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--put-wait", value]) == 3
    assert "put_wait_s" in capsys.readouterr().err


def test_comparison_and_suite_flags_make_the_config() -> None:
    args = build_parser().parse_args(
        [
            "canary",
            "--replica",
            "http://a:1",
            "--replica",
            "http://b:1",
            "--compare",
            "exact",
            "--top-k",
            "3",
            "--max-tie-gap",
            "0.2",
            "--max-drift",
            "0.05",
            "--block-size",
            "16",
            "--no-suite",
        ]
    )
    config = build_config(args)
    assert config.comparison == Comparison(
        mode=ComparisonMode.EXACT, top_k=3, max_tie_gap_nats=0.2, max_drift_nats=0.05
    )
    assert config.suite == "off"
    default = build_config(
        build_parser().parse_args(
            ["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--block-size", "16"]
        )
    )
    assert default.suite == "default" and default.comparison == Comparison()
    without_block_size = build_config(
        build_parser().parse_args(["canary", "--replica", "http://a:1", "--replica", "http://b:1"])
    )
    assert without_block_size.suite == "off"


def test_a_suite_file_is_read_and_bad_values_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = tmp_path / "suite.yaml"
    suite.write_text("- name: short\n  request: {model: m, messages: [{role: user, content: hi}]}\n")
    args = build_parser().parse_args(
        ["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--suite", str(suite)]
    )
    config = build_config(args)
    assert isinstance(config.suite, list) and config.suite[0].name == "short"
    suite.write_text("- name: Bad Name\n  request: {messages: [{role: user, content: hi}]}\n")
    assert main(["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--suite", str(suite)]) == 3
    assert "name" in capsys.readouterr().err
    assert main(["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--top-k", "50"]) == 3
    assert main(["canary", "--replica", "http://a:1", "--replica", "http://b:1", "--max-tie-gap", "nan"]) == 3


def test_comparison_flags_are_refused_with_a_resource(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["canary", "--resource", "default/x", "--max-tie-gap", "0.5"]) == 3
    assert "--max-tie-gap cannot be given with --resource" in capsys.readouterr().err


def test_progress_lines_on_stderr_name_the_pair_the_request_and_the_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeCluster.start(2) as cluster:
        secret_urls = [url.replace("http://", "http://admin:s3cret@") for url in cluster.urls]
        assert main(["canary", *replica_args(secret_urls), "--block-size", "32", "--eagle", "--json"]) == 0
        out, err = capsys.readouterr()
        json.loads(out)  # stdout stays the result alone
        lines = [line.removeprefix("mooncake-operator canary: ") for line in err.splitlines()]
        assert re.fullmatch(
            r"\[ *\d+\.\d s\] run \w+: 2 replica pair\(s\) x 5 request\(s\) = 10 measurement\(s\)", lines[1]
        )
        steps = [line for line in lines if re.match(r"\[ *\d+\.\d s\] \d+/10: ", line)]
        assert len(steps) == 20  # each measurement announced, then its verdict
        first = f"1/10: http://***@{cluster.urls[0][7:]} writes, http://***@{cluster.urls[1][7:]} reads; "
        assert steps[0].split("] ", 1)[1] == first + "request 'request' (1/5)"
        assert steps[1].split("] ", 1)[1] == "1/10: Passed"
        assert steps[-1].split("] ", 1)[1] == "10/10: Passed"
        seconds = [float(line[1:].split(" s]")[0]) for line in steps]
        assert seconds == sorted(seconds)  # elapsed since the run started
        assert "s3cret" not in err
        assert main(["canary", *replica_args(cluster.urls), "--pairs", "first", "--quiet"]) == 0
        assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica", "http://127.0.0.1:9"], "give at least two --replica URLs"),
        (["--resource", "default/m", "--kubeconfig", "/nonexistent/kubeconfig"], "/nonexistent/kubeconfig"),
    ],
)
def test_json_prints_an_error_object_on_a_setup_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["canary", *args, "--json"]) == 3
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["exitCode"] == 3
    assert printed["error"]["kind"] == "setup"
    assert message in printed["error"]["message"]
    assert message in err  # and still said on stderr for a person
    # Without --json stdout stays empty.
    assert main(["canary", *args]) == 3
    assert capsys.readouterr().out == ""


def test_json_prints_an_error_object_on_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr("mooncake_operator.canary.runner.run_canary", broken)
    args = ["canary", "--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:10", "--json"]
    assert main(args) == 70
    printed = json.loads(capsys.readouterr().out)
    assert printed == {
        "error": {"kind": "internal", "message": "internal error: RuntimeError: a defect"},
        "exitCode": 70,
    }
