"""`mooncake-operator sandbox`: a command the mooncake-sandbox distribution plugs in.

The sandbox (real CPU engines, tiny models generated with torch, the test tiers' network namespace) is a
distribution of its own, `sandbox/` in the repository, so that the operator's wheel and image carry none
of it. It registers its command in the entry point group `mooncake_operator.commands` (its pyproject.toml);
this module finds it there, so nothing here imports the sandbox by name. The command keeps its name and its
exit codes; without the distribution it says what to install.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from mooncake_operator import exit_codes
from mooncake_operator.cli.parser import VerdictCommandParser

ENTRY_POINT_GROUP = "mooncake_operator.commands"
SUMMARY = "run the reference deployment on real CPU engines here and prove it with the canary"
DISTRIBUTION = "mooncake-sandbox"
MISSING = (
    f"the sandbox is not installed: it is the {DISTRIBUTION} distribution, the folder sandbox/ of the "
    "mooncake-operator repository (scripts/bootstrap installs it; or `pip install -e . -e sandbox/` from a "
    "checkout). The operator's image does not carry it."
)


def plugged_in(name: str) -> Callable[[Any], None] | None:
    """The `register(subparsers)` a distribution declares for command `name`, or None when none does (or
    the declaring distribution's package is gone, as an uninstalled editable checkout leaves it)."""
    for entry_point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            register: Callable[[Any], None] = entry_point.load()
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] != entry_point.module.split(".")[0]:
                raise
            return None
        return register
    return None


def register(subparsers: Any) -> None:
    command = plugged_in("sandbox")
    if command is None:
        parser = subparsers.add_parser(
            "sandbox", help=SUMMARY, description=f"{SUMMARY}.\n\n{textwrap.fill(MISSING, 100)}"
        )
        parser.__class__ = _NotInstalled
        return
    command(subparsers)


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
