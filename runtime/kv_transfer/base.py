"""The connector interface (both sides of one transport) and the P/D settings.

A prefill instance `offer`s a request's gathered state (a flat list of device arrays plus its
descriptor) and answers the client with the returned transfer parameters. A decode instance
`start_pull`s with those parameters; `poll` hands back finished pulls (the arrays on this
instance's device, or the reason it failed) and `cancel` drops one (client gone). Everything
on the wire besides the arrays is JSON; nothing is pickled.

Smaller than vLLM's KVConnectorBase_V1 on purpose: the engine pulls *before* it admits a
request (the pulled arrays wait in a staging list, not in pages), so the scheduler only needs to
know how many prompt tokens arrive computed (`Request.num_external_tokens`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]


class TransferError(RuntimeError):
    """A transfer that cannot be used: refused claim, bad descriptor, failed or timed-out pull."""


@dataclass(frozen=True)
class KVTransferConfig:
    """`parallel.role` plus the `kv_transfer` section of the launch config."""

    role: Role = "both"
    connector: str = "jax_transfer"
    lease_s: float = 60.0  # the prefill side frees offered state this long after offering it
    pull_timeout_s: float = 30.0  # the decode side gives a claimed pull this long
    on_pull_failure: Literal["recompute", "error"] = "recompute"  # decode side: prefill locally, or fail
    host: str = "127.0.0.1"  # bind address of the control + transfer servers
    advertise_host: str | None = None  # address the other side dials (default: host)
    control_port: int = 0  # 0: a free port
    token: str | None = field(default=None, repr=False)  # the internal credential (X-KV-Transfer-Token)
    insecure: bool = False  # a non-loopback bind without a token (warned about every minute)
    extra: dict[str, Any] = field(default_factory=dict)  # connector-specific options (plugins)

    def __post_init__(self):
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.lease_s <= 0 or self.pull_timeout_s <= 0:
            raise ValueError("kv_transfer lease_s and pull_timeout_s must be > 0")
        if self.on_pull_failure not in ("recompute", "error"):
            raise ValueError(f"on_pull_failure must be recompute or error, got {self.on_pull_failure!r}")


@dataclass
class PullResult:
    """One finished pull: `arrays` (in descriptor order, on this device) or `error`."""

    key: str
    arrays: list | None = None
    error: str | None = None


class KVConnector(abc.ABC):
    """One transport, both sides. Built by `KV_CONNECTORS.create(name, config)`."""

    def __init__(self, config: KVTransferConfig):
        self.config = config

    # ---- prefill side ----------------------------------------------------------------------
    @abc.abstractmethod
    def offer(self, arrays: list, descriptor: dict) -> dict:
        """Hold `arrays` under a lease for one pull; -> the transfer parameters (JSON) for the client.
        A connector that honours a request's shorter lease also accepts `lease_s=` (seconds); it
        is only passed when a request asked for one."""

    # ---- decode side -----------------------------------------------------------------------
    @abc.abstractmethod
    def start_pull(self, key: str, params: dict, descriptor: dict, specs: list) -> None:
        """Claim the transfer in `params` and pull arrays shaped like `specs` (ShapeDtypeStructs)."""

    @abc.abstractmethod
    def poll(self) -> list[PullResult]:
        """Pulls that finished (or failed, or timed out) since the last call."""

    @abc.abstractmethod
    def cancel(self, key: str) -> None:
        """Forget pull `key`; the prefill side is told to free the state."""

    # ---- both ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
