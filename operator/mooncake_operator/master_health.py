"""A mooncake_master's own view of the leader election: its `GET /health` on the metrics port.

Measured on mooncake-transfer-engine-non-cuda 0.3.13.post1 (`-enable_ha`), every master answers 200:

    {"status":"ok","role":"leader","ha_state":"serving","service_ready":true,
     "leader_address":"10.0.0.5:50051","view_version":9}

and a standby `"role":"standby","service_ready":false` with the same `leader_address`. The leader's
address is what it publishes in etcd (`mooncake-store/<cluster_id>/master_view`) and what the store
clients connect to. The view version grows with every election (by more than one per failover, so it
is no failover count).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEALTH_PATH = "/health"


@dataclass(frozen=True)
class MasterView:
    role: str  # "leader", "standby"; "" when absent (a master without -enable_ha)
    serving: bool
    leader_address: str | None
    view_version: int | None

    @property
    def leads(self) -> bool:
        """Leads and serves (a fresh leader spends a few seconds in warm-up before it serves)."""
        return self.role == "leader" and self.serving

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> MasterView:
        version = body.get("view_version")
        leader = body.get("leader_address")
        return cls(
            role=str(body.get("role") or ""),
            serving=body.get("service_ready") is True,
            leader_address=str(leader) if leader else None,
            view_version=version if isinstance(version, int) and not isinstance(version, bool) else None,
        )
