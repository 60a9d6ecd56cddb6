"""Offline TTFT with a prefix-cache hit vs without, per hybrid checkpoint policy.

    python -m benchmarks.prefix_ttft CHECKPOINT --policy off --policy auto --policy page --json out.json

The shared-prefix workload (`benchmarks/workloads.py`: a system prompt of max_model_len / 2
tokens, user turns of 16-64) is sent one request at a time with max_tokens=1 (TTFT = add to
first token, `benchmarks.throughput.measure_ttft_sequential`) after one warm-up request that
fills the cache. `off` disables prefix caching; any other value is a `CheckpointPolicy` spec.
Engines share one persistent compilation cache, so only the first compiles its buckets.
Reported per policy: median / mean TTFT, the hit tokens of each request, and the median TTFT
as a fraction of `off`'s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.throughput import measure_ttft_sequential
from benchmarks.workloads import make_workload, shared_prefix_len, summarize


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--policy", action="append", default=None, help="off or a CheckpointPolicy spec (repeatable)")
    parser.add_argument("--requests", type=int, default=8, help="measured requests (after one warm-up)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--token-buckets", default="16,64,256", help="explicit token buckets (fewer compiles)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from models.model import load_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    model = load_model(args.checkpoint, dtype=args.dtype)
    requests = make_workload(
        "shared_prefix",
        vocab_size=model.cfg.vocab_size,
        seed=args.seed,
        num_requests=args.requests + 1,
        max_model_len=args.max_model_len,
    )
    report = {"shared_prefix_len": shared_prefix_len(requests), "workload": summarize(requests), "policies": {}}
    cache_dir = tempfile.mkdtemp(prefix="prefix-ttft-jit-")
    for policy in args.policy or ["off", "auto"]:
        engine = LLMEngine(
            EngineConfig(
                model=args.checkpoint,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                seed=0,
                load_tokenizer=False,
                token_buckets=tuple(int(t) for t in args.token_buckets.split(",")),
                compile_cache_dir=cache_dir,
                enable_prefix_caching=policy != "off",
                hybrid_checkpoint_policy="auto" if policy == "off" else policy,
            ),
            model=model,
        )
        measure_ttft_sequential(engine, requests[:1])  # warm-up; with caching on, it fills the cache
        before = engine.stats()["prefix_cache_hit_tokens"]
        ttfts = measure_ttft_sequential(engine, requests[1:])
        report["policies"][policy] = {
            "median_ttft_ms": 1000 * float(np.median(ttfts)),
            "mean_ttft_ms": 1000 * float(np.mean(ttfts)),
            "ttft_ms": [round(1000 * t, 1) for t in ttfts],
            "hit_tokens": engine.stats()["prefix_cache_hit_tokens"] - before,
        }
        print(policy, json.dumps(report["policies"][policy]), flush=True)
        del engine
    if "off" in report["policies"]:
        off = report["policies"]["off"]["median_ttft_ms"]
        for name, row in report["policies"].items():
            row["median_over_off"] = row["median_ttft_ms"] / off
            print(f"{name:12s} median TTFT {row['median_ttft_ms']:8.1f} ms  = {row['median_over_off']:.3f} x off")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
