"""Start-up progress on stderr: one rewritten status line on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO


class Progress:
    """Reports phases and the state of each server while the sandbox waits for it."""

    def __init__(self, stream: TextIO | None = None, *, heartbeat_s: float = 15.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty()
        self.heartbeat_s = heartbeat_s
        self._last_states: dict[str, str] = {}
        self._last_line_at = 0.0
        self._line_open = False

    def phase(self, message: str) -> None:
        self._close_line()
        self.stream.write(f"sandbox: {message}\n")
        self.stream.flush()

    def states(self, states: Mapping[str, str], elapsed_s: float) -> None:
        line = f"[{elapsed_s:5.0f}s] " + " · ".join(f"{name}: {state}" for name, state in states.items())
        if self.is_tty:
            self.stream.write("\r\033[K" + line)
            self._line_open = True
        elif dict(states) != self._last_states or time.monotonic() - self._last_line_at >= self.heartbeat_s:
            self.stream.write(f"sandbox: {line}\n")
            self._last_line_at = time.monotonic()
        self._last_states = dict(states)
        self.stream.flush()

    def done(self) -> None:
        self._close_line()
        self._last_states = {}

    def _close_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False


class SilentProgress(Progress):
    """For library users that want no output (tests with their own reporting)."""

    def phase(self, message: str) -> None:
        return

    def states(self, states: Mapping[str, str], elapsed_s: float) -> None:
        return

    def done(self) -> None:
        return
