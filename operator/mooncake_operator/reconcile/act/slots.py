"""Canary slots shared fairly by namespaces (tenants): at most `total` canaries run at once, and at most
`per_namespace` of them for one namespace, so replicas of one tenant that accept and never answer hold
at most that many slots (each for at most the run's deadline) while other tenants' canaries run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class CanarySlots:
    total: int
    per_namespace: int
    _all: asyncio.Semaphore = field(init=False)
    _namespaces: dict[str, asyncio.Semaphore] = field(init=False, default_factory=dict)
    _users: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._all = asyncio.Semaphore(self.total)

    @contextlib.asynccontextmanager
    async def held(self, namespace: str) -> AsyncIterator[None]:
        """A slot for a canary of `namespace`: its namespace's share first, so a namespace's waiting
        canaries never queue ahead of other namespaces' for the shared slots."""
        own = self._namespaces.setdefault(namespace, asyncio.Semaphore(self.per_namespace))
        self._users[namespace] = self._users.get(namespace, 0) + 1
        try:
            async with own, self._all:
                yield
        finally:
            self._users[namespace] -= 1
            if not self._users[namespace]:  # forget idle namespaces: no growth with namespaces seen
                del self._users[namespace], self._namespaces[namespace]

    async def run(self, namespace: str, deadline_s: float, work: Callable[[], Awaitable[T]]) -> T | None:
        """`work()` in a slot of `namespace`, cancelled at `deadline_s` (None then): a run that never
        ends would hold its slot for ever."""
        async with self.held(namespace):
            try:
                async with asyncio.timeout(deadline_s):
                    return await work()
            except TimeoutError:
                return None
