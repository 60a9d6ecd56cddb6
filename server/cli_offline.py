"""The `jaxserve` commands that compile or write instead of serving: `plan` (its own flags and the
report; runtime/aot/chip_report.py does the work) and `convert` (models/convert.py). JAX is imported
only when one of them runs; server/cli.py parses the shared flags and dispatches here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from configs.schema import LaunchConfig


def add_plan_arguments(sub: argparse.ArgumentParser) -> None:
    """`jaxserve plan`'s flags beyond the shared launch flags."""
    sub.add_argument(
        "--buckets",
        default=None,
        metavar="T,T,...",
        help="compile only these token buckets (default: every bucket)",
    )
    sub.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="also write the report as JSON to PATH (per device: max_num_seqs, kv_cache_bytes, "
        "state_bytes, weight_bytes, each executable's memory and cost, the roofline, the "
        "state-slot budget); the table stays on stdout",
    )
    sub.add_argument(
        "--host-ram",
        type=float,
        default=None,
        metavar="GIB",
        help="the host's memory in GiB: the host tier (cache.kv_offloading_size) must fit in it",
    )


def add_convert_parser(commands) -> None:
    """`jaxserve convert SOURCE OUT_DIR`."""
    convert = commands.add_parser("convert", help="write an HF checkpoint as an orbax checkpoint (fast, sharded loads)")
    convert.add_argument("source", help="HF checkpoint directory")
    convert.add_argument("out_dir", help="new directory: params/ (orbax) + config and tokenizer files")
    convert.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    convert.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="write from this sharding (each process writes its shards); any mesh restores it",
    )


def run_convert(args) -> int:
    """`jaxserve convert`: JAX is imported only for this command."""
    from models import convert  # JAX: imported only for this command

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
        from runtime.parallel.mesh import make_mesh

        mesh = make_mesh(*shape)
    try:
        out = convert.convert_checkpoint(args.source, args.out_dir, dtype=args.dtype, mesh=mesh, progress=True)
    except (OSError, ValueError) as err:
        print(f"jaxserve convert: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def run_plan(args, config: LaunchConfig) -> int:
    """`jaxserve plan`: 0 when the config fits its chip, 1 when not, 2 on a bad flag or config."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.aot import chip_report as plan  # JAX: imported only for this command

    buckets = None if args.buckets is None else tuple(int(b) for b in args.buckets.split(","))
    if args.json_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        print(f"jaxserve plan: --json {args.json_path}: its directory does not exist", file=sys.stderr)
        return 2
    try:
        host_ram = None if args.host_ram is None else int(args.host_ram * 2**30)
        report = plan.plan_config(
            config, args.config or "cpu-demo.yaml", token_buckets=buckets, host_ram_bytes=host_ram
        )
    except plan.PlanError as err:
        print(f"jaxserve plan: {err}", file=sys.stderr)
        return 2
    print(plan.format_report(report))
    if args.json_path is not None:
        try:
            with open(args.json_path, "w") as out:
                json.dump(plan.report_json(report), out, indent=2)
                out.write("\n")
        except OSError as err:
            print(f"jaxserve plan: cannot write --json {args.json_path}: {err}", file=sys.stderr)
            return 2
    return 0 if report.fits else 1
