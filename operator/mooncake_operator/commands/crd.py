"""`mooncake-operator crd`: write (or print) the MooncakeServing CRD generated from the API models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mooncake_operator.crd import crd_yaml, write_crd


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "crd",
        help="generate the MooncakeServing CustomResourceDefinition from the API models",
        description="Write the CRD as serving.mooncake-operator.dev_mooncakeservings.yaml into the "
        "directory --output (the repository's copy: --output crds), or print it to stdout without --output.",
    )
    parser.add_argument("--output", "-o", type=Path, metavar="DIR", help="directory to write the CRD into")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.output is None:
        sys.stdout.write(crd_yaml())
        return 0
    path = write_crd(args.output)
    print(f"wrote {path}", file=sys.stderr)
    return 0
