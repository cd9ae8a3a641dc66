"""The cluster DNS stand-in of scripts/cluster: Debian's dnsmasq, fed from the API's Services and Endpoints.

CoreDNS is not obtainable from the package registries this project builds from. This feeder is the
smallest honest replacement: every second it lists Services and Endpoints, writes a hosts file with
the names the product uses, and sends dnsmasq SIGHUP when the file changed (dnsmasq re-reads it; only
once dnsmasq handles SIGHUP, which otherwise ends it).

    SVC.NS.svc.cluster.local            -> the ClusterIP, or every ready endpoint of a headless Service
    HOSTNAME.SVC.NS.svc.cluster.local   -> the endpoint with that hostname (StatefulSet pods)

It is not CoreDNS: no SRV records, no PTR records, no wildcard or pod-IP names, answers up to a second
late. Run inside the cluster's network namespace:

    python -m tests.support.cluster_dns --kubeconfig FILE --hosts FILE --dnsmasq-pid PID
"""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

DOMAIN = "cluster.local"


def hosts_entries(services: list[dict[str, Any]], endpoints: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(ip, name) pairs for the hosts file, sorted so an unchanged cluster gives an unchanged file."""
    by_key = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in endpoints}
    entries: set[tuple[str, str]] = set()
    for service in services:
        namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
        fqdn = f"{name}.{namespace}.svc.{DOMAIN}"
        cluster_ip = service.get("spec", {}).get("clusterIP")
        headless = cluster_ip in (None, "", "None")
        if not headless:
            entries.add((cluster_ip, fqdn))
        for subset in by_key.get((namespace, name), {}).get("subsets") or []:
            for address in subset.get("addresses") or []:
                if headless:
                    entries.add((address["ip"], fqdn))
                if address.get("hostname"):
                    entries.add((address["ip"], f"{address['hostname']}.{fqdn}"))
    return sorted(entries)


def render_hosts(entries: list[tuple[str, str]]) -> str:
    return "".join(f"{ip} {name}\n" for ip, name in entries)


def _client(kubeconfig: Path) -> httpx.Client:
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    return httpx.Client(
        base_url=cluster["server"],
        verify=ssl.create_default_context(cafile=cluster["certificate-authority"]),
        headers={"Authorization": f"Bearer {user['token']}"},
        timeout=10.0,
    )


def handles_sighup(pid: int) -> bool:
    """Whether process `pid` has installed a SIGHUP handler yet (its /proc status, `SigCgt`)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1)))


def reload(dnsmasq_pid: int, timeout: float = 60.0) -> None:
    """SIGHUP dnsmasq once it handles it: before that, SIGHUP's default action ends it, and a loaded
    node started dnsmasq slower than this feeder's first listing (it died without a word, the cluster's
    names stopped resolving and every engine's store client failed to reach its master)."""
    deadline = time.monotonic() + timeout
    try:
        while not handles_sighup(dnsmasq_pid):
            if time.monotonic() > deadline:
                sys.exit(
                    f"cluster-dns: dnsmasq (pid {dnsmasq_pid}) installed no SIGHUP handler in {timeout:.0f} s"
                )
            time.sleep(0.05)
        os.kill(dnsmasq_pid, signal.SIGHUP)
    except (FileNotFoundError, ProcessLookupError):
        sys.exit(f"cluster-dns: dnsmasq (pid {dnsmasq_pid}) is gone: the cluster's names no longer resolve")


def run(kubeconfig: Path, hosts: Path, dnsmasq_pid: int, interval: float) -> None:
    last = None
    with _client(kubeconfig) as http:
        while True:
            try:
                services = http.get("/api/v1/services").raise_for_status().json()["items"]
                endpoints = http.get("/api/v1/endpoints").raise_for_status().json()["items"]
            except httpx.HTTPError as error:
                print(f"cluster-dns: listing failed, keeping the last answers: {error}", file=sys.stderr)
            else:
                text = render_hosts(hosts_entries(services, endpoints))
                if text != last:
                    tmp = hosts.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(hosts)
                    reload(dnsmasq_pid)
                    last = text
            time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--hosts", type=Path, required=True, help="the file dnsmasq reads (--addn-hosts)")
    parser.add_argument("--dnsmasq-pid", type=int, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run(args.kubeconfig, args.hosts, args.dnsmasq_pid, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
