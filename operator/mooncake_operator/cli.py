"""`mooncake-operator` command line: one subcommand per module in `mooncake_operator.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func=<callable(args) -> int>`. Keeping each command in its own module keeps this file a table.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mooncake_operator import __version__

COMMAND_MODULES = ("run", "render", "crd", "canary", "sandbox")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-operator",
        description=(
            "Deploy vLLM replicas that share a Mooncake KV store, with the Eagle load_mask fix, "
            "and prove with a warm/cold canary that externally loaded prefixes give the same answers."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"mooncake_operator.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
