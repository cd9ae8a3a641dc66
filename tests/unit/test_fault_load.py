"""The fault tier's measuring instruments (tests/support/fault_load.py): the client load against a fake
vLLM, and the ledger's arithmetic of user requests that reached an unproven pod."""

from __future__ import annotations

import http.server
import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from tests.support.fake_vllm import DEFAULT_MODEL, FakeCluster, Mode
from tests.support.fault_load import (
    ClientLoad,
    Instance,
    ServedLedger,
    counted_since,
    covers,
    failure_lines,
    failure_window,
    operator_process,
)

pytestmark = pytest.mark.unit

STARTED = datetime(2026, 12, 2, 8, 0, 0, tzinfo=UTC)
POD, OTHER = "demo-replica-0", "demo-replica-1"
KEY = (POD, "uid-0", 0)


def run(run_id: str, verdict: str, started: str, *, reader_warm: bool = True) -> dict[str, object]:
    return {
        "runId": run_id,
        "verdict": verdict,
        "startedAt": started,
        "finishedAt": started,
        "pairs": [
            {"writer": POD, "reader": OTHER, "coldLatencyMs": 10.0, "warmLatencyMs": 10.0},
            {
                "writer": OTHER,
                "reader": POD,
                "coldLatencyMs": 10.0,
                "warmLatencyMs": 10.0 if reader_warm else None,
            },
        ],
    }


def test_the_load_records_every_answer_and_the_failures_window() -> None:
    with FakeCluster.start(1) as replicas:
        url = replicas[0].url + "/v1/chat/completions"
        with ClientLoad(url, DEFAULT_MODEL, rate_per_s=20) as load:
            time.sleep(0.5)
            replicas[0].mode = Mode.HTTP_500
            time.sleep(0.3)
            replicas[0].mode = Mode.CORRECT
            time.sleep(0.3)
    responses = load.snapshot()
    ok = [r for r in responses if r.status == 200]
    assert len(responses) >= 15 and len(ok) >= 10
    assert len({r.body_hash for r in ok}) == 1, "one greedy answer, one hash"
    failed, window = failure_window(responses)
    assert failed == len(responses) - len(ok) > 0
    assert 0 < window < 1.0


class CountingServer(http.server.ThreadingHTTPServer):
    """Answers every POST with one chat answer over HTTP/1.1 (keep-alive allowed) and counts the
    connections it accepted."""

    def __init__(self) -> None:
        self.connections = 0
        super().__init__(("127.0.0.1", 0), ChatHandler)

    def process_request(self, request: object, client_address: object) -> None:
        self.connections += 1
        super().process_request(request, client_address)  # type: ignore[arg-type]


class ChatHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_every_request_of_the_load_opens_its_own_connection() -> None:
    # A kept-alive connection would stay on its pod whatever the client Service's endpoints say.
    server = CountingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with ClientLoad(f"http://127.0.0.1:{server.server_port}/", DEFAULT_MODEL, rate_per_s=20) as load:
            time.sleep(0.5)
    finally:
        server.shutdown()
        server.server_close()
    answered = [r for r in load.snapshot() if r.status == 200]
    assert len(answered) >= 5
    assert server.connections == len(load.snapshot())


def test_user_requests_to_an_unproven_instance_are_its_count_less_the_canarys() -> None:
    ledger = ServedLedger("demo")
    ledger.record([(KEY, 0.0, STARTED)], {})
    # The canary's two requests to it (cold as writer, warm as reader), then one more: a user's.
    ledger.record([(KEY, 3.0, STARTED)], {"runId": "r1", "verdict": "Running"})
    ledger.record([(KEY, 3.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"))
    # Proven: what it serves afterwards is users' and allowed.
    ledger.record([(KEY, 50.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"))
    (instance,) = ledger.instances.values()
    assert instance.proven_by == "r1"
    assert ledger.canary_requests(instance) == 2
    assert ledger.unproven_user_requests() == {"demo-replica-0 uid-0 r0": 1.0}


def test_with_followed_logs_the_users_requests_are_read_from_the_access_log(tmp_path: Path) -> None:
    # The counter rose by 4 before the proof: two requests of the run the status shows, one of a run
    # that never reached it (an operator restarted mid-run; its new pod has another address), one user's.
    # From the counters less the recorded run that would be 2; the access log tells them apart.
    (tmp_path / f"{POD}-uid-0.log").write_text(
        "2026-12-02T08:00:10.000000001Z INFO:     10.244.0.9:40000 - "
        '"POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        "2026-12-02T08:00:20.5Z INFO:     10.244.0.7:40001 - "
        '"POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        "2026-12-02T08:00:21.000000000Z INFO:     10.244.0.7:40002 - "
        '"POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        "2026-12-02T08:00:25.000000000Z INFO:     10.244.0.1:51000 - "
        '"POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        "2026-12-02T08:00:26.000000000Z INFO:     10.244.0.1:51001 - "
        '"GET /health HTTP/1.1" 200 OK\n'
        # After the proof (08:00:30): users are allowed.
        "2026-12-02T08:00:31.000000000Z INFO:     10.244.0.1:51002 - "
        '"POST /v1/chat/completions HTTP/1.1" 200 OK\n'
    )
    ledger = ServedLedger("demo", log_dir=tmp_path)
    ledger.operator_ips |= {"10.244.0.9", "10.244.0.7"}
    ledger.record([(KEY, 0.0, STARTED)], {})
    ledger.record([(KEY, 4.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"))
    (instance,) = ledger.instances.values()
    assert instance.proven_at == datetime(2026, 12, 2, 8, 0, 30, tzinfo=UTC)
    assert ledger.logged_user_requests(instance) == 1
    assert ledger.unproven_user_requests() == {"demo-replica-0 uid-0 r0": 1.0}
    # Its evidence says who sent each chat request before the proof.
    since = datetime(2026, 12, 2, 8, 0, 0, tzinfo=UTC).timestamp()
    (evidence,) = ledger.unproven_evidence(born_after=0.0, since=since).values()
    assert evidence["chat_requests_unproven"] == [
        (10.0, "10.244.0.9", "operator"),
        (20.5, "10.244.0.7", "operator"),
        (21.0, "10.244.0.7", "operator"),
        (25.0, "10.244.0.1", "user"),
    ]
    # A restarted container's next process has no log of its own: the counters decide.
    ledger.record([((POD, "uid-0", 1), 2.0, STARTED)], {})
    restarted = ledger.instances[(POD, "uid-0", 1)]
    assert ledger.logged_user_requests(restarted) is None


def test_a_user_request_on_an_unproven_instance_comes_with_its_evidence() -> None:
    ledger = ServedLedger("demo")
    ledger.record([(KEY, 0.0, STARTED)], {}, {KEY: "off"})
    # The canary's two and a user's, with the label on before the status shows the run: counted.
    ledger.record([(KEY, 3.0, STARTED)], {"runId": "r1", "verdict": "Running"}, {KEY: "on"})
    ledger.record([(KEY, 3.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"), {KEY: "on"})
    since = STARTED.timestamp()
    assert ledger.runs_started_after(since) == 1
    assert ledger.runs_started_after(since + 60) == 0
    (evidence,) = ledger.unproven_evidence(born_after=since - 1, since=since).values()
    assert [(count, label) for _, count, label in evidence["rises"]] == [(3.0, "on")]
    assert evidence["proven_by"] == "r1"
    assert evidence["engine_started_s"] == 0.0
    (seen,) = evidence["runs_seen"]
    assert (seen["run"], seen["verdict"], seen["started_s"], seen["wrote"], seen["read"]) == (
        "r1",
        "Passed",
        30.0,
        1,
        1,
    )


def test_an_instance_served_only_by_the_canary_has_no_evidence_to_show() -> None:
    ledger = ServedLedger("demo")
    ledger.record([(KEY, 2.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"))
    assert ledger.unproven_evidence(born_after=0.0, since=0.0) == {}


def test_only_the_canarys_requests_leave_nothing_and_old_instances_can_be_left_out() -> None:
    ledger = ServedLedger("demo")
    ledger.record([(KEY, 2.0, STARTED)], run("r1", "Passed", "2026-12-02T08:00:30Z"))
    assert ledger.unproven_user_requests() == {"demo-replica-0 uid-0 r0": 0.0}
    assert ledger.unproven_user_requests(born_after=STARTED.timestamp() + 1) == {}


def test_a_run_proves_an_instance_only_when_it_passed_after_it_started_and_covered_it_both_ways() -> None:
    instance = Instance(pod=POD, uid="uid-0", restarts=1, started_at=STARTED)
    assert covers(run("r", "Passed", "2026-12-02T08:00:30Z"), instance)
    assert not covers(run("r", "Passed", "2026-12-02T07:59:59Z"), instance)  # the engine before it
    assert not covers(run("r", "Inconclusive", "2026-12-02T08:00:30Z"), instance)
    one_way = run("r", "Passed", "2026-12-02T08:00:30Z")
    one_way["pairs"] = one_way["pairs"][:1]  # type: ignore[index]
    assert not covers(one_way, instance)


def test_a_restarted_operator_counts_everything_it_reports() -> None:
    assert counted_since({"op-a": 100.0}, {"op-a": 130.0}) == 30.0
    assert counted_since({"op-a": 100.0}, {"op-b": 12.0}) == 12.0


def test_a_restarted_operator_container_is_a_new_process_whose_counters_count_from_zero() -> None:
    pod = {"metadata": {"name": "op-a"}, "status": {"containerStatuses": [{"restartCount": 0}]}}
    restarted = {"metadata": {"name": "op-a"}, "status": {"containerStatuses": [{"restartCount": 1}]}}
    before, after = operator_process(pod), operator_process(restarted)
    assert before != after
    # The same pod after its container restarted (the API server's outage outlived the Lease): the new
    # process's 12 requests are counted, not 12 - 100.
    assert counted_since({before: 100.0}, {after: 12.0}) == 12.0
    assert operator_process({"metadata": {"name": "op-b"}, "status": {}}) == "op-b#0"


def test_the_log_lines_that_explain_a_failure_are_those_within_its_window() -> None:
    chat = '"POST /v1/chat/completions HTTP/1.1"'
    log = "\n".join(
        [
            f"2026-12-06T06:22:09.100000000Z INFO:     10.244.0.1:1 - {chat} 500 Internal",
            "2026-12-06T06:22:10.000000000Z E1206 06:22:10.000000   120 tcp.h:518] no transfer progress",
            f"2026-12-06T06:22:11.000000000Z INFO:     10.244.0.1:2 - {chat} 200 OK",
            "2026-12-06T06:25:00.000000000Z E1206 06:25:00.000000   120 later error, outside the window",
            "not a stamped line",
        ]
    )
    start = datetime(2026, 12, 6, 6, 22, 0, tzinfo=UTC)
    end = datetime(2026, 12, 6, 6, 23, 0, tzinfo=UTC)
    lines = failure_lines(log, start, end)
    assert [line.split(" ", 1)[0] for line in lines] == ["06:22:09.100", "06:22:10.000"]
    assert "500 Internal" in lines[0] and "no transfer progress" in lines[1]
