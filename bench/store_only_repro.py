"""Store-only attempt at the transfer stall: mooncake_master + a writer and a reader process, no vLLM.

    .venv/bin/python -m mooncake_sandbox.netns -- \
        ~/.cache/mooncake-operator/engine-venv/bin/python bench/store_only_repro.py MODE ROUNDS [--burn]

Runs with the engine venv's python (it has `mooncake`), inside the loopback-only namespace (store clients
listen on 0.0.0.0). Each round the writer puts 4 x 256 KiB blocks with `preferred_segment` set to its own
segment, so the reader's get always goes over the tcp transport (`strategy: 1` in the log with
GLOG_v=1), and prints both latencies. MODE is what the writer does between rounds: `sleep`, `spin` (a
busy Python loop, like a busy worker) or `pin` (the same, pinned to cpu 0). `--burn` runs a 2-thread torch
matmul loop in the reader meanwhile, like a model forward. Results: docs/sandbox.md, bench/RESULTS.md.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

BLOCKS = 4
BLOCK = 256 << 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def open_store(master: str) -> tuple[Any, int]:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) != 0:
        raise SystemExit("store setup failed")
    buffer = (ctypes.c_char * (BLOCKS * BLOCK))()
    base = ctypes.addressof(buffer)
    store.register_buffer(base, BLOCKS * BLOCK)
    open_store.keep = buffer  # type: ignore[attr-defined]  # the registered memory must stay alive
    return store, base


def writer(master: str, conn: Connection, mode: str) -> None:
    from mooncake.store import ReplicateConfig

    if mode == "pin":
        os.sched_setaffinity(0, {0})
    store, base = open_store(master)
    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()  # keep the blocks here: the reader must use tcp
    while (name := conn.recv()) is not None:
        keys = [f"{name}-{i}" for i in range(BLOCKS)]
        started = time.monotonic()
        result = store.batch_put_from(
            keys, [base + i * BLOCK for i in range(BLOCKS)], [BLOCK] * BLOCKS, config
        )
        conn.send((result, time.monotonic() - started))
        if mode in ("spin", "pin"):
            end = time.monotonic() + 3
            while time.monotonic() < end and not conn.poll():
                pass


def reader(master: str, conn: Connection, burn: bool) -> None:
    store, base = open_store(master)
    if burn:
        import torch

        torch.set_num_threads(2)
        matrix = torch.randn(384, 384)

        def forward_like() -> None:
            while True:
                torch.mm(matrix, matrix)

        threading.Thread(target=forward_like, daemon=True).start()
    while (name := conn.recv()) is not None:
        keys = [f"{name}-{i}" for i in range(BLOCKS)]
        started = time.monotonic()
        result = store.batch_get_into(keys, [base + i * BLOCK for i in range(BLOCKS)], [BLOCK] * BLOCKS)
        conn.send((result, time.monotonic() - started))


def main() -> None:
    mode, rounds, burn = sys.argv[1], int(sys.argv[2]), "--burn" in sys.argv[3:]
    import mooncake

    port = free_port()
    executable = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    argv = [executable, "-rpc_address=127.0.0.1", f"-rpc_port={port}", "-metrics_host=127.0.0.1"]
    argv += [f"-metrics_port={free_port()}", "-client_ttl=60", "-default_kv_lease_ttl=120s"]
    master = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    address = f"127.0.0.1:{port}"
    context = mp.get_context("spawn")
    to_writer, writer_end = context.Pipe()
    to_reader, reader_end = context.Pipe()
    processes = [
        context.Process(target=writer, args=(address, writer_end, mode)),
        context.Process(target=reader, args=(address, reader_end, burn)),
    ]
    for process in processes:
        process.start()
    worst = 0.0
    try:
        for index in range(rounds):
            to_writer.send(f"r{index}")
            put_result, put_s = to_writer.recv()
            to_reader.send(f"r{index}")
            get_result, get_s = to_reader.recv()
            worst = max(worst, get_s)
            failed = " FAILED" if any(value < 0 for value in get_result) else ""
            print(f"round {index}: put {put_s * 1000:.1f} ms {put_result} get {get_s * 1000:.1f} ms{failed}")
        print(f"worst get {worst:.3f} s")
    finally:
        to_writer.send(None)
        to_reader.send(None)
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        master.terminate()
        master.wait(10)


if __name__ == "__main__":
    main()
