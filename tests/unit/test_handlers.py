"""The workers follow kopf's watch: one per resource, stopped at once when it is being deleted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from tests.support.fake_api import runtime_answering

from mooncake_operator.api.group import API_VERSION, KIND
from mooncake_operator.kube.client import KubeClient
from mooncake_operator.kube.config import KubeConfig
from mooncake_operator.reconcile.act import worker
from mooncake_operator.reconcile.act.cache import WatchCache
from mooncake_operator.reconcile.act.worker import WORKERS_STOPPED, Workers, run_worker
from mooncake_operator.reconcile.decide.actions import Outcome, ReconcileResult

pytestmark = pytest.mark.unit


def serving(name: str, version: str, *, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "ns", "resourceVersion": version}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": {}}


class Recorder:
    """Worker stand-ins that run until cancelled, recording starts and how each ended."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []

    async def work(self, namespace: str, name: str) -> None:
        self.started.append((namespace, name))
        try:
            await asyncio.sleep(3600)  # a canary in progress
        finally:
            self.cancelled.append((namespace, name))


def workers() -> tuple[Workers, Recorder, KubeClient]:
    kube = KubeClient(KubeConfig(server="https://127.0.0.1:1"))
    recorder = Recorder()
    return Workers(WatchCache(kube, namespaces=(), on_change=lambda *_: None), recorder.work), recorder, kube


async def test_one_worker_per_resource_and_the_cache_holds_what_kopf_saw() -> None:
    running, recorder, kube = workers()
    await running.observe(None, serving("demo", "1"))  # listed at start-up
    await running.observe("MODIFIED", serving("demo", "2"))
    await running.observe("ADDED", serving("other", "3"))
    await asyncio.sleep(0)
    assert recorder.started == [("ns", "demo"), ("ns", "other")]
    stored = running.cache.get(API_VERSION, KIND, "ns", "demo")
    assert stored is not None and stored["metadata"]["resourceVersion"] == "2"
    await running.close()
    assert sorted(recorder.cancelled) == [("ns", "demo"), ("ns", "other")]
    await kube.aclose()


async def test_closing_says_once_every_worker_has_stopped(caplog: pytest.LogCaptureFixture) -> None:
    running, recorder, kube = workers()
    await running.observe("ADDED", serving("demo", "1"))
    await asyncio.sleep(0)
    with caplog.at_level(logging.INFO, logger="mooncake_operator.reconcile"):
        await running.close()
    assert recorder.cancelled == [("ns", "demo")] and not running.tasks
    assert f"{WORKERS_STOPPED} 1 workers (their reconciles and canaries cancelled)" in caplog.text
    await kube.aclose()


async def test_a_resource_being_deleted_stops_its_worker_mid_reconcile() -> None:
    running, recorder, kube = workers()
    await running.observe("ADDED", serving("demo", "1"))
    await asyncio.sleep(0)
    await running.observe("MODIFIED", serving("demo", "2", deleting=True))
    assert recorder.cancelled == [("ns", "demo")] and not running.tasks
    await running.observe("DELETED", serving("demo", "3", deleting=True))
    assert running.cache.get(API_VERSION, KIND, "ns", "demo") is None
    # Created again under the name: a fresh worker, the old one having finished.
    await running.observe("ADDED", serving("demo", "4"))
    await asyncio.sleep(0)
    assert recorder.started == [("ns", "demo"), ("ns", "demo")]
    await running.close()
    await kube.aclose()


async def test_a_reconcile_that_raises_is_logged_and_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = runtime_answering(lambda request: httpx.Response(404))
    calls: list[int] = []
    second = asyncio.Event()

    async def reconcile(*_: Any) -> Outcome:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the reconcile")
        second.set()
        return Outcome(ReconcileResult.READY)

    monkeypatch.setattr(worker, "reconcile", reconcile)
    monkeypatch.setattr(worker, "RESTART_SECONDS", 0.01)
    task = asyncio.create_task(run_worker(runtime, "ns", "demo"))
    try:
        await asyncio.wait_for(second.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.close()
    assert "ns/demo: the reconcile failed; retrying in 0.01 s" in caplog.text
    assert "a bug in the reconcile" in caplog.text
    assert ("ns", "demo") not in runtime.wakes.events  # the stopped worker unregistered


async def test_a_worker_cancelled_as_it_is_woken_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancellation that stops a worker can land with a wake-up (an event about its own write);
    it must not be lost (Python 3.11's wait_for returns the wake-up instead), or the worker outlives
    its resource and holds the operator's exit."""
    runtime = runtime_answering(lambda request: httpx.Response(404))
    reconciled = asyncio.Event()

    async def reconcile(*_: Any) -> Outcome:
        reconciled.set()
        return Outcome(ReconcileResult.READY)

    monkeypatch.setattr(worker, "reconcile", reconcile)
    task = asyncio.create_task(run_worker(runtime, "ns", "demo"))
    try:
        await asyncio.wait_for(reconciled.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0)  # the worker now waits for a wake-up
        runtime.wakes.poke("ns", "demo")
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the worker ignored its cancellation"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.close()
