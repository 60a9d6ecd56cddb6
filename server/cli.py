"""The `jaxserve` command line: the HTTP side.

    jaxserve serve [MODEL] [--config FILE] [--set KEY=VALUE ...] [CONFIG FLAGS ...] [--fake-engine]
    jaxserve config [MODEL] [--config FILE] [--set KEY=VALUE ...] [CONFIG FLAGS ...]   # print the validated config
    jaxserve convert HF_DIR OUT_DIR [--dtype bfloat16] [--mesh data=1,model=8]   # orbax checkpoint
    jaxserve plan --config FILE [--set KEY=VALUE ...] [--buckets 16,4096] [--json PATH]   # compile for the target chip

CONFIG FLAGS are the flags users type from habit (vLLM's names: `--dtype`, `--max-num-seqs`,
`--gpu-memory-utilization`, `--enable-prefix-caching`, ...); each maps onto one config key in
the one table `CONFIG_FLAGS` below (add a row to add a flag). Precedence: YAML < `--set` <
flags. vLLM's parallelism flags map onto `parallel.mesh` (`parallel_overrides`):
`--tensor-parallel-size N` is `model: N`, `--data-parallel-size D` is `data: D` (attention
data parallelism, runtime/parallel/data_parallel.py); `--enable-expert-parallel` is `parallel.expert: true`
(MoE experts split by expert index over the model axis). `plan` (runtime/aot/chip_report.py, imported only when
asked) compiles the config's steps for its `parallel.chip` from the model's config.json shapes
and prints memory and cost per device.

`serve` loads and validates the launch config, builds the engine and runs the server until
SIGTERM/SIGINT (graceful drain, exit 0). The JAX engine is built by
`runtime.engine.client_factory.create_engine_client(config)`, imported only when needed;
`--fake-engine` serves `server.testing.FakeEngine` instead (no model, no JAX) for exercising
clients and load generators against the HTTP layer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from configs import rules
from configs.schema import ConfigError, LaunchConfig, load_config, parse_override
from server.cli_offline import add_convert_parser, add_plan_arguments, run_convert, run_plan
from server.deployment import is_loopback, pd_deployment_error, warn_insecure_every_minute


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


_DTYPES = {
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_KV_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}

CONFIG_FLAGS: tuple[ConfigFlag, ...] = (
    ConfigFlag("--host", "server.host", "bind address"),
    ConfigFlag("--port", "server.port", "port (0 picks a free one)", type=int),
    ConfigFlag("--api-key", "server.api_key", "require this bearer token"),
    ConfigFlag("--served-model-name", "model.served_model_name", "model id reported by /v1/models"),
    ConfigFlag("--max-model-len", "model.max_model_len", "context length limit (prompt + output)", type=int),
    ConfigFlag(
        "--dtype",
        "model.dtype",
        "weight/activation dtype (auto: the config's)",
        choices=tuple(_DTYPES),
        convert=_DTYPES.get,
    ),
    ConfigFlag("--max-num-seqs", "scheduler.max_num_seqs", "most sequences in one step", type=int),
    ConfigFlag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "token budget of one step", type=int),
    ConfigFlag("--async-scheduling", "scheduler.async_scheduling", "plan step n+1 while step n runs", boolean=True),
    ConfigFlag(
        "--kv-offloading-size", "cache.kv_offloading_size", "GiB of host memory for evicted KV/state", type=float
    ),
    ConfigFlag("--kv-offloading-backend", "cache.kv_offloading_backend", "host tier backend", choices=("native",)),
    ConfigFlag(
        "--gpu-memory-utilization",
        "cache.memory_fraction",
        "fraction of device memory to budget for weights + KV cache (replaces cache.num_pages)",
        type=float,
        also=(("cache.num_pages", None),),
    ),
    ConfigFlag(
        "--kv-cache-dtype",
        "cache.kv_cache_dtype",
        "KV page dtype (fp8 = fp8_e4m3)",
        choices=tuple(_KV_DTYPES),
        convert=_KV_DTYPES.get,
    ),
    ConfigFlag(
        "--state-dtype",
        "cache.state_dtype",
        "GDN state slot dtype (vLLM's --mamba-ssm-cache-dtype; the recurrence computes in float32)",
        choices=rules.STATE_DTYPES,
    ),
    ConfigFlag(
        "--enable-prefix-caching", "cache.enable_prefix_caching", "share KV pages of common prefixes", boolean=True
    ),
    ConfigFlag(
        "--window-paging",
        "cache.window_paging",
        "sliding-window layers keep window-sized KV (default: on where the model has them)",
        boolean=True,
    ),
    ConfigFlag(
        "--speculative-config",
        "speculative_config",
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    ),
    ConfigFlag("--chat-template", "server.chat_template", "a Jinja chat template (or a file) replacing the model's"),
    ConfigFlag(
        "--trust-request-chat-template",
        "server.trust_request_chat_template",
        "let clients send their own chat_template (rendered in the sandbox, time-limited)",
        switch=True,
    ),
    ConfigFlag(
        "--quantization",
        "model.quantization",
        "quantize float weights at load: int8 | fp8 | w8a8-int8 | w8a8-fp8 | int4 | int4-zp | int4-sym",
    ),
    ConfigFlag(
        "--role",
        "parallel.role",
        "P/D disaggregation role (docs/disaggregation.md)",
        choices=rules.ROLES,
    ),
    ConfigFlag(
        "--reasoning-parser",
        "server.reasoning_parser",
        "split <think>...</think> into reasoning_content",
        choices=("qwen3",),
    ),
    ConfigFlag(
        "--tool-call-parser",
        "server.tool_call_parser",
        "the tool-call format parsed and forced: hermes (Qwen, Hermes) | llama3_json (Llama 3.x)",
        choices=("hermes", "llama3_json"),
    ),
    ConfigFlag(
        "--enable-auto-tool-choice",
        "server.enable_auto_tool_choice",
        'parse tool calls for tool_choice "auto" (and tools without a tool_choice)',
        boolean=True,
    ),
    ConfigFlag(
        "--max-tool-calls",
        "server.max_tool_calls",
        "most tool calls in one answer when parallel_tool_calls is on",
        type=int,
    ),
    ConfigFlag(
        "--kv-transfer-token",
        "kv_transfer.token",
        "P/D: the proxy <-> instance credential (prefer JAXSERVE_KV_TRANSFER_TOKEN: flags show in ps)",
    ),
    ConfigFlag(
        "--insecure-kv-transfer",
        "kv_transfer.insecure",
        "P/D: serve a role on a non-loopback address without a token (not for production)",
        switch=True,
    ),
    ConfigFlag(
        "--process-id",
        "parallel.multihost.process_id",
        "this process of a multi-host launch (0 serves HTTP; docs/scaling.md)",
        type=int,
    ),
)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for flag in CONFIG_FLAGS:
        dest = _dest(flag)
        if flag.boolean:
            parser.add_argument(
                flag.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{flag.help} ({flag.key})",
            )
        elif flag.switch:
            parser.add_argument(
                flag.flag, dest=dest, action="store_const", const=True, default=None, help=f"{flag.help} ({flag.key})"
            )
        else:
            metavar = None if flag.choices else {int: "N", float: "X"}.get(flag.type, "VALUE")
            parser.add_argument(
                flag.flag,
                dest=dest,
                type=flag.type,
                choices=flag.choices,
                default=None,
                metavar=metavar,
                help=f"{flag.help} ({flag.key})",
            )


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
    for name, text in (
        ("serve", "run the server"),
        ("config", "print the validated launch config"),
        ("plan", "compile the config for its chip; print memory and cost per device"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", default=None, help="launch YAML (default: configs/cpu-demo.yaml)")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set cache.page_size=32 (repeatable)",
        )
        sub.add_argument(
            "model",
            nargs="?",
            default=None,
            help="HF checkpoint directory or .gguf file (default: the config's, else SmolLM2-135M)",
        )
        _add_config_flags(sub)
        sub.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=None,
            metavar="N",
            help="devices the weights are split over (parallel.mesh.model)",
        )
        sub.add_argument(
            "--data-parallel-size",
            type=int,
            default=None,
            metavar="N",
            help="attention data parallelism: D ranks, each with its own batch, pages and "
            "state slots (parallel.mesh.data)",
        )
        sub.add_argument(
            "--enable-expert-parallel",
            action="store_true",
            default=None,
            help="MoE experts split by expert index over the model axis (parallel.expert)",
        )
        if name == "plan":
            add_plan_arguments(sub)
        if name == "serve":
            sub.add_argument(
                "--fake-engine", action="store_true", help="serve the hand-computable FakeEngine instead of a model"
            )
            sub.add_argument("--log-level", default="INFO")
    add_convert_parser(commands)
    commands.add_parser("proxy", add_help=False, help="prefill -> decode router (jaxserve proxy --help)")
    commands.add_parser("router", add_help=False, help="many replicas behind one endpoint (jaxserve router --help)")
    return parser


def _load(args) -> LaunchConfig:
    overrides = dict(parse_override(item) for item in args.overrides)
    if args.model is not None:
        overrides["model.path"] = args.model
    overrides.update(flag_overrides(args))
    overrides.update(
        parallel_overrides(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel)
    )
    return load_config(args.config, overrides)


def parallel_overrides(
    tensor_parallel_size: int | None, data_parallel_size: int | None, enable_expert_parallel: bool | None
) -> dict:
    """vLLM's parallelism flags -> `parallel` keys."""
    if data_parallel_size is not None and data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    if tensor_parallel_size is not None and tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    overrides = {} if tensor_parallel_size is None else {"parallel.mesh.model": tensor_parallel_size}
    if data_parallel_size is not None:
        overrides["parallel.mesh.data"] = data_parallel_size
    if enable_expert_parallel:
        overrides["parallel.expert"] = True
    return overrides


def _build_engine(config: LaunchConfig, fake: bool):
    if fake:
        from server.testing import FakeEngine, build_test_tokenizer

        return FakeEngine(
            build_test_tokenizer(),
            model_name=config.model.served_model_name or "fake-model",
            max_model_len=config.model.max_model_len or 2048,
            num_slots=config.scheduler.max_num_seqs,
        )
    from runtime.engine.client_factory import create_engine_client  # JAX: imported only for a real engine

    return create_engine_client(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["proxy"], ["router"]):  # the router (server/router.py); `proxy` is its P/D mode
        from server.router import main as router_main

        return router_main(argv[1:], command=argv[0])
    args = _parser().parse_args(argv)
    if args.command == "convert":
        return run_convert(args)
    try:
        config = _load(args)
    except ConfigError as err:
        print(f"jaxserve: invalid config: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.command == "plan":
        return run_plan(args, config)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refused = pd_deployment_error(config)
    if refused is not None:
        print(f"jaxserve: refusing to start: {refused}", file=sys.stderr)
        return 2
    kv = config.kv_transfer
    if (
        config.parallel.role != "both"
        and kv.token is None
        and not (is_loopback(config.server.host) and is_loopback(kv.host))
    ):
        warn_insecure_every_minute(f"this {config.parallel.role} instance")
    from server.runner import serve

    token = kv.token.get_secret_value() if kv.token is not None and config.parallel.role != "both" else None
    try:
        engine = _build_engine(config, args.fake_engine)
    except ValueError as err:  # a launch the runtime refuses (e.g. multi-host without its secret)
        print(f"jaxserve: refusing to start: {err}", file=sys.stderr)
        return 2
    return serve(engine, config.server, kv_transfer_token=token)


if __name__ == "__main__":
    sys.exit(main())
