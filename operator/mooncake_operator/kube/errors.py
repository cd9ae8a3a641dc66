"""Every error the Kubernetes API client raises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KubeError(Exception):
    """Base of every error this client raises."""


class KubeConfigError(KubeError):
    """The client cannot be configured (no kubeconfig, unsupported auth, missing files)."""


class KubeTransportError(KubeError):
    """The API server could not be reached, or did not answer in time."""


class KubeApiError(KubeError):
    """The API server answered with an error status; `message` is the server's own words (a 401 with an
    exec plugin adds that a fresh token was refused too)."""

    def __init__(
        self, status: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.details: Mapping[str, Any] = details or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409
