"""`mooncake-operator render -f FILE`: print a MooncakeServing's child manifests as a YAML stream.

Imports its dependencies when it runs (the CLI lists every command without importing it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mooncake_operator import exit_codes
from mooncake_operator.cli.parser import add_allow_flags

# The render module (pydantic models) is imported only when the command runs; its defaults are repeated
# here for --help, and a unit test keeps the two equal.
DEFAULT_OPERATOR_NAMESPACE = "mooncake-system"
REPLICA_INGRESS_DEFAULTS = ("anyone", "listed-clients")
OUTPUT_FORMATS = ("yaml", "json")

if TYPE_CHECKING:
    from mooncake_operator.api.resource import MooncakeServing

DESCRIPTION = """\
Validate MooncakeServing resources and print every child object as a YAML stream (-o json: one JSON
v1 List, as kubectl prints). Nothing is printed unless every resource in FILE is valid (exit 3
otherwise). A resource is valid here exactly when the operator would reconcile it: the same checks,
the same messages, and the node-level options (store.rdma.hostDevices, store.rdma.hostNetwork) refused
unless allowed with the same --allow-* switches as `run`.

-n/--namespace works as with kubectl apply: it sets the namespace of resources that name none, and a
resource that names another namespace is an error."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "render",
        help="print the Kubernetes manifests a MooncakeServing becomes (for review and GitOps)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-f", "--filename", required=True, metavar="FILE", help="YAML file, or - for stdin")
    parser.add_argument(
        "-n",
        "--namespace",
        metavar="NAMESPACE",
        help="namespace of resources that name none (default: default)",
    )
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
    parser.add_argument(
        "--replica-ingress-default",
        choices=REPLICA_INGRESS_DEFAULTS,
        default="anyone",
        help="as `run --replica-ingress-default`: who may call the replicas' HTTP port when "
        "spec.networkPolicy.clients is unset (default: anyone)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default="yaml",
        help="yaml: a stream of documents; json: one v1 List of them (default: yaml)",
    )
    add_allow_flags(parser)
    parser.set_defaults(func=_run)


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    return Path(filename).read_text(encoding="utf-8")


def load_resources(
    text: str,
    source: str,
    namespace: str | None = None,
    *,
    allow_privileged_engines: bool = False,
    allow_host_network: bool = False,
) -> list[MooncakeServing]:
    """Every MooncakeServing document in `text`, all validated as the operator validates them (with its
    --allow-* settings); raises ValueError naming each problem (a YAML error as source:line:column).

    `namespace` is given to documents without one; a document in another namespace is a problem."""
    import yaml

    from mooncake_operator import safe_yaml
    from mooncake_operator.api.admission import refused_node_options
    from mooncake_operator.api.resource import InvalidResourceError, parse_resource

    try:
        documents = [doc for doc in safe_yaml.load_all(text, source) if doc is not None]
    except yaml.YAMLError as error:
        raise ValueError(safe_yaml.describe_error(error, source)) from None
    if not documents:
        raise ValueError(f"{source}: no MooncakeServing found (the file is empty)")
    resources, problems = [], []
    for index, document in enumerate(documents, start=1):
        where = f"{source} (document {index})" if len(documents) > 1 else source
        if not isinstance(document, dict):
            problems.append(f"{where}: expected a MooncakeServing mapping, found {type(document).__name__}")
            continue
        if namespace is not None:
            metadata = document.get("metadata")
            if isinstance(metadata, dict):
                named = metadata.get("namespace")
                if named is not None and named != namespace:
                    problems.append(
                        f"{where}: metadata.namespace is {named!r} but -n says {namespace!r} "
                        "(remove one, or make them agree)"
                    )
                    continue
                document = {**document, "metadata": {**metadata, "namespace": namespace}}
        try:
            resource = parse_resource(document)
        except InvalidResourceError as error:
            problems += [f"{where}: {problem}" for problem in error.problems]
            continue
        refused = refused_node_options(
            resource.spec,
            allow_privileged_engines=allow_privileged_engines,
            allow_host_network=allow_host_network,
        )
        problems += [f"{where}: {problem}" for problem in refused]
        resources.append(resource)
    if problems:
        raise ValueError("invalid MooncakeServing:\n" + "\n".join(f"  - {p}" for p in problems))
    return resources


def _run(args: argparse.Namespace) -> int:
    import json

    import yaml

    from mooncake_operator.build.manifests import render_all, to_yaml_stream
    from mooncake_operator.build.names import Manifest

    source = "<stdin>" if args.filename == "-" else args.filename
    try:
        resources = load_resources(
            _read(args.filename),
            source,
            args.namespace,
            allow_privileged_engines=args.allow_privileged_engines,
            allow_host_network=args.allow_host_network,
        )
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as error:
        print(f"mooncake-operator render: {error}", file=sys.stderr)
        return exit_codes.USAGE
    manifests: list[Manifest] = []
    for resource in resources:
        manifests += render_all(
            resource,
            owner_uid=args.owner_uid,
            operator_namespace=args.operator_namespace,
            open_http_by_default=args.replica_ingress_default == "anyone",
        )
    if args.output == "json":
        listed = {"apiVersion": "v1", "kind": "List", "items": manifests}
        sys.stdout.write(json.dumps(listed, indent=2) + "\n")
    else:
        sys.stdout.write(to_yaml_stream(manifests))
    return exit_codes.SUCCESS
