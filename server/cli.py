"""The `jaxserve` command line: the HTTP side.

    jaxserve serve [MODEL] [--config FILE] [--set KEY=VALUE ...] [CONFIG FLAGS ...] [--fake-engine]
    jaxserve config [MODEL] [--config FILE] [--set KEY=VALUE ...] [CONFIG FLAGS ...]   # print the validated config

CONFIG FLAGS are the flags users type from habit (vLLM's names: `--dtype`, `--max-num-seqs`,
`--gpu-memory-utilization`, `--enable-prefix-caching`, ...); each maps onto one config key in
the one table `CONFIG_FLAGS` below (add a row to add a flag). Precedence: YAML < `--set` <
flags.

`serve` loads and validates the launch config, builds the engine and runs the server until
SIGTERM/SIGINT (graceful drain, exit 0). The JAX engine is built by
`runtime.engine_client.create_engine_client(config)`, imported only when needed;
`--fake-engine` serves `server.testing.FakeEngine` instead (no model, no JAX) for exercising
clients and load generators against the HTTP layer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

from configs.schema import ConfigError, LaunchConfig, load_config, parse_override

ENGINE_FACTORY = "runtime.engine_client:create_engine_client"


@dataclass(frozen=True)
class ConfigFlag:
    """One command-line flag that sets one config key.

    `convert` maps the value typed (vLLM's spelling) onto the config's; None leaves the key
    alone (e.g. `--dtype auto`). `boolean` flags come with their `--no-` form.
    """

    flag: str
    key: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    convert: Callable[[Any], Any] = lambda value: value
    boolean: bool = False
    switch: bool = False  # a bare flag that sets True
    also: tuple[tuple[str, Any], ...] = ()  # further (key, value) it implies


_DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
           "float": "float32", "float32": "float32"}
_KV_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
              "fp8_e5m2": "fp8_e5m2"}

CONFIG_FLAGS: tuple[ConfigFlag, ...] = (
    ConfigFlag("--host", "server.host", "bind address"),
    ConfigFlag("--port", "server.port", "port (0 picks a free one)", type=int),
    ConfigFlag("--api-key", "server.api_key", "require this bearer token"),
    ConfigFlag("--served-model-name", "model.served_model_name", "model id reported by /v1/models"),
    ConfigFlag("--max-model-len", "model.max_model_len", "context length limit (prompt + output)", type=int),
    ConfigFlag("--dtype", "model.dtype", "weight/activation dtype (auto: the config's)", choices=tuple(_DTYPES),
               convert=_DTYPES.get),
    ConfigFlag("--max-num-seqs", "scheduler.max_num_seqs", "most sequences in one step", type=int),
    ConfigFlag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "token budget of one step",
               type=int),
    ConfigFlag("--gpu-memory-utilization", "cache.memory_fraction",
               "fraction of device memory to budget for weights + KV cache (replaces cache.num_pages)", type=float,
               also=(("cache.num_pages", None),)),
    ConfigFlag("--kv-cache-dtype", "cache.kv_cache_dtype", "KV page dtype (fp8 = fp8_e4m3)",
               choices=tuple(_KV_DTYPES), convert=_KV_DTYPES.get),
    ConfigFlag("--enable-prefix-caching", "cache.enable_prefix_caching", "share KV pages of common prefixes",
               boolean=True),
    ConfigFlag("--chat-template", "server.chat_template", "a Jinja chat template (or a file) replacing the model's"),
    ConfigFlag("--trust-request-chat-template", "server.trust_request_chat_template",
               "let clients send their own chat_template (rendered in the sandbox, time-limited)", switch=True),
    ConfigFlag("--reasoning-parser", "server.reasoning_parser",
               "split <think>...</think> into reasoning_content", choices=("qwen3",)),
)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for flag in CONFIG_FLAGS:
        dest = _dest(flag)
        if flag.boolean:
            parser.add_argument(flag.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{flag.help} ({flag.key})")
        elif flag.switch:
            parser.add_argument(flag.flag, dest=dest, action="store_const", const=True, default=None,
                                help=f"{flag.help} ({flag.key})")
        else:
            metavar = None if flag.choices else {int: "N", float: "X"}.get(flag.type, "VALUE")
            parser.add_argument(flag.flag, dest=dest, type=flag.type, choices=flag.choices, default=None,
                                metavar=metavar, help=f"{flag.help} ({flag.key})")


def _dest(flag: ConfigFlag) -> str:
    return "flag_" + flag.flag.lstrip("-").replace("-", "_")


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config key -> value for every table flag given on the command line."""
    overrides = {}
    for flag in CONFIG_FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is not None:
            value = flag.convert(value)
        if value is not None:
            overrides[flag.key] = value
            overrides.update(flag.also)
    return overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving on JAX/XLA, OpenAI-compatible API")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("serve", "run the server"), ("config", "print the validated launch config")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", default=None, help="launch YAML (default: configs/cpu-demo.yaml)")
        sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config field, e.g. --set cache.page_size=32 (repeatable)")
        sub.add_argument("model", nargs="?", default=None,
                         help="HF checkpoint directory or .gguf file (default: the config's, else SmolLM2-135M)")
        _add_config_flags(sub)
        if name == "serve":
            sub.add_argument("--fake-engine", action="store_true",
                             help="serve the hand-computable FakeEngine instead of a model")
            sub.add_argument("--log-level", default="INFO")
    return parser


def _load(args) -> LaunchConfig:
    overrides = dict(parse_override(item) for item in args.overrides)
    if args.model is not None:
        overrides["model.path"] = args.model
    overrides.update(flag_overrides(args))
    return load_config(args.config, overrides)


def _build_engine(config: LaunchConfig, fake: bool):
    if fake:
        from server.testing import FakeEngine, build_test_tokenizer

        return FakeEngine(build_test_tokenizer(), model_name=config.model.served_model_name or "fake-model",
                          max_model_len=config.model.max_model_len or 2048,
                          num_slots=config.scheduler.max_num_seqs)
    module_name, _, attribute = ENGINE_FACTORY.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"jaxserve: the engine factory {ENGINE_FACTORY} is not available ({err}); "
                         "use --fake-engine to run the HTTP layer alone") from None
    return factory(config)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _load(args)
    except ConfigError as err:
        print(f"jaxserve: invalid config: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.runner import serve

    return serve(_build_engine(config, args.fake_engine), config.server)


if __name__ == "__main__":
    sys.exit(main())
