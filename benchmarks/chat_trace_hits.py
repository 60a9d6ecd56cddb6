"""Multi-turn chat on a hybrid: prefix-cache hits as a share of the page-aligned ceiling, by checkpoint pool
sizing and host-memory tier, with outputs identical to caching off; TTFT of a returning conversation.

    python -m benchmarks.chat_trace_hits CHECKPOINT [--conversations 12 --turns 4] --json out.json

The trace: `--conversations` conversations share one system prompt; each turn's prompt is the previous
prompt + the model's answer + a new user message; turn k of every conversation is sent at once
(more conversations than `--max-num-seqs`, so most are idle between their turns). Configurations:

  off            prefix caching off: the reference outputs (every other configuration must match)
  old_cap        the checkpoint pool capped at 2 per sequence (the sizing before memory-sized slots)
  memory_sized   the default: checkpoint slots sized by memory (32 per sequence, one per page)
  small_pool     a cache budget far too small for the conversations, no host tier
  small_host     the same small pool + `--host-gib` of host-memory tier (cache.kv_offloading_size)

Reported per configuration: hit tokens / queried tokens, and that rate over the ceiling (the same
token sequences through the simulator's scheduler with unbounded KV pages and no state constraint,
`benchmarks/prefix_cache_sim.py` `ceiling`). Then TTFT of `--returning` conversations that come
back after a filler evicted them from the device (max_tokens=1, one at a time): a host-tier hit
(small_host) vs recompute (small_pool, and caching off), median and p90. CPU numbers for the tiny
model show the mechanism, not a device's speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.prefix_cache_sim import SimConfig, ceiling
from benchmarks.prefix_traces import Session, Turn


def _conversations(vocab: int, n: int, turns: int, seed: int, system_len: int) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    draw = lambda k: rng.integers(3, vocab, size=k).tolist()
    system = draw(system_len)
    first = [system + draw(int(rng.integers(16, 64))) for _ in range(n)]
    users = [[draw(int(rng.integers(16, 64))) for _ in range(turns)] for _ in range(n)]
    return first, users


def run_trace(engine, first: list, users: list, turns: int, max_tokens: int) -> tuple[dict, list]:
    """Every conversation's turns, turn by turn: -> ({request id: output ids}, per-conversation token
    sequences of each turn [(prompt, output)])."""
    from runtime.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = list(first)
    outputs, history = {}, [[] for _ in first]
    for k in range(turns):
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"c{i}t{k}", prompt, params))
        done = {}
        while engine.has_unfinished():
            for delta in engine.step():
                done.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for i, prompt in enumerate(prompts):
            out = done[f"c{i}t{k}"]
            outputs[f"c{i}t{k}"] = out
            history[i].append((prompt, out))
            prompts[i] = prompt + out + users[i][k]
    return outputs, history


def _sessions(history: list) -> list[Session]:
    """The served token sequences as simulator sessions (each turn's new tokens, then its output)."""
    sessions = []
    for i, turns in enumerate(history):
        seen, parts = 0, []
        for prompt, out in turns:
            parts.append(Turn(tuple(prompt[seen:]), tuple(out)))
            seen = len(prompt) + len(out)
        sessions.append(Session(f"c{i}", tuple(parts)))
    return sessions


def measure_returning(engine, prompts: list, filler: list, vocab: int, seed: int) -> list[float]:
    """TTFT (add -> first token) of each returning prompt, each after a filler request that evicts
    the device copies of what came before."""
    from runtime.types import EngineRequest, SamplingParams

    rng = np.random.default_rng(seed)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(prompts):
        for j, size in enumerate(filler):
            engine.add_request(EngineRequest(f"fill{i}.{j}", rng.integers(3, vocab, size=size).tolist(), one))
        while engine.has_unfinished():
            engine.step()
        start, first = time.perf_counter(), None
        engine.add_request(EngineRequest(f"back{i}", prompt, one))
        while engine.has_unfinished():
            for delta in engine.step():
                if first is None and delta.new_token_ids:
                    first = time.perf_counter() - start
        ttfts.append(first)
    return ttfts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--small-pages", type=int, default=48, help="KV pages of the small pool")
    parser.add_argument("--host-gib", type=float, default=1.0)
    parser.add_argument("--returning", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import paged_kv.checkpoint_policy as checkpoint_policy
    from models.model import load_model
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    model = load_model(args.checkpoint, dtype="float32")
    vocab, ps, seqs = model.cfg.vocab_size, args.page_size, args.max_num_seqs
    first, users = _conversations(vocab, args.conversations, args.turns, args.seed, args.system_len)
    max_len = max(map(len, first)) + args.turns * (64 + args.max_tokens) + ps
    page_bytes = model.cache_bytes_per_token("auto") * ps
    slot_bytes = model.state_bytes_per_slot()
    total_pages = args.conversations * max_len // ps
    # large: every conversation's pages and one checkpoint per page fit within the 0.25 budget
    large = 4 * total_pages * slot_bytes + total_pages * page_bytes + (1 + seqs) * slot_bytes
    # small: `small_pages` pages, 0.25 of the memory for checkpoints
    small_pages = args.small_pages
    small = int((small_pages * page_bytes + (1 + seqs) * slot_bytes) / 0.75)
    # the default page count is what running sequences need (max_num_seqs x max_model_len): give the
    # large configurations every conversation's pages, so that only the checkpoint pool differs
    large_pages = total_pages + seqs * (max_len // ps + 2) + 1
    cache_dir = tempfile.mkdtemp(prefix="chat-trace-jit-")
    common = dict(
        model=args.checkpoint,
        dtype="float32",
        page_size=ps,
        max_model_len=max(128, -(-max_len // 128) * 128),
        max_num_seqs=seqs,
        max_num_batched_tokens=128,
        token_buckets=(16, 64, 128),
        load_tokenizer=False,
        seed=0,
        compile_cache_dir=cache_dir,
        aot_compile=False,
    )
    configs = {
        "off": dict(enable_prefix_caching=False),
        "old_cap": dict(kv_cache_memory_bytes=large, num_pages=large_pages),
        "memory_sized": dict(kv_cache_memory_bytes=large, num_pages=large_pages),
        "small_pool": dict(kv_cache_memory_bytes=small),
        "small_host": dict(kv_cache_memory_bytes=small, kv_offloading_size=args.host_gib),
    }
    report = {"args": vars(args), "configs": {}, "ttft_ms": {}}
    reference, returning, engines = None, None, {}
    for name, extra in configs.items():
        checkpoint_policy.CHECKPOINTS_PER_SEQ = 2 if name == "old_cap" else 32
        engine = LLMEngine(EngineConfig(**common, **extra), model=model)
        checkpoint_policy.CHECKPOINTS_PER_SEQ = 32
        start = time.perf_counter()
        outputs, history = run_trace(engine, first, users, args.turns, args.max_tokens)
        seconds = time.perf_counter() - start
        stats = engine.stats()
        if reference is None:
            reference = outputs
            top = ceiling(_sessions(history), SimConfig(page_size=ps, max_num_seqs=seqs, max_num_batched_tokens=128))
            report["ceiling_hit_rate"] = top["hit_rate"]
            returning = [p + o + users[i][-1][:16] for i, (p, o) in enumerate(h[-1] for h in history)]
        row = {
            "identical_to_off": outputs == reference,
            "hit_rate": stats["prefix_cache_hit_rate"],
            "of_ceiling": round(stats["prefix_cache_hit_rate"] / report["ceiling_hit_rate"], 3),
            "num_pages": engine.cache_config.num_pages,
            "num_state_slots": engine.cache_config.num_state_slots,
            "max_checkpoint_slots": stats["max_checkpoint_slots"],
            "trace_seconds": round(seconds, 2),
            **{k: stats[k] for k in ("page_evictions", "checkpoint_evictions", "num_preemptions")},
            **{k: v for k, v in stats.items() if k.startswith("host_cache_")},
        }
        report["configs"][name] = row
        print(name, json.dumps(row), flush=True)
        if name in ("off", "small_pool", "small_host"):
            engines[name] = engine
    filler = [min(common["max_model_len"] - 1, small_pages * ps // 2)] * 2
    for name in ("small_host", "small_pool", "off"):
        measure_returning(engines[name], returning[-2:], filler, vocab, args.seed + 2)  # warm-up: compiles
        before = engines[name].stats()["prefix_cache_hit_tokens"] if name != "off" else 0
        ttfts = measure_returning(engines[name], returning[: args.returning], filler, vocab, args.seed + 1)
        hits = engines[name].stats()["prefix_cache_hit_tokens"] - before if name != "off" else 0
        report["ttft_ms"][name] = {
            "median": round(1000 * float(np.median(ttfts)), 1),
            "p90": round(1000 * float(np.percentile(ttfts, 90)), 1),
            "all": [round(1000 * t, 1) for t in ttfts],
            "hit_tokens": hits,
            "prompt_tokens": sum(len(p) for p in returning[: args.returning]),
        }
        print("ttft", name, json.dumps(report["ttft_ms"][name]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
