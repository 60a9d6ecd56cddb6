"""The `jaxserve` command line: the HTTP side.

    jaxserve serve [MODEL] [--config FILE] [--host H] [--port N] [--api-key K] [--set KEY=VALUE ...] [--fake-engine]
    jaxserve config [--config FILE] [--set KEY=VALUE ...]   # print the validated config
    jaxserve convert HF_DIR OUT_DIR [--dtype bfloat16] [--mesh data=1,model=8]   # orbax checkpoint
    jaxserve plan --config FILE [--set KEY=VALUE ...] [--buckets 16,4096]   # compile for the target chip

vLLM's parallelism flags map onto `parallel.mesh`: `--tensor-parallel-size N` is `model: N`;
`--data-parallel-size` > 1 and `--enable-expert-parallel` are refused until attention data
parallelism and expert parallelism are built (issue 13), rather than silently ignored.
`plan` (runtime/plan.py, imported only when asked) compiles the config's steps for its
`parallel.chip` from the model's config.json shapes and prints memory and cost per device.

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
    for name, text in (("serve", "run the server"), ("config", "print the validated launch config"),
                       ("plan", "compile the config for its chip; print memory and cost per device")):
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
        sub.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                         help="devices the weights are split over (parallel.mesh.model)")
        sub.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                         help="attention data parallelism: not built yet, only 1 is accepted (issue 13)")
        sub.add_argument("--enable-expert-parallel", action="store_true", default=None,
                         help="expert parallelism: not built yet, refused (issue 13)")
        if name == "plan":
            sub.add_argument("--buckets", default=None, metavar="T,T,...",
                             help="compile only these token buckets (default: every bucket)")
        if name == "serve":
            sub.add_argument("--fake-engine", action="store_true",
                             help="serve the hand-computable FakeEngine instead of a model")
            sub.add_argument("--log-level", default="INFO")
    convert = commands.add_parser("convert", help="write an HF checkpoint as an orbax checkpoint (fast, sharded loads)")
    convert.add_argument("source", help="HF checkpoint directory")
    convert.add_argument("out_dir", help="new directory: params/ (orbax) + config and tokenizer files")
    convert.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    convert.add_argument("--mesh", default=None, metavar="data=D,model=M",
                         help="write from this sharding (each process writes its shards); any mesh restores it")
    return parser


def _load(args) -> LaunchConfig:
    overrides = dict(parse_override(item) for item in args.overrides)
    flags = {"model.path": args.model, "server.host": args.host, "server.port": args.port,
             "server.api_key": args.api_key, "model.served_model_name": args.served_model_name,
             "model.max_model_len": args.max_model_len}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    overrides.update(parallel_overrides(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel))
    return load_config(args.config, overrides)


def parallel_overrides(tensor_parallel_size: int | None, data_parallel_size: int | None,
                       enable_expert_parallel: bool | None) -> dict:
    """vLLM's parallelism flags -> `parallel.mesh` keys; DP > 1 and EP are refused (not built yet)."""
    if data_parallel_size is not None and data_parallel_size != 1:
        raise ConfigError(f"--data-parallel-size {data_parallel_size}: attention data parallelism is not built yet "
                          "(issue 13); today the mesh's data axis only holds replicas. Use --tensor-parallel-size")
    if enable_expert_parallel:
        raise ConfigError("--enable-expert-parallel: expert parallelism is not built yet (issue 13); MoE experts "
                          "are split over --tensor-parallel-size on their intermediate dimension")
    if tensor_parallel_size is not None and tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    return {} if tensor_parallel_size is None else {"parallel.mesh.model": tensor_parallel_size}


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


def _convert(args) -> int:
    """`jaxserve convert`: JAX is imported only for this command."""
    orbax_io = importlib.import_module("models.orbax_io")
    mesh = None
    if args.mesh is not None:
        try:
            axes = dict(part.split("=") for part in args.mesh.split(","))
            shape = int(axes.pop("data", 1)), int(axes.pop("model", 1))
        except ValueError:
            axes, shape = {"?": args.mesh}, (0, 0)
        if axes:
            print(f"jaxserve convert: --mesh must be data=D,model=M, got {args.mesh!r}", file=sys.stderr)
            return 2
        mesh = importlib.import_module("runtime.mesh").make_mesh(*shape)
    try:
        out = orbax_io.convert_checkpoint(args.source, args.out_dir, dtype=args.dtype, mesh=mesh, progress=True)
    except (OSError, ValueError) as err:
        print(f"jaxserve convert: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "convert":
        return _convert(args)
    try:
        config = _load(args)
    except ConfigError as err:
        print(f"jaxserve: invalid config: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.command == "plan":
        return _plan(args, config)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.runner import serve

    return serve(_build_engine(config, args.fake_engine), config.server)


def _plan(args, config: LaunchConfig) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    plan = importlib.import_module("runtime.plan")  # JAX: imported only for this command
    buckets = None if args.buckets is None else tuple(int(b) for b in args.buckets.split(","))
    try:
        report = plan.plan_config(config, args.config or "cpu-demo.yaml", token_buckets=buckets)
    except plan.PlanError as err:
        print(f"jaxserve plan: {err}", file=sys.stderr)
        return 2
    print(plan.format_report(report))
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
