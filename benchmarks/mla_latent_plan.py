"""MLA latent pools replicated vs split by token (`parallel.mla_latent`, models/mla_split.py), compiled
for a TPU slice by libtpu's compiler on this CPU host (`jaxserve plan`'s `plan_config`):

    PYTHONPATH=. ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/mla_latent_plan.py MODEL MODE T [cost]
    PYTHONPATH=. python benchmarks/mla_latent_plan.py compare

MODEL: deepseek-v3 (v5p-64, model axis 32, EP: the launch of tpu-v5p-64-deepseek-v3-mf085-T64-pinned.txt)
or kimi-linear-48b (v5p-8, model axis 4, EP: the launch of kimi-linear-48b-tpu-v5p-8-T64.txt, 4096-token
steps). MODE: replicated | split. `cost`: also XLA's cost model of the step (flops, bytes accessed; the
Pallas MLA kernel of the replicated path is opaque to it, counted 0). Writes
benchmarks/results/plan/mla-latent/<model>-<mode>-T<T>.{txt,json}; `compare` collects them into
benchmarks/results/plan/mla-latent/compare.json with split / replicated ratios.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "plan" / "mla-latent"

LAUNCHES = {
    "deepseek-v3": (
        None,
        {
            "model.path": "/models/DeepSeek-V3",
            "model.dtype": "bfloat16",
            "model.max_model_len": 32768,
            "cache.page_size": 128,
            "cache.num_pages": None,
            "cache.memory_fraction": 0.85,
            "cache.enable_prefix_caching": True,
            "scheduler.max_num_seqs": 64,
            "scheduler.max_num_batched_tokens": 4096,
            "scheduler.token_buckets": [64, 4096],
            "parallel.mesh": {"data": 1, "model": 32},
            "parallel.expert": True,
            "parallel.chip": "tpu-v5p",
            "parallel.topology": "4x4x2",
            "compile.aot": True,
        },
    ),
    "kimi-linear-48b": (
        "tpu-v5e-8-qwen3_5-27b.yaml",
        {
            "model.path": "/models/Kimi-Linear-48B-A3B-Instruct",
            "model.max_model_len": 32768,
            "model.served_model_name": "kimi-linear-48b",
            "parallel.chip": "tpu-v5p",
            "parallel.topology": "2x2x1",
            "parallel.mesh": {"data": 1, "model": 4},
            "parallel.expert": True,
            "cache.kv_cache_dtype": "auto",
            "scheduler.max_num_seqs": 32,
            "scheduler.max_num_batched_tokens": 4096,
            "scheduler.token_buckets": [64, 4096],
            "cache.memory_fraction": 0.9,
        },
    ),
}


def plan(model: str, mode: str, T: int, cost: bool) -> None:
    from configs import CONFIG_DIR, load_config
    from runtime.aot.chip_report import plan_config
    from runtime.aot.plan_report import format_report, report_json

    name, over = LAUNCHES[model]
    over = {**over, "parallel.mla_latent": mode}
    launch = load_config(None if name is None else CONFIG_DIR / name, over)
    t0 = time.time()
    report = plan_config(launch, f"{model} {mode}", token_buckets=(T,), compile_sampler=False, compile_cost=cost)
    seconds = time.time() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"{model}-{mode}-T{T}"
    argv = " ".join(sys.argv[1:])
    header = (
        f"# PYTHONPATH=. ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/mla_latent_plan.py {argv}\n"
        f"# libtpu's compiler on the 2-core CPU host (no TPU attached), {time.strftime('%Y-%m-%d')}; launch overrides: {over}\n"
    )
    stem.with_suffix(".txt").write_text(header + format_report(report) + f"\n# planned in {seconds:.1f} s\n")
    stem.with_suffix(".json").write_text(json.dumps({**report_json(report), "plan_seconds": seconds}, indent=1))
    print(format_report(report))


# the same launch planned before this script (README's DeepSeek-V3 numbers), used where this script's own run is missing
EARLIER = {("deepseek-v3", "replicated", T): f"tpu-v5p-64-deepseek-v3-mf085-T{T}-pinned.json" for T in (64, 4096)}
# per MLA layer: (MLA layers, query heads H, row width W = L + R, latent L, model axis m)
SHAPES = {"deepseek-v3": (61, 128, 576, 512, 32), "kimi-linear-48b": (7, 32, 576, 512, 4)}


def collective_bytes(model: str, T: int) -> dict:
    """What the split adds per step and chip (models/mla_split.py), analytically: the bf16 q all-gather
    [T, H, W] and the f32 reduce-scatter of [T, H, L + 1] (outputs and log-sum-exp weights), each
    moving (m - 1) / m of the array per chip, times the MLA layers. The replicated pool adds none."""
    layers, H, W, L, m = SHAPES[model]
    gather, scatter = T * H * W * 2 * (m - 1) / m, T * H * (L + 1) * 4 * (m - 1) / m
    return {
        "q_all_gather": layers * gather,
        "output_reduce_scatter": layers * scatter,
        "total": layers * (gather + scatter),
    }


def compare() -> None:
    rows = []
    for model in LAUNCHES:
        for T in (64, 4096):
            got, files = {}, []
            for mode in ("replicated", "split"):
                path = OUT / f"{model}-{mode}-T{T}.json"
                if not path.exists() and (model, mode, T) in EARLIER:
                    path = OUT.parent / EARLIER[model, mode, T]
                if path.exists():
                    got[mode] = json.loads(path.read_text())
                    files.append(str(path.relative_to(OUT.parents[3])))
            if len(got) < 2:
                continue
            row = {
                "model": model,
                "tokens": T,
                "files": files,
                "split_collective_bytes_per_step": collective_bytes(model, T),
            }
            for mode, r in got.items():
                step = r["executables"][0] if r["executables"] else {}
                row[mode] = {
                    "kv_bytes_per_token_per_device": r["kv_bytes_per_token"],
                    "kv_cache_bytes": r["kv_cache_bytes"],
                    "num_pages": r["num_pages"],
                    "max_sequences_at_max_model_len": r["max_sequences_at_max_model_len"],
                    "temp_bytes": step.get("temp_bytes"),
                    "peak_bytes": step.get("peak_bytes"),
                    "flops": step.get("flops"),
                    "bytes_accessed": step.get("bytes_accessed"),
                    "fits": r["fits"],
                }
            rep, spl = row["replicated"], row["split"]
            row["split_over_replicated"] = {
                k: (spl[k] / rep[k] if rep[k] else None)
                for k in ("kv_bytes_per_token_per_device", "max_sequences_at_max_model_len", "temp_bytes", "peak_bytes")
                if spl[k] is not None and rep[k] is not None
            }
            rows.append(row)
    (OUT / "compare.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare()
    else:
        plan(sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "cost")
