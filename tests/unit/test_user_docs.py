"""The user docs keep up with the code: docs/troubleshooting.md documents every condition reason and every
event the operator posts (with the type the code gives it), and every relative link in the docs resolves,
anchors included."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from tests.support.chart import REPO_ROOT

from mooncake_operator.api.status import Phase
from mooncake_operator.reconcile.decide.conditions import Reason
from mooncake_operator.reconcile.decide.status import event_type

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "operator" / "mooncake_operator"
TROUBLESHOOTING = REPO_ROOT / "docs" / "troubleshooting.md"


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert found, f"{TROUBLESHOOTING.name} has no '## {heading}' section"
    return found.group(1)


def table_rows(body: str) -> dict[str, list[str]]:
    """First-column code name -> the other cells, for the rows of the tables in `body`."""
    rows = {}
    for line in body.splitlines():
        row = re.match(r"^\| `(\w+)` \|(.*)\|$", line)
        if row:
            rows[row.group(1)] = [cell.strip() for cell in row.group(2).split("|")]
    return rows


def posted_events(package: Path) -> list[tuple[str, str, str]]:
    """(file, reason, type) of every `create_event(...)` call, and every event the planner orders
    (`PostEvent(...)`), whose reason and type are literals."""
    events = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if called not in ("create_event", "PostEvent"):
                continue
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            reason, type_ = keywords.get("reason"), keywords.get("type")
            if isinstance(reason, ast.Constant) and isinstance(type_, ast.Constant):
                events.append((path.name, str(reason.value), str(type_.value)))
    return events


def test_every_condition_reason_has_a_section() -> None:
    body = section(TROUBLESHOOTING.read_text(encoding="utf-8"), "Condition reasons")
    documented = set(re.findall(r"^### `(\w+)`$", body, flags=re.MULTILINE))
    missing = sorted(reason.value for reason in Reason if reason.value not in documented)
    assert not missing, f"{TROUBLESHOOTING.name} does not explain the condition reasons {missing}"
    unknown = sorted(documented - {reason.value for reason in Reason})
    assert not unknown, f"{TROUBLESHOOTING.name} explains reasons the code no longer has: {unknown}"


def test_every_phase_is_listed_with_the_event_type_the_code_posts() -> None:
    rows = table_rows(section(TROUBLESHOOTING.read_text(encoding="utf-8"), "Phases"))
    # A reason that is a Warning in any phase says nothing about the phase: take one that is not.
    plain = Reason.READY.value
    expected = {phase: event_type(phase, plain) for phase in get_args(Phase)}
    assert {phase: cells[0] for phase, cells in rows.items()} == expected


def test_every_posted_event_is_in_the_events_table_with_its_type() -> None:
    rows = table_rows(section(TROUBLESHOOTING.read_text(encoding="utf-8"), "Events"))
    literal = posted_events(PACKAGE)
    assert literal, "no create_event call with a literal reason found: the scan is broken"
    for where, reason, type_ in literal:
        assert reason in rows, f"{where} posts the event {reason!r}, which {TROUBLESHOOTING.name} lacks"
        page_type = rows[reason][0]
        assert page_type == type_, f"{reason}: the code posts it as {type_}, the page says {page_type}"
    for reason, cells in rows.items():
        if reason in {member.value for member in Reason}:
            # A phase event: Warning whatever the phase when the reason itself is one.
            if event_type("Pending", reason) == "Warning":
                assert cells[0] == "Warning", f"{reason} is always posted as a Warning"
        else:
            assert reason in {event[1] for event in literal}, f"{reason}: the code posts no such event"


def test_the_event_scan_finds_a_new_warning(tmp_path: Path) -> None:
    (tmp_path / "fire.py").write_text(
        'async def f(kube, body):\n    await kube.create_event(body, reason="StoreOnFire", type="Warning")\n'
    )
    assert posted_events(tmp_path) == [("fire.py", "StoreOnFire", "Warning")]
    (tmp_path / "fire.py").write_text(
        'EVENT = PostEvent(reason="StoreOnFire", message="m", type="Warning")\n'
    )
    assert posted_events(tmp_path) == [("fire.py", "StoreOnFire", "Warning")]


# --- links -------------------------------------------------------------------------------------------

DOCS = sorted([REPO_ROOT / "README.md", *REPO_ROOT.glob("docs/**/*.md"), REPO_ROOT / "bench" / "RESULTS.md"])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6} (.+?)#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert not broken_links(path), f"{path.relative_to(REPO_ROOT)}: broken links {broken_links(path)}"


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## The `spec.x` field (off by default)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-specx-field-off-by-default) [gone](missing.md) [bad](other.md#nope)\n"
        "[self](#here) `[in code](nowhere.md)`\n\n## Here\n\n```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nope (no heading with that anchor)"]


# --- the install path says one thing everywhere --------------------------------------------------------

INSTALL_PATH = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "docs" / "quickstart.md",
    REPO_ROOT / "docs" / "install.md",
    REPO_ROOT / "charts" / "mooncake-operator" / "templates" / "NOTES.txt",
]


def test_the_install_path_waits_as_long_everywhere() -> None:
    timeouts = {
        path.name: re.findall(r"kubectl wait --for=condition=Ready \S+ --timeout=(\S+)", path.read_text())
        for path in INSTALL_PATH
    }
    assert all(len(found) == 1 for found in timeouts.values()), timeouts
    assert len({found[0] for found in timeouts.values()}) == 1, f"different waits: {timeouts}"


def test_the_operator_image_has_one_name() -> None:
    """$REGISTRY/operator, as the chart's default repository and scripts/build-images name it."""
    values = (REPO_ROOT / "charts" / "mooncake-operator" / "values.yaml").read_text()
    repository = re.search(r"^image:\n  repository: (\S+)$", values, flags=re.MULTILINE)
    assert repository and repository.group(1).endswith("/operator"), "the chart's default image moved"
    assert '"$REPO/operator:' in (REPO_ROOT / "scripts" / "build-images").read_text()
    for path in [*INSTALL_PATH, REPO_ROOT / "images" / "operator" / "Dockerfile"]:
        text = path.read_text()
        named = set(re.findall(r"\$?REGISTRY/([\w.-]+)", text))
        assert named <= {"operator", "vllm-mooncake"}, f"{path.name} names images {named}"
        if "docker build -f images/operator/Dockerfile" in text:
            assert "-t $REGISTRY/operator:" in text, f"{path.name} names the operator image otherwise"


# --- user docs, not lab notes ----------------------------------------------------------------------------

USER_DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# Dates of runs, run names, "these machines", open observations (as the repository's before-stop hook
# looks for them), and the customer as the docs' subject: they belong in bench/RESULTS.md or docs/design.
LAB_NOTE = re.compile(
    r"measured on [0-9]+ [A-Z][a-z]+|run B[0-9]|[Oo]pen observation|these machines|[0-9]{1,2} December"
    r"|20[0-9]{2}-[01][0-9]-[0-3][0-9]|the customer's",
    flags=re.IGNORECASE,
)


def lab_notes(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if LAB_NOTE.search(line)]


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_user_docs_carry_no_lab_notes(path: Path) -> None:
    found = lab_notes(path.read_text(encoding="utf-8"))
    assert not found, f"{path.name}: move to bench/RESULTS.md or docs/design: {found}"


def test_the_lab_note_check_finds_a_dated_run() -> None:
    assert lab_notes("fine\nmeasured on 1 December in run B5\nThe customer's request\n") == [
        "measured on 1 December in run B5",
        "The customer's request",
    ]


def test_the_design_notes_are_linked_once_from_the_readmes_contributing_section() -> None:
    design_link = re.compile(r"\]\([^)]*design/")
    linking = {
        path.name: len(found)
        for path in USER_DOCS
        if (found := design_link.findall(path.read_text(encoding="utf-8")))
    }
    assert linking == {"README.md": 1}, linking
    contributing = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split("\n## Contributing\n", 1)
    assert len(contributing) == 2 and design_link.search(contributing[1]), "linked outside ## Contributing"


# --- the doc tree: one path for a user, every page on it --------------------------------------------------

DOCS_DIR = REPO_ROOT / "docs"
DOCS_INDEX = DOCS_DIR / "README.md"
QUICKSTART = DOCS_DIR / "quickstart.md"
DESIGN_INDEX = DOCS_DIR / "design" / "README.md"


def linked_files(path: Path) -> set[Path]:
    """The local files `path` links to (anchors dropped)."""
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            found.add((path.parent / target.partition("#")[0]).resolve())
    return found


def test_the_docs_index_links_every_user_page() -> None:
    pages = {path.resolve() for path in DOCS_DIR.glob("*.md")} - {DOCS_INDEX.resolve()}
    missing = sorted(path.name for path in pages - linked_files(DOCS_INDEX))
    assert not missing, f"docs/README.md does not link {missing}"


def test_the_design_index_links_every_note() -> None:
    notes = {path.resolve() for path in (DOCS_DIR / "design").glob("*.md")} - {DESIGN_INDEX.resolve()}
    missing = sorted(path.name for path in notes - linked_files(DESIGN_INDEX))
    assert not missing, f"docs/design/README.md does not link {missing}"


def test_the_readme_opens_with_the_product_then_install_then_the_two_commands() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", readme, flags=re.MULTILINE)
    assert headings[:2] == ["Install", "Develop"], headings
    opening = readme.split("\n## ", 1)[0]
    assert "scripts/" not in opening, "the opening says what the product does, not how to develop it"
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "helm install" in install and "docs/quickstart.md" in install and "docs/README.md" in install
    develop = readme.split("\n## Develop\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(scripts/\w+)", develop.split("```sh\n", 1)[1].split("```", 1)[0], re.MULTILINE)
    assert commands == ["scripts/sandbox", "scripts/test"], commands
    assert {DOCS_INDEX.resolve(), QUICKSTART.resolve()} <= linked_files(REPO_ROOT / "README.md")


def test_the_quickstart_goes_from_an_empty_cluster_to_a_first_answer() -> None:
    text = QUICKSTART.read_text(encoding="utf-8")
    steps = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert steps[:7] == [
        "0. What the cluster needs",
        "1. Build and push the images",
        "2. Install the operator",
        "3. Install the CLI",
        "4. Create your first MooncakeServing",
        "5. Wait for Ready, and what it means",
        "6. Send your first request",
    ], steps
    assert (DOCS_DIR / "prerequisites.md").resolve() in linked_files(QUICKSTART)
    assert "tolerations" in text and "untolerated taint" in text, "tainted GPU nodes"
    for needed in (
        "helm install mooncake-operator charts/mooncake-operator",
        "pip install .",
        "kubectl apply -f examples/quickstart.yaml",
        "kubectl wait --for=condition=Ready mcs/quickstart",
        "**`Ready` means**",
        "kubectl port-forward svc/quickstart 8000:8000",
        "http://quickstart.default.svc:8000/v1/chat/completions",
        "kind: HTTPRoute",
    ):
        assert needed in text, needed


def quickstart_example() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "quickstart.yaml").read_text())
    return document


def test_the_quickstarts_request_names_its_example() -> None:
    """The first request asks for the model the example serves, at the Service the example creates."""
    text = QUICKSTART.read_text(encoding="utf-8")
    example = quickstart_example()
    bodies = [json.loads(body) for body in re.findall(r"-d '(\{.*?\})'", text)]
    assert len(bodies) == 2 and all(body["model"] == example["spec"]["model"]["name"] for body in bodies)
    assert f"svc/{example['metadata']['name']} " in text
    assert f"mcs/{example['metadata']['name']} " in text
    notes = (REPO_ROOT / "charts" / "mooncake-operator" / "templates" / "NOTES.txt").read_text()
    assert f'"model": "{example["spec"]["model"]["name"]}"' in notes, "the chart's NOTES send another model"
    assert f"svc/{example['metadata']['name']} " in notes


def test_every_example_renders(capsys: pytest.CaptureFixture[str]) -> None:
    from mooncake_operator.cli.main import main

    examples = sorted((REPO_ROOT / "examples").glob("*.yaml"))
    assert (REPO_ROOT / "examples" / "quickstart.yaml") in examples
    for example in examples:
        assert main(["render", "-f", str(example)]) == 0, f"{example.name}: {capsys.readouterr().err}"
        assert "kind: StatefulSet" in capsys.readouterr().out, example.name


# Words from the project's origin that mean nothing to a user (code spans, e.g. a file name, excepted).
ORIGIN_WORDS = re.compile(r"\bcustomers?\b", flags=re.IGNORECASE)
USER_FACING = [*USER_DOCS, *sorted((REPO_ROOT / "examples").glob("*.yaml"))]


@pytest.mark.parametrize("path", USER_FACING, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_user_facing_text_speaks_of_the_reference_deployment_not_the_customer(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".md":
        lines = prose_lines("\n".join(lines))
    found = [line.strip() for line in lines if ORIGIN_WORDS.search(re.sub(r"`[^`]*`", "", line))]
    assert not found, f"{path.name}: say 'the reference deployment' (or the user): {found}"


@pytest.mark.parametrize("command", [None, "run", "render", "crd", "canary", "sandbox"])
def test_cli_help_speaks_of_the_reference_deployment_not_the_customer(
    command: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    from mooncake_operator.cli.main import main

    with pytest.raises(SystemExit):
        main([command, "--help"] if command else ["--help"])
    shown = capsys.readouterr().out
    assert "usage:" in shown
    found = [line.strip() for line in shown.splitlines() if ORIGIN_WORDS.search(line)]
    assert not found, f"mooncake-operator {command or ''} --help: say 'the reference deployment': {found}"


def test_crd_descriptions_and_chart_values_speak_of_the_reference_deployment_not_the_customer() -> None:
    from mooncake_operator.api.crd import crd_yaml

    for name, text in (
        ("the CRD", crd_yaml()),
        ("values.yaml", (REPO_ROOT / "charts" / "mooncake-operator" / "values.yaml").read_text("utf-8")),
    ):
        found = [line.strip() for line in text.splitlines() if ORIGIN_WORDS.search(line)]
        assert not found, f"{name}: say 'the reference deployment': {found}"


def chart_value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of the chart's values; a map of free-form keys (labels, resources) is one value."""
    paths = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        free_form = key in {"labels", "annotations", "resources", "requests", "limits"} or not value
        if (
            isinstance(value, dict)
            and not free_form
            and path not in {"podSecurityContext", "securityContext"}
        ):
            paths |= chart_value_paths(value, f"{path}.")
        else:
            paths.add(path)
    return paths


def documented_chart_values(text: str) -> set[str]:
    """The install guide's chart-values table: `a.b`, `.c` (a sibling of the previous), `x.*` (all of x)."""
    table = text.split("\n## Chart values\n", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        parent = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            full = parent + name[1:] if name.startswith(".") else name
            parent = full.rsplit(".", 1)[0] + "." if "." in full else ""
            documented.add(full)
    return documented


def test_every_chart_value_is_in_the_install_guide() -> None:
    values = yaml.safe_load((REPO_ROOT / "charts" / "mooncake-operator" / "values.yaml").read_text())
    documented = documented_chart_values((DOCS_DIR / "install.md").read_text(encoding="utf-8"))
    wildcards = {name[:-2] for name in documented if name.endswith(".*")}
    missing = sorted(
        path
        for path in chart_value_paths(values)
        if path not in documented and not any(path.startswith(prefix + ".") for prefix in wildcards)
    )
    assert not missing, f"docs/install.md's chart values table lacks {missing}"


def test_upgrades_are_never_told_to_reuse_the_previous_charts_defaults() -> None:
    """`helm upgrade --reuse-values` keeps the previous chart's defaults too: a value the new chart added
    is then missing (0.1.0 -> 0.2.0: `nil pointer evaluating interface {}.prometheusRule`)."""
    places = [*USER_DOCS, REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "charts").rglob("*.txt"))]
    places.append(REPO_ROOT / "charts" / "mooncake-operator" / "values.yaml")
    for path in places:
        for line in path.read_text(encoding="utf-8").splitlines():
            if "helm upgrade" in line:
                assert not re.search(r"--reuse-values\b", line), f"{path.name}: {line.strip()}"
