"""Preemption on a hybrid with and without the host-memory tier: what a preempted request recomputes.

    python -m benchmarks.preemption_swap CHECKPOINT --json out.json

A KV-exhaustion workload: `--requests` requests of `--prompt-len` tokens, each generating
`--max-tokens`, all at once, on a pool of `--num-pages` pages that cannot hold `--max-num-seqs`
of them at full length, so the scheduler preempts. A preempted request frees its pages and state
slot; when it comes back, prefix caching finds what is still cached: its published pages and its
rolling checkpoint (at most one page behind). Without the host tier those are gone once evicted
and the request recomputes them; with it (`cache.kv_offloading_size`) they come back from host
memory. Besides, a preempted request's own state — its partial last page and running GDN state —
is swapped to host under its id and restored at re-admission (paged_kv/preempt_swap.py), so it
resumes at exactly its progress; `host_tier_no_swap` is the tier without that swap (published pages
and checkpoints only, the rest recomputed). Reported per configuration: tokens/s, preemptions,
the tokens re-admissions found cached (not recomputed), outputs vs caching off, and that every page
and slot is free or cached afterwards. CPU numbers for small models show the mechanism.

Each configuration runs a warm-up round, then `--repeats` measured rounds of fresh prompts
(nothing shared between rounds), the configurations' engines taking turns round by round (a
change in the machine's load hits every one of them); tokens/s is their median, the counts are summed over them, and
`compiles` counts XLA compilations during the measured rounds (JAX's own log: 0 expected, the
host tier's programs compile at start-up). `host_tier_no_wait`: the tier, but a host hit with
no device room is recomputed instead of waited for. With the tier: its swap-ins (host hits loaded),
recomputes (host hits the cost rule declined), admission waits and load dispatch time, and the
preemption swap's records (swap_outs, swap_ins, fallbacks, declined); `recomputed_tokens`: computed
tokens preempted requests computed again.
The qwen3_5-small result: `--prompt-len 128 --max-tokens 64` (benchmarks/results/host-tier/).
"""

from __future__ import annotations

import argparse
import json
import logging
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    from models.model import load_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import SamplingParams

    model = load_model(args.checkpoint, dtype="float32")
    rng = np.random.default_rng(0)
    draw = lambda: [rng.integers(3, model.cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(args.requests)]
    rounds = [("warm-up", draw())] + [(f"measured{r}", draw()) for r in range(args.repeats)]  # nothing shared
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
    )
    configs = {
        "off": dict(enable_prefix_caching=False),
        "recompute": {},
        "host_tier": dict(kv_offloading_size=args.host_gib),
        "host_tier_no_wait": dict(kv_offloading_size=args.host_gib),  # a hit without room: recompute
        "host_tier_no_swap": dict(kv_offloading_size=args.host_gib),  # preemption recomputes (no record)
    }
    report, reference = {"args": vars(args), "configs": {}}, {}
    counted = (
        "host_cache_pages_loaded",
        "host_cache_checkpoints_loaded",
        "host_cache_hits_taken",
        "host_cache_recomputes",
        "host_cache_admission_waits",
        "host_cache_load_batches",
        "host_cache_load_seconds_total",
        "host_cache_swap_outs",
        "host_cache_swap_ins",
        "host_cache_swap_fallbacks",
        "host_cache_swap_declined",
    )
    engines, rates, sums, same, compiles = {}, {}, {}, {}, {}
    for name, extra in configs.items():
        engines[name] = LLMEngine(EngineConfig(**common, **extra), model=model, progress=False)
        if name == "host_tier_no_wait":
            engines[name].scheduler.cache.wait_for_room = False
        if name == "host_tier_no_swap":
            engines[name].scheduler.cache.swap_preempted = False
        rates[name], sums[name], same[name], compiles[name] = [], {}, True, []
    for round_, batch in rounds:  # round-robin over the configurations: a load change hits them all
        for name, engine in engines.items():
            outputs, seconds, before, compiled = _run(engine, round_, batch, params, jax)
            if round_ == "warm-up":
                continue
            stats = engine.stats()
            compiles[name] += compiled
            reference.setdefault(round_, outputs)
            same[name] &= outputs == reference[round_]
            rates[name].append(sum(map(len, outputs)) / seconds)
            keys = ("num_preemptions", "prefix_cache_hit_tokens", "preemption_recomputed_tokens")
            keys += tuple(k for k in counted if k in stats)
            for k in keys:
                sums[name][k] = sums[name].get(k, 0) + stats[k] - before[k]
    for name, engine in engines.items():
        stats = engine.stats()
        engine.scheduler.check_invariants()
        row = {
            "tokens_per_s": round(float(np.median(rates[name])), 1),
            "tokens_per_s_rounds": [round(r, 1) for r in rates[name]],
            "preemptions": sums[name].pop("num_preemptions"),
            "cached_tokens_on_admission": sums[name].pop("prefix_cache_hit_tokens"),
            "recomputed_tokens": sums[name].pop("preemption_recomputed_tokens"),
            "identical_to_off": same[name],
            "no_leaks": stats["pages_used"] == 0
            and stats["slots_used"] == 0
            and not stats.get("host_cache_swapped_requests"),
            "compiles": len(compiles[name]),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in sums[name].items()},
        }
        report["configs"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _run(engine, round_: str, batch: list, params, jax):
    """One round on one engine: -> (outputs in prompt order, seconds, stats before, compilations)."""
    from runtime.types import EngineRequest

    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(f"{round_}-{i}", prompt, params))
    before, counter, logger = engine.stats(), _CompileCounter(), logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        start, outputs = time.perf_counter(), {}
        while engine.has_unfinished():
            for delta in engine.step():
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        seconds = time.perf_counter() - start
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    return [outputs[f"{round_}-{i}"] for i in range(len(batch))], seconds, before, counter.compiled


class _CompileCounter(logging.Handler):
    """Every compilation JAX logs under jax_log_compiles."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.compiled: list[str] = []

    def emit(self, record):
        if record.getMessage().startswith("Compiling "):
            self.compiled.append(record.getMessage().split("\n")[0][:120])


if __name__ == "__main__":
    main()
