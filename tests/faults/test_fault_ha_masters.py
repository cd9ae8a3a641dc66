"""Scenario 7: highly available masters on the node. The customer's resource (CPU variant) under its own
name with 3 masters electing their leader through the managed etcd StatefulSet (the etcd image built
here from Debian's etcd-server); under the steady client load the leading master's pod is deleted. The
operator must report the failover (status.highAvailability, a MasterFailover event), prove the store
again (a canary after the fault passing with an external hit, against the new leader), and users may
see failures only while no master leads.

This file runs before test_faults_on_pods.py (file order) and deletes its resource at the end: the
2-core node cannot hold two resources' engines (four vLLM CPU engines plus the canaries), so it refuses
to start while another MooncakeServing exists rather than share the node with it."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.support import cluster, kube_node
from tests.support.fault_load import component_pods, parse_time, port_address, wait_until
from tests.support.fault_scenarios import proven_again_after, report, run_scenario, status_of
from tests.support.kube_node import kubectl

from mooncake_operator.build.etcd import ETCD_USER_ID
from mooncake_operator.build.names import COMPONENT_MASTER, METRICS_PORT_NAME
from mooncake_operator.reconcile.decide.leadership import HEALTH_PATH, MasterView

FIRST_VERDICT_TIMEOUT = 1200.0
# etcd's volumes on tmpfs, as a local SSD would serve it: on the node's disk, shared with containerd and
# the engines, its WAL fsync took up to 1.9 s under the load (etcd expects well under 1 s), the masters'
# lease keep-alives failed and leadership flapped (bench/RESULTS.md, "Faults on real pods").
ETCD_VOLUMES = Path("/dev/shm/mooncake-cluster-etcd-volumes")
GONE_TIMEOUT = 300.0
WATCH_PERIOD_S = 0.5  # how often the test asks every master who leads
HEALTH_TIMEOUT_S = 1.0
RELIST_S = 2.0  # master pods listed again (the deleted pod's replacement gets a new IP)
# A request sent up to one load tick (1 s) before the recorded fault can fail by it, and the delete call
# itself (kubectl) runs after the fault time is taken: failures may be sent this much outside
# [fault, new leader serving].
FAILOVER_SLACK_S = 2.0


def master_pods(name: str) -> list[dict[str, Any]]:
    return component_pods(name, COMPONENT_MASTER)


def health_urls(pods: list[dict[str, Any]]) -> dict[str, str]:
    """pod IP -> the master's /health URL on its metrics port (pods without an IP yet left out)."""
    urls = {}
    for pod in pods:
        address = port_address(pod, METRICS_PORT_NAME)
        if address is not None:
            urls[pod["status"]["podIP"]] = f"http://{address}{HEALTH_PATH}"
    return urls


class LeaderWatch:
    """Mooncake's own view of the failover: every WATCH_PERIOD_S it asks each master pod's /health (by
    pod IP, from the node) and records when a master other than the one at `old_ip` first says it leads
    and serves. Independent of the operator, which this scenario checks."""

    def __init__(self, name: str, old_ip: str) -> None:
        self.name, self.old_ip = name, old_ip
        self.new_leader: tuple[float, str, MasterView] | None = None  # (monotonic, IP, its view)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-watch", daemon=True)

    def __enter__(self) -> LeaderWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (the fault was injected)
            self._thread.join()

    def _run(self) -> None:
        urls: dict[str, str] = {}
        listed = float("-inf")
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as http:
            while not self._stop.is_set() and self.new_leader is None:
                if time.monotonic() - listed >= RELIST_S:
                    urls, listed = health_urls(master_pods(self.name)), time.monotonic()
                for ip, url in urls.items():
                    if ip == self.old_ip:
                        continue
                    try:
                        view = MasterView.parse(http.get(url).json())
                    except (httpx.HTTPError, ValueError, AttributeError):
                        continue
                    if view.leads:
                        self.new_leader = (time.monotonic(), ip, view)
                        break
                self.samples += 1
                self._stop.wait(WATCH_PERIOD_S)


def failover_events(name: str) -> list[dict[str, Any]]:
    listing = json.loads(
        kubectl(
            [
                "get",
                "events",
                "--namespace=default",
                f"--field-selector=involvedObject.name={name},reason=MasterFailover",
                "-o",
                "json",
            ]
        )
    )
    events: list[dict[str, Any]] = listing["items"]
    return events


@pytest.fixture(scope="module")
def ha_serving(node_cluster: kube_node.Images) -> Iterator[str]:
    others = json.loads(kubectl(["get", "mcs", "--namespace=default", "-o", "json"]))["items"]
    assert not others, (
        "scenario 7 needs the node to itself (a second resource's engines do not fit on 2 cores): "
        f"{[o['metadata']['name'] for o in others]} exist"
    )
    resource = cluster.ha_example_resource(node_cluster.engine_patched, node_cluster.etcd)
    name = resource["metadata"]["name"]
    claims, size = cluster.etcd_claims(resource)
    cluster.claim_directories(claims, ETCD_VOLUMES, ETCD_USER_ID)
    volumes = cluster.claim_volumes(claims, size, ETCD_VOLUMES)
    kubectl(["apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": volumes}))
    try:
        kubectl(["apply", "-f", "-"], input=json.dumps(resource))
        verdict = cluster.wait_for_verdict(name, FIRST_VERDICT_TIMEOUT)
        assert verdict == "Ready", f"{name} ended {verdict} before any fault"
        yield name
    finally:
        # Everything of this resource goes before the next file's resource starts: the resource (its
        # children by garbage collection), then the etcd claims the StatefulSet leaves, then the volumes.
        kubectl(["delete", "mcs", name, "--namespace=default", "--ignore-not-found", "--wait=true"])
        wait_until(
            f"{name}'s pods gone",
            lambda: (
                not json.loads(
                    kubectl(
                        [
                            "get",
                            "pods",
                            "--namespace=default",
                            f"--selector=app.kubernetes.io/instance={name}",
                            "-o",
                            "json",
                        ]
                    )
                )["items"]
            ),
            GONE_TIMEOUT,
        )
        kubectl(["delete", "pvc", *claims, "--namespace=default", "--ignore-not-found", "--wait=true"])
        kubectl(["delete", "pv", *claims, "--ignore-not-found", "--wait=true"])
        shutil.rmtree(ETCD_VOLUMES, ignore_errors=True)


def test_deleted_leader_master_fails_over_and_the_store_is_proven_again(ha_serving: str) -> None:
    before = status_of(ha_serving)
    ha_before = before.get("highAvailability") or {}
    leader = ha_before.get("leader")
    assert leader, f"no leader reported while Ready: {ha_before}"
    pods = {p["metadata"]["name"]: p for p in master_pods(ha_serving)}
    assert len(pods) == 3, sorted(pods)
    victim = pods[leader]
    old_ip = victim["status"]["podIP"]
    # The operator's leader is the masters' own: the pod it names says it leads.
    old_view = MasterView.parse(httpx.get(health_urls([victim])[old_ip], timeout=5).json())
    assert old_view.leads, f"{leader} does not lead by its own /health: {old_view}"
    assert ha_before.get("leaderAddress") == old_view.leader_address, (ha_before, old_view)
    fault: dict[str, float] = {}
    watch = LeaderWatch(ha_serving, old_ip)

    def inject() -> None:
        watch.__enter__()
        fault["at"], fault["wall"] = time.monotonic(), time.time()
        kubectl(["delete", "pod", leader, "--namespace=default", "--wait=false"])

    try:
        result = run_scenario(
            "HA masters: leader pod deleted", ha_serving, inject, lambda t: proven_again_after(ha_serving, t)
        )
    finally:
        watch.__exit__()
    status = status_of(ha_serving)
    ha = status.get("highAvailability") or {}
    failed_over = parse_time(ha.get("lastFailoverTime"))
    events = failover_events(ha_serving)
    new_events = [
        e
        for e in events
        if (posted := parse_time(e.get("lastTimestamp"))) is not None
        and posted.timestamp() >= int(fault["wall"])
    ]
    new_leader_s = None if watch.new_leader is None else round(watch.new_leader[0] - fault["at"], 1)
    report(
        {
            "scenario": "HA masters: leader pod deleted (failover)",
            "new_leader_serving_s": new_leader_s,
            "operator_observed_s": None
            if failed_over is None
            else round(failed_over.timestamp() - fault["wall"], 1),
            "leader": [leader, ha.get("leader")],
            "leader_address": [old_view.leader_address, ha.get("leaderAddress")],
            "view_version": [old_view.view_version, ha.get("viewVersion")],
            "failovers": [ha_before.get("failovers", 0), ha.get("failovers")],
            "errors_sent_s": result["errors_sent_s"],
            "watch_samples": watch.samples,
        }
    )
    # The masters failed over: a master other than the deleted one leads and serves.
    assert watch.new_leader is not None and new_leader_s is not None, (
        f"no other master led in {watch.samples} samples"
    )
    # The operator reports it: the new leader (by its address), one more failover counted after the
    # fault, the MasterFailover event, and the canary that proved the store ran against that leader.
    assert ha.get("leaderAddress") not in (None, old_view.leader_address), ha
    assert ha.get("failovers", 0) >= ha_before.get("failovers", 0) + 1, (ha_before, ha)
    assert failed_over is not None and failed_over.timestamp() >= int(fault["wall"]), ha
    assert new_events, f"no MasterFailover event since the fault: {events}"
    assert status["canary"]["target"]["masterLeader"] == ha["leader"], (status["canary"]["target"], ha)
    assert result["canaries_run"] >= 1, result
    # Users saw errors only while no master led: every failed request (the load's own cap aside) was
    # sent between the fault and the new leader serving, so none failed for longer than the failover.
    if result["errors_sent_s"] is not None:
        first, last = result["errors_sent_s"]
        assert first >= -FAILOVER_SLACK_S and last <= new_leader_s + FAILOVER_SLACK_S, (
            f"requests failed outside the failover (new leader serving {new_leader_s} s after the fault): "
            f"{result}"
        )
