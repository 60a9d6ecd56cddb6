"""Chat completion text -> message fields: reasoning_content, content, tool_calls.

One `ChatOutputParser` per choice chains the reasoning parser (when the server runs one) and
the Hermes tool-call parser (when the request's tools may be called). Both are pure functions
of the cumulative text, so the non-streaming `message()` and the streaming `deltas()` are the
same parse: streamed `delta.reasoning_content`, `delta.content` and `delta.tool_calls` (OpenAI's
shape: the first chunk of a call carries its index, id, type and name with empty arguments,
later ones append to `function.arguments`) add up to the message. Whitespace-only content is
held back and reported as null, as OpenAI does next to tool calls; with tools, so is trailing
whitespace (it separates the calls).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.reasoning import Qwen3ReasoningParser
from server.tool_parser import ParsedToolCall, parse_tool_calls


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedChat:
    reasoning: str
    content: str
    calls: list[ParsedToolCall]


@dataclass
class ChatOutputParser:
    reasoning: Qwen3ReasoningParser | None = None
    parse_tools: bool = False
    # streaming state: what was sent so far
    _reasoning_sent: int = 0
    _content_sent: int = 0
    _ids: list[str] = field(default_factory=list)
    _args_sent: list[int] = field(default_factory=list)

    def parse(self, text: str, final: bool) -> ParsedChat:
        reasoning, content = self.reasoning.split(text, final) if self.reasoning else ("", text)
        calls: list[ParsedToolCall] = []
        if self.parse_tools:  # trailing whitespace (before or between calls) is not content
            content, calls = parse_tool_calls(content, final)
            content = content.rstrip()
        if not content.strip():
            content = ""
        return ParsedChat(reasoning, content, calls)

    def message(self, text: str) -> dict:
        """The message fields of the final text: content, reasoning_content, tool_calls."""
        parsed = self.parse(text, final=True)
        fields: dict = {"content": parsed.content or None}
        if self.reasoning is not None:
            fields["reasoning_content"] = parsed.reasoning or None
        if self.parse_tools:
            while len(self._ids) < len(parsed.calls):
                self._ids.append(tool_call_id())
            fields["tool_calls"] = [
                {"id": self._ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(parsed.calls) if c.name is not None]
        return fields

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        if reason == "stop" and self.parse_tools and any(c.name for c in self.parse(text, True).calls):
            return "tool_calls"
        return reason

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Deltas of the cumulative `text` since the last call, in order."""
        parsed = self.parse(text, final)
        out = []
        if len(parsed.reasoning) > self._reasoning_sent:
            out.append({"reasoning_content": parsed.reasoning[self._reasoning_sent:]})
            self._reasoning_sent = len(parsed.reasoning)
        if len(parsed.content) > self._content_sent:
            out.append({"content": parsed.content[self._content_sent:]})
            self._content_sent = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # calls stream in order; wait for this one's name
            if index == len(self._ids):
                self._ids.append(tool_call_id())
            if index == len(self._args_sent):
                self._args_sent.append(0)
                out.append({"tool_calls": [{"index": index, "id": self._ids[index], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._args_sent[index]:
                out.append({"tool_calls": [{"index": index,
                                            "function": {"arguments": call.arguments[self._args_sent[index]:]}}]})
                self._args_sent[index] = len(call.arguments)
        return out
