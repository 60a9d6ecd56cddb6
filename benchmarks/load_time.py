"""Checkpoint load time: safetensors (HF layout) vs the orbax checkpoint `jaxserve convert` writes.

    python -m benchmarks.load_time [--repeats 3] [--json out.json]

Builds random checkpoints (models.random_checkpoint): the tiny test shapes of the dense and
hybrid families, and SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads, vocab 49152; random
weights: load time depends on shapes only), converts each with `convert_checkpoint`, then times
`load_model(...)` until every parameter is on the device (median of `--repeats`, after one warm-up
so both read from the page cache). One process, one device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from models.model import load_model
from models.orbax_io import convert_checkpoint
from models.random_checkpoint import write_random_checkpoint

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
CASES = {"tiny-llama": ("llama", {}), "tiny-qwen3_5": ("qwen3_5", {}), "smollm2-135m-shaped": ("llama", SMOLLM2_135M)}


def _timed_load(path: Path, dtype: str, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        jax.block_until_ready(load_model(path, dtype=dtype).params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, overrides) in CASES.items():
            src = write_random_checkpoint(family, Path(tmp) / name, **overrides)
            out = convert_checkpoint(src, Path(tmp) / f"{name}-orbax", dtype=args.dtype)
            safetensors_s = _timed_load(src, args.dtype, args.repeats)
            orbax_s = _timed_load(out, args.dtype, args.repeats)
            rows.append({"checkpoint": name, "dtype": args.dtype, "safetensors_s": round(safetensors_s, 3),
                         "orbax_s": round(orbax_s, 3), "orbax_over_safetensors": round(orbax_s / safetensors_s, 2)})
            print(f"{name:<22} safetensors {safetensors_s:7.3f} s   orbax {orbax_s:7.3f} s   "
                  f"ratio {orbax_s / safetensors_s:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
