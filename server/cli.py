"""The `jaxserve` command line: the HTTP side.

    jaxserve serve [MODEL] [--config FILE] [--host H] [--port N] [--api-key K] [--set KEY=VALUE ...] [--fake-engine]
    jaxserve config [--config FILE] [--set KEY=VALUE ...]   # print the validated config

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

from configs.schema import ConfigError, LaunchConfig, load_config, parse_override

ENGINE_FACTORY = "runtime.engine_client:create_engine_client"


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
        sub.add_argument("--host", default=None, help="bind address (server.host)")
        sub.add_argument("--port", type=int, default=None, help="port (server.port; 0 picks a free one)")
        sub.add_argument("--api-key", default=None, help="require this bearer token (server.api_key)")
        sub.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
        sub.add_argument("--max-model-len", type=int, default=None, help="model.max_model_len")
        sub.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                         help="P/D disaggregation role (parallel.role; docs/disaggregation.md)")
        if name == "serve":
            sub.add_argument("--fake-engine", action="store_true",
                             help="serve the hand-computable FakeEngine instead of a model")
            sub.add_argument("--log-level", default="INFO")
    commands.add_parser("proxy", add_help=False, help="prefill -> decode router (jaxserve proxy --help)")
    return parser


def _load(args) -> LaunchConfig:
    overrides = dict(parse_override(item) for item in args.overrides)
    flags = {"model.path": args.model, "server.host": args.host, "server.port": args.port,
             "server.api_key": args.api_key, "model.served_model_name": args.served_model_name,
             "model.max_model_len": args.max_model_len, "parallel.role": args.role}
    overrides.update({k: v for k, v in flags.items() if v is not None})
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        from server.proxy import main as proxy_main

        return proxy_main(argv[1:])
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
