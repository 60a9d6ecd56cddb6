"""Offered state under a lease: who holds what, until when. Plain Python, thread-safe.

Each offer gets a one-shot claim: the decode side claims it (the lease then runs until
`now + pull_timeout`), pulls, and releases it ("pulled" or "abort"). An unknown, expired,
released or already claimed id is refused, and so is a claim whose prompt digest or model
fingerprint differs from the offer's: a transfer id relabelled as another prompt's, or claimed
by an instance serving another checkpoint, never reads the state. Expired entries, claimed or
not, are handed to the connector, which frees their arrays.
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
    token_digest: str = ""  # sha256 of the prompt tokens the state belongs to (descriptor.token_digest)
    model_fingerprint: str = ""  # the checkpoint that computed it (descriptor.model_fingerprint)
    claimed: bool = False


class ClaimRefused(Exception):
    """Why a claim was refused: `status` 410 (unknown / expired / released / claimed) or 409
    (the claim names another prompt or model than the offer)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


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

    def claim(
        self,
        transfer_id: str,
        pull_timeout_s: float,
        token_digest: str | None = None,
        model_fingerprint: str | None = None,
    ) -> Lease:
        """The lease, now claimed, if it is live, unclaimed and (when given) for this prompt and
        model; else ClaimRefused. A mismatching claim also ends the lease: whoever sent it
        knows the id, so it is not offered again."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.claimed or lease.expires_at <= self._clock():
                raise ClaimRefused(410, "unknown, expired, released or already claimed transfer id")
            if token_digest is not None and token_digest != lease.token_digest:
                lease.claimed, lease.expires_at = True, self._clock()
                raise ClaimRefused(409, "the claim's prompt digest differs from the offered state's")
            if model_fingerprint is not None and model_fingerprint != lease.model_fingerprint:
                lease.claimed, lease.expires_at = True, self._clock()
                raise ClaimRefused(409, "the claim's model fingerprint differs from the offered state's")
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
        return (
            len(leases),
            sum(x.num_pages for x in leases),
            sum(x.num_slots for x in leases),
            sum(x.nbytes for x in leases),
        )
