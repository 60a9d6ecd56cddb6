"""The rules `LLMEngine.postprocess` follows: when the next schedule must wait for the step in
flight (`needs_host_tokens`), and when a failed step kills the engine (`check_step_failure`).

Asynchronous scheduling (`async_scheduling`, default on) keeps one step in flight: step n+1 is
scheduled and dispatched before step n's tokens reach the host, with a placeholder for every
token step n samples; step n+1's `prepare` writes step n's device token array into the table's
`last_token` rows and reads the placeholders from there (DP: `runtime.steps.async_step`'s TokenFeed).
A request that step n stops (EOS, stop token, stop string) may already be in step n+1: that
one extra token is dropped (never emitted or cached; its pages are freed at the stop). A length
stop (`max_tokens`) is known without the token, so it costs nothing.
Requests whose next step needs the previous token on the host — a grammar (its bitmask) or
penalties (the token-history matrices) — make the engine wait for the step in flight before it
schedules (a synchronous step); everything else (logprobs, min_tokens bans, seeds) works on the
placeholder, and a state checkpoint saved at a decode step is hashed once its tokens are known.
With `async_scheduling=False` the engine waits for each step's tokens right after dispatching
it and commits them before the next `schedule` (the previous step's outputs are still
detokenized while the device runs).

Failures stay local: a step that raises (in input building, dispatch or on the device) ends
only the requests scheduled in it, each with an output whose `error` is set and whose
finish_reason is "error"; their pages, slots and table rows are freed (a row is reset when it
is placed again, so a failed step leaves nothing wrong behind) and the next `step()` serves the
rest. A failure that consumed the donated caches is fatal (`EngineDeadError`: nothing on the
device can be trusted any more, and the owner must exit), and so are
MAX_CONSECUTIVE_FAILED_STEPS failed steps in a row.
"""

from __future__ import annotations

import logging

import jax

from runtime.steps.async_step import InFlightStep
from runtime.types import EngineDeadError

log = logging.getLogger("jaxserve.engine")


# A step fails for good (EngineDeadError) after this many failed steps in a row: a device that
# fails every step without consuming the caches is as dead as one that lost them.
MAX_CONSECUTIVE_FAILED_STEPS = 3


def needs_host_tokens(prev: InFlightStep) -> bool:
    """Whether the next schedule needs the in-flight step's tokens on the host: a request in it
    that goes on has a grammar (its bitmask) or penalties (the token-history matrices)."""
    if prev.resolved:
        return False
    for _, req, index in prev.placed:
        if index is None or req.is_finished:
            continue
        p = req.params
        if (
            p.structured_output is not None
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
        ):
            return True
    return False


def log_step_failure(err: Exception, step: int, num_requests: int) -> None:
    log.error(
        "engine step %d failed (%s: %s); failing its %d requests",
        step,
        type(err).__name__,
        err,
        num_requests,
        exc_info=err,
    )


def check_step_failure(err: Exception, caches, consecutive_failures: int) -> None:
    """After a failed step's requests have ended: raise EngineDeadError if the failure consumed the
    donated caches, or if it is the MAX_CONSECUTIVE_FAILED_STEPS-th failed step in a row."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(caches)):
        raise EngineDeadError(f"step failed after consuming the KV/state caches: {err}") from err
    if consecutive_failures >= MAX_CONSECUTIVE_FAILED_STEPS:
        raise EngineDeadError(f"{consecutive_failures} steps in a row failed, the last with: {err}") from err
