"""Tool-call formats: how calls are written in the text, read back, forced by a grammar, and
rendered for chat templates that know nothing of tools.

`TOOL_CALL_PARSERS` names them as vLLM's `--tool-call-parser` does:

* `hermes` (Hermes, Qwen2.5 / Qwen3 / Qwen3.5, the default): `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>` blocks anywhere in the text.
* `llama3_json` (Llama 3.1-3.3): the whole message is `{"name": ..., "parameters": {...}}`
  objects separated by `; ` (after `<|python_tag|>` when special tokens are kept).

`parse(text, final)` is a pure function of the cumulative text -> (content, complete calls).
Only complete calls are returned: while generating, text that may still become a call is
held back; at the end, an unfinished call (cut by `max_tokens`) is dropped, never turned into
content. So each result extends the previous one, and streamed deltas add up to the final
message. `max_calls` bounds the calls returned (the rest are dropped too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from server.reasoning import partial_tag_length

_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it


def _arguments_text(raw: str, obj: dict, key: str) -> str:
    """The arguments value's own text inside `raw` (the model's spelling), else re-serialized."""
    value = obj.get(key, {})
    match = re.search(rf'"{key}"\s*:\s*', raw)
    if match:
        try:
            parsed, length = _decoder.raw_decode(raw, match.end())
            if parsed == value:
                return raw[match.end() : length]
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _call_from(raw: str, obj) -> ParsedToolCall | None:
    """A `{"name": str, "arguments" | "parameters": ...}` object -> a call (None: not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    return ParsedToolCall(obj["name"], _arguments_text(raw, obj, key))


def _call_schema(function: dict, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: function["parameters"]},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(functions: list[dict], arguments_key: str) -> dict:
    variants = [_call_schema(f, arguments_key) for f in functions]
    schema = dict(variants[0]) if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON, as for response_format
    return schema


def _repeat(call: str, separator: str, max_calls: int) -> str:
    return call if max_calls == 1 else f"{call} ({json.dumps(separator)} {call}){{0,{max_calls - 1}}}"


def _tools_json(functions: list[dict]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)


class HermesToolParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Hermes, Qwen)."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool, max_calls: int | None = None) -> tuple[str, list[ParsedToolCall]]:
        content, calls, position = [], [], 0
        while True:
            start = text.find(self.start, position)
            if start < 0:
                tail = text[position:]
                hold = 0 if final else partial_tag_length(tail, self.start)
                content.append(tail[: len(tail) - hold])
                break
            content.append(text[position:start])
            end = text.find(self.end, start + len(self.start))
            if end < 0:
                break  # an unfinished call: held back while generating, dropped at the end
            body = text[start + len(self.start) : end].strip()
            try:
                call = _call_from(body, json.loads(body))
            except ValueError:
                call = None
            if call is None:  # a closed block that is not a call: plain text
                content.append(text[start : end + len(self.end)])
            elif max_calls is None or len(calls) < max_calls:
                calls.append(call)
            position = end + len(self.end)
        return "".join(content), calls

    def grammar(self, functions: list[dict], max_calls: int) -> str:
        """Lark: 1..max_calls blocks, each naming one of `functions` with schema-valid arguments."""
        return (
            f"start: {_repeat('call', chr(10), max_calls)}\n"
            f'call: "{self.start}\\n" body "\\n{self.end}"\n'
            f"body: %json {json.dumps(_calls_schema(functions, 'arguments'))}\n"
        )

    def render_calls(self, calls: list[tuple[str, object]]) -> str:
        return "\n".join(
            f"{self.start}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{self.end}"
            for name, args in calls
        )

    def tools_prompt(self, functions: list[dict]) -> str:
        return (
            "# Tools\n\nYou can call these functions (signatures inside <tools></tools>):\n"
            f"<tools>\n{_tools_json(functions)}\n</tools>\n\n"
            "To call one, answer with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )


class Llama3JsonToolParser:
    """The message is `{"name": ..., "parameters": {...}}` objects joined by `; ` (Llama 3.x)."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    separator = "; "
    _call_openings = ('{"name"', '{"parameters"', '{"arguments"')

    def parse(self, text: str, final: bool, max_calls: int | None = None) -> tuple[str, list[ParsedToolCall]]:
        body = text.lstrip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        elif not final and body and self.python_tag.startswith(body):
            return "", []  # may still become the tag
        if not body:
            return "", []
        if not body.startswith("{"):
            return text, []
        calls, position = [], 0
        while position < len(body):
            rest = body[position:]
            try:
                obj, end = _decoder.raw_decode(body, position)
            except ValueError:  # unfinished, or not JSON
                if not final:
                    return "", calls  # wait: it may still become a call
                if rest.startswith("{") and (calls or self._may_be_call(rest)):
                    return "", calls  # a call cut by max_tokens: dropped
                return (rest if calls else text), calls
            call = _call_from(body[position:end], obj)
            if call is None:  # a JSON object that is not a call: from here on it is content
                return (rest if calls else text), calls
            if max_calls is None or len(calls) < max_calls:
                calls.append(call)
            position = end + re.match(r"\s*(;\s*)?", body[end:]).end()
        return "", calls

    def _may_be_call(self, text: str) -> bool:
        compact = re.sub(r"\s+", "", text)
        return any(compact.startswith(opening) or opening.startswith(compact) for opening in self._call_openings)

    def grammar(self, functions: list[dict], max_calls: int) -> str:
        """Lark: 1..max_calls JSON objects joined by `; `, each naming one of `functions`."""
        return (
            f"start: {_repeat('call', self.separator, max_calls)}\n"
            f"call: %json {json.dumps(_calls_schema(functions, 'parameters'))}\n"
        )

    def render_calls(self, calls: list[tuple[str, object]]) -> str:
        return self.separator.join(
            json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls
        )

    def tools_prompt(self, functions: list[dict]) -> str:
        return (
            "You can call these functions:\n\n" + _tools_json(functions) + "\n\n"
            "To call one, answer with only a JSON object "
            '{"name": <function name>, "parameters": <arguments object>}; join several with "; ".'
        )


ToolCallParser = HermesToolParser | Llama3JsonToolParser
TOOL_CALL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def build_tool_parser(name: str) -> ToolCallParser:
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_CALL_PARSERS)}") from None


def render_tool_results(contents: list[str]) -> str:
    """Tool results as a user turn, for templates without a tool role (the Hermes convention)."""
    return "\n".join(f"<tool_response>\n{content}\n</tool_response>" for content in contents)
