"""The connector interface (both sides of one transport); its settings are `KVTransferConfig`.

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
from dataclasses import dataclass

from runtime.engine_config import KVTransferConfig


class TransferError(RuntimeError):
    """A transfer that cannot be used: refused claim, bad descriptor, failed or timed-out pull."""


class TransferCapacityError(TransferError):
    """A byte or pull cap is full: the request is refused for now (503), not for what it is."""


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
