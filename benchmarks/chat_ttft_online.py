"""TTFT of a returning conversation through the HTTP server: host-tier hit vs recompute, median and p90.

    python -m benchmarks.chat_ttft_online CHECKPOINT [--conversations 8 --returning 8] --json out.json

The online half of `benchmarks/chat_trace_hits.py`'s TTFT (which drives the engine in-process): each
configuration is a `jaxserve serve` process (benchmarks/pd_cluster.py's `Process`) on a KV pool far
too small for the conversations (`--num-pages`), and the client is the official `openai` package,
streaming `/v1/completions` with token-id prompts. Each conversation's first turn (a shared
`--system-len` system prompt + its own user message) is served; then, one at a time, filler requests
push the device copies out, and the conversation comes back (its first prompt + an answer + a new
message): TTFT is the time from the request to the first streamed chunk. Configurations:

  host       cache.kv_offloading_size = --host-gib: the returning prefix is loaded from host memory
  recompute  the same pool, no host tier: the prefix was evicted, the prompt is recomputed
  off        prefix caching off

Every configuration's returning completions must be identical (greedy) to `off`'s. The first two
returning conversations warm the compiled buckets up and are not counted. CPU numbers for a tiny
model show the mechanism, not a device's speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.pd_cluster import Process, scrape


def _serve(checkpoint: str, args, extra: list[str]) -> Process:
    flags = {
        "model.dtype": "float32",
        "model.max_model_len": args.max_model_len,
        "compile.aot": "false",
        "compile.cache_dir": "null",
        "scheduler.max_num_seqs": 4,
        "scheduler.max_num_batched_tokens": 256,
        "cache.page_size": args.page_size,
        "cache.num_pages": args.num_pages,
        "server.port": 0,
        "model.served_model_name": "m",
    }
    argv = ["serve", checkpoint]
    for key, value in flags.items():
        argv += ["--set", f"{key}={value}"]
    return Process("serve", argv + extra + ["--log-level", "INFO"], timeout_s=600)


def _stream_ttft(client, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    start, first, text = time.perf_counter(), None, []
    stream = client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
        text += [c.text for c in chunk.choices]
    return first, "".join(text)


def run_config(checkpoint: str, args, extra: list[str], firsts, returning, fillers) -> dict:
    import openai

    server = _serve(checkpoint, args, extra)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        for prompt in firsts:  # turn 1 of every conversation
            client.completions.create(model="m", prompt=prompt, max_tokens=args.answer_len, temperature=0.0)
        ttfts, texts = [], []
        for i, prompt in enumerate(returning):
            for filler in fillers[i]:  # evict what came before from the device pool
                client.completions.create(model="m", prompt=filler, max_tokens=1, temperature=0.0)
            ttft, text = _stream_ttft(client, prompt, args.answer_len)
            ttfts.append(ttft)
            texts.append(text)
        metrics = scrape(server.url)
    finally:
        server.kill()
    counted = ttfts[2:]  # the first two compile what a returning request runs
    return {
        "median_ms": round(1000 * float(np.median(counted)), 1),
        "p90_ms": round(1000 * float(np.percentile(counted, 90)), 1),
        "all_ms": [round(1000 * t, 1) for t in ttfts],
        "texts": texts,
        "metrics": {k: v for k, v in metrics.items() if "host_cache" in k or "prefix_cache" in k},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--answer-len", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=96, help="the device pool: too small to keep them")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--host-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=None, help="token ids drawn below this (default: the config's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    vocab = args.vocab or config.get("text_config", config)["vocab_size"]
    rng = np.random.default_rng(args.seed)
    draw = lambda n: rng.integers(3, vocab, size=n).tolist()
    system = draw(args.system_len)
    firsts = [system + draw(args.user_len) for _ in range(args.conversations)]
    returning = [p + draw(args.answer_len) + draw(args.user_len) for p in firsts]
    filler_len = min(args.max_model_len - 8, (args.num_pages - 1) * args.page_size // 2)
    fillers = [[draw(filler_len) for _ in range(2)] for _ in returning]
    configs = {
        "host": ["--set", f"cache.kv_offloading_size={args.host_gib}"],
        "recompute": [],
        "off": ["--set", "cache.enable_prefix_caching=false"],
    }
    report = {"args": vars(args), "prompt_tokens": [len(p) for p in returning], "configs": {}}
    for name, extra in configs.items():
        report["configs"][name] = run_config(args.checkpoint, args, extra, firsts, returning, fillers)
        row = {k: v for k, v in report["configs"][name].items() if k != "texts"}
        print(name, json.dumps(row), flush=True)
    off = report["configs"]["off"]["texts"]
    report["identical_to_off"] = {name: r["texts"] == off for name, r in report["configs"].items()}
    host, recompute = report["configs"]["host"], report["configs"]["recompute"]
    report["speedup_median"] = round(recompute["median_ms"] / host["median_ms"], 2)
    report["speedup_p90"] = round(recompute["p90_ms"] / host["p90_ms"], 2)
    print(json.dumps({k: report[k] for k in ("identical_to_off", "speedup_median", "speedup_p90")}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
