"""Time from a spec change to the new revision serving, InPlace vs BlueGreen, on the cluster tier.

A real etcd + kube-apiserver + kube-controller-manager (StatefulSet, endpoints and garbage collector
controllers), the operator in-process under kopf, fake vLLM replicas for the canary, and a fake kubelet
that marks a pod Ready `--load-seconds` after it first sees it (standing in for weight loading). Per run:
create a resource with the strategy, wait until its two proven pods are the client Service's endpoints,
change the engine image (a new pod template), and time until the endpoints are exactly `replicas` pods of
the new revision with the status Ready. Also reported: the fewest pods the client Service listed during the
rollout (capacity left to users).

    .venv/bin/python -m mooncake_sandbox.netns -- .venv/bin/python bench/rollout_bench.py \\
        [--load-seconds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.*

from tests.cluster.operator_harness import (
    FakeKubelet,
    get_serving,
    install_crd,
    is_ready,
    operator_settings,
    run_operator,
    serving,
)
from tests.cluster.test_operator_traffic import client_endpoints
from tests.support.apiserver import ControlPlane, start_control_plane
from tests.support.fake_vllm import FakeCluster

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.api.resource import parse_resource
from mooncake_operator.build.names import replica_set_name
from mooncake_operator.build.replicas import replica_template_id
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.kube.errors import KubeApiError
from mooncake_operator.kube.kinds import SERVING_KIND

OLD_IMAGE = "registry.invalid/vllm-mooncake:fixed"
NEW_IMAGE = "registry.invalid/vllm-mooncake:fixed-2"


class LoadingKubelet(FakeKubelet):
    """Marks a pod Ready only `load_s` after first seeing it (weights loading, as far as timing goes)."""

    def __init__(self, *args: Any, load_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_s = load_s
        self.first_seen: dict[str, float] = {}

    async def step(self) -> None:
        now = time.monotonic()
        for pod in await self.kube.list("v1", "Pod", self.namespace):
            metadata = pod["metadata"]
            if metadata.get("deletionTimestamp"):
                await self._finish_deletion(pod)
                continue
            seen = self.first_seen.setdefault(metadata["uid"], now)
            if not is_ready(pod):
                try:
                    await self._bind(pod)
                    if now - seen >= self.load_s:
                        await self.mark(pod, ready=True)
                except KubeApiError:
                    pass  # replaced meanwhile


def spec(strategy: str, image: str) -> dict[str, Any]:
    return {"rollout": {"strategy": strategy}, "engine": {"image": image, "blockSize": 32}}


def candidate(namespace: str, strategy: str) -> str:
    resource = parse_resource(serving(namespace, **spec(strategy, NEW_IMAGE)))
    return replica_set_name(resource, replica_template_id(resource))


async def new_namespace(kube: KubeClient) -> str:
    """A fresh namespace, once its default ServiceAccount exists (pods are refused before)."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    async def account() -> bool:
        found = await kube.get_or_none("v1", "ServiceAccount", "default", name)
        return bool(found and found.get("secrets"))

    await until(account, 30)
    return name


async def until(probe: Any, within: float) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def one_run(plane: ControlPlane, kube: KubeClient, strategy: str, load_s: float) -> tuple[float, int]:
    """(seconds from the spec change to the new revision serving, fewest pods serving meanwhile)."""
    namespace = await new_namespace(kube)
    # A third fake for the InPlace surge ordinal (demo-replica-2).
    with FakeCluster.start(3) as blue_fakes, FakeCluster.start(2) as green_fakes:
        endpoints = {
            f"{namespace}/demo": tuple(blue_fakes.urls),
            f"{namespace}/{candidate(namespace, strategy)}": tuple(green_fakes.urls),
        }
        settings = operator_settings(plane, namespace, replica_endpoints=endpoints)
        with run_operator(settings):
            async with LoadingKubelet(kube, namespace, node="fake-node", load_s=load_s):
                await kube.create(serving(namespace, **spec(strategy, OLD_IMAGE)))

                async def first_serving() -> set[str] | None:
                    listed = await client_endpoints(kube, namespace)
                    return listed if len(listed) == 2 else None

                before = await until(first_serving, 120)
                patch = {"spec": {"engine": {"image": NEW_IMAGE}}}
                started = time.monotonic()
                await kube.patch_merge(API_VERSION, KIND, "demo", patch, namespace)
                fewest = 2

                async def new_serving() -> bool:
                    nonlocal fewest
                    listed = await client_endpoints(kube, namespace)
                    fewest = min(fewest, len(listed))
                    if len(listed) != 2 or listed & before:
                        return False
                    status = (await get_serving(kube, namespace)).get("status") or {}
                    return status.get("phase") == "Ready"

                await until(new_serving, 300)
                return time.monotonic() - started, fewest


async def main(args: argparse.Namespace) -> None:
    plane = start_control_plane()
    try:
        config = KubeConfig(server=plane.server, token=plane.admin_token, ca_path=plane.ca_path)
        async with KubeClient(config, kinds=[SERVING_KIND]) as kube:
            await install_crd(kube)
            for strategy in ("InPlace", "BlueGreen"):
                runs = [await one_run(plane, kube, strategy, args.load_seconds) for _ in range(args.repeats)]
                times = [seconds for seconds, _ in runs]
                each = ", ".join(f"{t:.2f}" for t in times)
                print(
                    f"{strategy:9} load {args.load_seconds:.1f} s: spec change -> new revision serving "
                    f"median {statistics.median(times):.2f} s (runs: {each}); "
                    f"fewest pods serving during the rollout: {min(fewest for _, fewest in runs)} of 2",
                    flush=True,
                )
    finally:
        plane.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load-seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
