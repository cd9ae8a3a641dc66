"""The fault tier's steady client load, and who served it.

`ClientLoad` sends bounded chat requests at a fixed rate to the client Service from inside the
cluster's network namespace and records every response (start time, status, latency, a hash of the
answer's text). `ServedLedger` samples, about once a second, every replica pod's own vLLM request
counter (`vllm:request_success_total`), the pod's container restart count and the resource's canary
status; from those it computes, per pod instance (pod UID and restart count: a restarted engine starts
its counters at zero), how many requests the instance served before a canary that covers it passed,
minus the requests the canary itself sent it (one cold per pair it wrote, one warm per pair it read):
the user requests that reached an unproven pod. Measured, not assumed from the labels.

Ordering makes the measurement safe: each sample reads the counters first and the status after, so a
sample the status calls unproven was taken before the proof, whatever happened in between.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tests.support import cluster, kube_node
from tests.support.kube_node import kubectl

from mooncake_operator.build.names import TRAFFIC_LABEL
from mooncake_operator.canary.request import reference_request

MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 30.0
# A tick skipped because `max_in_flight` requests were in flight: saturation, recorded as a failure.
OVERLOADED = "overloaded"


@dataclass(frozen=True)
class Response:
    started: float  # time.monotonic()
    status: int | str  # HTTP status, or the transport error's class name
    latency_s: float
    body_hash: str | None  # of the answer's text (greedy: equal answers hash equal)


def load_request(model: str) -> dict[str, Any]:
    """The customer's chat request, short and greedy (so every correct answer is the same text)."""
    return {**reference_request(), "model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}


def answer_hash(body: dict[str, Any]) -> str:
    texts = [choice["message"]["content"] or "" for choice in body["choices"]]
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]


class ClientLoad:
    """Chat requests at `rate_per_s` to `url`, each on its own thread (at most `max_in_flight`; a tick
    with that many in flight is recorded as a failure, "overloaded", never silently skipped)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        rate_per_s: float = 1.0,
        max_in_flight: int = 8,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.body = load_request(model)
        self.period = 1.0 / rate_per_s
        self.max_in_flight = max_in_flight
        self.responses: list[Response] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._in_flight = 0
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight)
        self._thread = threading.Thread(target=self._run, name="client-load", daemon=True)
        # A new connection per request: kube-proxy routes each by the client Service's endpoints at that
        # moment, which is what the scenarios measure. A kept-alive connection stays on its pod whatever
        # the Service says (its conntrack entry), and one the old pod closes as it shuts down resets the
        # request sent on it (a BlueGreen switch showed one ReadError so): clients that keep connections
        # alive retry on connection errors (docs/operator.md, "What faults do to users").
        self._client = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))

    def __enter__(self) -> ClientLoad:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._client.close()

    def _run(self) -> None:
        tick = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                full = self._in_flight >= self.max_in_flight
                if not full:
                    self._in_flight += 1
            if full:
                self._record(Response(time.monotonic(), OVERLOADED, 0.0, None))
            else:
                self._pool.submit(self._one)
            tick += self.period
            self._stop.wait(max(0.0, tick - time.monotonic()))

    def _one(self) -> None:
        started = time.monotonic()
        try:
            response = self._client.post(self.url, json=self.body)
            status: int | str = response.status_code
            digest = answer_hash(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            status, digest = type(error).__name__, None
        finally:
            with self._lock:
                self._in_flight -= 1
        self._record(Response(started, status, time.monotonic() - started, digest))

    def _record(self, response: Response) -> None:
        with self._lock:
            self.responses.append(response)

    def snapshot(self) -> list[Response]:
        with self._lock:
            return sorted(self.responses, key=lambda r: r.started)


@dataclass
class Instance:
    """One engine process of one replica pod: its counter while unproven, and the canary's requests."""

    pod: str
    uid: str
    restarts: int
    started_at: datetime | None
    unproven_max: float = 0.0
    last_count: float = 0.0
    proven_by: str | None = None
    proven_at: datetime | None = None  # when the run that proved it finished
    # Each rise of its counter while unproven: (wall time of the sample, count, its traffic label then);
    # what a report shows when the instance served users before a proof the ledger saw.
    rises: list[tuple[float, float, str | None]] = field(default_factory=list)


@dataclass
class LedgerReport:
    instances: list[Instance]
    canary_requests: dict[tuple[str, str, int], int]
    runs: dict[str, dict[str, Any]]
    unproven_user_requests: dict[str, float] = field(default_factory=dict)


def success_count(pod_ip: str) -> float:
    text = httpx.get(f"http://{pod_ip}:8000/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def component_pods(name: str, component: str) -> list[dict[str, Any]]:
    """The pods of resource `name` (namespace default) with the component label `component`."""
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}"
    items: list[dict[str, Any]] = json.loads(
        kubectl(["get", "pods", "--namespace=default", f"--selector={selector}", "-o", "json"])
    )["items"]
    return items


def replica_pods(name: str) -> list[dict[str, Any]]:
    return component_pods(name, "engine")


def engine_state(pod: dict[str, Any]) -> tuple[int, datetime | None]:
    """The pod's restart count and when its running engine container started."""
    statuses = pod["status"].get("containerStatuses") or []
    restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
    started = [parse_time(((s.get("state") or {}).get("running") or {}).get("startedAt")) for s in statuses]
    return restarts, next((s for s in started if s is not None), None)


def covers(run: dict[str, Any], instance: Instance) -> bool:
    """A passed canary run that started after the instance's engine and proved its pod both ways."""
    if run.get("verdict") != "Passed" or instance.started_at is None:
        return False
    started = parse_time(run.get("startedAt"))
    pairs = run.get("pairs") or []
    wrote = any(p.get("writer") == instance.pod for p in pairs)
    read = any(p.get("reader") == instance.pod for p in pairs)
    return started is not None and started >= instance.started_at and wrote and read


def follow_pod_log(pod: str, namespace: str, into: Path) -> subprocess.Popen[bytes]:
    """`kubectl logs -f --timestamps` of a pod's (first) container, to its very last line (it ends when the
    container does), whatever happens to the pod object meanwhile: the log outlives a deleted pod."""
    return subprocess.Popen(
        [
            str(kube_node.kube_binaries()["kubectl"]),
            f"--kubeconfig={kube_node.admin_kubeconfig()}",
            "logs",
            "--follow",
            "--timestamps",
            f"--namespace={namespace}",
            pod,
        ],
        stdout=into.open("wb"),
        stderr=subprocess.STDOUT,
    )


def log_time(stamp: str) -> datetime | None:
    """The time `kubectl logs --timestamps` put before a line (nanoseconds cut to microseconds)."""
    try:
        return datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00")
    except ValueError:
        return None


# An access line of vLLM's HTTP server (uvicorn) in a `--timestamps` log: the time, the client's address.
_CHAT_ACCESS_LINE = re.compile(r'^(\S+) INFO:\s+(\[?[0-9a-fA-F.:]+?\]?):\d+ - "POST /v1/chat/completions ')


def chat_requests(log_text: str) -> list[tuple[datetime, str]]:
    """(time, client address) of each chat request a `--timestamps` engine log shows."""
    found = []
    for line in log_text.splitlines():
        match = _CHAT_ACCESS_LINE.match(line)
        if match is None:
            continue
        moment = log_time(match.group(1))
        if moment is not None:
            found.append((moment, match.group(2).strip("[]")))
    return found


# What explains a failed user request in an engine's log: vLLM's errors and HTTP 5xx lines, the store
# client's glog errors (E1206 ...), failed store loads.
_FAILURE_LINE = re.compile(r'" 5\d\d |\bERROR\b|^E\d{4} |Failed to get|timed out|no transfer progress')


def failure_lines(log_text: str, start: datetime, end: datetime, limit: int = 20) -> list[str]:
    """The lines of a `--timestamps` log stamped within [start, end] that can explain a failure."""
    found = []
    for line in log_text.splitlines():
        stamp, _, message = line.partition(" ")
        moment = log_time(stamp)
        if moment is not None and start <= moment <= end and _FAILURE_LINE.search(message):
            found.append(f"{stamp[11:23]} {message[:300]}")
    return found[:limit]


OPERATOR_IPS_EVERY = 5
EVIDENCE_REQUESTS = 40  # an unproven instance's chat requests listed in its evidence, at most


class ServedLedger:
    """Samples the replicas' counters and the canary status on a thread until closed."""

    def __init__(self, name: str, *, period_s: float = 1.0, log_dir: Path | None = None) -> None:
        self.name = name
        self.period = period_s
        # With `log_dir`, every replica pod instance's engine log is followed into it from the sample
        # that first lists the pod running: the evidence of a failure on a pod that is gone by the time it
        # is read (a container restarted in place ends its follower; its next process is not followed).
        self.log_dir = log_dir
        self.followers: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.instances: dict[tuple[str, str, int], Instance] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        # Every address an operator pod had while the ledger ran: the canary's requests come from them.
        self.operator_ips: set[str] = set()
        self.samples = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="served-ledger", daemon=True)

    def __enter__(self) -> ServedLedger:
        self.sample()  # the first sample before the fault, synchronously
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        for follower in self.followers.values():
            if follower.poll() is None:
                follower.terminate()
            follower.wait()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception as error:  # a pod between IPs, the API server busy: the next sample counts
                self.errors.append(repr(error))

    def sample(self) -> None:
        counts: list[tuple[tuple[str, str, int], float, datetime | None]] = []
        labels: dict[tuple[str, str, int], str | None] = {}
        for pod in replica_pods(self.name):
            self._follow(pod)
            ip = pod["status"].get("podIP")
            restarts, started = engine_state(pod)
            key = (pod["metadata"]["name"], pod["metadata"]["uid"], restarts)
            if not ip or started is None:
                continue
            try:
                counts.append((key, success_count(ip), started))
            except httpx.HTTPError:
                continue  # the engine is not serving metrics (starting, or just killed)
            labels[key] = (pod["metadata"].get("labels") or {}).get(TRAFFIC_LABEL)
        self.samples += 1
        if self.samples % OPERATOR_IPS_EVERY == 1:  # an operator pod lives far longer than this many samples
            self.operator_ips |= {ip for pod in operator_pods() if (ip := pod["status"].get("podIP"))}
        # The status after the counters: a run it does not show yet had not covered these samples.
        canary = (cluster.get_serving(self.name).get("status") or {}).get("canary") or {}
        self.record(counts, canary, labels)

    def log_path(self, pod: str, uid: str) -> Path:
        """Where a pod instance's followed log goes (needs `log_dir`)."""
        assert self.log_dir is not None
        return self.log_dir / f"{pod}-{uid[:8]}.log"

    def _follow(self, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["name"], pod["metadata"]["uid"])
        # Only once its container runs: `kubectl logs -f` of a container still being created exits at once.
        if self.log_dir is None or key in self.followers or engine_state(pod)[1] is None:
            return
        into = self.log_path(key[0], key[1])
        self.followers[key] = follow_pod_log(key[0], pod["metadata"]["namespace"], into)

    def failure_evidence(self, start: datetime, end: datetime) -> dict[str, list[str]]:
        """Per followed pod instance, its log lines within [start, end] that can explain a failure."""
        if self.log_dir is None:
            return {}
        evidence = {}
        for path in sorted(self.log_dir.glob("*.log")):
            lines = failure_lines(path.read_text(errors="replace"), start, end)
            if lines:
                evidence[path.stem] = lines
        return evidence

    def record(
        self,
        counts: list[tuple[tuple[str, str, int], float, datetime | None]],
        canary: dict[str, Any],
        labels: dict[tuple[str, str, int], str | None] | None = None,
    ) -> None:
        """One sample: each instance's counter `(pod, uid, restarts), count, engine start`, then the
        canary status read after them; `labels`: each instance's traffic label as listed with it."""
        if canary.get("runId") and canary.get("finishedAt"):
            self.runs[canary["runId"]] = canary
        for key, count, started in counts:
            instance = self.instances.get(key)
            if instance is None:
                instance = Instance(pod=key[0], uid=key[1], restarts=key[2], started_at=started)
                self.instances[key] = instance
            instance.last_count = count
            if instance.proven_by is None:
                proof = next((run for run in self.runs.values() if covers(run, instance)), None)
                if proof is None:
                    if count > instance.unproven_max:
                        instance.rises.append((time.time(), count, (labels or {}).get(key)))
                    instance.unproven_max = max(instance.unproven_max, count)
                else:
                    instance.proven_by = proof["runId"]
                    instance.proven_at = parse_time(proof.get("finishedAt"))

    def canary_requests(self, instance: Instance) -> int:
        """The chat requests the canary sent this instance before it was proven (cold as writer,
        warm as reader, per pair that got that far)."""
        sent = 0
        for run in self.runs.values():
            started = parse_time(run.get("startedAt"))
            if instance.started_at is None or started is None or started < instance.started_at:
                continue
            for pair in run.get("pairs") or []:
                if pair.get("writer") == instance.pod and pair.get("coldLatencyMs") is not None:
                    sent += 1
                if pair.get("reader") == instance.pod and pair.get("warmLatencyMs") is not None:
                    sent += 1
        return sent

    def runs_started_after(self, moment: float) -> int:
        """How many of the runs the ledger saw started after `moment` (wall clock)."""
        starts = (parse_time(run.get("startedAt")) for run in self.runs.values())
        return sum(1 for started in starts if started is not None and started.timestamp() >= moment)

    def evidence(self, instance: Instance, since: float) -> dict[str, Any]:
        """Why the ledger counts what it counts for `instance` (times in seconds after `since`, wall
        clock): its counter's rises while unproven with its traffic label at each, and every run the
        ledger saw with the pairs this pod wrote and read in it."""

        def after(value: str | None) -> float | None:
            moment = parse_time(value)
            return round(moment.timestamp() - since, 1) if moment is not None else None

        started = instance.started_at
        logged = self.chat_requests_unproven(instance)
        return {
            "engine_started_s": round(started.timestamp() - since, 1) if started is not None else None,
            # From its access log where the ledger followed it: who sent its chat requests while unproven.
            "chat_requests_unproven": None
            if logged is None
            else [
                (
                    round(moment.timestamp() - since, 1),
                    source,
                    "operator" if source in self.operator_ips else "user",
                )
                for moment, source in logged[:EVIDENCE_REQUESTS]
            ],
            "rises": [(round(at - since, 1), count, label) for at, count, label in instance.rises],
            "proven_by": instance.proven_by,
            "runs_seen": [
                {
                    "run": run_id,
                    "verdict": run.get("verdict"),
                    "started_s": after(run.get("startedAt")),
                    "finished_s": after(run.get("finishedAt")),
                    "wrote": sum(p.get("writer") == instance.pod for p in run.get("pairs") or []),
                    "read": sum(p.get("reader") == instance.pod for p in run.get("pairs") or []),
                }
                for run_id, run in self.runs.items()
            ],
        }

    def chat_requests_unproven(self, instance: Instance) -> list[tuple[datetime, str]] | None:
        """(time, client address) of each chat request in `instance`'s followed access log stamped before
        its proof finished; None without a log of its own (no `log_dir`, or a container restarted in
        place, whose next process is not followed)."""
        if self.log_dir is None or instance.restarts:
            return None
        path = self.log_path(instance.pod, instance.uid)
        if not path.exists():
            return None
        return [
            (moment, source)
            for moment, source in chat_requests(path.read_text(errors="replace"))
            if instance.proven_at is None or moment < instance.proven_at
        ]

    def logged_user_requests(self, instance: Instance) -> int | None:
        """The chat requests of `chat_requests_unproven` sent from any address but an operator pod's.
        Unlike its counter less the runs in the status, this also tells apart the requests of a canary
        run that never reached the status (cancelled by an operator restart, or by a pod change)."""
        logged = self.chat_requests_unproven(instance)
        if logged is None:
            return None
        return sum(1 for _, source in logged if source not in self.operator_ips)

    def unproven_user_requests(self, *, born_after: float | None = None) -> dict[str, float]:
        """Per instance first seen unproven (`pod uid restarts`): the users' requests it served while
        unproven, from its access log where the ledger followed it, else its counter less the canary's
        requests in the runs the status showed; every value must be 0. `born_after`: only instances whose
        engine started after this wall-clock time (the ones the fault created)."""
        result = {}
        for instance in self.instances.values():
            if born_after is not None and (
                instance.started_at is None or instance.started_at.timestamp() < born_after
            ):
                continue
            logged = self.logged_user_requests(instance)
            user = instance.unproven_max - self.canary_requests(instance) if logged is None else logged
            result[instance_name(instance)] = max(user, 0.0)
        return result

    def unproven_evidence(self, *, born_after: float, since: float) -> dict[str, dict[str, Any]]:
        """`evidence` of each instance that `unproven_user_requests` counts users' requests on."""
        counted = self.unproven_user_requests(born_after=born_after)
        return {
            instance_name(instance): self.evidence(instance, since)
            for instance in self.instances.values()
            if counted.get(instance_name(instance))
        }


def instance_name(instance: Instance) -> str:
    return f"{instance.pod} {instance.uid[:8]} r{instance.restarts}"


def failure_window(responses: list[Response]) -> tuple[int, float]:
    """(failed requests, seconds from the first failure's start to the last failure's end)."""
    failed = [r for r in responses if r.status != 200]
    if not failed:
        return 0, 0.0
    return len(failed), failed[-1].started + failed[-1].latency_s - failed[0].started


def port_address(pod: dict[str, Any], port_name: str) -> str | None:
    """`ip:port` of the pod's container port named `port_name`; None without an IP or such a port."""
    ip = pod["status"].get("podIP")
    ports = [
        p["containerPort"]
        for c in pod["spec"]["containers"]
        for p in c.get("ports") or []
        if p.get("name") == port_name
    ]
    return f"{ip}:{ports[0]}" if ip and ports else None


def operator_pods() -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = json.loads(
        kubectl(
            [
                "get",
                "pods",
                f"--namespace={cluster.OPERATOR_NAMESPACE}",
                "--selector=app.kubernetes.io/component=operator",
                "-o",
                "json",
            ]
        )
    )["items"]
    return pods


def operator_counters(metric: str) -> dict[str, float]:
    """One counter of every running operator process, by pod and restart count (scraped on its metrics
    port)."""
    pods = operator_pods()
    totals: dict[str, float] = {}
    for pod in pods:
        address = port_address(pod, "metrics")
        if address is None:
            continue
        try:
            text = httpx.get(f"http://{address}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        totals[operator_process(pod)] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(metric + "{") or line.startswith(metric + " ")
        )
    return totals


def container_restarts(pod: dict[str, Any]) -> int:
    """How often the pod's containers restarted, all together."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(c.get("restartCount") or 0) for c in statuses)


def operator_process(pod: dict[str, Any]) -> str:
    """The pod and its restart count: a restarted container is a new process whose counters start at 0."""
    return f"{pod['metadata']['name']}#{container_restarts(pod)}"


def operator_restarts() -> dict[str, int]:
    """Each operator pod's container restarts."""
    return {pod["metadata"]["name"]: container_restarts(pod) for pod in operator_pods()}


def counted_since(before: dict[str, float], after: dict[str, float]) -> float:
    """What the operator processes counted between two scrapes; a process new since `before` (another
    pod, or the same pod's restarted container) counted everything it reports."""
    return sum(value - before.get(pod, 0.0) for pod, value in after.items())


def wait_until(what: str, probe: Callable[[], Any], timeout: float, period: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f} s: {what}")
