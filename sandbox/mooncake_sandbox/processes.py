"""Child processes the sandbox owns: one process group each, logs to files, reliable teardown.

Every server runs in its own process group (vLLM forks an engine-core process; killing the group
takes the whole tree), dies with the sandbox (PR_SET_PDEATHSIG, so even a SIGKILLed sandbox leaves
nothing behind), and is recorded in a module registry that an atexit hook empties.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIVE: set[ManagedProcess] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now (closed connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. Popen is always called from the main thread, so
    # the "parent" whose death triggers this is the sandbox process itself.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (read from /proc; zombies included)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may contain spaces) start after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def tree_rss_bytes(pgids: Iterable[int]) -> int:
    """Resident memory summed over every process in the given groups."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pgid in pgids:
        for pid in group_members(pgid):
            try:
                resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
            total += resident_pages * page
    return total


@dataclass(eq=False)
class ManagedProcess:
    """A server process started by the sandbox, in its own process group, logging to a file."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    popen: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def start(
        cls, name: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, cwd: Path
    ) -> ManagedProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        process = cls(name=name, argv=tuple(argv), log_path=log_path, popen=popen)
        _LIVE.add(process)
        return process

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        # start_new_session makes the child the leader of a group numbered by its pid.
        return self.popen.pid

    def exit_code(self) -> int | None:
        """None while running."""
        return self.popen.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(log {self.log_path} unreadable: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def signal_group(self, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def signal_leader(self, signum: signal.Signals) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def group_alive(self) -> bool:
        return bool(group_members(self.pgid))


def stop_processes(
    processes: Sequence[ManagedProcess], *, grace_s: float = 10.0, leaders_only: bool = False
) -> list[str]:
    """SIGTERM every group, SIGKILL what is left after `grace_s`, reap. Returns problems, if any.

    With `leaders_only`, SIGTERM goes to each group's leader alone, as the kubelet signals a container's
    PID 1: the server then stops its own children (vLLM drains and its workers close their store
    clients); SIGKILL still goes to the whole group, as at the end of a pod's grace period.
    Synchronous on purpose: teardown must not be interruptible by task cancellation.
    """
    for process in processes:
        if leaders_only:
            process.signal_leader(signal.SIGTERM)
        else:
            process.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_reap(p) for p in processes):
        if leaders_only:
            for process in processes:
                if process.exit_code() is not None:
                    # As the kernel ends a container whose PID 1 exited: the rest of it at once.
                    process.signal_group(signal.SIGKILL)
        time.sleep(0.1)
    for process in processes:
        if _reap(process):
            process.signal_group(signal.SIGKILL)
    problems = []
    kill_deadline = time.monotonic() + 5.0
    for process in processes:
        while _reap(process) and time.monotonic() < kill_deadline:
            time.sleep(0.05)
        if _reap(process):
            problems.append(f"{process.name} (process group {process.pgid}) survived SIGKILL")
        _LIVE.discard(process)
    return problems


def _reap(process: ManagedProcess) -> bool:
    """Collect the leader if it exited; True while any member of its group still exists."""
    process.popen.poll()
    return process.group_alive()


@atexit.register
def _kill_leftovers() -> None:
    stop_processes(list(_LIVE), grace_s=2.0)
