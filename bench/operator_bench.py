"""The operator on a real API server: API calls per reconcile, time to children, 100 resources.

Part 1 calls the reconcile directly (no kopf) on one resource and counts the operator's own API calls
per reconcile, by verb: on create (writes should equal the six children, plus the status and its
event), again with nothing changed (zero writes), once the pods are Ready (the canary), and once more
(zero writes). Part 2 runs `mooncake-operator run` as a process, creates N resources at once, and reports
the time until every resource has its children and until every one is Ready (canary passed), and the
operator's resident memory. Pods are made Ready by the tests' stand-in kubelet; canaries go to two
loopback fake vLLM replicas shared by every resource.

    .venv/bin/python bench/operator_bench.py [--resources 100]

(Not bench/operator.py: run as a script, that name would shadow the standard library's `operator`.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*

import yaml
from tests.cluster.operator_harness import FakeKubelet, install_crd, serving
from tests.support.apiserver import ControlPlane, start_control_plane
from tests.support.fake_vllm import FakeCluster

from mooncake_operator import api, render
from mooncake_operator.crd import SERVING_KIND
from mooncake_operator.kube import KubeClient, KubeConfig, RequestCounts
from mooncake_operator.operator_settings import OperatorSettings
from mooncake_operator.reconcile import Runtime, reconcile

REPO = Path(__file__).resolve().parents[1]


def admin(plane: ControlPlane) -> KubeConfig:
    return KubeConfig(server=plane.server, token=plane.admin_token, ca_path=plane.ca_path)


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


def describe(counts: RequestCounts) -> str:
    verbs = ", ".join(f"{verb} {n}" for verb, n in sorted(counts.by_verb.items()))
    return f"reads {counts.reads}, writes {counts.writes} ({verbs})"


async def per_reconcile(
    plane: ControlPlane, kube: KubeClient, fakes: FakeCluster
) -> list[tuple[str, str, float]]:
    namespace = "bench-one"
    await create_namespace(kube, namespace)
    settings = OperatorSettings(
        kube=admin(plane),
        metrics_port=0,
        liveness_port=0,
        replica_endpoints={f"{namespace}/demo": tuple(fakes.urls)},
    )
    runtime = Runtime.start(settings)
    rows = []

    async def step(label: str) -> None:
        before = runtime.kube.counts.snapshot()
        started = time.perf_counter()
        outcome = await reconcile(runtime, namespace, "demo")
        elapsed = time.perf_counter() - started
        rows.append(
            (label, f"{describe(runtime.kube.counts.since(before))}; -> {outcome.result.value}", elapsed)
        )

    try:
        await kube.create(serving(namespace))
        await step("create (nothing exists yet)")
        await step("again, nothing changed (pods Pending)")
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


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (kopf stops gracefully), SIGKILL after 30 s; only the process this script started."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


async def many(plane: ControlPlane, kube: KubeClient, count: int) -> dict[str, float]:
    namespace = "bench-many"
    await create_namespace(kube, namespace)
    names = [f"mcs-{index:03d}" for index in range(count)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    endpoints = workdir / "endpoints.yaml"
    # Two fake replicas per resource: the stdlib servers drop connections when a hundred canaries share two.
    with contextlib.ExitStack() as stack:
        clusters = [stack.enter_context(FakeCluster.start(2)) for _ in names]
        endpoints.write_text(
            yaml.safe_dump(
                {f"{namespace}/{name}": cluster.urls for name, cluster in zip(names, clusters, strict=True)}
            )
        )
        return await _many(plane, kube, namespace, names, workdir, endpoints)


async def _many(
    plane: ControlPlane, kube: KubeClient, namespace: str, names: list[str], workdir: Path, endpoints: Path
) -> dict[str, float]:
    count = len(names)
    command = [
        str(REPO / ".venv" / "bin" / "mooncake-operator"),
        "run",
        f"--kubeconfig={plane.kubeconfig}",
        f"--namespace={namespace}",
        f"--replica-endpoints={endpoints}",
        "--liveness-port=0",
        "--metrics-port=0",
        "--resync-seconds=30",
        "--retry-delay-seconds=2",
    ]
    log = (workdir / "operator.log").open("wb")
    operator = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT)
    try:
        await asyncio.sleep(3)  # kopf's start-up (login, discovery, the watch)
        idle_rss = rss_kib(operator.pid)
        started = time.perf_counter()
        for name in names:
            await kube.create(serving(namespace, name=name))
        created = time.perf_counter() - started
        children_at = ready_at = None
        peak_rss = idle_rss
        async with FakeKubelet(kube, namespace, period_s=0.5):
            while ready_at is None:
                if operator.returncode is not None:
                    raise SystemExit(f"the operator exited: see {workdir / 'operator.log'}")
                peak_rss = max(peak_rss, rss_kib(operator.pid))
                if children_at is None:
                    statefulsets = await kube.list("apps/v1", "StatefulSet", namespace)
                    services = await kube.list("v1", "Service", namespace)
                    if len(statefulsets) == count and len(services) == 3 * count:
                        children_at = time.perf_counter() - started
                items = await kube.list(api.API_VERSION, api.KIND, namespace)
                if sum((item.get("status") or {}).get("phase") == "Ready" for item in items) == count:
                    ready_at = time.perf_counter() - started
                if time.perf_counter() - started > 900:
                    raise SystemExit("not all resources Ready in 15 minutes")
                await asyncio.sleep(1.0)
        ready_rss = rss_kib(operator.pid)
    finally:
        await stop(operator)
        log.close()
    return {
        "resources": count,
        "create_requests_s": created,
        "all_children_s": children_at or 0.0,
        "all_ready_s": ready_at,
        "rss_idle_mib": idle_rss / 1024,
        "rss_peak_mib": peak_rss / 1024,
        "rss_ready_mib": ready_rss / 1024,
    }


async def time_to_children(
    plane: ControlPlane, kube: KubeClient, fakes: FakeCluster, runs: int
) -> list[float]:
    """Create -> every child of one resource applied, through the real operator (kopf) process."""
    namespace = "bench-latency"
    await create_namespace(kube, namespace)
    command = [
        str(REPO / ".venv" / "bin" / "mooncake-operator"),
        "run",
        f"--kubeconfig={plane.kubeconfig}",
        f"--namespace={namespace}",
        "--liveness-port=0",
        "--metrics-port=0",
    ]
    operator = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    samples = []
    try:
        await asyncio.sleep(3)
        for index in range(runs):
            name = f"lat-{index}"
            started = time.perf_counter()
            await kube.create(serving(namespace, name=name))
            names = render.ChildNames.of(name)
            while True:
                found = await kube.get_or_none("v1", "Service", names.client_service, namespace)
                if found is not None:  # the last child in apply order
                    break
                await asyncio.sleep(0.01)
            samples.append(time.perf_counter() - started)
    finally:
        await stop(operator)
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--resources", type=int, default=100)
    parser.add_argument("--latency-runs", type=int, default=10)
    args = parser.parse_args()
    with start_control_plane() as plane, FakeCluster.start(2) as fakes:
        async with KubeClient(admin(plane), kinds=[SERVING_KIND]) as kube:
            await install_crd(kube)
            print("## API calls per reconcile (one resource, reconcile called directly)\n")
            print("| reconcile | operator's API calls | wall |\n|---|---|---|")
            for label, calls, elapsed in await per_reconcile(plane, kube, fakes):
                print(f"| {label} | {calls} | {elapsed * 1000:.0f} ms |")
            samples = await time_to_children(plane, kube, fakes, args.latency_runs)
            print(
                f"\n## create -> all six children applied (operator process, {len(samples)} runs)\n\n"
                f"median {statistics.median(samples) * 1000:.0f} ms, max {max(samples) * 1000:.0f} ms"
            )
            result = await many(plane, kube, args.resources)
            print(f"\n## {args.resources} resources at once (operator process)\n")
            for key, value in result.items():
                print(f"- {key}: {value:.1f}" if isinstance(value, float) else f"- {key}: {value}")
    print(f"\n(host: {os.cpu_count()} cores)")


if __name__ == "__main__":
    asyncio.run(main())
