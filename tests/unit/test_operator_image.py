"""images/operator/Dockerfile, read statically (no container runtime in the test tiers): a pinned
base, the package built from exactly the files the build context lets in, a non-root numeric user the
chart agrees with, and `mooncake-operator run` as the default command."""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import tomllib

import pytest
import yaml
from tests.support.chart import CHART_DIR, REPO_ROOT

pytestmark = pytest.mark.unit

IMAGE_DIR = REPO_ROOT / "images" / "operator"
DOCKERFILE = IMAGE_DIR / "Dockerfile"
DOCKERIGNORE = IMAGE_DIR / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def base_image() -> str:
    default = next(
        rest for keyword, rest in instructions() if keyword == "ARG" and rest.startswith("PYTHON_IMAGE=")
    )
    return default.split("=", 1)[1]


def context_includes(path: str) -> bool:
    """Whether the build context holds `path` under Dockerfile.dockerignore (last matching rule wins)."""
    included = True
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negated = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            matched = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            matched = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if matched:
            included = negated
    return included


def test_base_image_is_pinned_to_a_python_patch_release_and_debian_release() -> None:
    image = base_image()
    match = re.fullmatch(r"python:(3\.\d+)\.\d+-slim-(bookworm|trixie)", image)
    assert match, f"pin the base to python:X.Y.Z-slim-<debian>, not {image!r}"
    assert match.group(1) == f"{sys.version_info.major}.{sys.version_info.minor}", (
        "the image's Python is the one the tests run on"
    )
    assert all(rest.startswith("${PYTHON_IMAGE}") for keyword, rest in instructions() if keyword == "FROM")


def test_runs_as_a_numeric_non_root_user_the_chart_agrees_with() -> None:
    users = [rest for keyword, rest in final_stage() if keyword == "USER"]
    assert len(users) == 1, users
    uid, gid = (int(part) for part in users[0].split(":"))
    assert uid != 0 and gid != 0
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    assert (uid, gid) == (
        values["podSecurityContext"]["runAsUser"],
        values["podSecurityContext"]["runAsGroup"],
    )


def test_default_command_is_mooncake_operator_run() -> None:
    stage = dict(final_stage())
    assert json.loads(stage["ENTRYPOINT"]) == ["mooncake-operator"]
    assert json.loads(stage["CMD"]) == ["run"]


def test_the_package_is_installed_from_the_checkout() -> None:
    steps = instructions()
    copies = [rest.split() for keyword, rest in steps if keyword == "COPY" and not rest.startswith("--from")]
    sources = [source.rstrip("/") for copy in copies for source in copy[:-1]]
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_root = pyproject["tool"]["setuptools"]["packages"]["find"]["where"][0]
    assert {"pyproject.toml", pyproject["project"]["readme"], package_root} <= set(sources)
    for source in sources:
        assert (REPO_ROOT / source).exists(), source
        assert context_includes(source), f"{source} is copied but Dockerfile.dockerignore leaves it out"
    assert any(keyword == "RUN" and "pip install ." in rest for keyword, rest in steps)


@pytest.mark.parametrize(
    ("path", "included"),
    [
        ("pyproject.toml", True),
        ("operator/mooncake_operator/cli/main.py", True),
        ("operator/mooncake_operator/build/names.py", True),
        ("operator/mooncake_operator/__pycache__/cli.cpython-311.pyc", False),
        (".venv/bin/python", False),
        ("tests/unit/test_chart.py", False),
        ("charts/mooncake-operator/values.yaml", False),
        (".git/HEAD", False),
    ],
)
def test_build_context_is_the_package_sources_only(path: str, included: bool) -> None:
    assert context_includes(path) is included


def test_the_image_holds_no_build_tools() -> None:
    run = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    assert "pip uninstall --yes pip setuptools" in run
    assert [rest for keyword, rest in final_stage() if keyword == "COPY"] == [
        "--from=build /opt/mooncake-operator /opt/mooncake-operator"
    ]
