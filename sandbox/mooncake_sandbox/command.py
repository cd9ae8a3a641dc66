"""`mooncake-operator sandbox`: the reference deployment on real engines, on this machine, with the canary.

    mooncake-operator sandbox [run] [--engine patched|buggy] [--replicas N] [--no-speculative] [--json]
    mooncake-operator sandbox --master-ha [--no-oplog]   # etcd + 3 masters; the leader is killed mid-run
    mooncake-operator sandbox --scenario revision-change [--store-isolation on|off]
    mooncake-operator sandbox --perturb-reader 0.2   # replica B's logits move by <= 0.2 nats (GPU-like drift)
    mooncake-operator sandbox --reasoning-model [--reasoning-parser minimax_m2]   # thinks, then answers
    mooncake-operator sandbox prepare      # engine venv, tiny models, engine overlays; nothing started

`run` (the default) prepares what is missing (the only step that needs the network), re-executes itself
in a loopback-only network namespace, starts a real mooncake_master and N real vLLM CPU replicas
configured by `engine_args` from the reference deployment, runs the warm/cold canary across them,
prints the verdict with its evidence and stops everything, also on Ctrl-C, SIGTERM and failure.

With `--master-ha` it runs a real etcd and three masters electing a leader instead of one master, and
after the first canary kills the leader while the store holds a prefix, waits for the new leader, proves
that prefix still loads (warm == cold; without the oplog it is lost, and the run says so) and runs the
canary again. The failover time (leader killed -> a warm load succeeds again) is reported. An election
the sandbox did not cause (a pause of the machine can cost the leader its etcd lease) voids the step it
happened in when that step did not pass: it is reported under "unplanned_leader_changes" and the step
runs again, at most twice.

With `--scenario revision-change` it proves instead that a new model revision is never served the old
revision's KV blocks: both replicas start at revision 1 and share the prefix of a request WITHOUT a
salt (as users' requests are) through the store; one replica moves to revision 2 (other weights, the
same model name as vLLM keys it); the same unsalted request to it must equal its own cold answer and
load nothing from the store. `--store-isolation off` drops the per-revision key namespace
(spec.store.isolateRevisions) to show the hazard: the moved replica serves a stale answer (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from mooncake_operator.canary.models import CanaryResult, ExitCode, Verdict
from mooncake_operator.canary.report import render_json, render_table
from mooncake_operator.canary.runner import run_canary
from mooncake_operator.cli.parser import VerdictCommandParser
from mooncake_sandbox import (
    EngineMode,
    Prepared,
    ReplicaDiedError,
    Sandbox,
    SandboxError,
    SandboxOptions,
    SandboxSetupError,
    netns,
    prepare,
    start_sandbox,
)
from mooncake_sandbox.engine_env import ensure_engine_wheels
from mooncake_sandbox.failover import FailoverReport, prove_failover, wait_for_a_warm_load
from mooncake_sandbox.ha import LeaderChange, redo_after_unplanned_leader_changes
from mooncake_sandbox.revision_change import RevisionChangeReport, prove_revision_change
from mooncake_sandbox.runtime import MAX_REPLICAS, check_reasoning_parser

HA_MASTERS = 3
T = TypeVar("T")
CANARY, REVISION_CHANGE = "canary", "revision-change"


VERDICT_EXIT = {
    Verdict.PASSED: ExitCode.PASSED,
    Verdict.FAILED: ExitCode.FAILED,
    Verdict.INCONCLUSIVE: ExitCode.INCONCLUSIVE,
}
CONTENT_CHECKS_OFF = (
    "content checks off: the tiny random model answers gibberish, so the canary checks that the warm "
    "answer equals the cold one and that the reader loaded the prefix from the store"
)

EPILOG = """\
exit status: 0 passed, 1 failed (or a replica died), 2 inconclusive, 3 usage or environment error
(nothing was judged: engine env, models, master, a replica that did not start or cannot be reached),
70 internal error (a defect of mooncake-operator), 130 interrupted (SIGINT), 143 terminated (SIGTERM).
The codes mean the same as `mooncake-operator canary`'s. With --master-ha the worst of: the canary
before the failover, the pre-failover prefix loaded after it (inconclusive when it was lost, as with
--no-oplog), and the canary after it. With --scenario revision-change: 0 the new revision loaded none
of the old one's blocks and answered as cold, 1 a stale answer was served (or another revision's blocks
were loaded), 2 the revision-1 replicas never shared the prefix through the store.

Everything heavy is cached in $MOONCAKE_OPERATOR_CACHE (default ~/.cache/mooncake-operator). The sandbox
is the mooncake-sandbox distribution (the repository's sandbox/), installed beside the operator; the
operator's image does not carry it.
"""


# The one-line help `mooncake-operator --help` lists (the CLI knows it without loading the sandbox; a unit
# test keeps the two equal).
SUMMARY = "run the reference deployment on real CPU engines here and prove it with the canary"


def register(subparsers: Any) -> None:
    """The `sandbox` subcommand, plugged into `mooncake-operator` through the entry point group
    mooncake_operator.commands (sandbox/pyproject.toml)."""
    parser = subparsers.add_parser(
        "sandbox",
        help=SUMMARY,
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.__class__ = VerdictCommandParser
    parser.add_argument(
        "action",
        nargs="?",
        choices=("run", "prepare"),
        default="run",
        help="run (default): start and prove; prepare: set up the engine env, models and overlays only",
    )
    parser.add_argument(
        "--engine",
        choices=[mode.value for mode in EngineMode],
        default=EngineMode.PATCHED.value,
        help="patched (default): the pre-fix coordinator after our patcher; buggy: the pre-fix coordinator",
    )
    parser.add_argument(
        "--replicas",
        type=_replica_count,
        default=2,
        metavar="N",
        help=f"replicas, 2 to {MAX_REPLICAS} (default: 2)",
    )
    parser.add_argument(
        "--no-speculative", action="store_true", help="drop the deployment's Eagle-3 speculative config"
    )
    parser.add_argument(
        "--master-ha",
        action="store_true",
        help=f"etcd + {HA_MASTERS} masters electing a leader; kill the leader mid-run, prove the store again",
    )
    parser.add_argument(
        "--no-oplog",
        action="store_true",
        help="with --master-ha: masters without -enable_oplog (shows what a failover loses without it)",
    )
    parser.add_argument(
        "--scenario",
        choices=(CANARY, REVISION_CHANGE),
        default=CANARY,
        help="canary (default): prove warm == cold across the replicas; revision-change: prove a replica "
        "moved to a new model revision is not served the old revision's blocks",
    )
    parser.add_argument(
        "--store-isolation",
        choices=("on", "off"),
        default="on",
        help="on (default): a store key namespace per KV-compatibility fingerprint "
        "(spec.store.isolateRevisions); off: none, to reproduce the revision-change hazard",
    )
    parser.add_argument(
        "--perturb-reader",
        type=_nats,
        default=None,
        metavar="NATS",
        help="replica B serves a copy of the target whose logits move by at most NATS (its lm_head plus "
        "bounded seeded noise; KV unchanged): a benign numeric divergence like another GPU's, sandbox only",
    )
    parser.add_argument(
        "--reasoning-model",
        action="store_true",
        help="the replicas serve the tiny target's reasoning variant: its template opens <think>, the model "
        "writes </think> and then its answer, as MiniMax-M2.5 does (sandbox only)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="with --reasoning-model: `--reasoning-parser NAME` in every replica's engine.extraArgs "
        "(e.g. minimax_m2: vLLM splits each answer into reasoning and content)",
    )
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON on stdout")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the run directory (logs, store configs) on success too"
    )
    parser.set_defaults(func=_run)


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 2 <= value <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(
            f"need 2 to {MAX_REPLICAS} replicas (one writes the prefix, another reads it), got {value}"
        )
    return value


def _nats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 10):
        raise argparse.ArgumentTypeError(f"need a bound between 0 and 10 nats, got {text}")
    return value


class _Terminated(BaseException):
    """SIGTERM before the event loop takes over the signal (during set-up)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _run(args: argparse.Namespace) -> int:
    engine = EngineMode(args.engine)
    log = _stderr_line
    if args.no_oplog and not args.master_ha:
        log("setup error: --no-oplog needs --master-ha (it is about the highly available masters' oplog)")
        return ExitCode.USAGE_OR_ENVIRONMENT
    if args.scenario == REVISION_CHANGE and args.master_ha:
        log("setup error: --scenario revision-change runs with one master; drop --master-ha")
        return ExitCode.USAGE_OR_ENVIRONMENT
    if args.perturb_reader is not None and args.scenario == REVISION_CHANGE:
        log("setup error: --perturb-reader applies to the canary scenario (it perturbs a copy of revision 1)")
        return ExitCode.USAGE_OR_ENVIRONMENT
    problem = _reasoning_problem(args)
    if problem is not None:
        log(f"setup error: {problem}")
        return ExitCode.USAGE_OR_ENVIRONMENT
    signal.signal(signal.SIGTERM, _terminate)
    try:
        # Outside the namespace: the first run installs packages.
        engines = tuple(EngineMode) if args.action == "prepare" else (engine,)
        prepared = prepare(engines, log=log)
        if args.action == "prepare":
            # Kept for scripts/build-images: the CPU engine image installs from them (no-op once stamped).
            ensure_engine_wheels(prepared.env, prepared.cache, log=log)
    except SandboxSetupError as error:
        log(f"setup error: {error}")
        return ExitCode.USAGE_OR_ENVIRONMENT
    except KeyboardInterrupt:
        log("interrupted during set-up")
        return ExitCode.INTERRUPTED
    except _Terminated:
        log("terminated during set-up")
        return ExitCode.TERMINATED
    if args.action == "prepare":
        log(f"ready: engine venv {prepared.env.venv}, models {prepared.models.root}")
        for build in prepared.builds.values():
            status = f"patch_connector.py status: {build.patcher_status}"
            log(f"engine {build.mode.value}: {build.pythonpath} ({status})")
        return ExitCode.PASSED
    isolated = _enter_private_netns()
    options = SandboxOptions(
        replicas=args.replicas,
        engine=engine,
        speculative=not args.no_speculative,
        keep_logs=args.keep_logs,
        ha_masters=HA_MASTERS if args.master_ha else 0,
        enable_oplog=not args.no_oplog,
        store_isolation=args.store_isolation == "on",
        perturb_nats=args.perturb_reader,
        reasoning_model=args.reasoning_model,
        reasoning_parser=args.reasoning_parser,
    )
    return run_sandbox(options, prepared, as_json=args.json, isolated=isolated, scenario=args.scenario)


def _reasoning_problem(args: argparse.Namespace) -> str | None:
    """Why the reasoning options cannot run as given, or None."""
    if args.reasoning_parser is not None and not args.reasoning_model:
        return "--reasoning-parser needs --reasoning-model (the plain tiny target never ends a reasoning)"
    if args.reasoning_model and args.perturb_reader is not None:
        return "--perturb-reader perturbs a copy of the plain target; drop it or --reasoning-model"
    if args.reasoning_model and args.scenario == REVISION_CHANGE:
        return "--reasoning-model applies to the canary scenario (the reasoning target has one revision)"
    try:
        check_reasoning_parser(args.reasoning_parser)
    except ValueError as error:
        return f"--reasoning-parser: {error}"
    return None


def _enter_private_netns() -> bool:
    """Re-execute this command in a loopback-only namespace (no return), or say why it runs without one."""
    if netns.in_private_netns():
        return True
    if netns.namespaces_permitted():
        netns.exec_in_netns([sys.executable, "-m", "mooncake_operator", *sys.argv[1:]])
    _stderr_line(
        "warning: network namespaces are not permitted here; running on 127.0.0.1 of the host network "
        "(vLLM's Mooncake store client still listens on 0.0.0.0 while the sandbox runs)"
    )
    return False


def run_sandbox(
    options: SandboxOptions, prepared: Prepared, *, as_json: bool, isolated: bool, scenario: str = CANARY
) -> int:
    """Start, prove, report, tear down; the exit code for the outcome."""
    outcome: dict[str, Any] = {"engine": options.engine.value, "replicas": options.replicas}
    outcome["scenario"] = scenario
    outcome["store_isolation"] = options.store_isolation
    outcome["speculative"] = options.speculative
    if options.reasoning_model:
        outcome["reasoning_model"] = {"reasoning_parser": options.reasoning_parser}
    if options.perturb_nats is not None:
        outcome["perturbed_reader"] = {
            "bound_nats": options.perturb_nats,
            "replicas": list(options.perturbed),
        }
    outcome["network_namespace"] = isolated
    if options.ha_masters:
        outcome["master_ha"] = {"masters": options.ha_masters, "enable_oplog": options.enable_oplog}
    try:
        code = asyncio.run(_main(options, prepared, outcome, scenario))
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
        outcome["error"] = "interrupted (SIGINT); every process the sandbox started was stopped"
    except (asyncio.CancelledError, _Terminated):
        code = ExitCode.TERMINATED
        outcome["error"] = "terminated (SIGTERM); every process the sandbox started was stopped"
    except ReplicaDiedError as error:
        code = ExitCode.FAILED
        outcome["error"] = f"replica died: {error}"
    except SandboxSetupError as error:
        code = ExitCode.USAGE_OR_ENVIRONMENT
        outcome["error"] = f"setup error: {error}"
    except SandboxError as error:
        code = ExitCode.FAILED
        outcome["error"] = str(error)
    except Exception:
        # Exit 1 means Failed; a defect of ours must not read as a verdict about the engines.
        code = ExitCode.INTERNAL_ERROR
        outcome["error"] = "internal error (a defect of mooncake-operator):\n" + traceback.format_exc()
    outcome["exit_code"] = code
    _print_outcome(outcome, as_json=as_json)
    return code


async def _main(options: SandboxOptions, prepared: Prepared, outcome: dict[str, Any], scenario: str) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    # SIGINT already cancels the main task under asyncio.run; SIGTERM must do the same, so the
    # context manager below tears everything down before the process exits.
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    started = time.monotonic()
    async with start_sandbox(options, prepared=prepared) as sandbox:
        try:
            return await _in_sandbox(sandbox, outcome, scenario, started)
        finally:
            outcome["cpu_stalls"] = [stall.describe() for stall in sandbox.cpu_stalls.stalls_since()]


async def _in_sandbox(sandbox: Sandbox, outcome: dict[str, Any], scenario: str, started: float) -> int:
    outcome["healthy_after_s"] = round(time.monotonic() - started, 1)
    outcome["substitutions"] = sandbox.describe()
    outcome["content_checks"] = CONTENT_CHECKS_OFF
    for line in sandbox.describe():
        _stderr_line(f"  {line}")
    if scenario == REVISION_CHANGE:
        return await _revision_change(sandbox, outcome, started)
    leader_changes: list[LeaderChange] = []
    try:
        result = await sandbox.guard(_canary_step(sandbox, "the canary", leader_changes))
        outcome["rss_bytes"] = sandbox.rss_bytes()
        outcome["verdict"] = result.verdict.value
        outcome["canary"] = json.loads(render_json(result))
        outcome["canary_table"] = render_table(result)
        verdict = result.verdict
        if sandbox.ha is not None:
            verdict = await _failover(sandbox, result, outcome, leader_changes)
    finally:
        if sandbox.ha is not None:
            # Elections the sandbox did not cause (a pause of the machine longer than the leader's lease):
            # each voided the step it happened in, which ran again. Reported, never hidden.
            outcome["unplanned_leader_changes"] = [change.as_json() for change in leader_changes]
    outcome["verdict"] = verdict.value
    if verdict is not Verdict.PASSED:
        sandbox.keep_run_dir = True  # the engines' logs are the evidence
        outcome["logs"] = str(sandbox.run_dir)
    if verdict is result.verdict:
        return result.exit_code  # an unreachable replica is an environment error (3), as in `canary`
    return VERDICT_EXIT[verdict]


_SEVERITY = {Verdict.PASSED: 0, Verdict.INCONCLUSIVE: 1, Verdict.FAILED: 2}


async def _revision_change(sandbox: Sandbox, outcome: dict[str, Any], started: float) -> int:
    config = sandbox.canary_config()
    async with httpx.AsyncClient(trust_env=False) as client:
        report: RevisionChangeReport = await sandbox.guard(prove_revision_change(sandbox, client, config))
    outcome["revision_change"] = report.as_json()
    outcome["verdict"] = report.verdict.value
    outcome["wall_s"] = round(time.monotonic() - started, 1)
    if report.verdict is not Verdict.PASSED:
        sandbox.keep_run_dir = True
        outcome["logs"] = str(sandbox.run_dir)
    return VERDICT_EXIT[report.verdict]


async def _failover(
    sandbox: Sandbox, before: CanaryResult, outcome: dict[str, Any], leader_changes: list[LeaderChange]
) -> Verdict:
    """After a passing canary: kill the leader, prove the pre-failover prefix, run the canary again."""
    if before.verdict is not Verdict.PASSED:
        outcome["failover"] = {"skipped": "the canary before the failover did not pass"}
        return before.verdict
    config = sandbox.canary_config()
    async with httpx.AsyncClient(trust_env=False) as client:
        # The proof causes an election of its own, so only the UnplannedLeaderChange it raises redoes it.
        proof = _redone_after_elections(
            sandbox,
            client,
            "the failover proof",
            lambda: prove_failover(sandbox, client, config),
            passed=lambda _report: True,
            leader_changes=leader_changes,
        )
        report: FailoverReport = await sandbox.guard(proof)
    _stderr_line(f"sandbox: failover: {report.summary()}")
    outcome["failover"] = report.as_json()
    after = await sandbox.guard(_canary_step(sandbox, "the canary after the failover", leader_changes))
    outcome["canary_after_failover"] = json.loads(render_json(after))
    outcome["canary_table"] += "after the failover:\n" + render_table(after)
    return max((before.verdict, report.verdict, after.verdict), key=_SEVERITY.__getitem__)


async def _canary_step(sandbox: Sandbox, step: str, leader_changes: list[LeaderChange]) -> CanaryResult:
    """The canary; with HA masters, run again when it did not pass across an unplanned election."""
    if sandbox.ha is None:
        return await _canary(sandbox)
    async with httpx.AsyncClient(trust_env=False) as client:
        return await _redone_after_elections(
            sandbox,
            client,
            step,
            lambda: _canary(sandbox),
            passed=lambda result: result.verdict is Verdict.PASSED,
            leader_changes=leader_changes,
        )


async def _redone_after_elections(
    sandbox: Sandbox,
    client: httpx.AsyncClient,
    step: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    passed: Callable[[T], bool],
    leader_changes: list[LeaderChange],
) -> T:
    """`attempt`, run again (reported) when it did not pass across an election the sandbox did not cause."""
    ha = sandbox.ha
    assert ha is not None
    config = sandbox.canary_config()
    return await redo_after_unplanned_leader_changes(
        step,
        attempt,
        passed=passed,
        read_epoch=lambda: ha.epoch(client),
        store_serves=lambda: wait_for_a_warm_load(sandbox, client, config, since=time.monotonic()),
        changes=leader_changes,
        progress=sandbox.progress,
    )


async def _canary(sandbox: Sandbox) -> CanaryResult:
    config = sandbox.canary_config()
    _stderr_line(f"sandbox: canary across {', '.join(sandbox.replica_urls)} ({CONTENT_CHECKS_OFF})")
    async with httpx.AsyncClient(trust_env=False) as client:
        return await run_canary(config, client=client)


def _print_outcome(outcome: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        printable = {key: value for key, value in outcome.items() if key != "canary_table"}
        sys.stdout.write(json.dumps(printable, indent=2) + "\n")
        return
    if "canary_table" in outcome:
        sys.stdout.write(outcome["canary_table"])
        failover = outcome.get("failover")
        if isinstance(failover, dict) and "summary" in failover:
            sys.stdout.write(f"sandbox: failover: {failover['summary']}\n")
        sys.stdout.write(f"sandbox: verdict {outcome['verdict']}; {CONTENT_CHECKS_OFF}\n")
    change = outcome.get("revision_change")
    if isinstance(change, dict):
        for name, namespace in change["key_namespaces"].items():
            sys.stdout.write(f"sandbox: {name} store keys: {namespace}\n")
        sys.stdout.write(f"sandbox: revision change: {change['summary']}\n")
        sys.stdout.write(f"sandbox: verdict {outcome['verdict']}\n")
    if "error" in outcome:
        sys.stdout.write(f"sandbox: {outcome['error']}\n")
    sys.stdout.write(f"sandbox: exit {outcome['exit_code']}\n")


def _stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
