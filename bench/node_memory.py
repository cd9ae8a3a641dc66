"""Memory of scripts/cluster's node: RSS of each process `up` started (state.json), of the containerd
shims, and of the pods (the kubelet's memory cgroup, total_rss). Run as root while a cluster is up:

    python3 bench/node_memory.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

STATE = Path("/var/lib/mooncake-cluster/state.json")
POD_CGROUP = Path("/sys/fs/cgroup/memory/mooncake-cluster/memory.stat")


def rss_mib(pid: int | str) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0
    found = re.search(r"VmRSS:\s+(\d+)", status)
    return int(found.group(1)) / 1024 if found else 0.0


def main() -> None:
    state = json.loads(STATE.read_text())
    node = 0.0
    for name, process in state["pids"].items():
        value = rss_mib(process["pid"])
        node += value
        print(f"{name:28s} {value:7.0f} MiB")
    shims = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"containerd-shim" in cmdline and b"mooncake-cluster" in cmdline:
            shims += rss_mib(pid)
    print(f"{'containerd shims':28s} {shims:7.0f} MiB")
    stat = dict(line.split() for line in POD_CGROUP.read_text().splitlines())
    pods = int(stat["total_rss"]) / 2**20
    print(f"{'pods (cgroup total_rss)':28s} {pods:7.0f} MiB")
    print(f"{'node':28s} {node + shims:7.0f} MiB")
    print(f"{'total':28s} {node + shims + pods:7.0f} MiB")


if __name__ == "__main__":
    main()
