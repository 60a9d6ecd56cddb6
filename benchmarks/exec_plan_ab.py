"""A/B of every CPU choice of the execution plan (runtime/steps/execution_plan.py): each one on vs off,
tiny dense + tiny hybrid, output tokens/s, in one invocation.

    python -m benchmarks.exec_plan_ab                       # .cache/peers/tiny-llama, .cache/peers/qwen3_5-small
    python -m benchmarks.exec_plan_ab CKPT ... --workload mixed --scale 0.25 --num-requests 32 --repeats 3 --json out.json

For each checkpoint the CPU plan (`plan_execution(config, model, "cpu")`) runs as is, then
with one choice turned off at a time (`dataclasses.replace` of the plan, handed to
`LLMEngine(plan=...)`): layers scanned instead of unrolled, no fused greedy backbone, token
buckets from 16 instead of 4, no 1.5x buckets, the reference attention instead of the chunked
one, and (with bfloat16 KV pages, where it matters) float KV storage instead of raw bits. Every
request is greedy with `ignore_eos`, so each yields exactly its `max_tokens`; tokens/s = output
tokens / wall time of the batch after one warm-up pass. The variants run interleaved (round r
runs every variant once), and a choice's gain is the median over rounds of plan / choice-off
within the round, so load drifting on a shared machine hits both sides alike. Executables are
compiled at engine start (not timed; their count and the start-up seconds are reported), through
one persistent compilation cache per invocation, so the variants share what they have in common. A choice "pays"
when plan / off >= 1.05. On a shared machine the numbers move between runs: compare ratios
from one invocation only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINTS = (REPO / ".cache/peers/tiny-llama", REPO / ".cache/peers/qwen3_5-small")


def _variants(plan, config):
    """(name, plan, engine-config overrides): the CPU plan, then each choice off."""
    from runtime.buckets import pow2_buckets

    limit, seqs = config.max_num_batched_tokens, config.max_num_seqs
    yield "plan", plan, {}
    yield "layer_loop=scan", dataclasses.replace(plan, layer_loop="scan"), {}
    yield "fuse_greedy=off", dataclasses.replace(plan, fuse_greedy=False), {}
    yield (
        "min token bucket 16",
        dataclasses.replace(plan, token_buckets=pow2_buckets(limit, minimum=16, fine_until=seqs)),
        {},
    )
    yield "no 1.5x buckets", dataclasses.replace(plan, token_buckets=pow2_buckets(limit, minimum=4)), {}
    yield "attention=reference", dataclasses.replace(plan, attention_path="reference"), {}
    yield "bf16 KV, bit storage", plan, {"kv_cache_dtype": "bfloat16"}
    yield "bf16 KV, float storage", dataclasses.replace(plan, kv_bit_storage=False), {"kv_cache_dtype": "bfloat16"}


def _run(engine, requests) -> float:
    """Output tokens/s of the whole batch."""
    from runtime.types import EngineRequest, SamplingParams

    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"ab-{time.monotonic_ns()}-{i}", list(r.prompt_ids), params))
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def _paired_ratio(on: list[float], off: list[float]) -> float:
    """Median over repeats of on / off measured in the same round."""
    return statistics.median(a / b for a, b in zip(on, off))


def _build_engines(path: Path, base, plan, requests, skip: tuple[str, ...], only: tuple[str, ...] = ()) -> dict:
    """{variant: (warmed-up engine, start-up seconds)}; variants whose name starts with a `skip`
    entry are left out, and with `only`, all but the plan and those starting with an `only` entry."""
    from models.model import load_model
    from runtime.engine.llm_engine import LLMEngine

    engines = {}
    for name, variant, overrides in _variants(plan, base):
        if any(name.startswith(prefix) for prefix in skip) or (
            only and name != "plan" and not any(name.startswith(p) for p in only)
        ):
            continue
        config = dataclasses.replace(base, **overrides)
        model = load_model(path, dtype=config.dtype)  # fresh: an unrolled Model stays unrolled
        t0 = time.perf_counter()
        engine = LLMEngine(config, model=model, plan=variant)
        engines[name] = (engine, time.perf_counter() - t0)
        print(f"{path.name}: built {name!r} in {engines[name][1]:.1f} s", flush=True)
        _run(engine, requests[: max(1, len(requests) // 4)])  # warm-up
    return engines


def measure_checkpoint(path: Path, args) -> dict:
    from benchmarks.workloads import make_workload, summarize
    from models.model import load_model
    from runtime.engine_config import EngineConfig
    from runtime.steps.execution_plan import plan_execution

    base = EngineConfig(
        model=str(path),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
        seed=0,
        load_tokenizer=False,
        compile_cache_dir=args.compile_cache_dir,
        **({"dtype": args.dtype} if args.dtype else {}),
    )
    cfg = load_model(path, dtype=base.dtype).cfg
    requests = make_workload(
        args.workload,
        vocab_size=cfg.vocab_size,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    engines = _build_engines(path, base, plan_execution(base, cfg, "cpu"), requests, args.skip, args.only)
    runs = {name: [] for name in engines}
    for _ in range(args.repeats):  # interleaved: the machine's load drifts over all variants alike
        for name, (engine, _) in engines.items():
            runs[name].append(_run(engine, requests))
    rows = []
    for name, (engine, start_s) in engines.items():
        row = {
            "variant": name,
            "tok_s": statistics.median(runs[name]),
            "runs": runs[name],
            "start_s": start_s,
            "executables": len(engine.executables.compile_seconds),
        }
        rows.append(row)
        print(
            f"{path.name:16s} {name:24s} {row['tok_s']:8.1f} tok/s  runs {[round(r) for r in runs[name]]}  "
            f"{row['executables']} executables, start {start_s:.1f} s",
            flush=True,
        )
    gains = {
        name: _paired_ratio(runs["plan"], runs[name]) for name in runs if name != "plan" and not name.startswith("bf16")
    }
    if "bf16 KV, bit storage" in runs:
        gains["kv bit storage (bf16 KV)"] = _paired_ratio(runs["bf16 KV, bit storage"], runs["bf16 KV, float storage"])
    return {
        "checkpoint": str(path),
        "layers": cfg.num_layers,
        "hybrid": cfg.is_hybrid,
        "workload": summarize(requests),
        "rows": rows,
        "plan_over_off": gains,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="*", type=Path, default=list(DEFAULT_CHECKPOINTS))
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-pages", type=int, default=1100)
    parser.add_argument("--skip", default="", help="comma-separated variant name prefixes to leave out, e.g. bf16")
    parser.add_argument("--only", default="", help="comma-separated variant name prefixes: the plan and only these")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: EngineConfig's)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--compile-cache-dir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args(argv)
    args.skip = tuple(prefix for prefix in args.skip.split(",") if prefix)
    args.only = tuple(prefix for prefix in args.only.split(",") if prefix)
    args.compile_cache_dir = args.compile_cache_dir or tempfile.mkdtemp(prefix="exec-plan-ab-xla-")
    results = [measure_checkpoint(path, args) for path in args.checkpoints]
    print("\nplan / choice-off (>= 1.05: the choice pays)")
    for res in results:
        for name, ratio in res["plan_over_off"].items():
            print(f"  {Path(res['checkpoint']).name:16s} {name:28s} {ratio:5.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
