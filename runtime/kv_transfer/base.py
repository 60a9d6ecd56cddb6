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


class TransferCapacityError(TransferError):
    """A byte or pull cap is full: the request is refused for now (503), not for what it is."""


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
    # Decode side: prefill control endpoints ("host:port") it may dial. With a token configured,
    # transfer parameters are token-bearing (the server refused any without it), so the decode
    # side also dials the endpoints they name; without one it dials these only.
    peers: tuple[str, ...] = ()
    max_held_bytes: int = 4 << 30  # prefill side: offered state held at once; past it, 503
    max_staged_bytes: int = 4 << 30  # decode side: state pulling or pulled, waiting for pages; past it, 503
    max_pulls_in_flight: int = 64  # decode side: concurrent pulls (each bounded by pull_timeout_s)
    control_timeout_s: float = 5.0  # one claim or release exchange, end to end
    extra: dict[str, Any] = field(default_factory=dict)  # connector-specific options (plugins)

    def __post_init__(self):
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if min(self.lease_s, self.pull_timeout_s, self.control_timeout_s) <= 0:
            raise ValueError("kv_transfer lease_s, pull_timeout_s and control_timeout_s must be > 0")
        if self.on_pull_failure not in ("recompute", "error"):
            raise ValueError(f"on_pull_failure must be recompute or error, got {self.on_pull_failure!r}")
        object.__setattr__(self, "peers", tuple(normalize_peer(p) for p in self.peers))
        if min(self.max_held_bytes, self.max_staged_bytes, self.max_pulls_in_flight) <= 0:
            raise ValueError("kv_transfer max_held_bytes, max_staged_bytes and max_pulls_in_flight must be > 0")


def normalize_peer(peer: str) -> str:
    """ "host:port" (an http:// URL's netloc is accepted) -> "host:port" lowercased; ValueError if not."""
    text = str(peer).strip().lower().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host or "@" in host:
        raise ValueError(f"kv_transfer peer must be host:port, got {peer!r}")
    return f"{host}:{int(port)}"


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

    def has_room(self) -> bool:
        """Prefill side: whether another offer fits under the connector's caps (checked when a
        request is admitted; a full connector makes the request a 503)."""
        return True

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

    def close(self) -> None:  # noqa: B027 - optional hook: most connectors hold nothing to close
        pass
