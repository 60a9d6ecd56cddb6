"""The engine's one validation site: is this request servable by this model and these arrays?

`SamplingParams.__post_init__` checks what holds for any model (ranges such as top_p in (0, 1]);
`validate_request` checks what depends on the model and on the device arrays the values land
in (int32 token ids, the vocabulary, max_model_len, the steps' logprob width), and normalises
what vLLM normalises (a top_k of at least the vocabulary is the same as no top_k). The server
calls it, through `EngineClient`, and answers its `SamplingParamsError` (a `ValueError` naming
the field) with a 400; the engine calls it only on a request not marked `validated` (one a
Python caller built), so a served request is checked once. Plain Python.
"""

from __future__ import annotations

import dataclasses

from runtime.types import MAX_LOGPROBS, EngineRequest, SamplingParamsError


def validate_request(request: EngineRequest, *, vocab_size: int, max_model_len: int) -> EngineRequest:
    """-> the request, normalised and marked `validated` (the engine admits it unchecked);
    SamplingParamsError (a ValueError, `.param` set) if it cannot be served."""
    params, prompt = request.params, request.prompt_token_ids
    _check(len(prompt) > 0, "prompt", "must not be empty")
    _check_token_ids("prompt", prompt, vocab_size)
    _check(params.n == 1, "n", f"the engine runs one completion per request (fan it out), got n={params.n}")
    room = max_model_len - len(prompt)
    if params.max_tokens == 0:  # scoring only: the prompt must fit, nothing is generated
        _check(room >= 0, "prompt", f"{len(prompt)} tokens exceed the maximum context length of {max_model_len}")
    else:
        _check(
            room >= 1,
            "prompt",
            f"{len(prompt)} tokens leave no room to generate within the maximum context "
            f"length of {max_model_len} tokens",
        )
    if params.max_tokens is not None:
        _check(
            params.max_tokens <= room,
            "max_tokens",
            f"{params.max_tokens} tokens requested but the prompt has {len(prompt)} tokens and the maximum "
            f"context length is {max_model_len}",
        )
    _check(
        params.min_tokens <= max(room, 0),
        "min_tokens",
        f"({params.min_tokens}) exceeds the {max(room, 0)} tokens the context leaves after the prompt",
    )
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
        _check_token_ids(name, ids, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        _check(value is None or value <= MAX_LOGPROBS, name, f"must be <= {MAX_LOGPROBS}")
    if params.top_k >= vocab_size:  # keeps every token: the same as no top-k, and fits int32
        params = params.replace(top_k=0)
    return dataclasses.replace(request, params=params, validated=True)


def _check_token_ids(param: str, ids, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    _check(bad is None, param, f"token id {bad} is out of vocabulary (size {vocab_size})")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
