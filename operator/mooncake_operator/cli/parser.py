"""The argument parser of every command: usage errors exit 3 (exit_codes.USAGE), never argparse's 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from mooncake_operator import exit_codes


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
