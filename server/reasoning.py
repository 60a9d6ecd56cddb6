"""Reasoning parsers: split a completion's text into `reasoning_content` and `content`.

`Qwen3ReasoningParser` (`--reasoning-parser qwen3`): the reasoning is the text inside
`<think>…</think>`. The block is open from the start when the model emits `<think>` first or
when the rendered prompt already ends inside one (Qwen3.5 / thinking templates put `<think>\\n`
in the generation prompt); with `enable_thinking: false` the template closes it in the prompt
and everything is content. Newlines right after `</think>` are dropped.

`split(text, final)` is a pure function of the cumulative text: while generating
(`final=False`) it holds back a tail that could still become a tag, so each result is a
prefix of the next one and streamed deltas add up to the final split exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3",)


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Qwen3ReasoningParser:
    open_at_start: bool = False  # the prompt ends inside a <think> block
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """-> (reasoning, content) of the cumulative `text`."""
        in_reasoning = self.open_at_start
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            in_reasoning, text = True, stripped[len(self.start_tag) :]
        elif not final and not self.open_at_start and stripped and self.start_tag.startswith(stripped):
            return "", ""  # may still become "<think>"
        if not in_reasoning:
            return "", text
        end = text.find(self.end_tag)
        if end < 0:
            hold = 0 if final else partial_tag_length(text, self.end_tag)
            return text[: len(text) - hold], ""
        return text[:end], text[end + len(self.end_tag) :].lstrip("\n")

    @staticmethod
    def prompt_opens_reasoning(prompt_text_tail: str) -> bool:
        """Whether a rendered prompt (its last characters suffice) ends inside a <think> block."""
        return prompt_text_tail.rfind("<think>") > prompt_text_tail.rfind("</think>")

    def prompt_closes_reasoning(self, prompt_text_tail: str) -> bool:
        """Whether a rendered prompt ends right after a closed block (thinking switched off)."""
        return prompt_text_tail.rstrip().endswith(self.end_tag)

    def model_may_open(self, chat_template: str, vocabulary_has_tag: bool) -> bool:
        """Whether the model may write a block itself: its template or vocabulary knows the tag
        (a model that has never seen `<think>` does not write one)."""
        return vocabulary_has_tag or self.start_tag in chat_template


def build_reasoning_parser(name: str | None, prompt_text_tail: str) -> Qwen3ReasoningParser | None:
    if name is None:
        return None
    if name != "qwen3":
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(REASONING_PARSERS)}")
    return Qwen3ReasoningParser(open_at_start=Qwen3ReasoningParser.prompt_opens_reasoning(prompt_text_tail))
