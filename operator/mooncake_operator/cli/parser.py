"""The argument parser of every command: usage errors exit 3 (exit_codes.USAGE), never argparse's 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from mooncake_operator import exit_codes


def add_allow_flags(parser: argparse.ArgumentParser) -> None:
    """`--allow-privileged-engines` and `--allow-host-network`, the same for `run` and `render`: what the
    operator refuses without them (api/admission.py), `render` refuses too."""
    parser.add_argument(
        "--allow-privileged-engines",
        action="store_true",
        help="allow store.rdma.hostDevices (a privileged replica container); without it such a resource "
        "is Invalid and nothing is applied",
    )
    parser.add_argument(
        "--allow-host-network",
        action="store_true",
        help="allow store.rdma.hostNetwork (replicas on the node's network); without it such a resource "
        "is Invalid and nothing is applied",
    )


class VerdictCommandParser(argparse.ArgumentParser):
    """Usage errors exit 3 (exit_codes.USAGE): argparse's usual 2 means Inconclusive for canary/sandbox."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # Unknown arguments would otherwise reach the top-level parser, which exits 2.
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras
