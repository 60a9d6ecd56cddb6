"""Preemption on a hybrid with and without the host-memory tier: what a preempted request recomputes.

    python -m benchmarks.preemption_swap CHECKPOINT --json out.json

A KV-exhaustion workload: `--requests` requests of `--prompt-len` tokens, each generating
`--max-tokens`, all at once, on a pool of `--num-pages` pages that cannot hold `--max-num-seqs`
of them at full length, so the scheduler preempts. A preempted request frees its pages and state
slot; when it comes back, prefix caching finds what is still cached: its published pages and its
rolling checkpoint (at most one page behind). Without the host tier those are gone once evicted
and the request recomputes them; with it (`cache.kv_offloading_size`) they come back from host
memory, which is how preemption "swaps" here. Reported per configuration: tokens/s, preemptions,
the tokens re-admissions found cached (not recomputed), outputs vs caching off, and that every page
and slot is free or cached afterwards. CPU numbers for small models show the mechanism.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-pages", type=int, default=48)
    parser.add_argument("--host-gib", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from models.model import load_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    model = load_model(args.checkpoint, dtype="float32")
    rng = np.random.default_rng(0)
    draw = lambda: [rng.integers(3, model.cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(args.requests)]
    warm_up, prompts = draw(), draw()  # the warm-up compiles; its prompts share nothing with the measured ones
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    common = dict(
        model=args.checkpoint,
        dtype="float32",
        page_size=16,
        num_pages=args.num_pages,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=128,
        token_buckets=(16, 64, 128),
        load_tokenizer=False,
        seed=0,
        aot_compile=False,
    )
    configs = {
        "off": dict(enable_prefix_caching=False),
        "recompute": {},
        "host_tier": dict(kv_offloading_size=args.host_gib),
    }
    report, reference = {"args": vars(args), "configs": {}}, None
    for name, extra in configs.items():
        engine = LLMEngine(EngineConfig(**common, **extra), model=model)
        for round_, batch in (("warm-up", warm_up), ("measured", prompts)):
            for i, prompt in enumerate(batch):
                engine.add_request(EngineRequest(f"{round_}{i}", prompt, params))
            before = engine.stats()
            start, outputs = time.perf_counter(), {}
            while engine.has_unfinished():
                for delta in engine.step():
                    outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            seconds = time.perf_counter() - start
        stats = engine.stats()
        engine.scheduler.check_invariants()
        outputs = [outputs[f"measured{i}"] for i in range(len(prompts))]
        reference = reference or outputs
        row = {
            "tokens_per_s": round(sum(map(len, outputs)) / seconds, 1),
            "seconds": round(seconds, 2),
            "preemptions": stats["num_preemptions"] - before["num_preemptions"],
            "cached_tokens_on_admission": stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "identical_to_off": outputs == reference,
            "no_leaks": stats["pages_used"] == 0 and stats["slots_used"] == 0,
            **{
                k: stats[k] - before[k]
                for k in ("host_cache_pages_loaded", "host_cache_checkpoints_loaded")
                if k in stats
            },
        }
        report["configs"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
