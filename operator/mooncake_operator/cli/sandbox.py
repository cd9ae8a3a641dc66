"""`mooncake-operator sandbox`: handed to the mooncake-sandbox distribution when it is installed.

The sandbox (real CPU engines, tiny models generated with torch, the test tiers' network namespace) is a
distribution of its own, `sandbox/` in the repository, so that the operator's wheel and image carry none
of it. The command keeps its name and its exit codes; without the distribution it says what to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from mooncake_operator import exit_codes
from mooncake_operator.cli.parser import VerdictCommandParser

SUMMARY = "run the customer's deployment on real CPU engines here and prove it with the canary"
DISTRIBUTION = "mooncake-sandbox"
MISSING = (
    f"the sandbox is not installed: it is the {DISTRIBUTION} distribution, the folder sandbox/ of the "
    "mooncake-operator repository (scripts/bootstrap installs it; or `pip install -e . -e sandbox/` from a "
    "checkout). The operator's image does not carry it."
)


def register(subparsers: Any) -> None:
    try:
        command = importlib.import_module("mooncake_sandbox.command")
    except ModuleNotFoundError as error:
        if error.name != "mooncake_sandbox":
            raise
        parser = subparsers.add_parser(
            "sandbox", help=SUMMARY, description=f"{SUMMARY}.\n\n{textwrap.fill(MISSING, 100)}"
        )
        parser.__class__ = _NotInstalled
        return
    command.register(subparsers)


class _NotInstalled(VerdictCommandParser):
    """Accepts any arguments (the sandbox's own are unknown here): --help explains, anything else exits 3."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        if "-h" in words or "--help" in words:
            self.print_help()
            self.exit(exit_codes.SUCCESS)
        result = namespace if namespace is not None else argparse.Namespace()
        result.func = _not_installed
        return result, []


def _not_installed(args: argparse.Namespace) -> int:
    print(f"mooncake-operator sandbox: {MISSING}", file=sys.stderr)
    return exit_codes.USAGE
