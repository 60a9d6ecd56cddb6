"""One server's state (`app[STATE]`): its engine, config, metrics and per-app caches; nothing global."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from aiohttp import web

from configs.schema import ServerConfig
from server import formats
from server.chat_messages import template_source
from server.engine_client import EngineClient
from server.metrics import ServerMetrics
from server.responses import Formatter
from server.tool_parser import build_tool_parser


def server_version() -> str:
    try:
        return metadata.version("jaxserve")
    except metadata.PackageNotFoundError:
        return "0.1.0+local"


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    metrics: ServerMetrics
    texts: formats.TokenTexts
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    cut: asyncio.Event = field(default_factory=asyncio.Event)  # set when a drain times out: end streams now
    chat_template: str | None = None  # --chat-template (text), replacing the model's
    fingerprint: str = ""

    grammar_compiler: object = None  # built on the first grammar request (runtime.structured_output)
    # P/D: the internal credential a request must carry for its kv_transfer_params to be honoured
    # (None: a loopback-only deployment, checked at start-up by server.deployment)
    kv_transfer_token: str | None = field(default=None, repr=False)
    tool_parser: object = None  # server.tool_parser's format for server.tool_call_parser
    _vocabulary: dict = field(default_factory=dict)  # tag -> whether the tokenizer has it as one token

    def __post_init__(self) -> None:
        self.idle.set()
        self.chat_template = load_chat_template(self.config.chat_template)
        self.fingerprint = formats.system_fingerprint(server_version(), self.engine.model_name)
        self.tool_parser = build_tool_parser(self.config.tool_call_parser)

    def template_text(self, request_template: str | None = None) -> str:
        """The source of the chat template a request renders with."""
        return template_source(
            request_template or self.chat_template or getattr(self.engine.tokenizer, "chat_template", None)
        )

    def vocabulary_has(self, tag: str) -> bool:
        if tag not in self._vocabulary:  # once: the vocabulary of a large model is a big dict
            self._vocabulary[tag] = tag in self.engine.tokenizer.get_vocab()
        return self._vocabulary[tag]

    def formatter(self, chat: bool) -> Formatter:
        return Formatter(chat, self.texts, self.fingerprint)

    def compiler(self):
        """The engine's grammar compiler (the engine process's, through `RemoteGrammarCompiler`), whose
        cache then serves the request's add: a grammar is compiled once. One of our own for an engine
        without (e.g. `FakeEngine`, which never compiles)."""
        if self.grammar_compiler is None:
            compiler = getattr(self.engine, "grammar_compiler", None)
            if compiler is None:
                from runtime.structured_output import build_compiler

                tokenizer = self.engine.tokenizer
                compiler = build_compiler(tokenizer, self.engine.vocab_size, (tokenizer.eos_token_id,))
            compiler.timeout_s = self.config.grammar_compile_timeout_s
            self.grammar_compiler = compiler
        return self.grammar_compiler


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template itself (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:  # e.g. a template line longer than a file name may be
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"server.chat_template: {value!r} is neither a file nor a Jinja template")
    return value


STATE = web.AppKey("jaxserve_state", ServerState)
REQUEST_ID = web.RequestKey("jaxserve_request_id", str) if hasattr(web, "RequestKey") else "jaxserve_request_id"
