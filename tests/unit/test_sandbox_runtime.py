"""The sandbox's orchestration against fake engines: real processes and HTTP, no vLLM.

The fake `python` and `mooncake_master` below stand in for the engine venv's: the fake engine records
the argv and environment it was started with, then serves /health on the port it was given. That is
enough to prove the sandbox launches exactly what `engine_args` produces, waits, watches, and always
tears down, in well under a minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from mooncake_operator.build.engine_args import kv_fingerprint, replica_launch
from mooncake_operator.canary.evidence import PER_REQUEST_FLAG, PER_REQUEST_SPEC_OPTION
from mooncake_sandbox import (
    EngineBuild,
    EngineMode,
    MasterDownError,
    Prepared,
    ReplicaDiedError,
    SandboxOptions,
    SandboxSetupError,
    SilentProgress,
    sandbox_spec,
    start_sandbox,
)
from mooncake_sandbox.engine_env import EngineEnv
from mooncake_sandbox.models import (
    PERTURBATION_GENERATOR,
    PerturbedTarget,
    ReasoningTarget,
    TinyModels,
    perturbed_dir,
    reasoning_dir,
)
from mooncake_sandbox.processes import group_members, port_is_free
from mooncake_sandbox.runtime import (
    MASTER_CLIENT_TTL_S,
    MASTER_KV_LEASE_TTL_S,
    SANDBOX_RUNTIME_ENV,
    SERVER_MODULE,
    replica_env,
    substitutions_for,
)

pytestmark = pytest.mark.unit

FAKE_WORKER = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").close(), sys.exit(0)))
time.sleep(3600)
"""

FAKE_ENGINE = r"""
import http.server, json, os, signal, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
behaviour = os.environ.get("FAKE_ENGINE", "serve")
record = os.path.join(os.environ["FAKE_RECORDS"], f"{port}-{time.monotonic_ns()}.json")
with open(record, "w") as out:
    json.dump({"argv": sys.argv, "env": dict(os.environ)}, out)
if behaviour == "exit":
    print("fake engine: cannot load the model", flush=True)
    sys.exit(7)
# Its store segment (a file the fake master counts) and a worker in its process group, like vLLM's.
# Stopped the kubelet's way (SIGTERM to this process alone), it stops its worker and, unless told
# otherwise by FAKE_STOP, unmounts its segment; a worker that gets SIGTERM itself leaves a mark.
segment = os.path.join(os.environ["FAKE_RECORDS"], "segments", str(port))
os.makedirs(os.path.dirname(segment), exist_ok=True)
if os.environ.get("FAKE_MOUNT", "yes") == "yes":
    with open(segment, "w") as out:
        out.write("1000")
worker = subprocess.Popen([sys.executable, "-c", WORKER, record + ".worker-sigterm"])
stop = os.environ.get("FAKE_STOP", "drains")

def on_sigterm(signum, frame):
    worker.kill()
    if stop == "drains" and os.path.exists(segment):
        os.remove(segment)
    if stop == "unmounts-late":  # the master sees the segment leave 1.5 s after the process exited
        subprocess.Popen(["sh", "-c", f"sleep 1.5; rm -f {segment}"], start_new_session=True)
    os._exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if stop == "ignores-sigterm" else on_sigterm)
if behaviour == "never-healthy":
    time.sleep(3600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            # Every answered chat counts as a 128-token load from the store, except when it never loads.
            hits = 0 if behaviour == "never-loads" else 128 * Health.answered
            body = f'vllm:external_prefix_cache_hits_total{{model_name="m"}} {hits}.0\n'.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    posts = 0
    answered = 0
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Health.posts += 1
        if behaviour == "chat-500" or (behaviour == "chat-500-first" and Health.posts == 1):
            self.send_response(500)
            self.end_headers()
            return
        body = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 185, "completion_tokens": 1}}).encode()
        Health.answered += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

print("fake engine: serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

FAKE_MASTER = r"""
import http.server, os, socket, sys, threading
def flag(name):
    return int(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"-{name}=")))
port = int(flag("rpc_port"))
segments = os.path.join(os.environ["FAKE_RECORDS"], "segments")

class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        mounted = os.listdir(segments) if os.path.isdir(segments) else []
        body = f"master_total_capacity_bytes {1000 * len(mounted)}\n"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())
    def log_message(self, *args):
        pass

metrics = http.server.HTTPServer(("127.0.0.1", flag("metrics_port")), Metrics)
threading.Thread(target=metrics.serve_forever, daemon=True).start()
server = socket.create_server(("127.0.0.1", port))
print("fake master: listening", sys.argv[1:], flush=True)
while True:
    server.accept()[0].close()
"""


def _wrapper(path: Path, script: Path) -> None:
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    path.chmod(0o755)


@pytest.fixture
def prepared(tmp_path: Path) -> Prepared:
    venv = tmp_path / "engine-venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE.replace("WORKER", repr(FAKE_WORKER)))
    (tmp_path / "fake_master.py").write_text(FAKE_MASTER)
    _wrapper(venv / "bin" / "python", tmp_path / "fake_engine.py")
    _wrapper(venv / "bin" / "mooncake_master", tmp_path / "fake_master.py")
    builds = {
        mode: EngineBuild(
            mode=mode,
            pythonpath=tmp_path / f"overlay-{mode.value}",
            vllm_dir=tmp_path / f"overlay-{mode.value}" / "vllm",
            patcher_status=mode.value,
            patcher_detail="fake",
        )
        for mode in EngineMode
    }
    return Prepared(
        cache=tmp_path, env=EngineEnv(venv), models=TinyModels(tmp_path / "models"), builds=builds
    )


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "records"
    path.mkdir()
    return path


def _env(records: Path, behaviour: str = "serve") -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "FAKE_RECORDS": str(records),
        "FAKE_ENGINE": behaviour,
        "VIRTUAL_ENV": "/somewhere/.venv",
        "PYTHONPATH": "/somewhere/else",
    }


class RecordingProgress(SilentProgress):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def phase(self, message: str) -> None:
        self.lines.append(message)


def _recorded(records: Path, port: int) -> list[dict[str, object]]:
    return [json.loads(path.read_text()) for path in sorted(records.glob(f"{port}-*.json"))]


def _workers_signalled(records: Path) -> list[Path]:
    """Marks left by fake workers that received SIGTERM themselves."""
    return sorted(records.glob("*.worker-sigterm"))


def _options(tmp_path: Path, **changes: object) -> SandboxOptions:
    settings: dict[str, object] = {
        "engine": EngineMode.BUGGY,
        "run_dir": tmp_path / "run",
        "stop_grace_s": 2.0,
    }
    settings.update(changes)
    return SandboxOptions(**settings)  # type: ignore[arg-type]


async def test_replicas_run_exactly_what_engine_args_renders(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        assert len(sandbox.replica_urls) == 2 and len(set(sandbox.replica_urls)) == 2
        for replica in sandbox.replicas:
            (seen,) = _recorded(records, replica.port)
            config_path = sandbox.run_dir / f"{replica.name}.mooncake_store.json"
            expected = replica_launch(
                sandbox_spec(speculative=True),
                master_address=sandbox.master_address,
                host="127.0.0.1",
                port=replica.port,
                store_config_path=str(config_path),
                entrypoint=(str(prepared.env.python), "-m", SERVER_MODULE),
                substitutions=substitutions_for(prepared.models, speculative=True),
            )
            assert seen["argv"][1:] == list(expected.argv[1:])  # argv[0]: the wrapper's python
            # The canary's per-request evidence, as production renders it (Eagle on: both flags).
            argv = seen["argv"]
            assert isinstance(argv, list) and PER_REQUEST_FLAG in argv
            assert argv[argv.index(PER_REQUEST_SPEC_OPTION) + 1] == "summary"
            env = seen["env"]
            assert isinstance(env, dict)
            assert env["PYTHONHASHSEED"] == expected.env["PYTHONHASHSEED"] == "0"
            assert env["MOONCAKE_CONFIG_PATH"] == str(config_path)
            assert json.loads(config_path.read_text()) == dict(expected.store_config)
            assert env["PYTHONPATH"] == str(prepared.builds[EngineMode.BUGGY].pythonpath)
            assert "VIRTUAL_ENV" not in env
            assert all(env[key] == value for key, value in SANDBOX_RUNTIME_ENV.items())
        master_log = (sandbox.run_dir / "mooncake-master.log").read_text()
        assert f"-rpc_port={sandbox.master_port}" in master_log
        assert "-rpc_address=127.0.0.1" in master_log
        assert f"-client_ttl={MASTER_CLIENT_TTL_S}" in master_log
        assert f"-default_kv_lease_ttl={MASTER_KV_LEASE_TTL_S}s" in master_log
        groups = [replica.process.pgid for replica in sandbox.replicas if replica.process]
        assert sandbox.master is not None
        groups.append(sandbox.master.pgid)
        ports = [replica.port for replica in sandbox.replicas] + [sandbox.master_port]
    assert all(group_members(pgid) == [] for pgid in groups)
    assert all(port_is_free(port) for port in ports)


async def test_describe_lists_every_substitution(tmp_path: Path, prepared: Prepared, records: Path) -> None:
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        lines = sandbox.describe()
    text = "\n".join(lines)
    assert "block-size: 16 -> 32" in text
    assert "tensor-parallel-size: 4 -> 1" in text
    assert "draft model: thoughtworks/MiniMax-M2.5-Eagle3" in text
    assert "mooncake_master -client_ttl: 10 s -> 60 s (store.master.clientTtlSeconds)" in text
    assert "mooncake_master -default_kv_lease_ttl: 10 s -> 120 s (store.master.kvLeaseTtlSeconds)" in text
    assert "VLLM_CPU_KVCACHE_SPACE=1" in text
    assert "replica-A" in text and "engine buggy (patch_connector.py status: buggy)" in text


async def test_a_replica_that_exits_during_start_up_is_a_setup_error_with_its_log(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    started = time.monotonic()
    with pytest.raises(SandboxSetupError) as caught:
        async with start_sandbox(
            _options(tmp_path),
            progress=SilentProgress(),
            prepared=prepared,
            inherited_env=_env(records, "exit"),
        ):
            pytest.fail("the sandbox must not start")
    message = str(caught.value)
    assert "exited with code 7 during start-up" in message
    assert "fake engine: cannot load the model" in message
    assert time.monotonic() - started < 30
    assert (tmp_path / "run" / "replica-A.0.log").exists(), "logs are kept after a failure"


async def test_start_up_gives_up_after_the_timeout(tmp_path: Path, prepared: Prepared, records: Path) -> None:
    options = _options(tmp_path, startup_timeout_s=1.0)
    with pytest.raises(SandboxSetupError, match="not healthy after"):
        async with start_sandbox(
            options,
            progress=SilentProgress(),
            prepared=prepared,
            inherited_env=_env(records, "never-healthy"),
        ):
            pytest.fail("the sandbox must not start")


async def test_store_paths_are_warmed_and_a_transient_failure_is_retried(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    progress = RecordingProgress()
    async with start_sandbox(
        _options(tmp_path),
        progress=progress,
        prepared=prepared,
        inherited_env=_env(records, "chat-500-first"),
    ):
        pass
    assert any("warm-up replica-A -> replica-B attempt 1 failed" in line for line in progress.lines)
    assert any("store transfer paths warmed (2 pairs)" in line for line in progress.lines)


@pytest.mark.parametrize(
    ("behaviour", "why"),
    [
        ("chat-500", "HTTP 500"),
        # HTTP 200 on both sides is not enough: the reader must have loaded from the store once.
        (
            "never-loads",
            "replica-B loaded nothing from the store (vllm:external_prefix_cache_hits_total did not rise)",
        ),
    ],
)
async def test_a_store_path_that_never_works_is_a_setup_error(
    tmp_path: Path, prepared: Prepared, records: Path, behaviour: str, why: str
) -> None:
    with pytest.raises(SandboxSetupError, match="failed 3 warm-up attempts") as caught:
        async with start_sandbox(
            _options(tmp_path),
            progress=SilentProgress(),
            prepared=prepared,
            inherited_env=_env(records, behaviour),
        ):
            pytest.fail("the sandbox must not start")
    assert why in str(caught.value)


async def test_a_replica_dying_mid_run_fails_fast(tmp_path: Path, prepared: Prepared, records: Path) -> None:
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        victim = sandbox.replicas[1].process
        assert victim is not None
        asyncio.get_running_loop().call_later(0.3, os.kill, victim.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ReplicaDiedError) as caught:
            await sandbox.guard(asyncio.sleep(3600))
        assert time.monotonic() - started < 5
        assert f"replica-B (pid {victim.pid}" in str(caught.value)
        assert "fake engine: serving" in str(caught.value)


async def test_master_down_is_a_setup_error(tmp_path: Path, prepared: Prepared, records: Path) -> None:
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        assert sandbox.master is not None
        os.kill(sandbox.master.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        with pytest.raises(MasterDownError, match=r"Mooncake master at 127\.0\.0\.1:\d+ is not running"):
            sandbox.check_alive()
        with pytest.raises(SandboxSetupError, match="not running"):
            await sandbox.restart_replica(0)


async def test_restart_changes_only_what_was_asked(tmp_path: Path, prepared: Prepared, records: Path) -> None:
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        replica_b = sandbox.replicas[1]
        old = replica_b.process
        assert old is not None
        started = time.monotonic()
        await sandbox.restart_replica(1, speculative=False, engine=EngineMode.PATCHED)
        # Stopped the kubelet's way: SIGTERM to the API server alone, which stopped its worker and
        # unmounted its segment; the restart went on as soon as the master showed it gone, not after
        # the client TTL (60 s here).
        assert group_members(old.pgid) == []
        assert _workers_signalled(records) == []
        assert time.monotonic() - started < MASTER_CLIENT_TTL_S / 2
        assert await sandbox.store_capacity_bytes() == 2000  # A's segment and the new B's
        first, second = _recorded(records, replica_b.port)
        assert "--speculative-config" in first["argv"]  # type: ignore[operator]
        assert "--speculative-config" not in second["argv"]  # type: ignore[operator]
        # vLLM refuses the spec-decode evidence flag without a draft; the cached-token one stays.
        assert PER_REQUEST_SPEC_OPTION in first["argv"]  # type: ignore[operator]
        assert PER_REQUEST_SPEC_OPTION not in second["argv"]  # type: ignore[operator]
        assert PER_REQUEST_FLAG in second["argv"]  # type: ignore[operator]
        env = second["env"]
        assert isinstance(env, Mapping)
        assert env["PYTHONPATH"] == str(prepared.builds[EngineMode.PATCHED].pythonpath)
        assert replica_b.url == sandbox.replica_urls[1]
        (replica_a,) = _recorded(records, sandbox.replicas[0].port)  # replica A untouched
        assert "--speculative-config" in replica_a["argv"]  # type: ignore[operator]


async def test_a_restart_under_the_sandboxs_own_guard_is_not_a_dead_replica(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    # A scenario that restarts a replica while it watches every process (revision-change does): the
    # replica is gone while the master still counts its segment, and that is the restart, not a death.
    env = {**_env(records), "FAKE_STOP": "unmounts-late"}
    async with start_sandbox(
        _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=env
    ) as sandbox:
        await sandbox.guard(sandbox.restart_replica(1))
        sandbox.check_alive()
        assert len(_recorded(records, sandbox.replicas[1].port)) == 2


@pytest.mark.parametrize(
    ("stop", "why"),
    [
        ("keeps-segment", "exits without unmounting, as workers force-killed by vLLM's default shutdown"),
        ("ignores-sigterm", "never exits by itself and is killed at the end of its grace"),
    ],
)
async def test_a_restart_refuses_to_go_on_while_the_master_lists_the_old_segment(
    tmp_path: Path, prepared: Prepared, records: Path, stop: str, why: str
) -> None:
    options = _options(tmp_path, drain_grace_s=0.5, segment_drop_wait_s=1.0)
    env = {**_env(records), "FAKE_STOP": stop}
    async with start_sandbox(
        options, progress=SilentProgress(), prepared=prepared, inherited_env=env
    ) as sandbox:
        old = sandbox.replicas[1].process
        assert old is not None
        with pytest.raises(
            SandboxSetupError,
            match=r"still lists 2000 bytes .* hold 1000\); the old segments were never unmounted",
        ):
            await sandbox.restart_replica(1)
        assert group_members(old.pgid) == []  # stopped, killed if it had to be
        assert len(_recorded(records, sandbox.replicas[1].port)) == 1  # and no replacement started


async def test_replicas_whose_store_never_mounted_are_a_setup_error(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    env = {**_env(records), "FAKE_MOUNT": "no"}
    with pytest.raises(SandboxSetupError, match="the master counts no store segment"):
        async with start_sandbox(
            _options(tmp_path), progress=SilentProgress(), prepared=prepared, inherited_env=env
        ):
            pass


async def test_cancellation_during_start_up_leaves_nothing_behind(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    async def run() -> None:
        async with start_sandbox(
            _options(tmp_path),
            progress=SilentProgress(),
            prepared=prepared,
            inherited_env=_env(records, "never-healthy"),
        ):
            pytest.fail("the sandbox must not start")

    task = asyncio.ensure_future(run())
    await _until(lambda: len(list(records.glob("*.json"))) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    leftovers = [
        pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _mentions(pid, str(tmp_path))
    ]
    assert leftovers == []


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _mentions(pid: int, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_replica_env_keeps_production_values_over_everything() -> None:
    build = EngineBuild(EngineMode.PATCHED, Path("/overlay"), Path("/overlay/vllm"), "patched", "")
    launch = replica_launch(
        sandbox_spec(speculative=True), master_address="127.0.0.1:1", store_config_path="/run/store.json"
    )
    inherited = {
        "HOME": "/root",
        "PYTHONHASHSEED": "random",
        "MOONCAKE_CONFIG_PATH": "/etc/x",
        "PYTHONHOME": "/p",
    }

    env = replica_env(inherited, launch, build)

    assert env["HOME"] == "/root"
    assert env["PYTHONHASHSEED"] == "0"
    assert env["MOONCAKE_CONFIG_PATH"] == "/run/store.json"
    assert env["PYTHONPATH"] == "/overlay"
    assert "PYTHONHOME" not in env


def test_no_speculative_spec_is_the_customer_spec_without_its_draft() -> None:
    with_draft, without = sandbox_spec(speculative=True), sandbox_spec(speculative=False)
    assert with_draft.speculative is not None and without.speculative is None
    assert with_draft.model_copy(update={"speculative": None}) == without


def test_replica_count_is_bounded() -> None:
    with pytest.raises(ValueError, match="between 1 and 8"):
        SandboxOptions(replicas=0)


def _fake_perturbed_target(models: TinyModels, bound: float) -> Path:
    """What perturbed_model.py leaves behind (the fake engine venv cannot run it)."""
    path = perturbed_dir(models, bound)
    path.mkdir(parents=True)
    report = {"bound_nats": bound, "effective_bound_nats": bound * 1.1, "typical_move_nats": bound / 11}
    (path / "perturbation.json").write_text(json.dumps(report))
    return path


async def test_a_perturbed_replica_differs_from_the_others_only_in_its_model_directory(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    perturbed = _fake_perturbed_target(prepared.models, 0.2)
    options = _options(tmp_path, perturb_nats=0.2, segment_drop_wait_s=0.5)
    async with start_sandbox(
        options, progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        replica_a, replica_b = sandbox.replicas
        (seen_a,) = _recorded(records, replica_a.port)
        (seen_b,) = _recorded(records, replica_b.port)
        argv_a, argv_b = seen_a["argv"], seen_b["argv"]
        assert isinstance(argv_a, list) and isinstance(argv_b, list)
        model_at = argv_a.index("--model") + 1
        assert argv_a[model_at] == str(prepared.models.target)
        assert argv_b[model_at] == str(perturbed) and perturbed.name == "target"  # same store key
        differing = {index for index, (a, b) in enumerate(zip(argv_a, argv_b, strict=True)) if a != b}
        assert differing == {model_at, argv_a.index("--port") + 1}
        assert sandbox.key_namespace(replica_a) == sandbox.key_namespace(replica_b)
        assert "lm_head perturbed: every logit moves by at most 0.22 nats" in sandbox.describe()[-1]

        await sandbox.restart_replica(1, engine=EngineMode.PATCHED)  # the perturbation is kept
        await sandbox.restart_replica(1, perturb_nats=None)  # and dropped
        _, kept, dropped = _recorded(records, replica_b.port)
        assert kept["argv"][model_at] == str(perturbed)  # type: ignore[index]
        assert dropped["argv"][model_at] == str(prepared.models.target)  # type: ignore[index]
        assert replica_b.perturb_nats is None

        await sandbox.restart_replicas([0, 1], perturb_nats={1: 0.2})  # per replica
        assert _recorded(records, replica_a.port)[-1]["argv"][model_at] == str(prepared.models.target)  # type: ignore[index]
        assert _recorded(records, replica_b.port)[-1]["argv"][model_at] == str(perturbed)  # type: ignore[index]
        assert (replica_a.perturb_nats, replica_b.perturb_nats) == (None, 0.2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"perturb_nats": 0.0}, "between 0 and 10 nats"),
        ({"perturb_nats": float("nan")}, "between 0 and 10 nats"),
        ({"perturb_nats": 11.0}, "between 0 and 10 nats"),
        ({"perturb_nats": 0.1, "perturbed": (2,)}, "indices of the 2 replicas"),
        ({"perturb_nats": 0.1, "perturbed": ()}, "indices of the 2 replicas"),
    ],
)
def test_perturbation_options_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SandboxOptions(**changes)  # type: ignore[arg-type]


def test_the_perturbed_copy_is_of_revision_1_only(tmp_path: Path) -> None:
    models = TinyModels(tmp_path)
    copy = PerturbedTarget(perturbed_dir(models, 0.1), 0.1, 0.11, 0.01)
    assert substitutions_for(models, speculative=True, perturbed=copy).model_path == str(copy.path)
    with pytest.raises(ValueError, match="revision 1"):
        substitutions_for(models, speculative=True, revision=2, perturbed=copy)


def test_perturbed_copies_are_cached_per_bound_and_generator(tmp_path: Path) -> None:
    models = TinyModels(tmp_path)
    first, second = perturbed_dir(models, 0.1), perturbed_dir(models, 0.2)
    assert first != second and first.name == second.name == "target"
    digest = hashlib.sha256(PERTURBATION_GENERATOR.read_bytes()).hexdigest()[:16]
    assert first.parent.name == f"{digest}-0.1"


def _with_reasoning_target(prepared: Prepared) -> Prepared:
    """What reasoning_model.py leaves behind, as `prepare` records it (the fake venv cannot run it)."""
    path = reasoning_dir(prepared.models)
    path.mkdir(parents=True)
    reasoning = ReasoningTarget(path=path, think_end_id=4, probe_reasoning_tokens=24)
    return Prepared(prepared.cache, prepared.env, prepared.models, prepared.builds, reasoning=reasoning)


async def test_reasoning_replicas_serve_the_reasoning_target_with_and_without_a_parser(
    tmp_path: Path, prepared: Prepared, records: Path
) -> None:
    prepared = _with_reasoning_target(prepared)
    assert prepared.reasoning is not None
    options = _options(tmp_path, reasoning_model=True, reasoning_parser="minimax_m2", segment_drop_wait_s=0.5)
    async with start_sandbox(
        options, progress=SilentProgress(), prepared=prepared, inherited_env=_env(records)
    ) as sandbox:
        replica_a, replica_b = sandbox.replicas
        (seen_a,) = _recorded(records, replica_a.port)
        argv = seen_a["argv"]
        assert isinstance(argv, list)
        assert argv[argv.index("--model") + 1] == str(prepared.reasoning.path)
        # The parser is production's extraArgs item, after everything engine_args manages.
        assert argv[-2:] == ["--reasoning-parser", "minimax_m2"]
        expected = replica_launch(
            sandbox_spec(speculative=True, reasoning_parser="minimax_m2"),
            master_address=sandbox.master_address,
            host="127.0.0.1",
            port=replica_a.port,
            store_config_path=str(sandbox.run_dir / f"{replica_a.name}.mooncake_store.json"),
            entrypoint=(str(prepared.env.python), "-m", SERVER_MODULE),
            substitutions=substitutions_for(prepared.models, speculative=True, reasoning=prepared.reasoning),
        )
        assert argv[1:] == list(expected.argv[1:])
        text = "\n".join(sandbox.describe())
        assert "--reasoning-parser minimax_m2" in text and "reasoning variant of the target" in text
        # A parser does not change the KV: both keep one store key namespace with or without it.
        namespace = sandbox.key_namespace(replica_b)

        await sandbox.restart_replica(1, reasoning_parser=None)
        await sandbox.restart_replica(1, engine=EngineMode.PATCHED)  # kept off

        _, without, kept = _recorded(records, replica_b.port)
        for seen in (without, kept):
            argv_b = seen["argv"]
            assert isinstance(argv_b, list)
            assert "--reasoning-parser" not in argv_b
            assert argv_b[argv_b.index("--model") + 1] == str(prepared.reasoning.path)
        assert sandbox.key_namespace(replica_b) == namespace
        assert (replica_a.reasoning_parser, replica_b.reasoning_parser) == ("minimax_m2", None)

        # A perturbed copy exists of the plain target only: refused before any replica stops.
        with pytest.raises(ValueError, match="not of the reasoning one"):
            await sandbox.restart_replica(1, perturb_nats=0.2)
        assert replica_b.process is not None and replica_b.process.exit_code() is None
        assert replica_b.perturb_nats is None and len(_recorded(records, replica_b.port)) == 3


@pytest.mark.parametrize("name", ["", "MiniMax", "minimax_m2 --trust-remote-code", "-x", "a" * 65])
def test_a_reasoning_parser_is_one_parser_name(name: str) -> None:
    with pytest.raises(ValueError, match="vLLM parser name"):
        SandboxOptions(reasoning_parser=name)
    with pytest.raises(ValueError, match="vLLM parser name"):
        sandbox_spec(speculative=True, reasoning_parser=name)


def test_the_reasoning_target_has_no_perturbed_copy_and_no_second_revision(tmp_path: Path) -> None:
    models = TinyModels(tmp_path)
    reasoning = ReasoningTarget(reasoning_dir(models), 4, 24)
    assert substitutions_for(models, speculative=True, reasoning=reasoning).model_path == str(reasoning.path)
    assert reasoning.path.name != models.target.name  # its blocks never share keys with the plain target's
    with pytest.raises(ValueError, match="one revision"):
        substitutions_for(models, speculative=True, revision=2, reasoning=reasoning)
    with pytest.raises(ValueError, match="not of the reasoning one"):
        SandboxOptions(reasoning_model=True, perturb_nats=0.2)


def test_a_parser_in_extra_args_keeps_the_kv_fingerprint() -> None:
    plain = sandbox_spec(speculative=True)
    parsed = sandbox_spec(speculative=True, reasoning_parser="minimax_m2")
    assert parsed.engine.extra_args == ["--reasoning-parser", "minimax_m2"]
    assert kv_fingerprint(plain) == kv_fingerprint(parsed)
