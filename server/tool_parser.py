"""The Hermes / Qwen tool-call parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls(text, final)` is a pure function of the cumulative text. It returns the
content outside the blocks and, per block, the function name (once complete) and the
arguments as the model wrote them (the raw JSON text of the `arguments` value). While
generating (`final=False`) a tail that may begin `<tool_call>` is held back and an
unfinished argument value is returned as far as it goes, so every result extends the
previous one: streaming sends the differences and they add up to the non-streaming answer.
A block that does not parse as `{"name", "arguments"}` once it is complete is kept as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from server.reasoning import partial_tag_length

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_decoder = json.JSONDecoder()


@dataclass
class ParsedToolCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text of the arguments value, possibly unfinished


def parse_tool_calls(text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
    """-> (content, calls) of the cumulative `text`."""
    content, calls, position = [], [], 0
    while True:
        start = text.find(START, position)
        if start < 0:
            tail = text[position:]
            hold = 0 if final else partial_tag_length(tail, START)
            content.append(tail[: len(tail) - hold])
            break
        content.append(text[position:start])
        body_start = start + len(START)
        end = text.find(END, body_start)
        complete = end >= 0 or final
        body = text[body_start:end if end >= 0 else len(text)]
        if end < 0 and not final:
            body = body[: len(body) - partial_tag_length(body, END)]
        call = _parse_block(body, complete)
        if call is None:  # a complete block that is not a tool call: plain text
            content.append(text[start:end + len(END) if end >= 0 else len(text)])
        else:
            calls.append(call)
        if end < 0:
            break
        position = end + len(END)
    return "".join(content), calls


def _parse_block(body: str, complete: bool) -> ParsedToolCall | None:
    name_match = _NAME.search(body)
    name = json.loads(name_match.group(1)) if name_match else None
    args_match = _ARGUMENTS.search(body)
    arguments = ""
    if args_match:
        value = body[args_match.end():]
        try:
            _, length = _decoder.raw_decode(value)
            closed = value[:1] in "{[\"" or complete  # a bare number may still grow
            arguments = value[:length] if closed else value.rstrip()
        except ValueError:
            arguments = value.rstrip() if complete else value
    if complete:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if not args_match:
            arguments = json.dumps(obj.get("arguments", obj.get("parameters", {})))
    return ParsedToolCall(name, arguments)
