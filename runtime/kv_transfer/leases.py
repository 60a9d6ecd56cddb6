"""Offered state under a lease: who holds what, until when. Plain Python, thread-safe.

Each offer gets a one-shot claim: the decode side claims it (the lease then runs until
`now + pull_timeout`), pulls, and releases it ("pulled" or "abort"). An unknown, expired,
released or already claimed id is refused, so a replayed or forged transfer id can never read
another request's state. Expired entries are handed to `drain` (the connector frees them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    transfer_id: str
    payload: object  # what the connector must keep alive (arrays, a transfer handle)
    num_pages: int
    num_slots: int
    nbytes: int
    expires_at: float
    claimed: bool = False


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0

    def add(self, lease: Lease) -> None:
        with self._lock:
            if lease.transfer_id in self._leases:
                raise ValueError(f"transfer id {lease.transfer_id!r} already held")
            self._leases[lease.transfer_id] = lease

    def new_deadline(self, lease_s: float | None = None) -> float:
        """Now + the table's lease, or a shorter `lease_s` asked for by one request."""
        return self._clock() + min(self.lease_s, lease_s or self.lease_s)

    def claim(self, transfer_id: str, pull_timeout_s: float) -> Lease | None:
        """The lease if it is live and unclaimed (now claimed), else None."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.claimed or lease.expires_at <= self._clock():
                return None
            lease.claimed = True
            lease.expires_at = max(lease.expires_at, self._clock() + pull_timeout_s)
            return lease

    def release(self, transfer_id: str) -> Lease | None:
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is not None:
                self.num_released += 1
            return lease

    def pop_expired(self) -> list[Lease]:
        now = self._clock()
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in gone:
                del self._leases[lease.transfer_id]
            self.num_expired += len(gone)
            return gone

    def held(self) -> tuple[int, int, int, int]:
        """(leases, pages, slots, bytes) currently held."""
        with self._lock:
            leases = list(self._leases.values())
        return (len(leases), sum(x.num_pages for x in leases), sum(x.num_slots for x in leases),
                sum(x.nbytes for x in leases))
