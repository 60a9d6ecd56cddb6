"""Request fields that constrain the output -> a `StructuredOutput` grammar, checked up front.

OpenAI `response_format` (`text`, `json_object`, `json_schema`), vLLM `structured_outputs`
(`json`, `regex`, `choice`, `grammar`) and forced tool calls (`tool_choice: required` or a
named function) all become one grammar for the engine. Every malformed field is a
`RequestError(400)` naming it; the grammar is then compiled (thread pool, cache, time bound:
`runtime.structured_output.GrammarCompiler`) before the request is accepted, so a schema or
regex that cannot compile is a 400 too, never a 500 or an in-band stream error.

Forced tool calls are written in the server's tool-call format (`server/tool_parser.py`:
Hermes / Qwen `<tool_call>` blocks, or Llama 3 JSON), the arguments constrained by the tool's
JSON schema and the number of calls bounded (one without `parallel_tool_calls`, else
`server.max_tool_calls`); the same parser reads them back.

A reasoning parser never switches a grammar off: when the prompt opens the reasoning block the
grammar starts after its end tag; when the model may open one itself the grammar allows an
optional leading block; otherwise (a model that never thinks, thinking switched off) the
grammar applies from the first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.structured_output.backend import GrammarError
from runtime.types import StructuredOutput
from server.protocol import RequestError
from server.reasoning import Qwen3ReasoningParser, build_reasoning_parser
from server.tool_parser import HermesToolParser, ToolCallParser

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUT_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "ebnf"}
STRUCTURED_OUTPUT_OPTIONS = (
    "json_object",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ANY_JSON_OBJECT = '{"type": "object"}'


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param=param)


def response_format_grammar(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _bad("response_format.type", f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}[kind]
    extra = sorted(set(response_format) - allowed)
    if extra:
        raise _bad(f"response_format.{extra[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object {name, schema, strict, description}")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _bad(f"response_format.json_schema.{unknown[0]}", "unknown field")
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise _bad("response_format.json_schema.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ . -")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise _bad("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON Schema object")
    return StructuredOutput("json", json.dumps(schema))


def vllm_structured_outputs_grammar(options: dict[str, Any] | None) -> StructuredOutput | None:
    if not options:
        return None
    unknown = sorted(set(options) - set(STRUCTURED_OUTPUT_KINDS) - set(STRUCTURED_OUTPUT_OPTIONS))
    if unknown:
        raise _bad(
            f"structured_outputs.{unknown[0]}",
            f"unknown field; use one of {', '.join(STRUCTURED_OUTPUT_KINDS)} or json_object",
        )
    given = [k for k in STRUCTURED_OUTPUT_KINDS if options.get(k) is not None]
    if options.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise _bad("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object; got {given}")
    key = given[0]
    value = options.get(key)
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise _bad(param, f"is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise _bad(param, "must be a JSON Schema object (or its JSON text)")
        return StructuredOutput("json", json.dumps(value))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(param, "must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    return StructuredOutput(STRUCTURED_OUTPUT_KINDS[key], value)


@dataclass(frozen=True)
class ToolPlan:
    """What the tools of a chat request ask for: `mode` none | auto | forced; `functions` the
    function definitions to render; `forced` the names a forced call may use; `max_calls` the
    most calls one answer may hold."""

    mode: str
    functions: list[dict]
    forced: tuple[str, ...] = ()
    max_calls: int = 1

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "forced")


def tool_plan(
    tools: list[dict] | None,
    tool_choice,
    parallel_tool_calls: bool,
    *,
    max_tool_calls: int = 8,
    auto_tool_choice: bool = True,
) -> ToolPlan:
    """`auto_tool_choice` off (vLLM without `--enable-auto-tool-choice`): tools without a
    tool_choice are only rendered, and an explicit `"auto"` is a 400."""
    functions = [_check_tool(i, tool) for i, tool in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", "function names must be unique")
    max_calls = max_tool_calls if parallel_tool_calls else 1
    if tool_choice is None:
        tool_choice = "auto" if functions and auto_tool_choice else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise _bad(
                "tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or a named function, got {tool_choice!r}"
            )
        if tool_choice != "none" and not functions:
            raise _bad("tool_choice", f"{tool_choice!r} needs a non-empty tools list")
        if tool_choice == "auto" and not auto_tool_choice:
            raise _bad("tool_choice", '"auto" needs a server started with --enable-auto-tool-choice')
        mode = {"none": "none", "auto": "auto", "required": "forced"}[tool_choice]
        return ToolPlan(mode, functions, tuple(names) if mode == "forced" else (), max_calls)
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(tool_choice.get("function"), dict)
    ):
        raise _bad("tool_choice", 'a named choice must be {"type": "function", "function": {"name": ...}}')
    name = tool_choice["function"].get("name")
    if name not in names:
        raise _bad("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(names) or 'none'})")
    return ToolPlan("forced", functions, (name,), max_calls=1)


def _check_tool(index: int, tool: Any) -> dict:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{param}.type", 'only {"type": "function", "function": {...}} tools are supported')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object {name, description, parameters, strict}")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise _bad(f"{param}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ . -")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise _bad(f"{param}.function.parameters", 'must be a JSON Schema of type "object"')
    return {**function, "parameters": parameters}


def forced_tool_call_grammar(plan: ToolPlan, parser: ToolCallParser) -> StructuredOutput:
    """Lark: 1..plan.max_calls calls in the parser's format, each naming one of the allowed
    functions with arguments valid under its schema."""
    functions = [f for f in plan.functions if f["name"] in plan.forced]
    return StructuredOutput("lark", parser.grammar(functions, plan.max_calls))


def request_grammar(
    body,
    plan: ToolPlan | None = None,
    parser: ToolCallParser | None = None,
) -> tuple[StructuredOutput | None, str | None]:
    """The one grammar a request asks for, and the field it came from (for error messages)."""
    found = []
    grammar = response_format_grammar(body.response_format)
    if grammar is not None:
        schema_given = body.response_format.get("type") == "json_schema"
        found.append((grammar, "response_format.json_schema.schema" if schema_given else "response_format"))
    grammar = vllm_structured_outputs_grammar(body.structured_outputs)
    if grammar is not None:
        key = next(k for k in (*STRUCTURED_OUTPUT_KINDS, "json_object") if body.structured_outputs.get(k))
        found.append((grammar, f"structured_outputs.{key}"))
    if plan is not None and plan.mode == "forced":
        found.append((forced_tool_call_grammar(plan, parser or HermesToolParser()), "tool_choice"))
    if len(found) > 1:
        raise _bad(found[1][1], f"cannot be combined with {found[0][1]}")
    return found[0] if found else (None, None)


async def compile_or_400(compiler, grammar: StructuredOutput, param: str) -> None:
    """Compile on the compiler's pool (cached); a bad grammar or a timeout is a 400 naming `param`."""
    future = compiler.submit(grammar)
    try:
        await asyncio.wait_for(asyncio.wrap_future(future), compiler.timeout_s)
    except TimeoutError:
        raise _bad(param, f"the grammar did not compile within {compiler.timeout_s:g} s") from None
    except GrammarError as err:
        raise _bad(param, str(err)) from None
    except Exception as err:
        raise _bad(param, f"the grammar failed to compile: {type(err).__name__}: {err}") from None


async def chat_grammar(
    body,
    tools: ToolPlan,
    tool_parser: ToolCallParser,
    template_kwargs: dict,
    prompt: list[int],
    tokenizer,
    reasoning_parser: str | None,
    compiler,
    model_may_think,
) -> tuple[StructuredOutput | None, Qwen3ReasoningParser | None]:
    """A chat request's grammar (compiled, or a 400) and its reasoning parser. `compiler()` is
    called for the compiler only when there is a grammar; `model_may_think(parser)` says
    whether the model may open a reasoning block by itself (asked only when it matters)."""
    grammar, param = request_grammar(body, tools, tool_parser)
    reasoning = None
    prompt_tail = ""
    if reasoning_parser is not None:  # does the prompt end inside a <think> block?
        prompt_tail = tokenizer.decode(prompt[-16:])
        reasoning = build_reasoning_parser(reasoning_parser, prompt_tail)
    if grammar is None:
        return None, reasoning
    if reasoning is not None and template_kwargs.get("enable_thinking") is not False:
        if reasoning.open_at_start:
            end_ids = await asyncio.to_thread(tokenizer.encode, reasoning.end_tag, add_special_tokens=False)
            grammar = dataclasses.replace(grammar, start_after=tuple(end_ids))
        elif not reasoning.prompt_closes_reasoning(prompt_tail) and model_may_think(reasoning):
            grammar = dataclasses.replace(grammar, optional_block=(reasoning.start_tag, reasoning.end_tag))
    await compile_or_400(compiler(), grammar, param)
    return grammar, reasoning
