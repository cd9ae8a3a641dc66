"""Every YAML the product reads refuses alias bombs fast, with a clear message and bounded memory."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import pytest
import yaml

from mooncake_operator import safe_yaml
from mooncake_operator.cli.main import main

pytestmark = pytest.mark.unit

# The classic "billion laughs": 9 levels of 9 aliases, 10^9 leaves once expanded.
BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_the_bomb_is_tiny() -> None:
    assert len(BOMB.encode()) < 360  # the 351-byte bomb, written without optional spaces


def test_the_loader_refuses_the_bomb_fast_with_bounded_memory() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(safe_yaml.YamlBombError, match="expands through its aliases"):
            safe_yaml.load(BOMB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 1024 * 1024


def test_too_many_aliases_are_refused_and_ordinary_ones_load() -> None:
    many = "a: &a x\nb: [" + ", ".join(["*a"] * (safe_yaml.MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(safe_yaml.YamlBombError, match="more than 100 YAML aliases"):
        safe_yaml.load(many)
    assert safe_yaml.load("base: &r {cpu: 1}\nx: *r\ny: {<<: *r, memory: 2Gi}\n") == {
        "base": {"cpu": 1},
        "x": {"cpu": 1},
        "y": {"cpu": 1, "memory": "2Gi"},
    }
    assert safe_yaml.load_all("a: 1\n---\nb: 2\n") == [{"a": 1}, {"b": 2}]


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(yaml.YAMLError):
        safe_yaml.load("a: &a [*a]\n")


def test_no_module_loads_yaml_any_other_way() -> None:
    root = Path(safe_yaml.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "safe_yaml.py"
        and re.search(r"(?<![\w.])yaml\.(safe_|full_|unsafe_)?load", path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


@pytest.mark.parametrize("option", ["--request", "--expect"])
def test_canary_input_files_refuse_the_bomb(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    code = main(
        ["canary", "--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:10", option, str(path)]
    )
    assert code == 3
    assert "expands through its aliases" in capsys.readouterr().err


def test_render_refuses_the_bomb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("apiVersion: serving.mooncake-operator.dev/v1alpha1\nkind: MooncakeServing\n" + BOMB)
    assert main(["render", "-f", str(path)]) == 3
    assert "expands through its aliases" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("replicas: " + "9" * 5000 + "\n", "cannot be read"),
        ("a: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),
    ],
)
def test_values_python_cannot_hold_are_yaml_errors(text: str, message: str) -> None:
    with pytest.raises(yaml.YAMLError, match=message):
        safe_yaml.load(text)


def test_a_5000_digit_number_in_a_request_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chat.yaml"
    path.write_text("max_tokens: " + "9" * 5000 + "\nmessages: [{role: user, content: hi}]\n")
    code = main(
        [
            "canary",
            "--replica",
            "http://127.0.0.1:9",
            "--replica",
            "http://127.0.0.1:10",
            "--request",
            str(path),
        ]
    )
    assert code == 3
    assert "cannot be read" in capsys.readouterr().err
