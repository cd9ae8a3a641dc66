"""`mooncake-operator crd` (being built; see the issue that owns it)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("crd", help="(not available yet)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise SystemExit("mooncake-operator crd: not available in this build yet")
