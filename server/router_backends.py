"""The router's replicas: each in or out of service, with its counters; added and removed at run time.

`BackendSet` has the shape `server.proxy_health.HealthChecker` polls (`backends`,
`record_check`), so the proxy's active `/health` checks serve the router too. Passive checks:
a refused connection takes a replica out at once; `failures_to_remove` failed requests in a row
(timeouts, 5xx, broken streams) take it out too; a healthy `/health` answer puts it back. Every
exit from service also empties the replica's entry in the block index (its cache is presumed
lost). Replicas are named by a never-reused id (`backend[3]`), not by address, in /health and
/metrics; the start-up log and `GET /admin/backends` map ids to URLs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass

from server.router_policy import BlockIndex, Candidate

log = logging.getLogger("jaxserve.router")
MAX_BACKENDS = 256  # memory bound on what /admin/backends may add


@dataclass
class Backend:
    id: int
    url: str
    in_service: bool = True  # optimistic until the first check says otherwise
    failed_checks: int = 0  # health checks or requests failed in a row
    outstanding: int = 0
    requests: int = 0
    failures: int = 0
    by_affinity: int = 0
    hit_blocks: int = 0  # estimated: blocks of routed prompts the index believed cached there
    role: str = "backend"  # what HealthChecker's log lines print

    @property
    def name(self) -> str:
        return f"backend[{self.id}]"


class BackendSet:
    role = "backend"

    def __init__(self, urls, index: BlockIndex, failures_to_remove: int):
        self.index = index
        self.failures_to_remove = failures_to_remove
        self._ids = itertools.count()
        self.backends: list[Backend] = []
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Backend:
        if any(b.url == url for b in self.backends):
            raise ValueError(f"{url} is already a backend")
        if len(self.backends) >= MAX_BACKENDS:
            raise ValueError(f"at most {MAX_BACKENDS} backends")
        backend = Backend(next(self._ids), url)
        self.backends.append(backend)
        log.info("%s = %s added", backend.name, url)
        return backend

    def remove(self, url: str) -> Backend:
        """Out of the rotation at once; requests in flight on it finish."""
        for backend in self.backends:
            if backend.url == url:
                self.backends.remove(backend)
                self.index.forget(backend.id)
                log.info("%s = %s removed", backend.name, url)
                return backend
        raise KeyError(url)

    def get(self, backend_id: int) -> Backend:
        return next(b for b in self.backends if b.id == backend_id)

    def candidates(self, exclude: set[int] = frozenset()) -> list[Candidate]:
        return [Candidate(b.id, b.outstanding) for b in self.backends if b.in_service and b.id not in exclude]

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
        self.index.forget(backend.id)

    def record_check(
        self, backend: Backend, healthy: bool, refused: bool, failures_to_remove: int, reason: str = ""
    ) -> None:
        """One active /health check's outcome (HealthChecker calls this)."""
        if healthy:
            if not backend.in_service:
                log.info("%s back in service", backend.name)
            backend.in_service, backend.failed_checks = True, 0
            return
        self.record_failure(backend, refused, reason, count=False)

    def record_failure(self, backend: Backend, refused: bool, reason: str, count: bool = True) -> None:
        """A failed check or (count=True) a failed request."""
        backend.failures += count
        backend.failed_checks += 1
        if refused:
            self.take_out(backend, reason)
        elif backend.failed_checks >= self.failures_to_remove:
            self.take_out(backend, f"{reason} ({backend.failed_checks} failures in a row)")

    @staticmethod
    def record_success(backend: Backend) -> None:
        backend.failed_checks = 0
