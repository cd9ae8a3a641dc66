"""One validation: `mooncake-operator render` refuses exactly what the operator refuses (the resource's
checks, and the node-level options its --allow-* settings do not allow), with the same messages; image
references are checked as the runtime parses them; YAML errors name file:line:column; unknown fields
name the closest known one; `-o json` prints one v1 List.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.builders.cases import example_dict

from mooncake_operator.api.images import image_reference_problem
from mooncake_operator.api.resource import InvalidResourceError, parse_resource
from mooncake_operator.build.manifests import render_all, to_yaml_stream
from mooncake_operator.cli.main import build_parser, main
from mooncake_operator.runtime.settings import OperatorSettings

pytestmark = pytest.mark.unit

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def write(tmp_path: Path, obj: Any, name: str = "mcs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else yaml.safe_dump(obj), encoding="utf-8")
    return path


def render(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["render", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def rdma(**options: Any) -> dict[str, Any]:
    obj = example_dict()
    obj["spec"]["store"].update({"protocol": "rdma", "deviceName": "mlx5_0", "rdma": options})
    return obj


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"hostDevices": True}, "--allow-privileged-engines"),
        ({"resourceName": "rdma/ib", "hostNetwork": True}, "--allow-host-network"),
    ],
)
def test_render_refuses_the_node_options_the_operator_refuses_with_its_words(
    options: dict[str, Any], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, rdma(**options))
    code, out, err = render(["-f", str(path)], capsys)
    assert (code, out) == (3, "")
    # The operator's own refusal (what it writes in the Ready condition), word for word.
    (refusal,) = OperatorSettings().refused_options(parse_resource(rdma(**options)).spec)
    assert f"{path}: {refusal}" in err
    assert flag in refusal
    # Allowed as the operator allows it: the same switch.
    code, out, err = render(["-f", str(path), flag], capsys)
    assert code == 0, err
    allowed = OperatorSettings(
        allow_privileged_engines=flag == "--allow-privileged-engines",
        allow_host_network=flag == "--allow-host-network",
    )
    assert allowed.refused_options(parse_resource(rdma(**options)).spec) == []


def test_render_and_run_offer_the_same_allow_switches() -> None:
    def switches(command: str) -> dict[str, str | None]:
        parser = build_parser([command])
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
        return {o: a.help for a in sub._actions for o in a.option_strings if o.startswith("--allow-")}

    assert switches("render") == switches("run")
    assert set(switches("render")) == {"--allow-privileged-engines", "--allow-host-network"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_as_the_operator_accepts_it(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = render(["-f", str(example)], capsys)
    resource = parse_resource(yaml.safe_load(example.read_text(encoding="utf-8")))
    assert (code == 0) == (OperatorSettings().refused_options(resource.spec) == []), err


def test_an_invalid_image_reference_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = example_dict()
    obj["spec"]["engine"]["image"] = "Not A Valid Ref!!"
    code, out, err = render(["-f", str(write(tmp_path, obj))], capsys)
    assert (code, out) == (3, "")
    assert "spec.engine.image: image 'Not A Valid Ref!!'" in err
    with pytest.raises(InvalidResourceError):  # the operator's parse: the same check
        parse_resource(obj)


@pytest.mark.parametrize(
    "reference",
    [
        "vllm",
        "registry.example.com/team/vllm:0.32",
        "registry:5000/ops/operator:0.2.0",
        "quay.io/coreos/etcd:v3.5.17",
        "localhost/vllm@sha256:" + "4f" * 32,
        "registry.example.com/team/vllm:0.32@sha256:" + "4f" * 32,
        "[fd00::1]:5000/vllm:1",
        "Registry.Example.com/team/vllm",  # the registry host may have capitals
        "a/b__c/d-e.f:T_1.x-y",
    ],
)
def test_image_references_the_runtime_accepts(reference: str) -> None:
    assert image_reference_problem(reference) is None


@pytest.mark.parametrize(
    ("reference", "why"),
    [
        ("Not A Valid Ref!!", "whitespace"),
        ("vllm!!", "not a valid image reference"),
        ("team/VLLM:1", "must be lowercase"),
        ("vllm@sha256:" + "4f" * 32 + ":0.32", "a tag goes before the digest"),
        ("vllm@sha256:abc", "not a valid image reference"),
        ("vllm@sha256:" + "4F" * 32, "64 lowercase hex digits"),
        ("vllm:", "not a valid image reference"),
        ("a//b", "not a valid image reference"),
        ("/vllm", "not a valid image reference"),
        ("vllm:" + "t" * 129, "not a valid image reference"),
        ("r/" + "a" * 254, "longer than 255"),
    ],
)
def test_image_references_the_runtime_refuses(reference: str, why: str) -> None:
    problem = image_reference_problem(reference)
    assert problem is not None and why in problem, problem


def test_every_image_field_is_checked() -> None:
    for path in ("engine", "store.master", "store.master.highAvailability.etcd.managed"):
        obj = example_dict()
        spec = obj["spec"]
        if path.endswith("managed"):
            spec["store"]["master"]["highAvailability"] = {"enabled": True, "etcd": {"managed": {}}}
        target = spec
        for key in path.split("."):
            target = target[key]
        target["image"] = "bad image"
        with pytest.raises(InvalidResourceError) as caught:
            parse_resource(obj)
        assert any(p.startswith(f"spec.{path}.image: image 'bad image'") for p in caught.value.problems)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("apiVersion: v1\nspec:\n  a: b\n   c: d\n", ":4:"),
        ("apiVersion: v1\nspec: [unclosed\n", ":3:1:"),
        ("apiVersion: v1\nspec:\n\t- b\n", ":3:1:"),
    ],
)
def test_a_yaml_error_names_the_file_and_line(
    text: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, text, "broken.yaml")
    code, out, err = render(["-f", str(path)], capsys)
    assert (code, out) == (3, "")
    assert f"{path}{where}" in err, err
    assert "<unicode string>" not in err


def test_a_yaml_error_on_stdin_says_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("spec: [unclosed\n"))
    code, _, err = render(["-f", "-"], capsys)
    assert code == 3 and "<stdin>:2:1:" in err, err


@pytest.mark.parametrize(
    ("path", "typo", "suggestion"),
    [
        (("spec", "engine"), "tensorParalelSize", "did you mean 'tensorParallelSize'?"),
        (("spec",), "replica", "did you mean 'replicas'?"),
        (("spec", "canary"), "intervalSecond", "did you mean 'intervalSeconds'?"),
        (("spec", "store", "master"), "rpcport", "did you mean 'rpcPort'?"),
    ],
)
def test_an_unknown_field_names_the_closest(
    path: tuple[str, ...], typo: str, suggestion: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    obj = example_dict()
    target = obj
    for key in path:
        target = target.setdefault(key, {})
    target[typo] = 1
    code, _, err = render(["-f", str(write(tmp_path, obj))], capsys)
    assert code == 3
    assert f"{'.'.join(path)}.{typo}: unknown field; {suggestion}" in err, err


def test_an_unknown_field_in_a_list_item_names_the_closest() -> None:
    obj = example_dict()
    obj["spec"]["engine"]["extraEnv"] = [{"name": "A", "valeu": "b"}]
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    assert "spec.engine.extraEnv.0.valeu: unknown field; did you mean 'value'?" in caught.value.problems


def test_an_unknown_field_with_nothing_close_lists_the_known_ones() -> None:
    obj = example_dict()
    obj["spec"]["model"]["xyzzy"] = 1
    with pytest.raises(InvalidResourceError) as caught:
        parse_resource(obj)
    (problem,) = caught.value.problems
    assert problem.startswith("spec.model.xyzzy: unknown field (known fields: ")
    assert "name" in problem and "cache" in problem


def test_render_json_is_one_list_of_what_yaml_prints(capsys: pytest.CaptureFixture[str]) -> None:
    example = str(EXAMPLES[0])
    code, as_yaml, _ = render(["-f", example], capsys)
    assert code == 0
    code, as_json, err = render(["-f", example, "-o", "json"], capsys)
    assert code == 0, err
    listed = json.loads(as_json)
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    assert listed["items"] == list(yaml.safe_load_all(as_yaml))
    resource = parse_resource(yaml.safe_load(Path(example).read_text(encoding="utf-8")))
    assert as_yaml == to_yaml_stream(render_all(resource, owner_uid=None))


def test_render_refuses_an_unknown_output_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["render", "-f", str(write(tmp_path, example_dict())), "-o", "wide"])
    assert exited.value.code == 3  # a usage error
    captured = capsys.readouterr()
    assert captured.out == "" and "invalid choice: 'wide'" in captured.err
