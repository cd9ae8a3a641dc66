"""Operator upgrades do not roll replicas unless announced: every example's replica pod template, as this
tree renders it, equals what the previous release rendered for the same resource, except at the paths
CHANGELOG.md's current section announces as rolling (a bullet starting "Replica pods roll" that names
each changed path of the pod template in backticks; a path covers everything below it).

The previous release's templates are a committed snapshot (tests/unit/golden/previous-release/), so the
check needs no git history. Where the history is there, a second test renders the snapshot's inputs with
the previous release's own code (`git archive PREVIOUS_RELEASE`) and checks the snapshot against it.
Regenerate the snapshot (after moving PREVIOUS_RELEASE to a new release's commit) with:

    MOONCAKE_OPERATOR_UPDATE_PREVIOUS_RELEASE=1 \
        .venv/bin/python -m pytest tests/unit/test_template_stability.py
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.replicas import replica_stateful_set

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# 0.1.0: the last commit before 0.2.0's first change (9d72d0a, issue 24, which opened CHANGELOG.md).
PREVIOUS_RELEASE = "535068849ea25bb6530299f311a719ce79011a16"
SNAPSHOT = Path(__file__).parent / "golden" / "previous-release"
UPDATE = os.environ.get("MOONCAKE_OPERATOR_UPDATE_PREVIOUS_RELEASE") == "1"
ANNOUNCEMENT = "Replica pods roll"


def template_paths(old: Any, new: Any, path: str = "") -> Iterator[str]:
    """Where two pod templates differ: mappings by key, lists of named items (containers, volumes, env,
    mounts) by name as `[name]`, anything else as a whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            yield from template_paths(old.get(key), new.get(key), f"{path}.{key}" if path else key)
    elif _named(old) and _named(new):
        before = {item["name"]: item for item in old}
        after = {item["name"]: item for item in new}
        for name in sorted(set(before) | set(after)):
            yield from template_paths(before.get(name), after.get(name), f"{path}[{name}]")
    elif old != new:
        yield path


def _named(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def announced_paths(changelog: str) -> list[str]:
    """The paths in backticks of the current section's bullets that announce a rolling change."""
    current = re.split(r"^## ", changelog, flags=re.MULTILINE)[1]
    bullets = re.split(r"^- ", current, flags=re.MULTILINE)
    return [
        path
        for bullet in bullets
        if bullet.startswith(ANNOUNCEMENT)
        for path in re.findall(r"`([^`\s]+)`", bullet)
        if path.startswith(("spec", "metadata"))
    ]


def unannounced(changed: list[str], announced: list[str]) -> list[str]:
    return [
        path
        for path in changed
        if not any(path == prefix or path.startswith((prefix + ".", prefix + "[")) for prefix in announced)
    ]


def current_template(resource_body: dict[str, Any]) -> dict[str, Any]:
    resource = parse_resource(resource_body)
    return replica_stateful_set(resource, owner_uid=None)["spec"]["template"]


def snapshots() -> list[Path]:
    return sorted(SNAPSHOT.glob("*.yaml"))


def test_every_example_has_a_previous_release_snapshot() -> None:
    """A new example gets its snapshot when the next release moves PREVIOUS_RELEASE; until then the
    examples the previous release shipped (or accepted) are all covered."""
    names = {path.name for path in snapshots()}
    assert names, "no snapshot of the previous release's templates: regenerate it (module docstring)"
    assert {"minimax-m2.5-eagle3.yaml", "quickstart.yaml"} <= names


@pytest.mark.parametrize("snapshot", snapshots(), ids=lambda path: path.name)
def test_the_replica_template_changes_only_where_the_changelog_says_it_rolls(snapshot: Path) -> None:
    recorded = yaml.safe_load(snapshot.read_text(encoding="utf-8"))
    changed = list(template_paths(recorded["template"], current_template(recorded["input"])))
    missing = unannounced(changed, announced_paths((REPO / "CHANGELOG.md").read_text(encoding="utf-8")))
    assert not missing, (
        f"{snapshot.name}: the replica pod template differs from release {recorded['release'][:12]}'s at "
        f"{missing}: an operator upgrade would roll every replica. Render it as before, or announce it in "
        f"CHANGELOG.md's current section, in a bullet starting '{ANNOUNCEMENT}' naming each path in backticks"
    )


def test_the_announcement_check_catches_a_change() -> None:
    """The check itself: a changed image is not covered by an announcement of other paths."""
    changed = list(
        template_paths(
            {"spec": {"containers": [{"name": "vllm", "image": "a", "env": [{"name": "X", "value": "1"}]}]}},
            {"spec": {"containers": [{"name": "vllm", "image": "b", "env": [{"name": "X", "value": "2"}]}]}},
        )
    )
    assert changed == ["spec.containers[vllm].env[X].value", "spec.containers[vllm].image"]
    assert unannounced(changed, ["spec.containers[vllm].env"]) == ["spec.containers[vllm].image"]
    changelog = (
        "# C\n\n## 1.0 (unreleased)\n\n- Replica pods roll once: `spec.containers[vllm].image`.\n\n## 0.9\n"
    )
    assert announced_paths(changelog) == ["spec.containers[vllm].image"]


def _history_has(ref: str) -> bool:
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{ref}^{{commit}}"], capture_output=True, check=False
    )
    return found.returncode == 0


def _previous_release_render(tree: Path, body: dict[str, Any]) -> dict[str, Any]:
    """The replica pod template the previous release's own `render -f` prints for `body`."""
    source = tree / "input.yaml"
    source.write_text(yaml.safe_dump(body), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tree / "operator")}
    printed = subprocess.run(
        [sys.executable, "-m", "mooncake_operator", "render", "-f", str(source)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for document in yaml.safe_load_all(printed):
        labels = ((document or {}).get("metadata") or {}).get("labels") or {}
        if document["kind"] == "StatefulSet" and labels.get("app.kubernetes.io/component") == "engine":
            return dict(document["spec"]["template"])
    raise AssertionError("the previous release rendered no replica StatefulSet")


def _inputs(tree: Path) -> dict[str, dict[str, Any]]:
    """Each example the previous release accepts, by file name: this tree's, else that release's own
    version of it (a user of that release has that one)."""
    found = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for candidate in (path, tree / "examples" / path.name):
            if not candidate.exists():
                continue
            body = yaml.safe_load(candidate.read_text(encoding="utf-8"))
            try:
                _previous_release_render(tree, body)
            except subprocess.CalledProcessError:
                continue
            found[path.name] = body
            break
    return found


def test_the_snapshot_is_what_the_previous_release_renders(tmp_path: Path) -> None:
    if not _history_has(PREVIOUS_RELEASE):
        pytest.skip(
            f"this checkout lacks commit {PREVIOUS_RELEASE[:12]}: the committed snapshot is checked alone"
        )
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "operator", "examples"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    inputs = _inputs(tmp_path)
    if UPDATE:
        SNAPSHOT.mkdir(parents=True, exist_ok=True)
        for stale in snapshots():
            stale.unlink()
        for name, body in inputs.items():
            recorded = {
                "release": PREVIOUS_RELEASE,
                "input": body,
                "template": _previous_release_render(tmp_path, body),
            }
            (SNAPSHOT / name).write_text(
                yaml.safe_dump(recorded, sort_keys=False, width=120), encoding="utf-8"
            )
    assert sorted(inputs) == [path.name for path in snapshots()]
    for name, body in inputs.items():
        recorded = yaml.safe_load((SNAPSHOT / name).read_text(encoding="utf-8"))
        assert recorded["release"] == PREVIOUS_RELEASE, f"{name}: snapshot of another release; regenerate it"
        assert recorded["input"] == body, f"{name}: the snapshot's input is not the example; regenerate it"
        assert recorded["template"] == _previous_release_render(tmp_path, body), name


def test_nothing_of_the_operators_version_enters_the_replica_pod_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator's version labels the objects it creates, never their pod templates: a template that
    carried it would roll every replica on every operator upgrade."""
    from mooncake_operator.build import names

    body = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text(encoding="utf-8"))
    before = replica_stateful_set(parse_resource(body), owner_uid=None)
    monkeypatch.setattr(names, "__version__", "9.9.9")
    after = replica_stateful_set(parse_resource(body), owner_uid=None)
    assert after["metadata"]["labels"]["app.kubernetes.io/version"] == "9.9.9"  # the patch took
    assert after["spec"]["template"] == before["spec"]["template"]
    assert "9.9.9" not in yaml.safe_dump(after["spec"]["template"])
