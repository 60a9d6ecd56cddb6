"""Chat-template rendering that a hostile or runaway template cannot abuse.

Every template (the model's, `--chat-template`'s, and a client's when the operator allows it
with `--trust-request-chat-template`) goes through `tokenizer.apply_chat_template`, which
compiles it in jinja2's `ImmutableSandboxedEnvironment` (no attribute escapes, no mutation of
lists or dicts; transformers hardens `namespace` and `dict` further).

A sandbox does not bound time: `{% for i in range(20000) %}{% for j in range(20000) %}...`
is legal. We render in a worker thread under a per-thread trace function that watches only
the template's own frames (jinja compiles templates to Python code named `<template>`): at
every line the template executes, it checks a deadline and a cancel flag and raises
`TemplateTimeout` when either trips. So a runaway render stops within one template line of
its deadline, or of its client disconnecting, and its worker thread is free again; other
code in the thread is not traced, so a normal template costs microseconds extra. A
subprocess would also bound memory, but costs a process start (or a pool whose busy worker
must be killed) per request; a loop budget alone cannot stop a loop that calls nothing.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

TEMPLATE_FILENAME = "<template>"  # what jinja2's `Environment.from_string` compiles to
_CHECK_EVERY = 64  # template lines between clock reads


class TemplateTimeout(Exception):
    """The template ran past its time limit or its client went away."""


class _Deadline:
    """The trace function: counts template lines, raises once the deadline or cancel trips."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.cancelled = threading.Event()
        self.lines = 0

    def check(self) -> None:
        self.lines += 1
        if self.lines % _CHECK_EVERY == 0 or self.cancelled.is_set():
            if self.cancelled.is_set():
                raise TemplateTimeout("the request was cancelled while its chat template rendered")
            if time.monotonic() > self.deadline:
                raise TemplateTimeout(f"the chat template did not finish rendering within {self.timeout_s:g} s")

    def on_call(self, frame, event, arg):
        if frame.f_code.co_filename != TEMPLATE_FILENAME:
            return None  # not a template frame: no line events there
        self.check()
        return self.on_line

    def on_line(self, frame, event, arg):
        if event == "line":
            self.check()
        return self.on_line


def run_with_deadline(work: Callable[[], Any], deadline: _Deadline) -> Any:
    """Run `work()` in this thread with the template tracer installed."""
    previous = sys.gettrace()
    sys.settrace(deadline.on_call)
    try:
        return work()
    finally:
        sys.settrace(previous)


async def render_chat_template(
    tokenizer,
    conversation: list[dict],
    *,
    template: str | None,
    add_generation_prompt: bool,
    template_kwargs: dict | None,
    timeout_s: float,
) -> str:
    """Render `conversation` with `template` (None: the tokenizer's own) in a worker thread.

    Raises TemplateTimeout past `timeout_s`; if the awaiting task is cancelled (the client
    went away), the render stops at its next template line.
    """
    deadline = _Deadline(timeout_s)
    kwargs = dict(template_kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template

    def render() -> str:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    try:
        return await asyncio.to_thread(run_with_deadline, render, deadline)
    finally:
        deadline.cancelled.set()  # a no-op when it finished; stops it when we were cancelled
