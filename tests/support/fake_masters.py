"""Stand-ins for highly available mooncake_master admin endpoints: each answers GET /health with the JSON
mooncake_master 0.3.13.post1 gives in HA mode (shape measured; see reconcile/decide/leadership.py). Tests
decide who leads; a master can also stop answering (as a killed one)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeMaster:
    def __init__(self, address: str) -> None:
        self.address = address  # what it would publish as -rpc_address:-rpc_port
        self.body: dict[str, Any] | None = None  # None: no answer (HTTP 503)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.body
                if self.path != "/health" or body is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-master")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeMaster:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class FakeMasters:
    """N fake masters; `lead(i, view=v)` makes master i the leader of view version v."""

    def __init__(self, count: int = 3) -> None:
        self.masters = [FakeMaster(f"10.0.0.{10 + i}:50051").start() for i in range(count)]
        self.killed: set[int] = set()

    @property
    def urls(self) -> list[str]:
        return [master.url for master in self.masters]

    def lead(self, index: int | None, *, view: int) -> None:
        """Master `index` leads (None: an election in progress, all stand by); killed ones stay silent."""
        leader = self.masters[index].address if index is not None else None
        for i, master in enumerate(self.masters):
            if i in self.killed:
                continue
            leads = i == index
            master.body = {
                "status": "ok",
                "role": "leader" if leads else "standby",
                "ha_state": "serving" if leads else "standby",
                "service_ready": leads,
                "leader_address": leader,
                "view_version": view,
            }

    def kill(self, index: int) -> None:
        """Master `index` stops answering, as a killed process."""
        self.killed.add(index)
        self.masters[index].body = None

    def close(self) -> None:
        for master in self.masters:
            master.stop()
