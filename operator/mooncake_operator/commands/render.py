"""`mooncake-operator render -f FILE`: print a MooncakeServing's child manifests as a YAML stream."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from mooncake_operator import safe_yaml
from mooncake_operator.api import InvalidResourceError, MooncakeServing, parse_resource
from mooncake_operator.render import DEFAULT_OPERATOR_NAMESPACE, Manifest, render_all, to_yaml_stream

EXIT_INVALID = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "render",
        help="print the Kubernetes manifests a MooncakeServing becomes (for review and GitOps)",
        description="Validate MooncakeServing resources and print every child object as a YAML stream. "
        "Nothing is printed unless every resource in FILE is valid (exit 2 otherwise).",
    )
    parser.add_argument("-f", "--filename", required=True, metavar="FILE", help="YAML file, or - for stdin")
    parser.add_argument(
        "--owner-uid",
        metavar="UID",
        help="add owner references to this uid (the live resource's metadata.uid); "
        "without it there are none, since a reference to a uid that does not exist gets children deleted",
    )
    parser.add_argument(
        "--operator-namespace",
        default=DEFAULT_OPERATOR_NAMESPACE,
        metavar="NS",
        help="the namespace the operator runs in: the only one whose operator pods the NetworkPolicies admit "
        f"(default: {DEFAULT_OPERATOR_NAMESPACE}, where docs/install.md installs it)",
    )
    parser.set_defaults(func=_run)


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    return Path(filename).read_text(encoding="utf-8")


def load_resources(text: str, source: str) -> list[MooncakeServing]:
    """Every MooncakeServing document in `text`, all validated; raises ValueError naming each problem."""
    documents = [doc for doc in safe_yaml.load_all(text) if doc is not None]
    if not documents:
        raise ValueError(f"{source}: no MooncakeServing found (the file is empty)")
    resources, problems = [], []
    for index, document in enumerate(documents, start=1):
        where = f"{source} (document {index})" if len(documents) > 1 else source
        if not isinstance(document, dict):
            problems.append(f"{where}: expected a MooncakeServing mapping, found {type(document).__name__}")
            continue
        try:
            resources.append(parse_resource(document))
        except InvalidResourceError as error:
            problems += [f"{where}: {problem}" for problem in error.problems]
    if problems:
        raise ValueError("invalid MooncakeServing:\n" + "\n".join(f"  - {p}" for p in problems))
    return resources


def _run(args: argparse.Namespace) -> int:
    source = "<stdin>" if args.filename == "-" else args.filename
    try:
        resources = load_resources(_read(args.filename), source)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as error:
        print(f"mooncake-operator render: {error}", file=sys.stderr)
        return EXIT_INVALID
    manifests: list[Manifest] = []
    for resource in resources:
        manifests += render_all(
            resource, owner_uid=args.owner_uid, operator_namespace=args.operator_namespace
        )
    sys.stdout.write(to_yaml_stream(manifests))
    return 0
