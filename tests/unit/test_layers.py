"""The package's floor plan, checked on the source: what each room may import.

Rooms, bottom to top (a module may import its own room and the rooms below it, never one above):

  leaves                exit_codes, safe_yaml: import nothing of ours
  canary                the warm/cold proof against any vLLM replicas (no Kubernetes, no API models)
  api                   the MooncakeServing models, no I/O (it uses the canary's own request and checks)
  canary.policy/status  the bridge from the API to the canary: a spec's run, a result's status evidence
  build                 pure builders: spec -> manifests
  kube                  the Kubernetes API client
  reconcile.decide      the reconcile's pure decisions
  runtime               the operator process's settings, Lease and metrics
  reconcile.act         the reconcile's I/O (reads the settings, updates the metrics)
  runtime.handlers      the kopf handlers that start the runtime and hand events to the workers
  cli                   the commands

And the pure rooms stay pure: nothing under reconcile/decide, api, build or canary reaches the Kubernetes
client or kopf, even through another module of ours; nothing under reconcile/decide, api or build imports
httpx itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import mooncake_operator

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(mooncake_operator.__file__).parent
ROOT = "mooncake_operator"

ORDER: tuple[tuple[str, ...], ...] = (
    (ROOT, f"{ROOT}.exit_codes", f"{ROOT}.safe_yaml"),
    (f"{ROOT}.canary",),
    (f"{ROOT}.api",),
    (f"{ROOT}.canary.policy", f"{ROOT}.canary.status"),
    (f"{ROOT}.build",),
    (f"{ROOT}.kube",),
    (f"{ROOT}.reconcile.decide",),
    (f"{ROOT}.runtime",),
    (f"{ROOT}.reconcile", f"{ROOT}.reconcile.act"),
    (f"{ROOT}.runtime.handlers",),
    (f"{ROOT}.cli", f"{ROOT}.__main__"),
)
PURE = (f"{ROOT}.reconcile.decide", f"{ROOT}.api", f"{ROOT}.build", f"{ROOT}.canary")
NO_HTTPX = (f"{ROOT}.reconcile.decide", f"{ROOT}.api", f"{ROOT}.build")


def modules(directory: Path = PACKAGE_DIR) -> dict[str, Path]:
    found = {}
    for path in sorted(directory.rglob("*.py")):
        parts = path.relative_to(directory.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every module `path` imports, anywhere in it (function-local and TYPE_CHECKING imports included),
    with its line: `from a import b` imports `a` and, where `a.b` is a module of ours, `a.b`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    yield f"{node.module}.{alias.name}", node.lineno


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def rank(name: str) -> int:
    """The room of module `name`: the entry of ORDER with the longest prefix of it."""
    best, length = -1, -1
    for index, room in enumerate(ORDER):
        for prefix in room:
            if within(name, (prefix,)) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best >= 0, f"{name} is in no room of ORDER: add it"
    return best


MODULES = modules()
GRAPH = {name: sorted(set(imported(path, set(MODULES)))) for name, path in MODULES.items()}


def closure(start: str) -> dict[str, list[str]]:
    """Every module reachable from `start` through imports, with the chain that reaches it."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        current = todo.pop()
        for target, _ in GRAPH.get(current, []):
            if target in chains:
                continue
            chains[target] = [*chains[current], target]
            if target in MODULES:
                todo.append(target)
    return chains


def test_the_scan_sees_the_package() -> None:
    assert f"{ROOT}.reconcile.decide.plan" in MODULES and f"{ROOT}.kube.client" in MODULES
    assert f"{ROOT}.kube.client" in {name for name, _ in GRAPH[f"{ROOT}.reconcile.act.core"]}


@pytest.mark.parametrize("module", sorted(name for name in MODULES if within(name, PURE)))
def test_the_pure_rooms_never_reach_the_kubernetes_client_or_kopf(module: str) -> None:
    for reached, chain in closure(module).items():
        forbidden = within(reached, (f"{ROOT}.kube", "kopf", "kubernetes"))
        assert not forbidden, f"{module} reaches {reached}: {' -> '.join(chain)}"


@pytest.mark.parametrize("module", sorted(name for name in MODULES if within(name, NO_HTTPX)))
def test_decide_api_and_build_never_import_httpx(module: str) -> None:
    lines = [line for name, line in GRAPH[module] if within(name, ("httpx",))]
    assert lines == [], f"{module} imports httpx (line {lines})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_goes_to_the_same_room_or_below(module: str) -> None:
    own = rank(module)
    upward = [
        f"{target} (line {line})"
        for target, line in GRAPH[module]
        if within(target, (ROOT,)) and rank(target) > own
    ]
    assert upward == [], f"{module} ({ORDER[own][0]}) imports a room above it: {upward}"


def module_level_graph() -> dict[str, set[str]]:
    """Imports executed when a module is imported (its top level; not functions, not TYPE_CHECKING)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
                targets.add(node.module)
                targets |= {
                    f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES
                }
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith(ROOT)}
        graph[name] = {target for target in targets if target in MODULES}
    return graph


def test_no_import_cycles() -> None:
    graph = module_level_graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The scan finds an upward import, a function-local one included."""
    package = tmp_path / ROOT
    (package / "api").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "api" / "__init__.py").write_text("")
    (package / "api" / "bad.py").write_text("def f():\n    from mooncake_operator.kube import client\n")
    (package / "kube").mkdir()
    (package / "kube" / "__init__.py").write_text("")
    (package / "kube" / "client.py").write_text("import httpx\n")
    found = modules(package)
    targets = {name for name, _ in imported(found[f"{ROOT}.api.bad"], set(found))}
    assert f"{ROOT}.kube.client" in targets
    assert rank(f"{ROOT}.kube.client") > rank(f"{ROOT}.api.bad")
