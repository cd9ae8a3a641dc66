"""Run `mooncake-operator sandbox ... --json` as a user does and read its outcome (the e2e tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_sandbox_json(*args: str, timeout_s: float = 1100) -> tuple[int, dict[str, Any], str]:
    """(exit code, the JSON outcome, stderr); no JSON on stdout fails with the command's stderr."""
    command = [sys.executable, "-m", "mooncake_operator", "sandbox", *args, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    try:
        outcome = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(
            f"no JSON outcome (exit {result.returncode}):\n{result.stderr[-4000:]}"
        ) from None
    return result.returncode, outcome, result.stderr
