"""The operator's distribution holds the operator only: its wheel, built from exactly what the operator
image's build context lets in, carries no sandbox and nothing that imports torch, and its CLI (help
included) never tries to import torch. The sandbox is the mooncake-sandbox distribution (sandbox/)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCKERIGNORE = REPO / "images/operator/Dockerfile.dockerignore"
# What the engine venv holds and the operator must never import.
ENGINE_ONLY = ("torch", "safetensors", "tokenizers", "transformers", "vllm")


def _image_context(dest: Path) -> None:
    """The paths the operator image's build context lets in (the dockerignore's `!` lines), copied."""
    allowed = [line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")]
    assert "operator" in allowed and "pyproject.toml" in allowed, allowed
    for name in allowed:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(
                source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
            )
        else:
            shutil.copy2(source, dest / name)


def _imported_top_levels(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    work = tmp_path_factory.mktemp("operator-wheel")
    context = work / "context"
    context.mkdir()
    _image_context(context)
    # Offline and without build isolation: the dev venv's pinned setuptools builds it.
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [*pip_wheel, "-q", "-w", str(work / "dist"), str(context)],
        check=True,
        capture_output=True,
        text=True,
    )
    (built,) = (work / "dist").glob("mooncake_operator-*.whl")
    return zipfile.ZipFile(built)


def test_the_operator_wheel_holds_the_operator_package_only(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"mooncake_operator"}
    assert (
        "mooncake_operator/cli/main.py" in names
        and "mooncake_operator/build/replicas.py" in names
        and "mooncake_operator/canary/runner.py" in names
    )
    assert "mooncake_operator/data/minimax-m2.5-eagle3.yaml" in names
    sandbox_files = [n for n in names if "sandbox" in n and n != "mooncake_operator/cli/sandbox.py"]
    assert sandbox_files == []
    generators = ("tiny_models.py", "perturbed_model.py", "reasoning_model.py")
    for gone in (*generators, "buggy_engine.py", "cpu_stalls.py", "netns.py"):
        assert not any(name.endswith("/" + gone) for name in names), gone


def test_nothing_in_the_operator_wheel_imports_the_engines_packages(wheel: zipfile.ZipFile) -> None:
    modules = [name for name in wheel.namelist() if name.endswith(".py")]
    assert len(modules) > 30
    for name in modules:
        imported = _imported_top_levels(wheel.read(name).decode())
        assert not imported & set(ENGINE_ONLY), (name, sorted(imported & set(ENGINE_ONLY)))
        # cli/sandbox.py finds the sandbox's command through an entry point: it never names the package.
        assert "mooncake_sandbox" not in imported, name
        assert "mooncake_sandbox" not in wheel.read(name).decode(), name


# Records every attempt to import an engine-venv package (none is installed in the dev venv, so a plain
# sys.modules check could not fail) and, with "block", makes mooncake_sandbox unavailable.
PROBE = """
import sys
from importlib.abc import MetaPathFinder

ENGINE_ONLY = {engine_only!r}
tried = []

class Watch(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in ENGINE_ONLY:
            tried.append(fullname)
        if top == "mooncake_sandbox" and sys.argv[1] == "block":
            raise ModuleNotFoundError(f"No module named {{fullname!r}}", name=fullname)
        return None

sys.meta_path.insert(0, Watch())
import mooncake_operator.cli.main

try:
    code = mooncake_operator.cli.main.main(sys.argv[2:])
except SystemExit as done:
    code = done.code
print("engine imports tried:", sorted(tried), file=sys.stderr)
print("sandbox loaded:", "mooncake_sandbox" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _cli(mode: str, *argv: str) -> subprocess.CompletedProcess[str]:
    probe = PROBE.format(engine_only=ENGINE_ONLY)
    return subprocess.run(
        [sys.executable, "-c", probe, mode, *argv], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "argv", [["--help"], ["sandbox", "--help"], ["canary", "--help"], ["run", "--help"], ["crd"]]
)
def test_the_cli_and_its_help_never_import_torch(argv: list[str]) -> None:
    done = _cli("allow", *argv)
    assert done.returncode == 0, done.stderr
    assert "engine imports tried: []" in done.stderr, done.stderr


def test_without_the_sandbox_distribution_the_command_says_what_to_install() -> None:
    done = _cli("block", "sandbox", "--engine", "buggy")
    assert done.returncode == 3, done.stderr
    assert "the sandbox is not installed: it is the mooncake-sandbox distribution" in done.stderr
    assert "pip install -e . -e sandbox/" in done.stderr
    assert "sandbox loaded: False" in done.stderr
    helped = _cli("block", "sandbox", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "mooncake-sandbox" in helped.stdout and "exit status" in helped.stdout
    listed = _cli("block", "--help")
    assert listed.returncode == 0 and "sandbox" in listed.stdout
    assert "engine imports tried: []" in done.stderr + helped.stderr + listed.stderr


def test_with_the_sandbox_installed_the_command_is_the_sandboxs() -> None:
    done = _cli("allow", "sandbox", "--replicas", "1")
    assert done.returncode == 3, done.stderr
    assert "need 2 to" in done.stderr and "sandbox loaded: True" in done.stderr


def test_the_sandbox_plugs_its_command_in_through_an_entry_point() -> None:
    """sandbox/pyproject.toml declares it (scripts/bootstrap installs the sandbox editable, which registers
    it); the operator's CLI loads it from there."""
    from mooncake_operator.cli.sandbox import ENTRY_POINT_GROUP, plugged_in
    from mooncake_sandbox import command

    declared = tomllib.loads((REPO / "sandbox" / "pyproject.toml").read_text(encoding="utf-8"))
    assert declared["project"]["entry-points"][ENTRY_POINT_GROUP] == {
        "sandbox": "mooncake_sandbox.command:register"
    }
    assert plugged_in("sandbox") is command.register
    assert plugged_in("no-such-command") is None
