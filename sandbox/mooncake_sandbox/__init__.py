"""The sandbox: a real Mooncake master and real vLLM CPU replicas with tiny local models, on loopback.

Public API (used by `mooncake-operator sandbox`, the e2e tests and the operator's tests):

    prepared = prepare((EngineMode.PATCHED,), log=print)       # install/generate; may need the network
    async with start_sandbox(SandboxOptions(replicas=2)) as sb:  # start, always tear down
        sb.replica_urls, sb.master_address
        await sb.restart_replica(1, speculative=False, engine=EngineMode.BUGGY)
        await sb.guard(some_coroutine)                          # fails fast if a process dies
"""

from mooncake_sandbox.engines import EngineBuild, EngineMode
from mooncake_sandbox.errors import (
    MasterDownError,
    ReplicaDiedError,
    SandboxError,
    SandboxSetupError,
)
from mooncake_sandbox.progress import Progress, SilentProgress
from mooncake_sandbox.runtime import (
    Prepared,
    Replica,
    Sandbox,
    SandboxOptions,
    prepare,
    sandbox_spec,
    start_sandbox,
)

__all__ = [
    "EngineBuild",
    "EngineMode",
    "MasterDownError",
    "Prepared",
    "Progress",
    "Replica",
    "ReplicaDiedError",
    "Sandbox",
    "SandboxError",
    "SandboxOptions",
    "SandboxSetupError",
    "SilentProgress",
    "prepare",
    "sandbox_spec",
    "start_sandbox",
]
