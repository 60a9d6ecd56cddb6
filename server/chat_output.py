"""Chat completion text -> message fields: reasoning_content, content, tool_calls.

One `ChatOutputParser` per choice chains the reasoning parser (when the server runs one) and
the tool-call parser (when the request's tools may be called; `server/tool_parser.py`). Both
are pure functions of the cumulative text, so the non-streaming `message()` and the streaming
`deltas()` are the same parse: streamed `delta.reasoning_content`, `delta.content` and
`delta.tool_calls` add up to the message. A tool call is streamed once it is complete, in one
delta (`index`, `id`, `type`, `name` and the whole `arguments`), so a call that `max_tokens`
cuts is never half-sent: it is dropped from both. Whitespace-only content is held back and
reported as null, as OpenAI does next to tool calls; with tools, so is trailing whitespace
(it separates the calls).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.reasoning import Qwen3ReasoningParser
from server.tool_parser import ParsedToolCall, ToolCallParser


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
    tools: ToolCallParser | None = None  # None: tool calls are not parsed
    max_calls: int | None = None
    # streaming state: what was sent so far
    _reasoning_sent: int = 0
    _content_sent: int = 0
    _ids: list[str] = field(default_factory=list)

    @property
    def parse_tools(self) -> bool:
        return self.tools is not None

    def parse(self, text: str, final: bool) -> ParsedChat:
        reasoning, content = self.reasoning.split(text, final) if self.reasoning else ("", text)
        calls: list[ParsedToolCall] = []
        if self.tools is not None:  # trailing whitespace (before or between calls) is not content
            content, calls = self.tools.parse(content, final, self.max_calls)
            content = content.rstrip()
        if not content.strip():
            content = ""
        return ParsedChat(reasoning, content, calls)

    def _call_ids(self, count: int) -> list[str]:
        while len(self._ids) < count:
            self._ids.append(tool_call_id())
        return self._ids

    def message(self, text: str) -> dict:
        """The message fields of the final text: content, reasoning_content, tool_calls."""
        parsed = self.parse(text, final=True)
        fields: dict = {"content": parsed.content or None}
        if self.reasoning is not None:
            fields["reasoning_content"] = parsed.reasoning or None
        if self.tools is not None:
            ids = self._call_ids(len(parsed.calls))
            fields["tool_calls"] = [
                {"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(parsed.calls)
            ]
        return fields

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        if reason == "stop" and self.tools is not None and self.parse(text, True).calls:
            return "tool_calls"
        return reason

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Deltas of the cumulative `text` since the last call, in order."""
        parsed = self.parse(text, final)
        out = []
        if len(parsed.reasoning) > self._reasoning_sent:
            out.append({"reasoning_content": parsed.reasoning[self._reasoning_sent :]})
            self._reasoning_sent = len(parsed.reasoning)
        if len(parsed.content) > self._content_sent:
            out.append({"content": parsed.content[self._content_sent :]})
            self._content_sent = len(parsed.content)
        sent = len(self._ids)
        ids = self._call_ids(len(parsed.calls))
        for index in range(sent, len(parsed.calls)):
            call = parsed.calls[index]
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": ids[index],
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ]
                }
            )
        return out
