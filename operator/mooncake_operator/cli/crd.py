"""`mooncake-operator crd`: print (or write) the MooncakeServing CRD generated from the API models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mooncake_operator import exit_codes

FORMATS = ("yaml", "json")

DESCRIPTION = """\
Print the CRD to stdout (-o yaml, the default, or -o json), or write it as
serving.mooncake-operator.dev_mooncakeservings.yaml into a directory with --output-dir DIR (the
repository's copy: --output-dir crds)."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "crd",
        help="generate the MooncakeServing CustomResourceDefinition from the API models",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-o", "--output", choices=FORMATS, metavar="FORMAT", help="yaml (default) or json, printed to stdout"
    )
    parser.add_argument("--output-dir", type=Path, metavar="DIR", help="directory to write the CRD into")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from mooncake_operator.api.crd import crd_yaml, custom_resource_definition, write_crd

    directory: Path | None = args.output_dir
    output_format = args.output
    if directory is not None:
        if output_format is not None:
            print("mooncake-operator crd: give -o FORMAT or --output-dir DIR, not both", file=sys.stderr)
            return exit_codes.USAGE
        path = write_crd(directory)
        print(f"wrote {path}", file=sys.stderr)
        return exit_codes.SUCCESS
    if output_format == "json":
        sys.stdout.write(json.dumps(custom_resource_definition(), indent=2) + "\n")
    else:
        sys.stdout.write(crd_yaml())
    return exit_codes.SUCCESS
