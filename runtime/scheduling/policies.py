"""Scheduling policies: the order requests are served in and which one is preempted first.

A policy is a sort key: smaller keys are admitted and scheduled first, and the running
request with the largest key is the preemption victim. `get_policy(name)` looks one up.
Plain Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.registry import Registry

if TYPE_CHECKING:
    from runtime.scheduling.request import Request


@dataclass(frozen=True)
class SchedulingPolicy:
    name: str
    key: Callable[[Request], tuple]

    def victim(self, candidates: list[Request]) -> Request:
        """The request to preempt among `candidates`: the last one in service order."""
        return max(candidates, key=self.key)


def _fcfs_key(request: Request) -> tuple:
    return (request.sequence_number,)


def _priority_key(request: Request) -> tuple:
    # Lower priority value is served first (vLLM semantics); ties by arrival, then by add order.
    return (request.priority, request.arrival_time, request.sequence_number)


POLICIES: dict[str, SchedulingPolicy] = {
    "fcfs": SchedulingPolicy("fcfs", _fcfs_key),
    "priority": SchedulingPolicy("priority", _priority_key),
}
# The project's registry (plugins add `scheduling_policy.<name>` entry points returning a policy).
POLICY_REGISTRY: Registry[SchedulingPolicy] = Registry("scheduling_policy")
for _name, _policy in POLICIES.items():
    POLICY_REGISTRY.register(_name, lambda _policy=_policy: _policy)


def get_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICY_REGISTRY.create(name)
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {POLICY_REGISTRY.names()}") from None
