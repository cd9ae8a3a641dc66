"""`mooncake-operator` command line: one subcommand per module in `mooncake_operator.cli`.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func=<callable(args) -> int>`. Only the module of the command being run is imported (the others are
listed from COMMANDS): importing them all cost 1.5 s of CPU before any command started.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mooncake_operator import __version__, exit_codes
from mooncake_operator.cli.parser import VerdictCommandParser

# name -> the one-line help `mooncake-operator --help` shows (each module's add_parser says the same;
# a unit test keeps them equal).
COMMANDS: dict[str, str] = {
    "run": "run the operator (kopf)",
    "render": "print the Kubernetes manifests a MooncakeServing becomes (for review and GitOps)",
    "crd": "generate the MooncakeServing CustomResourceDefinition from the API models",
    "canary": "prove that answers from prefixes loaded from the store equal cold answers",
    "sandbox": "run the reference deployment on real CPU engines here and prove it with the canary",
}
COMMAND_MODULES = tuple(COMMANDS)


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv (the first word that is not an option), if it is one of ours."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the named command's module is imported (all without it)."""
    parser = VerdictCommandParser(
        prog="mooncake-operator",
        description=(
            "Deploy vLLM replicas that share a Mooncake KV store, with the Eagle load_mask fix, and prove\n"
            "with a warm/cold canary that externally loaded prefixes give the same answers."
        ),
        epilog=exit_codes.TABLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=VerdictCommandParser
    )
    chosen = _chosen(argv) if argv is not None else None
    for name, summary in COMMANDS.items():
        if argv is not None and name != chosen:
            subparsers.add_parser(name, help=summary)  # listed only: its module is not imported
            continue
        module = importlib.import_module(f"mooncake_operator.cli.{name}")
        module.register(subparsers)
        command = subparsers.choices[name]
        if "exit status" not in (command.epilog or ""):
            command.epilog = ((command.epilog or "") + "\n\n" + exit_codes.TABLE).lstrip()
            command.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
