"""Errors the sandbox raises; the CLI maps them to exit codes."""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error the sandbox reports to its user."""


class SandboxSetupError(SandboxError):
    """The sandbox could not be built or started (engine env, models, master, replicas): exit 3."""


class MasterDownError(SandboxSetupError):
    """The Mooncake master is not running: nothing the replicas do can be trusted."""


class ReplicaDiedError(SandboxError):
    """A replica process exited while the sandbox was using it: the run failed (exit 1)."""
