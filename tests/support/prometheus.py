"""Debian's Prometheus 2.42 for the monitoring tests: promtool, and a real server bound to 127.0.0.1.

scripts/bootstrap unpacks the package's two binaries into the cache (never installed: the package would
start a service on every address). A missing binary is a failure naming that command, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from tests.support.apiserver import cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]


def binary(name: str) -> Path:
    path = cache_root() / "prometheus" / "usr" / "bin" / name
    if os.access(path, os.X_OK):
        return path
    raise AssertionError(
        f"{name} not found at {path}: run scripts/bootstrap (it unpacks Debian's prometheus)"
    )


def promtool(
    *args: str, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary("promtool")), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PrometheusServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10, trust_env=False)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {response.status_code} {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def running_prometheus(
    scrape_configs: Sequence[dict[str, Any]],
    *,
    rule_files: Sequence[Path] = (),
    evaluation_interval: str = "1s",
) -> Iterator[PrometheusServer]:
    """A Prometheus server on 127.0.0.1 only, its data in a temporary directory, stopped on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="prometheus-"))
    try:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": evaluation_interval},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": list(scrape_configs),
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = workdir / "prometheus.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    str(binary("prometheus")),
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        server = PrometheusServer(f"http://127.0.0.1:{port}", process, log)
        try:
            _wait_ready(server)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(server: PrometheusServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"prometheus exited {server.process.returncode}:\n{server.logs()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/-/ready", timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready in {timeout:g}s:\n{server.logs()}")
