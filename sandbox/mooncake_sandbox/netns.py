"""Run a command inside a fresh loopback-only network namespace.

`python -m mooncake_sandbox.netns -- CMD...` re-executes CMD under `unshare --net` with the
loopback interface up. Processes inside can reach only each other on 127.0.0.1, and vLLM's
Mooncake store clients (which listen on 0.0.0.0 whatever they are told) are invisible from
outside. Where namespaces are not permitted, CMD runs on the host network with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

_MARKER = "MOONCAKE_OPERATOR_NETNS"


def in_private_netns() -> bool:
    """True when this process was started by `exec_in_netns` (or inherits from one)."""
    return os.environ.get(_MARKER) == "1"


def namespaces_permitted() -> bool:
    """Whether `unshare --net` works here (root, or user namespaces allowed)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--net", "--", "ip", "link", "set", "lo", "up"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def exec_in_netns(argv: Sequence[str]) -> None:
    """Replace this process with `argv` inside a new loopback-only network namespace.

    Never returns. Falls back to plain exec (host network) with a warning.
    """
    if in_private_netns():
        os.execvp(argv[0], list(argv))
    if not namespaces_permitted():
        print(
            "warning: network namespaces are not permitted here; running on the host network "
            "(servers still bind 127.0.0.1, but vLLM's store client listens on 0.0.0.0)",
            file=sys.stderr,
        )
        os.execvp(argv[0], list(argv))
    script = 'ip link set lo up && exec "$@"'
    os.environ[_MARKER] = "1"
    os.execvp("unshare", ["unshare", "--net", "--", "sh", "-c", script, "netns", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m mooncake_sandbox.netns -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exec_in_netns(args)
    return 0  # unreachable: exec_in_netns never returns


if __name__ == "__main__":
    sys.exit(main())
