"""The host tier's swap-or-recompute constants on this backend: a load's bandwidth and fixed cost,
and the prefill rate it competes with (runtime/steps/execution_plan.py `HOST_SWAP_COST`).

    python -m benchmarks.host_swap_cost CHECKPOINT --json benchmarks/results/host-tier/swap-cost-cpu.json

On one engine with the host tier (`kv_offloading_size`, compiled at start-up): the load program
(runtime/engine/host_tier.py, one scatter of host entries into the caches) on 1 and 16 KV pages,
timed to completion (`block_until_ready`), median of `--repeats`: latency = t(1), bandwidth =
15 pages' bytes / (t(16) - t(1)); and a prefill step of `--prompt-len` tokens (one request, one
output token), median: tokens/s and FLOP/s = tokens/s x 2 x parameters. Also the break-even: the
tokens whose recompute costs one page's load, which the rule compares per host hit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from paged_kv.host_tier import KV
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.checkpoint,
            dtype="float32",
            page_size=16,
            num_pages=64,
            max_model_len=args.prompt_len + 16,
            max_num_seqs=4,
            max_num_batched_tokens=args.prompt_len,
            load_tokenizer=False,
            kv_offloading_size=1.0,
        ),
        progress=False,
    )
    tier, params = engine.host_tier, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    prefill = []
    for i in range(args.repeats + 1):
        engine.add_request(EngineRequest(f"p{i}", rng.integers(3, 1000, size=args.prompt_len).tolist(), params))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        prefill.append(time.perf_counter() - start)
    prefill_s = float(np.median(prefill[1:]))
    sub = {"kv": engine.caches["kv"]}
    page = jax.tree.map(lambda x: x[np.arange(tier.num_groups) * tier.size[KV] + 1], sub)  # page 1's rows
    page_bytes = int(sum(x.nbytes for x in jax.tree.leaves(page)))
    load = {}
    for num in (1, 16):
        times = []
        for _ in range(args.repeats):
            batch = [(1 + j, page) for j in range(num)]
            jax.block_until_ready(engine.caches)
            start = time.perf_counter()
            engine.caches = tier._load(engine.caches, KV, batch, num)
            jax.block_until_ready(engine.caches)
            times.append(time.perf_counter() - start)
        load[num] = float(np.median(times))
    latency = load[1]
    bandwidth = 15 * page_bytes / max(load[16] - load[1], 1e-9)
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(engine.model.params))
    tokens_per_s = args.prompt_len / prefill_s
    flops = tokens_per_s * 2 * num_params
    report = {
        "args": vars(args),
        "backend": jax.default_backend(),
        "page_bytes": page_bytes,
        "load_seconds_1_page": round(load[1], 6),
        "load_seconds_16_pages": round(load[16], 6),
        "host_load_latency_s": round(latency, 6),
        "host_load_bytes_per_s": float(f"{bandwidth:.3g}"),
        "prefill_step_seconds": round(prefill_s, 4),
        "prefill_tokens_per_s": round(tokens_per_s, 1),
        "parameters": num_params,
        "prefill_flops_per_s": float(f"{flops:.3g}"),
        "tokens_recomputed_per_page_load": round((latency + page_bytes / bandwidth) * tokens_per_s, 2),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
