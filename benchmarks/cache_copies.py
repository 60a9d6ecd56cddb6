"""Does the compiled TPU step hold a second copy of the caches? `jaxserve plan` of tiny checkpoints.

    python -m benchmarks.cache_copies [--out benchmarks/results/cache-copies/before.json] [--hlo DIR]

Builds tiny random checkpoints (models.random_checkpoint) under .cache/cache_copies/, plans each
case for one v5e chip with libtpu's real compiler (runtime/aot/chip_report.py: one decode bucket,
no sampler, no cost compiles) and prints, per case, the KV and GDN-state bytes beside the largest
temp of the compiled backbone. A step that updates its caches in place needs no temp that grows
with the pool; a copy of the pool shows as temp >= KV. `--hlo DIR` writes each compiled module's
text (`compiled.as_text()`) for reading where the copy is; `--copies` also lists, per case, the
largest `copy` instructions of the compiled HLO (a whole-pool copy is one of them).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE = REPO_ROOT / ".cache" / "cache_copies"

# checkpoint name -> (family, config overrides)
CHECKPOINTS = {
    "qwen3_5-hd256": ("qwen3_5", {"head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128}),
    "qwen3_5-hd32": ("qwen3_5", {}),
    "llama-hd16": ("llama", {"head_dim": 16}),
    # two layer groups: the caches are carried through the layer scan, as in the real models
    "qwen3_5-hd256-2groups": (
        "qwen3_5",
        {
            "head_dim": 256,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_hidden_layers": 8,
            "layer_types": ["linear_attention"] * 3
            + ["full_attention"]
            + ["linear_attention"] * 3
            + ["full_attention"],
        },
    ),
    "llama-hd128": ("llama", {"head_dim": 128}),
    "llama-hd64": ("llama", {"head_dim": 64}),
}
# (checkpoint, kv_cache_dtype, page_size, num_pages)
CASES = (
    ("qwen3_5-hd256", "bfloat16", 16, 4097),
    ("qwen3_5-hd256", "bfloat16", 128, 513),
    ("qwen3_5-hd256", "fp8_e4m3", 16, 8193),
    ("qwen3_5-hd256", "fp8_e4m3", 128, 1025),
    ("qwen3_5-hd32", "bfloat16", 128, 8193),
    ("qwen3_5-hd32", "fp8_e4m3", 128, 8193),
    ("qwen3_5-hd32", "bfloat16", 16, 65537),  # 16-token pages: not token-minor (plan warns)
    ("llama-hd16", "bfloat16", 128, 8193),
    ("llama-hd16", "fp8_e4m3", 128, 8193),
    ("llama-hd64", "bfloat16", 128, 2049),
    ("llama-hd64", "fp8_e4m3", 256, 2049),
    ("qwen3_5-hd256-2groups", "bfloat16", 128, 513),
    ("qwen3_5-hd256-2groups", "fp8_e4m3", 128, 1025),
    ("llama-hd128", "bfloat16", 128, 1025),
    ("llama-hd128", "fp8_e4m3", 128, 2049),
)
GIB = 2**30


def checkpoint(name: str) -> Path:
    from models.random_checkpoint import write_random_checkpoint

    family, overrides = CHECKPOINTS[name]
    path = CACHE / name
    if not (path / "config.json").exists():
        write_random_checkpoint(family, path, **overrides)
    return path


_SHAPE = re.compile(r"^\s*(\S+) = (\w+)\[([\d,]*)\]\{([^}]*)\}[^=]*?\bcopy\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "u8": 1, "s8": 1}


def largest_copies(hlo_text: str, top: int = 3) -> list[dict]:
    """The `top` largest `copy` instructions of a compiled module: name, shape, layout, bytes (dense)."""
    found = []
    for line in hlo_text.splitlines():
        m = _SHAPE.match(line)
        if m is None:
            continue
        name, dtype, dims, layout = m.groups()
        size = _BYTES.get(dtype, 4)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        found.append({"name": name, "shape": f"{dtype}[{dims}]", "layout": layout, "bytes": size})
    return sorted(found, key=lambda c: -c["bytes"])[:top]


def plan_case(name: str, kv_dtype: str, page_size: int, num_pages: int, hlo_dir: Path | None, bucket: int = 16) -> dict:
    from configs.schema import load_config
    from runtime.aot import chip_report

    launch = load_config(
        overrides={
            "model.path": str(checkpoint(name)),
            "model.dtype": "bfloat16",
            "parallel.chip": "tpu-v5e",
            "parallel.topology": "1x1",
            "cache.kv_cache_dtype": kv_dtype,
            "cache.page_size": page_size,
            "cache.num_pages": num_pages,
            "scheduler.max_num_seqs": 16,
            "scheduler.max_num_batched_tokens": max(bucket, 16),
        }
    )
    compiled = {}
    figures = chip_report.figures

    def keep(step_name, tokens, exe):
        compiled[step_name] = exe
        return figures(step_name, tokens, exe)

    chip_report.figures = keep
    try:
        start = time.perf_counter()
        report = chip_report.plan_config(
            launch, name, token_buckets=(bucket,), compile_sampler=False, compile_cost=False
        )
        seconds = time.perf_counter() - start
    finally:
        chip_report.figures = figures
    label = f"{name}-{kv_dtype}-ps{page_size}-T{bucket}"
    big_copies = {step_name: largest_copies(exe.as_text()) for step_name, exe in compiled.items()}
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        for step_name, exe in compiled.items():
            (hlo_dir / f"{label}-{step_name}.hlo.txt").write_text(exe.as_text())
    steps = [
        {"name": s.name, "argument_bytes": s.argument_bytes, "alias_bytes": s.alias_bytes, "temp_bytes": s.temp_bytes}
        for s in report.steps
    ]
    temp = max((s["temp_bytes"] for s in steps), default=0)
    return {
        "case": label,
        "checkpoint": name,
        "family": CHECKPOINTS[name][0],
        "checkpoint_overrides": CHECKPOINTS[name][1],
        "kv_cache_dtype": kv_dtype,
        "page_size": page_size,
        "num_pages": num_pages,
        "kv_bytes": report.kv_bytes,
        "state_bytes": report.state_bytes,
        "max_temp_bytes": temp,
        "temp_over_caches": temp / max(report.kv_bytes + report.state_bytes, 1),
        "steps": steps,
        "problems": report.problems,
        "kv_token_minor": getattr(report, "kv_token_minor", False),  # pages [P, Hkv, D, ps]
        "warnings": getattr(report, "warnings", []),
        "plan_seconds": round(seconds, 1),
        "largest_copies": big_copies,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--hlo", type=Path, help="write each compiled module's HLO text into this directory")
    parser.add_argument("--only", help="run only the cases whose label contains one of these (comma-separated)")
    parser.add_argument("--bucket", type=int, default=16, help="the token bucket compiled (16: decode)")
    args = parser.parse_args(argv)
    import jax

    rows = []
    print(f"{'case':<40}{'KV':>10}{'state':>10}{'max temp':>10}{'temp/(KV+state)':>17}")
    for name, kv_dtype, page_size, num_pages in CASES:
        if args.only and not any(o in f"{name}-{kv_dtype}-ps{page_size}" for o in args.only.split(",")):
            continue
        row = plan_case(name, kv_dtype, page_size, num_pages, args.hlo, args.bucket)
        rows.append(row)
        print(
            f"{row['case']:<40}{row['kv_bytes'] / GIB:>9.2f}G{row['state_bytes'] / GIB:>9.2f}G"
            f"{row['max_temp_bytes'] / GIB:>9.2f}G{row['temp_over_caches']:>17.2f}"
            + (f"  ({'; '.join(row['problems'])})" if row["problems"] else "")
        )
    if args.out:
        import jaxlib

        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"target": "tpu-v5e 1x1 (libtpu compile-only, this CPU host)", "jax": jax.__version__}
        meta["jaxlib"] = jaxlib.__version__
        meta["command"] = f"python -m benchmarks.cache_copies --bucket {args.bucket} --out {args.out}" + (
            f" --only {args.only}" if args.only else ""
        )
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
