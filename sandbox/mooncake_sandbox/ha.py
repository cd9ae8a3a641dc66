"""Highly available masters in the sandbox: a real etcd and N real mooncake_master electing a leader.

The masters' HA flags and the replicas' `etcd://` master address and cluster id come from
`render.ha_topology` / `engine_args.HaTopology`, fed the reference deployment with
`store.master.highAvailability` enabled and the sandbox's etcd as its external etcd: the same functions
that render production's master StatefulSet and store config.

Which master leads is read from Mooncake itself: every master answers `GET /health` on its metrics port
with its `role` ("leader" or "standby"), whether it serves, the `leader_address` it sees in etcd and the
view version. Measured on mooncake-transfer-engine-non-cuda 0.3.13.post1: a killed leader is replaced
after about 9 s (its etcd lease runs out, a standby is elected and spends 5 s in "leader_warmup").

Elections the sandbox did not cause happen too: a pause of this machine of about 5 s is enough for the
leader to lose its etcd lease (measured 2026-12-01: "keep alive channel closed", "Release leadership"),
and the put that follows can fail at the new leader before the replicas' segments are mounted there.
What a step measured across such an election is about the election, not the store: every step of the
HA scenario reads the leader and the view version before and after it (`LeaderEpoch`), and a step that
did not pass across an unplanned election is reported (`LeaderChange`) and run again, at most
`MAX_REDOS` times (`redo_after_unplanned_leader_changes`). A step that passes is never run again.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from mooncake_operator.api.examples import reference_deployment
from mooncake_operator.api.resource import MooncakeServing
from mooncake_operator.api.store import EtcdSpec, ExternalEtcd, MasterHighAvailability, MasterSpec
from mooncake_operator.build.engine_args import HaTopology, master_argv
from mooncake_operator.build.etcd import ha_topology
from mooncake_operator.reconcile.decide.leadership import HEALTH_PATH, MasterView
from mooncake_sandbox.errors import MasterDownError, SandboxSetupError
from mooncake_sandbox.processes import ManagedProcess, free_port, stop_processes
from mooncake_sandbox.progress import Progress

LOOPBACK = "127.0.0.1"
ETCD_PACKAGE_HINT = "install Debian's etcd-server (apt-get install etcd-server; scripts/bootstrap does)"
ETCD_START_TIMEOUT_S = 30.0
LEADER_TIMEOUT_S = 90.0
MAX_REDOS = 2  # per step; an election every attempt is a machine that cannot hold a lease: stop and say so
_POLL_S = 0.2

T = TypeVar("T")


def sandbox_ha_resource(
    etcd_endpoint: str, *, masters: int, enable_oplog: bool, master: MasterSpec | None = None
) -> MooncakeServing:
    """The reference deployment with highly available masters electing through the sandbox's etcd;
    `master`: the master spec to make highly available (the sandbox's, with its TTLs), else the
    reference deployment's."""
    resource = reference_deployment()
    ha = MasterHighAvailability(
        enabled=True,
        replicas=masters,
        enable_oplog=enable_oplog,
        etcd=EtcdSpec(external=ExternalEtcd(endpoints=[etcd_endpoint])),
    )
    highly_available = (master or resource.spec.store.master).model_copy(update={"high_availability": ha})
    store = resource.spec.store.model_copy(update={"master": highly_available})
    return resource.model_copy(update={"spec": resource.spec.model_copy(update={"store": store})})


@dataclass(eq=False)
class MasterNode:
    index: int
    rpc_port: int
    metrics_port: int
    process: ManagedProcess | None = None

    @property
    def name(self) -> str:
        return f"master-{self.index}"

    @property
    def address(self) -> str:
        """What the master publishes as the leader's address (its -rpc_address:-rpc_port)."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def health_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}{HEALTH_PATH}"

    def alive(self) -> bool:
        return self.process is not None and self.process.exit_code() is None


@dataclass(eq=False)
class HaMasters:
    etcd: ManagedProcess
    etcd_port: int
    topology: HaTopology
    nodes: list[MasterNode] = field(default_factory=list)

    def processes(self) -> list[ManagedProcess]:
        return [self.etcd, *(node.process for node in self.nodes if node.process is not None)]

    def describe(self) -> list[str]:
        return [
            f"etcd (Debian's etcd-server) on {LOOPBACK}:{self.etcd_port}; "
            f"{len(self.nodes)} mooncake_master, -enable_ha -cluster_id={self.topology.cluster_id} "
            f"-enable_oplog={'true' if self.topology.enable_oplog else 'false'}",
            f"master_server_address: {self.topology.master_server_address}, "
            f"replica env MC_STORE_CLUSTER_ID={self.topology.cluster_id}",
        ]

    def check(self) -> None:
        """Raise MasterDownError when etcd is gone or no master is left (a killed leader is expected)."""
        if self.etcd.exit_code() is not None:
            raise MasterDownError(
                f"etcd exited with code {self.etcd.exit_code()}; the masters cannot elect a leader\n"
                f"--- {self.etcd.log_path} (tail) ---\n{self.etcd.log_tail()}"
            )
        if not any(node.alive() for node in self.nodes):
            raise MasterDownError("every mooncake_master has exited; the store has no master")

    async def views(self, client: httpx.AsyncClient) -> list[tuple[MasterNode, MasterView]]:
        """/health of every running master (masters that do not answer are left out)."""
        found = []
        for node in self.nodes:
            if not node.alive():
                continue
            try:
                response = await client.get(node.health_url, timeout=2.0)
                body = response.json()
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(body, dict):
                found.append((node, MasterView.parse(body)))
        return found

    async def _leading(self, client: httpx.AsyncClient) -> tuple[MasterNode, MasterView] | None:
        """The master that says it leads and serves, and whose address the others see as the leader's."""
        for node, view in await self.views(client):
            if view.leads and view.leader_address == node.address:
                return node, view
        return None

    async def epoch(self, client: httpx.AsyncClient, *, timeout_s: float = LEADER_TIMEOUT_S) -> LeaderEpoch:
        """Who leads and serves now, in which view; waits for one."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            self.check()
            found = await self._leading(client)
            if found is not None:
                node, view = found
                return LeaderEpoch(node.name, node.address, view.view_version, node=node)
            await asyncio.sleep(_POLL_S)
        views = {node.name: view for node, view in await self.views(client)}
        raise SandboxSetupError(f"no master became a serving leader within {timeout_s:.0f} s; views: {views}")

    def alive_count(self) -> int:
        return sum(node.alive() for node in self.nodes)

    def kill(self, node: MasterNode) -> None:
        """SIGKILL: the leader gets no chance to hand over (as on a node failure)."""
        if node.process is None:
            return
        node.process.signal_group(signal.SIGKILL)
        stop_processes([node.process], grace_s=1.0)


@dataclass(frozen=True)
class LeaderEpoch:
    """The serving leader and the election view it leads in. Any election in between changes the view
    version (it grows with every election), so two equal epochs mean no election happened between them."""

    leader: str
    address: str
    view_version: int | None
    node: MasterNode = field(compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.leader} ({self.address}, view {self.view_version})"

    def as_json(self) -> dict[str, object]:
        return {"leader": self.leader, "address": self.address, "view_version": self.view_version}


@dataclass(frozen=True)
class LeaderChange:
    """An election the sandbox did not cause, seen between two reads of the leader."""

    during: str
    before: LeaderEpoch
    after: LeaderEpoch

    def describe(self) -> str:
        return (
            f"unplanned leader change during {self.during}: {self.before.describe()} -> "
            f"{self.after.describe()}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "during": self.during,
            "before": self.before.as_json(),
            "after": self.after.as_json(),
            "summary": self.describe(),
        }


class UnplannedLeaderChange(SandboxSetupError):
    """The masters elected a leader the sandbox did not ask for while a step ran; what the step measured
    is about that election, not the store (exit 3, an unstable environment, when it keeps happening)."""

    def __init__(self, change: LeaderChange) -> None:
        super().__init__(change.describe())
        self.change = change


async def redo_after_unplanned_leader_changes(
    step: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    passed: Callable[[T], bool],
    read_epoch: Callable[[], Awaitable[LeaderEpoch]],
    store_serves: Callable[[], Awaitable[object]],
    changes: list[LeaderChange],
    progress: Progress,
) -> T:
    """Run `attempt`; run it again when it did not pass and the masters elected a leader while it ran.

    `attempt` may also raise UnplannedLeaderChange itself (a step that causes an election of its own,
    like the failover proof, checks the epochs around it). Each change is appended to `changes`, and
    `store_serves` is awaited before the redo (the replicas mount their segments at the new leader a
    few seconds after it serves). After MAX_REDOS redos the last result stands (or the last
    UnplannedLeaderChange is raised).
    """
    redos = 0
    while True:
        before = await read_epoch()
        try:
            result = await attempt()
        except UnplannedLeaderChange as unplanned:
            changes.append(unplanned.change)
            if redos == MAX_REDOS:
                raise
        else:
            if passed(result):
                return result
            after = await read_epoch()
            if after == before:
                return result
            changes.append(LeaderChange(step, before, after))
            if redos == MAX_REDOS:
                return result
        redos += 1
        progress.phase(f"{changes[-1].describe()}; running {step} again (redo {redos} of {MAX_REDOS})")
        await store_serves()


async def start_ha_masters(
    *,
    run_dir: Path,
    env: Mapping[str, str],
    executable: Path,
    masters: int,
    enable_oplog: bool,
    master: MasterSpec,
    progress: Progress,
) -> HaMasters:
    """Start etcd and `masters` masters; return once one of them leads and serves."""
    etcd_binary = shutil.which("etcd")
    if etcd_binary is None:
        raise SandboxSetupError(f"--master-ha needs the etcd binary: {ETCD_PACKAGE_HINT}")
    etcd_port, peer_port = free_port(), free_port()
    resource = sandbox_ha_resource(
        f"{LOOPBACK}:{etcd_port}", masters=masters, enable_oplog=enable_oplog, master=master
    )
    topology = ha_topology(resource)
    assert topology is not None
    progress.phase(f"starting etcd on {LOOPBACK}:{etcd_port}")
    etcd = ManagedProcess.start(
        "etcd",
        (
            etcd_binary,
            "--name=sandbox",
            f"--data-dir={run_dir / 'etcd-data'}",
            f"--listen-client-urls=http://{LOOPBACK}:{etcd_port}",
            f"--advertise-client-urls=http://{LOOPBACK}:{etcd_port}",
            f"--listen-peer-urls=http://{LOOPBACK}:{peer_port}",
            f"--initial-advertise-peer-urls=http://{LOOPBACK}:{peer_port}",
            f"--initial-cluster=sandbox=http://{LOOPBACK}:{peer_port}",
        ),
        env=env,
        log_path=run_dir / "etcd.log",
        cwd=run_dir,
    )
    cluster = HaMasters(etcd=etcd, etcd_port=etcd_port, topology=topology)
    async with httpx.AsyncClient(trust_env=False) as client:
        await _wait_etcd(client, cluster)
        for index in range(masters):
            node = MasterNode(index=index, rpc_port=free_port(), metrics_port=free_port())
            argv = master_argv(
                resource.spec,
                rpc_address=LOOPBACK,
                rpc_port=node.rpc_port,
                metrics_host=LOOPBACK,
                metrics_port=node.metrics_port,
                executable=str(executable),
                ha=topology,
            )
            node.process = ManagedProcess.start(
                f"mooncake-{node.name}",
                argv,
                env=env,
                log_path=run_dir / f"mooncake-{node.name}.log",
                cwd=run_dir,
            )
            cluster.nodes.append(node)
        progress.phase(f"started {masters} mooncake_master (HA), waiting for a leader")
        leader = await cluster.epoch(client)
    progress.phase(f"{leader.describe()} leads; the others stand by")
    return cluster


async def _wait_etcd(client: httpx.AsyncClient, cluster: HaMasters) -> None:
    started = time.monotonic()
    url = f"http://{LOOPBACK}:{cluster.etcd_port}/health"
    while time.monotonic() - started < ETCD_START_TIMEOUT_S:
        if cluster.etcd.exit_code() is not None:
            raise SandboxSetupError(f"etcd exited during start-up\n{cluster.etcd.log_tail()}")
        try:
            if (await client.get(url, timeout=1.0)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(_POLL_S)
    raise SandboxSetupError(f"etcd did not answer {url} within {ETCD_START_TIMEOUT_S:.0f} s")
