"""Where and why greedy outputs with FP8 KV part from bf16 KV (and bf16 from the model's own
float32 KV): for every sequence, the first position whose greedy token differs, and the margin
between the best and second-best token there, in each run's own log-probabilities.

    python -m benchmarks.fp8_divergence .cache/peers/tiny-llama --workload mixed --scale 0.25 \
        --num-requests 16 --json benchmarks/results/cpu-2core-tiny-llama-fp8-divergence/fp8-divergence.json

A wrong KV path diverges early with a large margin (the reference run was sure of a token the
other did not pick); rounding flips a near-tie: a small margin in both runs, anywhere in the
sequence. The float32-KV vs bf16-KV pair is the yardstick: rounding the cache to bf16 already
flips near-ties, so FP8's divergences are judged against those.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.workloads import make_workload

KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3")  # "auto": the model dtype (float32 here)


def generate(model, requests, kv_cache_dtype: str, args) -> list:
    from runtime.engine.llm import LLM
    from runtime.types import SamplingParams

    num_pages = args.max_num_seqs * -(-args.max_model_len // 16) + 1
    llm = LLM(
        model,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        num_pages=num_pages,
        page_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=0,
        enable_prefix_caching=False,
    )
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2) for r in requests]
    outs = llm.generate([list(r.prompt_ids) for r in requests], params)
    return [o.outputs[0] for o in outs]


def margin(logprob) -> float:
    """Best minus second-best log-probability at one generated position."""
    top = logprob.top
    return top[0][1] - top[1][1] if len(top) >= 2 else float("inf")


def compare(reference: list, other: list) -> dict:
    rows = []
    for ref, out in zip(reference, other):
        n = min(len(ref.token_ids), len(out.token_ids))
        first = next((i for i in range(n) if ref.token_ids[i] != out.token_ids[i]), None)
        row = {"length": n, "first_divergence": first}
        if first is not None:
            row["margin_reference"] = margin(ref.logprobs[first])
            row["margin_other"] = margin(out.logprobs[first])
            # the reference's log-probability of the token the other run chose there
            chosen = dict(ref.logprobs[first].top).get(out.token_ids[first])
            row["reference_logprob_gap_to_chosen"] = (
                ref.logprobs[first].logprob - chosen if chosen is not None else None
            )
        rows.append(row)
    diverged = [r for r in rows if r["first_divergence"] is not None]
    all_margins = [margin(lp) for seq in reference for lp in seq.logprobs]
    summary = {
        "sequences": len(rows),
        "diverged": len(diverged),
        "agreement": 1 - len(diverged) / max(len(rows), 1),
        "first_divergence_fraction_median": (
            statistics.median(r["first_divergence"] / r["length"] for r in diverged) if diverged else None
        ),
        "margin_at_divergence_max": max((r["margin_reference"] for r in diverged), default=None),
        "margin_at_divergence_median": (
            statistics.median(r["margin_reference"] for r in diverged) if diverged else None
        ),
        "margin_all_positions_median": statistics.median(all_margins),
        "margin_all_positions_p10": statistics.quantiles(all_margins, n=10)[0],
    }
    return {"summary": summary, "sequences": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from models import load_model

    model = load_model(args.checkpoint, dtype="float32")
    requests = make_workload(
        args.workload,
        vocab_size=model.cfg.vocab_size,
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    runs = {kv: generate(model, requests, kv, args) for kv in KV_DTYPES}
    report = {
        "checkpoint": args.checkpoint,
        "workload": args.workload,
        "scale": args.scale,
        "float32_vs_bf16": compare(runs["auto"], runs["bfloat16"]),
        "bf16_vs_fp8_e4m3": compare(runs["bfloat16"], runs["fp8_e4m3"]),
        "float32_vs_fp8_e4m3": compare(runs["auto"], runs["fp8_e4m3"]),
    }
    for pair in ("float32_vs_bf16", "bf16_vs_fp8_e4m3", "float32_vs_fp8_e4m3"):
        print(pair, json.dumps(report[pair]["summary"], indent=None), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
