"""Compile time of one backbone bucket as the model gets deeper: scanned layer groups vs unrolled.

    python -m benchmarks.compile_depth [--family qwen3_5] [--depths 4 8 16 32] [--tokens 64]

Builds small random checkpoints of increasing depth (models.random_checkpoint), then times
trace+lower+compile of the serving forward pass for one token bucket, with the layer groups
under `lax.scan` (what the engine runs) and unrolled. Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax

from models import KernelOptions, load_model
from models.random_checkpoint import write_random_checkpoint
from models.transformer import forward
from runtime.steps.specs import abstract_spec as _spec


def _layer_types(family: str, depth: int) -> dict:
    if family in ("llama", "qwen3"):
        return {"num_hidden_layers": depth}
    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return {"num_hidden_layers": depth, "layer_types": (pattern * depth)[:depth]}


def compile_seconds(model, tokens: int, scan: bool) -> float:
    from runtime.steps.executables import StepExecutables

    caches = model.init_caches(64, 16, 8)
    ex = StepExecutables(
        model, caches, KernelOptions(), token_buckets=(tokens,), seq_buckets=(8,), max_num_seqs=8, max_blocks_per_seq=16
    )
    fn = jax.jit(
        lambda p, c, b: forward(p, c, b, cfg=model.cfg, opts=KernelOptions(), scan_layers=scan), donate_argnums=1
    )
    t0 = time.perf_counter()
    fn.trace(jax.tree.map(_spec, model.params), jax.tree.map(_spec, caches), ex.batch_spec(tokens)).lower().compile()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in args.depths:
            path = write_random_checkpoint(args.family, Path(tmp) / f"d{depth}", **_layer_types(args.family, depth))
            model = load_model(path)
            row = {
                "family": args.family,
                "layers": depth,
                "tokens": args.tokens,
                "scan_s": compile_seconds(model, args.tokens, True),
                "unrolled_s": compile_seconds(model, args.tokens, False),
            }
            rows.append(row)
            print(
                f"{args.family:10s} layers={depth:3d}  scan {row['scan_s']:6.2f}s   unrolled {row['unrolled_s']:6.2f}s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
