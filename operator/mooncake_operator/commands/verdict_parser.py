"""The argument parser of the commands whose exit status is a verdict (`canary`, `sandbox`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from mooncake_operator.canary.models import ExitCode


class VerdictCommandParser(argparse.ArgumentParser):
    """Usage errors exit 3 (ExitCode.USAGE_OR_ENVIRONMENT): argparse's usual 2 means Inconclusive here."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(ExitCode.USAGE_OR_ENVIRONMENT, f"{self.prog}: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # Unknown arguments would otherwise reach the top-level parser, which exits 2.
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras
