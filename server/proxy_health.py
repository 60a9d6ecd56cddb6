"""The proxy's backends: one pool per role, each backend in or out of service.

A background task polls every backend's `/health`. A backend that refuses the connection is
taken out at once; one that fails `failures_to_remove` checks in a row (timeout, non-200) is
taken out then; any 200 puts it back. The proxy also takes a backend out when a request's
connection to it is refused. Requests are only sent to backends in service, the least loaded
first (outstanding requests; ties: the first listed). `/health` and `/metrics` name backends by
role and index (`decode[0]`), not by address; the start-up log maps each index to its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("jaxserve.proxy")


@dataclass
class Backend:
    role: str
    index: int
    url: str
    outstanding: int = 0
    in_service: bool = True  # optimistic until the first check says otherwise
    failed_checks: int = 0  # in a row

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


class Pool:
    """The backends of one role."""

    def __init__(self, role: str, urls: list[str] | tuple[str, ...]):
        self.role = role
        self.backends = [Backend(role, i, url.rstrip("/")) for i, url in enumerate(urls)]

    def candidates(self) -> list[Backend]:
        """The backends in service, least outstanding requests first (ties: the first listed)."""
        return sorted((b for b in self.backends if b.in_service), key=lambda b: b.outstanding)

    def live_count(self) -> int:
        return sum(b.in_service for b in self.backends)

    @staticmethod
    @contextlib.contextmanager
    def hold(backend: Backend):
        backend.outstanding += 1
        try:
            yield backend
        finally:
            backend.outstanding -= 1

    def take_out(self, backend: Backend, reason: str) -> None:
        if backend.in_service:
            log.warning("%s taken out of service: %s", backend.name, reason)
        backend.in_service = False

    def record_check(
        self, backend: Backend, healthy: bool, refused: bool, failures_to_remove: int, reason: str = ""
    ) -> None:
        if healthy:
            if not backend.in_service:
                log.info("%s back in service", backend.name)
            backend.in_service, backend.failed_checks = True, 0
            return
        backend.failed_checks += 1
        if refused:
            self.take_out(backend, reason)
        elif backend.failed_checks >= failures_to_remove:
            self.take_out(backend, f"{reason} ({backend.failed_checks} failed health checks in a row)")


class HealthChecker:
    """Polls `/health` of every backend of `pools` every `interval_s` seconds."""

    def __init__(
        self,
        pools: list[Pool],
        session: aiohttp.ClientSession,
        interval_s: float,
        timeout_s: float,
        failures_to_remove: int,
    ):
        self.pools = pools
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures_to_remove = failures_to_remove

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not freeze every backend's state
                log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(pool, backend) for pool in self.pools for backend in pool.backends))

    async def _check(self, pool: Pool, backend: Backend) -> None:
        healthy, refused, reason = False, False, ""
        try:
            async with self.session.get(backend.url + "/health", timeout=self.timeout) as resp:
                await resp.read()
                healthy, reason = resp.status == 200, f"/health answered {resp.status}"
        except aiohttp.ClientConnectorError as err:
            refused, reason = True, f"connection failed: {err.os_error or err}"
        except (TimeoutError, aiohttp.ClientError) as err:
            reason = f"/health failed: {type(err).__name__} {err}".strip()
        pool.record_check(backend, healthy, refused, self.failures_to_remove, reason)
