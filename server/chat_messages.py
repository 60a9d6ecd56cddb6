"""Chat messages as the OpenAI API sends them -> the dicts chat templates expect (vLLM's rules).

* `content` null or absent (an assistant turn that only calls tools) becomes `""`; text parts
  are joined with newlines.
* An assistant's `tool_calls` keep `id` / `type` / `function.name`; `function.arguments`, a
  JSON string on the wire, is parsed into an object (as HF and vLLM do) for a template that
  expects one (`arguments | tojson`, `.items()`, ...). A template that takes the string as it
  is (`{{ arguments }}`, or Qwen's `arguments is string` branch) gets the client's own text:
  the model then sees its calls exactly as it wrote them. (transformers rebuilds the template's
  data from plain JSON types, so one object cannot serve both kinds.)
* `tool` messages keep `tool_call_id` (and `name`).
* A template that does not know tools (no `tool_calls` in its source, e.g. SmolLM2's ChatML)
  would drop the calls and may refuse the `tool` role: for it, calls are written into the
  assistant's content in the server's tool-call format, consecutive tool results become one
  user turn of `<tool_response>` blocks, and the tool definitions are added to the system
  prompt, so the model sees the whole loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.protocol import ChatMessage, RequestError
from server.tool_parser import render_tool_results

_ARGUMENTS_AS_TEXT = re.compile(r"arguments\s+is\s+string")
_ARGUMENTS_AS_OBJECT = re.compile(r"arguments\s*(\|\s*(tojson|items|dictsort)\b|is\s+mapping\b|\.items\s*\()")


def template_source(template: str | dict | None) -> str:
    """The text of a chat template (a tokenizer may hold several, by name)."""
    if isinstance(template, dict):
        return "\n".join(str(value) for value in template.values())
    return template or ""


def template_knows_tools(source: str) -> bool:
    return "tool_calls" in source


def template_wants_argument_objects(source: str) -> bool:
    """Whether a template needs tool-call arguments as objects (it cannot print the JSON text)."""
    return not _ARGUMENTS_AS_TEXT.search(source) and bool(_ARGUMENTS_AS_OBJECT.search(source))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content


def _arguments(value: Any, param: str, as_object: bool):
    if value is None or value == "":
        return {} if as_object else "{}"
    if isinstance(value, dict):
        return value if as_object else json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise RequestError(400, f"{param}: must be a JSON string", param=param)
    if not as_object:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value  # not JSON: the template gets the text as it is
    return parsed if isinstance(parsed, dict) else value


def _tool_calls(calls: Any, param: str, as_object: bool) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(400, f"{param}: must be a list of tool calls", param=param)
    out = []
    for index, call in enumerate(calls):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                400, f'{where}: must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=where
            )
        out.append(
            {
                **call,
                "type": call.get("type") or "function",
                "function": {
                    **function,
                    "arguments": _arguments(function.get("arguments"), f"{where}.function.arguments", as_object),
                },
            }
        )
    return out


def normalize_messages(
    messages: list[ChatMessage], template: str, tool_parser=None, tools: list[dict] | None = None
) -> list[dict]:
    """The conversation for `apply_chat_template` with the template whose source is `template`.
    When it does not render tool calls itself, they are folded into text with `tool_parser`
    (its `render_calls` and `tools_prompt`), and `tools` (function definitions) go into the
    system prompt."""
    knows_tools = template_knows_tools(template)
    as_object = knows_tools and template_wants_argument_objects(template)
    conversation = []
    for index, message in enumerate(messages):
        turn = message.model_dump(exclude_none=True)
        turn["content"] = _text(message.content)
        calls = turn.pop("tool_calls", None)
        if calls:
            turn["tool_calls"] = _tool_calls(calls, f"messages[{index}].tool_calls", as_object)
        conversation.append(turn)
    if knows_tools or tool_parser is None:
        return conversation
    return _folded(conversation, tool_parser, tools or [])


def _folded(conversation: list[dict], tool_parser, functions: list[dict]) -> list[dict]:
    out: list[dict] = []
    for turn in conversation:
        if turn["role"] == "tool":
            if out and out[-1].get("_tool_results") is not None:
                out[-1]["_tool_results"].append(turn["content"])
            else:
                out.append({"role": "user", "_tool_results": [turn["content"]]})
            continue
        if turn.get("tool_calls"):
            calls = [(c["function"]["name"], _as_value(c["function"]["arguments"])) for c in turn.pop("tool_calls")]
            written = tool_parser.render_calls(calls)
            turn["content"] = f"{turn['content']}\n{written}" if turn["content"] else written
        out.append(turn)
    for turn in out:
        results = turn.pop("_tool_results", None)
        if results is not None:
            turn["content"] = render_tool_results(results)
    if functions:
        prompt = tool_parser.tools_prompt(functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_value(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
