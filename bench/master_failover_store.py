"""Mooncake master failover at the store level, without vLLM: how long until keys are readable again.

Runs Debian's etcd, three `mooncake_master -enable_ha` (oplog on unless --no-oplog), a writer and a
reader `MooncakeDistributedStore` following the leader through `etcd://`; the writer puts 5 keys, the
leader is SIGKILLed, and the reader polls one key until it reads it again (or gives up). Run it with the
engine venv's python, in a loopback-only namespace:

    .venv/bin/python -m mooncake_sandbox.netns -- \
        ~/.cache/mooncake-operator/engine-venv/bin/python bench/master_failover_store.py [--no-oplog]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CLUSTER_ID = "bench-failover"
KEYS = [f"key-{i}" for i in range(5)]
GIVE_UP_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client(role: str, master: str, port: int) -> None:
    """A store client reading commands on stdin: `put KEY` (writer) or `get KEY` (reader)."""
    from mooncake.store import MooncakeDistributedStore  # the engine venv's

    store = MooncakeDistributedStore()
    config = {
        "local_hostname": f"127.0.0.1:{port}",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 64 << 20,
        "local_buffer_size": 16 << 20,
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master,
    }
    print(json.dumps({"setup": store.setup(config)}), flush=True)
    for line in sys.stdin:
        verb, key = line.split()
        if verb == "put":
            print(json.dumps({"put": store.put(key, key.encode() * 100)}), flush=True)
        else:
            value = store.get(key)
            print(json.dumps({"ok": value == key.encode() * 100}), flush=True)


class Client:
    def __init__(self, role: str, master: str, log: Path) -> None:
        env = {**os.environ, "MC_STORE_CLUSTER_ID": CLUSTER_ID}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--client", role, master, str(free_port())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )
        self.read()

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        return answer

    def ask(self, verb: str, key: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{verb} {key}\n")
        self.process.stdin.flush()
        return self.read()


def health(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except OSError:
        return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-oplog", action="store_true")
    args = parser.parse_args()
    master_binary = Path(sys.executable).parent / "mooncake_master"
    etcd_binary = shutil.which("etcd")
    if etcd_binary is None:
        raise SystemExit("needs Debian's etcd-server: apt-get install etcd-server")
    work = Path(tempfile.mkdtemp(prefix="master-failover-"))
    etcd_port, peer_port = free_port(), free_port()
    processes: list[subprocess.Popen[Any]] = []
    try:
        processes.append(
            subprocess.Popen(
                [
                    etcd_binary,
                    f"--data-dir={work / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                ],
                stdout=(work / "etcd.log").open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        time.sleep(2)
        masters = []
        for index in range(3):
            rpc, metrics = free_port(), free_port()
            argv = [
                str(master_binary),
                "-enable_ha=true",
                f"-etcd_endpoints=127.0.0.1:{etcd_port}",
                f"-cluster_id={CLUSTER_ID}",
                f"-enable_oplog={'false' if args.no_oplog else 'true'}",
                "-rpc_address=127.0.0.1",
                f"-rpc_port={rpc}",
                "-metrics_host=127.0.0.1",
                f"-metrics_port={metrics}",
                "-client_ttl=30",
            ]
            log = (work / f"master-{index}.log").open("w")
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            processes.append(process)
            masters.append((process, metrics))
        while not any(
            health(m).get("role") == "leader" and health(m).get("service_ready") for _, m in masters
        ):
            time.sleep(0.2)
        address = f"etcd://127.0.0.1:{etcd_port}"
        writer = Client("writer", address, work / "writer.log")
        reader = Client("reader", address, work / "reader.log")
        processes += [writer.process, reader.process]
        puts = [writer.ask("put", key)["put"] for key in KEYS]
        before = reader.ask("get", KEYS[0])["ok"]
        leader = next(i for i, (_, m) in enumerate(masters) if health(m).get("role") == "leader")
        killed_at = time.monotonic()
        masters[leader][0].send_signal(signal.SIGKILL)
        new_leader_s = readable_s = None
        while time.monotonic() - killed_at < GIVE_UP_S:
            if new_leader_s is None and any(
                health(m).get("role") == "leader" and health(m).get("service_ready")
                for i, (_, m) in enumerate(masters)
                if i != leader
            ):
                new_leader_s = round(time.monotonic() - killed_at, 1)
            if reader.ask("get", KEYS[0])["ok"]:
                readable_s = round(time.monotonic() - killed_at, 1)
                break
            time.sleep(0.25)
        while new_leader_s is None and time.monotonic() - killed_at < GIVE_UP_S:
            time.sleep(0.2)
            if any(health(m).get("service_ready") for i, (_, m) in enumerate(masters) if i != leader):
                new_leader_s = round(time.monotonic() - killed_at, 1)
        survivors = sum(reader.ask("get", key)["ok"] for key in KEYS)
        fresh = writer.ask("put", "fresh-after-failover")["put"]
        print(
            json.dumps(
                {
                    "enable_oplog": not args.no_oplog,
                    "puts_before": puts,
                    "readable_before": before,
                    "new_leader_serving_after_s": new_leader_s,
                    "key_readable_again_after_s": readable_s,
                    "keys_readable_after_failover": f"{survivors}/{len(KEYS)}",
                    "fresh_put_after_failover": fresh,
                    "fresh_get_after_failover": reader.ask("get", "fresh-after-failover")["ok"],
                }
            )
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
