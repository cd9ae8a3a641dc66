"""The operator on a real API server: API calls per reconcile, many resources on one operator, reaction.

Part 1 calls the reconcile directly (no kopf) on one resource and counts, per reconcile, the operator's
own API calls by verb and the requests the API server itself counted (`apiserver_request_total`, by
verb): on create, again with nothing changed, once the pods are Ready (the canary), and twice more with
nothing changed (a no-op resync: zero reads, zero writes).

Part 2 runs `mooncake-operator run` as a process (`--resync-seconds 600`) and creates N resources at once
in one namespace, then reports: the time until every child is applied and every resource is Ready
(readiness and a passing canary each), the operator's resident memory, the API requests per second in a
steady state (the API server's counter, all clients, and the operator's own counter), the time from
create to all six children applied for further resources created while the N exist, and the reaction
times: a pod became Ready -> canary started, a replica pod replaced -> canary started again, a child
deleted -> recreated. Pods are made Ready by a watch-driven stand-in kubelet; canaries go to loopback
fake vLLM replicas (a pool shared by the N resources, one pair of its own per reaction resource, so its
first request marks the canary's start).

    .venv/bin/python -m mooncake_sandbox.netns -- .venv/bin/python bench/operator_bench.py \\
        [--resources 1000] [--operator PATH]

`--operator` runs another build of the operator (e.g. an older checkout's .venv/bin/mooncake-operator)
for before/after numbers; it must accept the flags listed in `operator_command`. The steady state also
counts the operator's reconciles (`mooncake_operator_reconciles_total`): with every resource Ready and
unchanged each is a no-op resync, so its reads per reconcile are the reads per no-op resync of an
operator that part 1 cannot call directly.
(Not bench/operator.py: run as a script, that name would shadow the standard library's `operator`.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*

import httpx
import yaml
from tests.cluster.operator_harness import FakeKubelet, install_crd, is_ready, pod_status, serving
from tests.support.apiserver import ControlPlane, free_port, start_control_plane
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.build.names import LABEL_INSTANCE, ChildNames
from mooncake_operator.kube.client import READ_VERBS, KubeClient, RequestCounts
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError, KubeError
from mooncake_operator.kube.kinds import SERVING_KIND
from mooncake_operator.reconcile.act.core import Runtime, reconcile
from mooncake_operator.runtime.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
SHARED_FAKE_CLUSTERS = 16
STEADY_WINDOW_S = 60.0


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def admin(plane: ControlPlane) -> KubeConfig:
    return KubeConfig(server=plane.server, token=plane.admin_token, ca_path=plane.ca_path)


def samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"] == metric:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            found.append((labels, float(match["value"])))
    return found


async def apiserver_requests(http: httpx.AsyncClient) -> Counter[str]:
    """The API server's own count of resource requests, by verb (its /metrics scrape is not one)."""
    text = (await http.get("/metrics")).text
    counts: Counter[str] = Counter()
    for labels, value in samples(text, "apiserver_request_total"):
        if labels.get("resource"):
            counts[labels["verb"]] += int(value)
    return counts


async def operator_requests(port: int) -> Counter[str]:
    """The operator's own API requests by verb, and its reconciles (all results) as "(reconciles)"."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    counts = Counter(
        {labels["verb"]: int(v) for labels, v in samples(text, "mooncake_operator_kube_requests_total")}
    )
    counts["(reconciles)"] = sum(int(v) for _, v in samples(text, "mooncake_operator_reconciles_total"))
    return counts


def verbs(counts: Counter[str]) -> str:
    return ", ".join(f"{verb} {n}" for verb, n in sorted(counts.items()) if n) or "none"


async def create_namespace(kube: KubeClient, name: str) -> None:
    await kube.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager="bench"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        account = await kube.get_or_none("v1", "ServiceAccount", "default", name)
        if account and account.get("secrets"):
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"namespace {name}: no default ServiceAccount token (controller-manager down?)")


async def install_crd_file(kube: KubeClient, path: Path) -> None:
    """An older operator's own CRD: the current one defaults fields (e.g. spec.store.isolateRevisions)
    that an older operator refuses as unknown."""
    manifest = yaml.safe_load(await asyncio.to_thread(path.read_text, encoding="utf-8"))
    await kube.apply(manifest, field_manager="bench")
    established = await until(
        lambda: kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", manifest["metadata"]["name"]),
        30,
        period=0.2,
    )
    if established is None:
        raise SystemExit(f"{path}: the API server did not serve the CRD in 30 s")


async def until(probe: Callable[[], Awaitable[T | None]], within: float, period: float = 0.01) -> T | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await probe()
        if found:
            return found
        await asyncio.sleep(period)
    return None


# --------------------------------------------------------------------------- part 1


async def per_reconcile(
    plane: ControlPlane, kube: KubeClient, server: httpx.AsyncClient, fakes: FakeCluster
) -> list[tuple[str, str, str, str]]:
    namespace = "bench-one"
    await create_namespace(kube, namespace)
    settings = OperatorSettings(
        kube=admin(plane),
        namespaces=(namespace,),
        metrics_port=0,
        liveness_port=0,
        replica_endpoints={f"{namespace}/demo": tuple(fakes.urls)},
    )
    runtime = Runtime.start(settings)
    await runtime.cache.wait_synced()
    rows = []

    async def step(label: str) -> None:
        await asyncio.sleep(1.0)  # let the watches deliver what the last step and the kubelet did
        before, server_before = runtime.kube.counts.snapshot(), await apiserver_requests(server)
        started = time.perf_counter()
        outcome = await reconcile(runtime, namespace, "demo")
        elapsed = time.perf_counter() - started
        server_calls = await apiserver_requests(server) - server_before
        mine = runtime.kube.counts.since(before)
        rows.append(
            (
                label,
                describe(mine),
                f"{verbs(server_calls)}; -> {outcome.result.value}",
                f"{elapsed * 1000:.0f} ms",
            )
        )

    try:
        await kube.create(serving(namespace))
        await step("create (nothing exists yet)")
        await step("again (the controllers created the pods meanwhile)")
        async with FakeKubelet(kube, namespace) as kubelet:
            for _ in range(100):
                await kubelet.step()
                pods = await kube.list("v1", "Pod", namespace)
                if len(pods) == 3 and all(is_ready(pod) for pod in pods):
                    break
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the workload controllers publish the pods' readiness
        await step("pods Ready: canary runs")
        await step("resync, nothing changed")
        await step("resync, nothing changed (again)")
    finally:
        await runtime.close()
    return rows


def describe(counts: RequestCounts) -> str:
    return f"reads {counts.reads}, writes {counts.writes} ({verbs(counts.by_verb)})"


# --------------------------------------------------------------------------- part 2


class WatchingKubelet:
    """Marks each new pod Ready as its watch event arrives, except pods whose names start with a held
    prefix (the bench marks those itself). One list, then one watch: its load does not grow with time."""

    def __init__(self, kube: KubeClient, namespace: str, hold_prefixes: tuple[str, ...]) -> None:
        self.kube, self.namespace, self.hold = kube, namespace, hold_prefixes
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(16)
        self._pending: set[asyncio.Task[None]] = set()

    async def _mark(self, pod: dict[str, Any]) -> None:
        async with self._slots:
            with contextlib.suppress(KubeError):  # replaced meanwhile
                await self.kube.patch_status(
                    "v1", "Pod", pod["metadata"]["name"], pod_status(pod, ready=True), self.namespace
                )

    def _see(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if pod["metadata"].get("deletionTimestamp") or is_ready(pod) or name.startswith(self.hold):
            return
        task = asyncio.create_task(self._mark(pod))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run(self) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    pods, version = await self.kube.list_snapshot("v1", "Pod", self.namespace)
                    for pod in pods:
                        self._see(pod)
                async for event in self.kube.watch("v1", "Pod", self.namespace, resource_version=version):
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        version = None
                        break
                    version = obj["metadata"]["resourceVersion"]
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._see(obj)
            except KubeError:
                version = None
                await asyncio.sleep(0.5)

    async def __aenter__(self) -> WatchingKubelet:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [self._task, *self._pending]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (kopf stops gracefully), SIGKILL after 60 s; only the process this script started."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def operator_command(
    binary: str, plane: ControlPlane, namespace: str, endpoints: Path, metrics: int, resync: float
) -> list[str]:
    return [
        binary,
        "run",
        f"--kubeconfig={plane.kubeconfig}",
        f"--namespace={namespace}",
        f"--replica-endpoints={endpoints}",
        "--liveness-port=0",
        "--metrics-host=127.0.0.1",
        f"--metrics-port={metrics}",
        f"--resync-seconds={resync:g}",
        "--quiet",
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (
        f"p50 {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms "
        f"({len(values)} samples: {', '.join(f'{v * 1000:.0f}' for v in values)} ms)"
    )


class Many:
    def __init__(
        self, plane: ControlPlane, kube: KubeClient, server: httpx.AsyncClient, args: argparse.Namespace
    ) -> None:
        self.plane, self.kube, self.server, self.args = plane, kube, server, args
        self.namespace = "bench-many"
        self.names = [f"mcs-{index:04d}" for index in range(args.resources)]
        self.latency_names = [f"lat-{index:02d}" for index in range(args.latency_runs)]
        self.reaction_names = [f"react-{index:02d}" for index in range(args.reaction_runs)]
        self.results: dict[str, Any] = {}

    async def run(self) -> dict[str, Any]:
        await create_namespace(self.kube, self.namespace)
        workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
        with contextlib.ExitStack() as stack:
            pool = [stack.enter_context(FakeCluster.start(2)) for _ in range(SHARED_FAKE_CLUSTERS)]
            self.reacting = {name: stack.enter_context(FakeCluster.start(2)) for name in self.reaction_names}
            endpoints = {
                f"{self.namespace}/{name}": pool[index % len(pool)].urls
                for index, name in enumerate(self.names + self.latency_names)
            }
            endpoints |= {f"{self.namespace}/{name}": fakes.urls for name, fakes in self.reacting.items()}
            endpoints_file = workdir / "endpoints.yaml"
            endpoints_file.write_text(yaml.safe_dump(endpoints))
            self.metrics_port = free_port()
            command = operator_command(
                self.args.operator,
                self.plane,
                self.namespace,
                endpoints_file,
                self.metrics_port,
                self.args.resync_seconds,
            )
            log = (workdir / "operator.log").open("wb")
            self.operator = await asyncio.create_subprocess_exec(
                *command, stdout=log, stderr=subprocess.STDOUT
            )
            self.results["operator_log"] = str(workdir / "operator.log")
            try:
                await asyncio.sleep(5)  # kopf's start-up (login, discovery, the watches)
                self.results["rss_idle_mib"] = rss_mib(self.operator.pid)
                async with WatchingKubelet(self.kube, self.namespace, ("react-",)):
                    await self.rollout()
                    progress(f"rollout: {self.results}")
                    await self.steady_state()
                    progress("steady state measured")
                    await self.create_latency()
                    progress("create latency measured")
                    await self.reactions()
                self.results["rss_end_mib"] = rss_mib(self.operator.pid)
                self.results["rss_peak_mib"] = rss_mib(self.operator.pid, "VmHWM")
            finally:
                await stop(self.operator)
                log.close()
        return self.results

    async def rollout(self) -> None:
        count = len(self.names)
        started = time.perf_counter()
        creating = asyncio.Semaphore(8)

        async def create(name: str) -> None:
            async with creating:
                await self.kube.create(serving(self.namespace, name=name))

        await asyncio.gather(*(create(name) for name in self.names))
        self.results["create_requests_s"] = time.perf_counter() - started
        children_at = ready_at = None
        ready = 0
        while ready_at is None and time.perf_counter() - started < self.args.ready_timeout:
            if self.operator.returncode is not None:
                raise SystemExit(f"the operator exited: see {self.results['operator_log']}")
            if children_at is None:
                stateful_sets = await self.kube.list("apps/v1", "StatefulSet", self.namespace)
                services = await self.kube.list("v1", "Service", self.namespace)
                if len(stateful_sets) >= count and len(services) >= 3 * count:
                    children_at = time.perf_counter() - started
            items = await self.kube.list(API_VERSION, KIND, self.namespace)
            ready = sum((item.get("status") or {}).get("phase") == "Ready" for item in items)
            if ready == count:
                ready_at = time.perf_counter() - started
            progress(
                f"{ready}/{count} Ready, children applied: {children_at is not None}, "
                f"rss {rss_mib(self.operator.pid):.0f} MiB"
            )
            await asyncio.sleep(5.0)
        self.results |= {
            "resources": count,
            "all_children_s": children_at,
            "all_ready_s": ready_at,
            "ready": ready,
            "rss_after_rollout_mib": rss_mib(self.operator.pid),
        }

    async def steady_state(self) -> None:
        await asyncio.sleep(15)  # the last statuses and events settle
        server_before = await apiserver_requests(self.server)
        mine_before = await operator_requests(self.metrics_port)
        await asyncio.sleep(STEADY_WINDOW_S)
        server_delta = await apiserver_requests(self.server) - server_before
        mine_delta = await operator_requests(self.metrics_port) - mine_before
        reconciles = mine_delta.pop("(reconciles)", 0)
        reads = sum(n for verb, n in mine_delta.items() if verb in READ_VERBS)
        self.results["steady_apiserver_per_s"] = sum(server_delta.values()) / STEADY_WINDOW_S
        self.results["steady_apiserver_verbs"] = verbs(server_delta)
        self.results["steady_operator_per_s"] = sum(mine_delta.values()) / STEADY_WINDOW_S
        self.results["steady_operator_verbs"] = verbs(mine_delta)
        # With every resource Ready and unchanged, each reconcile in the window is a no-op resync.
        self.results["steady_reconciles"] = reconciles
        self.results["steady_reads_per_reconcile"] = (
            f"{reads / reconciles:.1f}" if reconciles else f"no reconcile ({reads} reads)"
        )
        self.results["rss_steady_mib"] = rss_mib(self.operator.pid)

    async def create_latency(self) -> None:
        samples_s = []
        for name in self.latency_names:
            last_child = ChildNames.of(name).client_service  # the last child in apply order
            started = time.perf_counter()
            await self.kube.create(serving(self.namespace, name=name))

            async def applied(last_child: str = last_child) -> dict[str, Any] | None:
                return await self.kube.get_or_none("v1", "Service", last_child, self.namespace)

            if await until(applied, 30):
                samples_s.append(time.perf_counter() - started)
        self.results["create_to_children"] = samples_s

    async def pods(self, name: str) -> dict[str, dict[str, Any]]:
        selector = f"{LABEL_INSTANCE}={name}"
        found = await self.kube.list("v1", "Pod", self.namespace, label_selector=selector)
        return {pod["metadata"]["name"]: pod for pod in found if not pod["metadata"].get("deletionTimestamp")}

    async def mark_ready(self, pod: dict[str, Any]) -> None:
        await self.kube.patch_status(
            "v1", "Pod", pod["metadata"]["name"], pod_status(pod, ready=True), self.namespace
        )

    async def canary_started(self, fakes: FakeCluster, before: int, within: float) -> float | None:
        started = time.perf_counter()
        while time.perf_counter() - started < within:
            if sum(len(replica.requests) for replica in fakes.replicas) > before:
                return time.perf_counter() - started
            await asyncio.sleep(0.005)
        return None

    async def reactions(self) -> None:
        self.reaction_samples: dict[str, list[float]] = {
            "pod_ready_to_canary": [],
            "replica_replaced_to_canary": [],
            "replica_deleted_to_canary": [],
            "child_deleted_to_recreated": [],
        }
        self.missed: Counter[str] = Counter()
        for name in self.reaction_names:
            await self.react(name)
        self.results |= {**self.reaction_samples, "reaction_missed": dict(self.missed)}

    async def react(self, name: str) -> None:
        """Pod Ready -> canary, replica replaced -> canary, child deleted -> recreated, on one resource."""
        fakes, within, found = self.reacting[name], self.args.reaction_timeout, self.reaction_samples
        names = ChildNames.of(name)
        replica = [f"{names.replicas}-0", f"{names.replicas}-1"]
        await self.kube.create(serving(self.namespace, name=name))
        pods = await until(lambda: self._all_pods(name), 60, period=0.2)
        if pods is None:
            self.missed["pods"] += 1
            return
        for pod_name, pod in pods.items():
            if pod_name != replica[1]:
                await self.mark_ready(pod)
        await asyncio.sleep(2.0)  # the operator has seen those and waits for the last one
        before = sum(len(r.requests) for r in fakes.replicas)
        await self.mark_ready(pods[replica[1]])
        took = await self.canary_started(fakes, before, within)
        if took is None:
            self.missed["ready"] += 1
        else:
            found["pod_ready_to_canary"].append(took)
        if await until(lambda: self._phase(name, "Ready"), 60, period=0.2) is None:
            self.missed["ready phase"] += 1
            return

        # A replica replaced: its pod deleted, recreated by the StatefulSet controller (new UID).
        old_uid = pods[replica[0]]["metadata"]["uid"]
        deleted_at = time.perf_counter()
        await self.kube.delete("v1", "Pod", replica[0], self.namespace)

        async def successor() -> dict[str, Any] | None:
            pod = (await self.pods(name)).get(replica[0])
            return pod if pod is not None and pod["metadata"]["uid"] != old_uid else None

        new_pod = await until(successor, 60, period=0.05)
        if new_pod is None:
            self.missed["successor"] += 1
            return
        await asyncio.sleep(1.0)  # the operator has seen the new, unready pod
        before = sum(len(r.requests) for r in fakes.replicas)
        await self.mark_ready(new_pod)
        marked_at = time.perf_counter()
        took = await self.canary_started(fakes, before, within)
        if took is None:
            self.missed["replaced"] += 1
        else:
            found["replica_replaced_to_canary"].append(took)
            found["replica_deleted_to_canary"].append(marked_at + took - deleted_at)
        await until(lambda: self._phase(name, "Ready"), 60, period=0.2)

        # A child deleted.
        started = time.perf_counter()
        await self.kube.delete("v1", "Service", names.client_service, self.namespace)

        async def recreated() -> dict[str, Any] | None:
            return await self.kube.get_or_none("v1", "Service", names.client_service, self.namespace)

        if await until(recreated, within):
            found["child_deleted_to_recreated"].append(time.perf_counter() - started)
        else:
            self.missed["recreated"] += 1

    async def _all_pods(self, name: str) -> dict[str, dict[str, Any]] | None:
        pods = await self.pods(name)
        return pods if len(pods) == 3 else None

    async def _phase(self, name: str, phase: str) -> bool:
        try:
            body = await self.kube.get(API_VERSION, KIND, name, self.namespace)
        except KubeApiError:
            return False
        return bool((body.get("status") or {}).get("phase") == phase)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--resources", type=int, default=1000)
    parser.add_argument("--latency-runs", type=int, default=10)
    parser.add_argument("--reaction-runs", type=int, default=5)
    parser.add_argument(
        "--reaction-timeout", type=float, default=60.0, help="give up on one reaction after S"
    )
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="give up on all-Ready after S")
    parser.add_argument("--operator", default=str(REPO / ".venv" / "bin" / "mooncake-operator"))
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=600.0,
        help="the operator's --resync-seconds (600; an operator without watch caches ran at its default, 30)",
    )
    parser.add_argument(
        "--crd",
        type=Path,
        metavar="FILE",
        help="install this CRD instead of the generated one (an older --operator's crds/ file)",
    )
    parser.add_argument("--skip-direct", action="store_true", help="skip part 1 (needs this checkout's code)")
    args = parser.parse_args()
    with start_control_plane() as plane, FakeCluster.start(2) as fakes:
        async with (
            KubeClient(admin(plane), timeout=60, kinds=[SERVING_KIND]) as kube,
            httpx.AsyncClient(
                base_url=plane.server,
                verify=ssl.create_default_context(cafile=plane.ca_path),
                headers={"Authorization": f"Bearer {plane.admin_token}"},
            ) as server,
        ):
            if args.crd is not None:
                await install_crd_file(kube, args.crd)
                await asyncio.sleep(2.0)  # the API server serves a new CRD's resource shortly after
            else:
                await install_crd(kube)
            if not args.skip_direct:
                print("## API calls per reconcile (one resource, reconcile called directly)\n")
                print("| reconcile | operator's client | API server's apiserver_request_total | wall |")
                print("|---|---|---|---|")
                for row in await per_reconcile(plane, kube, server, fakes):
                    print("| " + " | ".join(row) + " |")
            results = await Many(plane, kube, server, args).run()
    print(f"\n## {args.resources} resources on one operator ({args.operator})\n")
    for key, value in results.items():
        if isinstance(value, list):
            print(f"- {key}: {summary(value)}")
        elif isinstance(value, float):
            print(f"- {key}: {value:.2f}")
        else:
            print(f"- {key}: {value}")
    print(f"\n(host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    asyncio.run(main())
