"""One operator at a time, on a real API server: two `mooncake-operator run` processes share a Lease;
the second stays idle (reconciles nothing) until the first stops, then takes over. Each holder writes its
own `--lease-duration-seconds` into the Lease.

The hand-over is by release, so the Leases are long: this platform's CPU stalls (up to a minute, seen
in CI beside the e2e tier) would end a short one, and its holder rightly exits. Losing a Lease to a
stall is the unit tier's (tests/unit/test_operator_lease.py); the waits leave room for one stall."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cluster.operator_harness import eventually, serving
from tests.support.apiserver import ControlPlane, free_port

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.runtime.lease import LEASE_API_VERSION, LEASE_KIND

pytestmark = pytest.mark.cluster

LEASE = "mooncake-operator-test"
FIRST_LEASE_S, SECOND_LEASE_S = 600, 300  # distinct, and each outlasts a stall's renewal gap
WITHIN_S = 180  # one wait: a minute's stall on top of a loaded start


@contextlib.contextmanager
def operator_process(
    kubeconfig: Path, namespace: str, log_path: Path, *extra_args: str
) -> Iterator[subprocess.Popen[bytes]]:
    argv = [
        sys.executable,
        "-m",
        "mooncake_operator",
        "run",
        f"--kubeconfig={kubeconfig}",
        f"--namespace={namespace}",
        f"--lease-namespace={namespace}",
        f"--lease-name={LEASE}",
        f"--liveness-port={free_port()}",
        "--liveness-host=127.0.0.1",
        "--metrics-port=0",
        "--resync-seconds=1",
        "--retry-delay-seconds=0.5",
        *extra_args,
    ]
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("KUBERNETES_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def log_of(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


async def holder(kube: KubeClient, namespace: str) -> str | None:
    lease = await kube.get_or_none(LEASE_API_VERSION, LEASE_KIND, LEASE, namespace)
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def lease_duration(kube: KubeClient, namespace: str) -> object:
    lease = await kube.get_or_none(LEASE_API_VERSION, LEASE_KIND, LEASE, namespace)
    return ((lease or {}).get("spec") or {}).get("leaseDurationSeconds")


async def reconciled(kube: KubeClient, namespace: str, name: str) -> bool:
    body = await kube.get_or_none(API_VERSION, KIND, name, namespace)
    return bool(((body or {}).get("status") or {}).get("phase"))


async def test_the_second_operator_stays_idle_until_the_first_stops(
    kube: KubeClient, kube_cluster: ControlPlane, namespace: str, crd: None, tmp_path: Path
) -> None:
    kubeconfig = kube_cluster.write_kubeconfig(
        tmp_path / "admin.kubeconfig", kube_cluster.admin_token, "admin"
    )
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with operator_process(
        kubeconfig, namespace, first_log, f"--lease-duration-seconds={FIRST_LEASE_S}"
    ) as first:
        first_identity = await eventually(
            lambda: holder(kube, namespace), within=WITHIN_S, what="a Lease holder"
        )
        assert first_identity.endswith(f"-{first.pid}")
        assert await lease_duration(kube, namespace) == FIRST_LEASE_S
        with operator_process(
            kubeconfig, namespace, second_log, f"--lease-duration-seconds={SECOND_LEASE_S}"
        ) as second:
            await eventually(
                lambda: _contains(second_log, "standby: lease"),
                within=WITHIN_S,
                what="the second one in standby",
            )
            # The leader reconciles a new resource; the standby touches nothing.
            await kube.create(serving(namespace, "one"))
            await eventually(
                lambda: reconciled(kube, namespace, "one"), within=WITHIN_S, what="'one' reconciled"
            )
            await asyncio.sleep(2)  # time for a standby that wrongly reconciles to show it
            assert await holder(kube, namespace) == first_identity
            assert f"{namespace}/one" not in log_of(second_log)  # kopf and the reconcile name ns/name
            assert "acquired" not in log_of(second_log)

            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=WITHIN_S) == 0, log_of(first_log)
            assert "released" in log_of(first_log)
            second_identity = await eventually(
                lambda: _new_holder(kube, namespace, first_identity),
                within=WITHIN_S,
                what="the second takes over",
            )
            assert second_identity.endswith(f"-{second.pid}")
            assert await lease_duration(kube, namespace) == SECOND_LEASE_S  # the second's own
            await kube.create(serving(namespace, "two"))
            await eventually(
                lambda: reconciled(kube, namespace, "two"), within=WITHIN_S, what="'two' reconciled"
            )
            assert second.poll() is None, log_of(second_log)
            # Leave nothing behind for another test's cluster-wide operator.
            for name in ("one", "two"):
                await kube.delete(API_VERSION, KIND, name, namespace)
            await eventually(
                lambda: _all_gone(kube, namespace), within=WITHIN_S, what="the resources deleted"
            )


async def _contains(path: Path, text: str) -> bool:
    return text in log_of(path)


async def _new_holder(kube: KubeClient, namespace: str, old: str) -> str | None:
    now = await holder(kube, namespace)
    return now if now and now != old else None


async def _all_gone(kube: KubeClient, namespace: str) -> bool:
    return not await kube.list(API_VERSION, KIND, namespace)
