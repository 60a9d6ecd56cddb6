"""Speculative decoding (ngram) vs off, in one process: single-stream decode of copy-heavy prompts
and tokens/s against concurrency.

    python -m benchmarks.spec_decode .cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf \
        --json benchmarks/results/spec-decode/smollm2-cpu-2core.json

Two engines of the same configuration are built: one with `speculative_config` (ngram), one
without (its default asynchronous scheduling; speculation runs the synchronous path in steps that
may draft). Every
request is greedy with `ignore_eos`, so both must produce identical text, which is checked.

  single_stream   each copy-heavy prompt (a code edit, a summary quoting its text) alone, the
                  modes interleaved per repeat; output tokens / wall time, the median of repeats
  concurrency     N copies of the prompts (cycled) added at once, for each N; output tokens / wall
  acceptance      drafted and accepted tokens per run (the engine's spec_decode_* counters)

`--adaptive` adds a mode `adaptive`: ngram with `disable_by_batch_size: auto` (no drafts while more
requests decode than the execution plan's measured crossover; `ngram` always drafts).

The machine's load average is recorded before and after (CPU numbers on a shared 2-core machine
are noisy; compare the ratio, measured in the same process and interleaved).

A tiny random GDN hybrid (the drafts' GDN state rolled back by replay, models/gdn_replay.py):

    python -m benchmarks.spec_decode tiny:qwen3_5 --oracle-drafts --concurrency 1,4,16 \
        --json benchmarks/results/spec-decode/tiny-qwen3_5-cpu-2core.json

`tiny:<family>` builds (or reuses) the tests' tiny checkpoint. A random model does not copy its
prompt, so prompt lookup is mostly rejected there (the `ngram` rows: what speculation costs when
it fails); `--oracle-drafts` adds `oracle` rows whose drafts are the off engine's own output for
the same prompt (every draft accepted until the end: the ceiling of verify + replay on this
model, not a drafting method).

`--mtp` (Qwen3.5 / Qwen3-Next) adds `mtp` rows (`method: mtp`, the checkpoint's MTP layer drafting
inside the verify step; a random MTP layer is mostly rejected: its cost when it fails) and, with
`--oracle-drafts`, `mtp_oracle` rows: the MTP layer still runs every draft step but the verify step
checks the oracle's drafts (the ceiling of a well-trained MTP layer, its drafting cost included):

    python -m benchmarks.spec_decode tiny:qwen3_5 --mtp --oracle-drafts --concurrency 1,4 \
        --json benchmarks/results/spec-decode/tiny-qwen3_5-mtp-cpu-2core.json

`--stop-at-eos` ends each single stream at the model's end of turn instead of `ignore_eos` (a
served answer, without the unrelated text a small model rambles on with past it; both engines
must still produce the same text):

    python -m benchmarks.spec_decode ~/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf --stop-at-eos \
        --concurrency 1 --json benchmarks/results/spec-decode/smollm2-cpu-2core-eos.json

`--draft-layers 6,10` adds `draft6`, `draft10` rows: `method: draft_model` with a LayerSkip-style
self-draft, the target's first N layers + final norm + lm_head (benchmarks/layerskip_draft.py
writes it beside the target in the cache dir); `--prompts ...,free_text` adds a prompt whose
answer is not in it (no copying for prompt lookup to find):

    python -m benchmarks.spec_decode ~/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf --draft-layers 6,10 \
        --prompts code_edit,quote_summary,free_text --concurrency 1 \
        --json benchmarks/results/spec-decode/smollm2-draft-model-cpu-2core.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

from benchmarks import write_json

CODE = """def parse_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def load_settings(path, defaults):
    config = parse_config(path)
    settings = dict(defaults)
    for key, value in config.items():
        if key in settings:
            settings[key] = type(settings[key])(value)
    return settings
"""

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. The chair said that the "
    "building would open in March, that the reading room would stay open until ten at night, and that "
    "the children's section would have its own entrance. The treasurer reported that the project was "
    "within budget, but warned that the cost of heating had risen by twelve percent since the spring."
)

PROMPTS = {
    "code_edit": f"Rename the function parse_config to read_config everywhere in this code and "
    f"return the full code:\n\n{CODE}",
    "quote_summary": f"Repeat the following text word for word, then summarize it in one sentence:\n\n{TEXT}",
    # not copy-heavy: the answer is not in the prompt (prompt lookup has little to find)
    "free_text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
DEFAULT_PROMPTS = "code_edit,quote_summary"


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def run(engine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> dict:
    from runtime.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    before = engine.stats()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"q{time.monotonic_ns()}-{i}", ids, params))
    tokens: dict[str, list[int]] = {}
    order = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id not in tokens:
                order.append(delta.request_id)
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    wall = time.perf_counter() - t0
    after = engine.stats()
    out = [tokens[rid] for rid in sorted(order, key=lambda r: int(r.rsplit("-", 1)[1]))]
    n = sum(len(t) for t in out)
    spec = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    }
    return {"tokens": out, "output_tokens": n, "wall_s": wall, "tokens_per_s": n / wall, **spec}


class OracleDrafts:
    """Stands in for `propose_ngram`: the next k tokens of the reference output whose prompt the
    context extends ([] if none)."""

    def __init__(self):
        self.continuations: list[list[int]] = []

    def __call__(self, tokens, k, min_n, max_n):
        context = tokens.tolist()
        for full in self.continuations:
            if len(full) > len(context) and full[: len(context)] == context:
                return full[len(context) : len(context) + k]
        return []


def resolve_checkpoint(name: str) -> str:
    if name.startswith("tiny:"):
        from benchmarks.tiny_checkpoints import build_cached_checkpoint

        return str(build_cached_checkpoint(name.split(":", 1)[1]))
    return name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128, help="single stream")
    ap.add_argument("--sweep-max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"of {', '.join(PROMPTS)}")
    ap.add_argument("--adaptive", action="store_true", help="also ngram with disable_by_batch_size: auto")
    ap.add_argument("--oracle-drafts", action="store_true", help="also a mode drafting the off engine's own output")
    ap.add_argument("--mtp", action="store_true", help="also method mtp (and mtp_oracle with --oracle-drafts)")
    ap.add_argument("--draft-layers", default="", help="also method draft_model with these N-layer self-drafts")
    ap.add_argument("--draft-speculative-tokens", type=int, help="k of the draft_model modes (default: as ngram)")
    ap.add_argument(
        "--stop-at-eos", action="store_true", help="single stream: stop at the end of the answer (default: ignore_eos)"
    )
    args = ap.parse_args(argv)
    checkpoint = resolve_checkpoint(args.checkpoint)

    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    load_before = os.getloadavg()
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "disable_by_batch_size": None,  # ngram: always draft; adaptive: the plan's "auto"
    }
    concurrency = [int(c) for c in args.concurrency.split(",")]
    engines = {}
    modes = [("ngram", spec_config), ("off", None)] + ([("oracle", spec_config)] if args.oracle_drafts else [])
    if args.adaptive:
        modes.append(("adaptive", {**spec_config, "disable_by_batch_size": "auto"}))
    mtp_config = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens, "disable_by_batch_size": None}
    if args.mtp:
        modes += [("mtp", mtp_config)] + ([("mtp_oracle", mtp_config)] if args.oracle_drafts else [])
    draft_configs = {}
    for n in [int(x) for x in args.draft_layers.split(",") if x]:  # LayerSkip-style: the target's first n layers
        from benchmarks.layerskip_draft import write_layerskip_draft

        draft_configs[f"draft{n}"] = {
            "method": "draft_model",
            "model": str(write_layerskip_draft(checkpoint, n)),
            "num_speculative_tokens": args.draft_speculative_tokens or args.num_speculative_tokens,
            "disable_by_batch_size": None,
        }
    modes += list(draft_configs.items())
    for mode, spec in modes:
        t0 = time.perf_counter()
        engines[mode] = LLMEngine(
            EngineConfig(
                model=checkpoint,
                dtype="float32",
                max_model_len=args.max_model_len,
                max_num_seqs=max(concurrency),
                max_num_batched_tokens=args.max_num_batched_tokens,
                seed=0,
                keep_gguf_quantized=False,
                enable_prefix_caching=False,  # every run computes its prompts
                speculative_config=spec,
            )
        )
        print(f"{mode}: engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    tokenizer = engines["off"].tokenizer
    prompts = {name: tokenizer.encode(chat(PROMPTS[name])) for name in args.prompts.split(",")}
    oracle = OracleDrafts()
    if args.oracle_drafts:  # the reference outputs, then the oracle engine's drafts from them
        for ids in prompts.values():
            for n in (args.max_tokens, args.sweep_max_tokens):
                oracle.continuations.append(ids + run(engines["off"], [ids], n)["tokens"][0])
        engines["oracle"].speculator.propose = functools.partial(propose_from, oracle, engines["oracle"].speculator)
        if "mtp_oracle" in engines:
            spec = engines["mtp_oracle"].speculator
            spec.propose = functools.partial(propose_from, oracle, spec, mtp=True)

    single, eos = {}, not args.stop_at_eos  # eos: the single streams' ignore_eos
    for name, ids in prompts.items():
        for mode in engines:  # warm-up: the buckets this prompt touches run once
            run(engines[mode], [ids], args.max_tokens, eos)
        runs = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                runs[mode].append(run(engine, [ids], args.max_tokens, eos))
        identical = all(r["tokens"] == runs["off"][0]["tokens"] for rs in runs.values() for r in rs)
        entry = {
            "prompt_tokens": len(ids),
            "output_tokens": runs["off"][0]["output_tokens"],
            "identical_text": identical,
            "text": tokenizer.decode(runs["off"][0]["tokens"][0]),
        }
        for mode, rs in runs.items():
            entry[mode] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "runs_tokens_per_s": [r["tokens_per_s"] for r in rs],
                "draft_tokens": rs[-1]["spec_decode_num_draft_tokens"],
                "accepted_tokens": rs[-1]["spec_decode_num_accepted_tokens"],
            }
        entry["speedup"] = entry["ngram"]["tokens_per_s"] / entry["off"]["tokens_per_s"]
        for mode in (m for m in runs if m not in ("off", "ngram")):
            entry[f"{mode}_speedup"] = entry[mode]["tokens_per_s"] / entry["off"]["tokens_per_s"]
        for mode in (m for m in runs if m != "off"):
            drafted = entry[mode]["draft_tokens"]
            entry[mode]["acceptance_rate"] = entry[mode]["accepted_tokens"] / drafted if drafted else None
        single[name] = entry
        for mode in (m for m in runs if m != "off"):
            print(
                f"single {name}: {mode} {entry[mode]['tokens_per_s']:.1f} tok/s, off {entry['off']['tokens_per_s']:.1f} "
                f"tok/s, x{entry[mode]['tokens_per_s'] / entry['off']['tokens_per_s']:.2f}, accepted "
                f"{entry[mode]['accepted_tokens']}/{entry[mode]['draft_tokens']}, identical {identical}",
                flush=True,
            )

    sweep = []
    cycle = list(prompts.values())
    for n in concurrency:
        batch = [cycle[i % len(cycle)] for i in range(n)]
        for mode in engines:
            run(engines[mode], batch, args.sweep_max_tokens)  # warm-up
        row = {"concurrency": n}
        results = {mode: run(engine, batch, args.sweep_max_tokens) for mode, engine in engines.items()}
        for mode, r in results.items():
            row[mode] = {k: r[k] for k in ("tokens_per_s", "output_tokens", "wall_s")}
        for mode in (m for m in results if m != "off"):
            row[mode]["accepted_tokens"] = results[mode]["spec_decode_num_accepted_tokens"]
            row[mode]["draft_tokens"] = results[mode]["spec_decode_num_draft_tokens"]
            row[mode]["speedup"] = row[mode]["tokens_per_s"] / row["off"]["tokens_per_s"]
            print(
                f"concurrency {n}: {mode} {row[mode]['tokens_per_s']:.1f} tok/s, off {row['off']['tokens_per_s']:.1f} "
                f"tok/s, x{row[mode]['speedup']:.2f}, accepted {row[mode]['accepted_tokens']}/{row[mode]['draft_tokens']}",
                flush=True,
            )
        row["identical_text"] = all(r["tokens"] == results["off"]["tokens"] for r in results.values())
        row["speedup"] = row["ngram"]["speedup"]
        sweep.append(row)
        print(f"concurrency {n}: identical {row['identical_text']}", flush=True)

    report = {
        "checkpoint": args.checkpoint,
        "oracle_note": "oracle: drafts are the off engine's output for the prompt (a ceiling, not a method)"
        if args.oracle_drafts
        else None,
        "speculative_config": spec_config,
        "mtp_config": mtp_config if args.mtp else None,
        "draft_model_configs": draft_configs or None,
        "max_tokens": args.max_tokens,
        "single_stream_ignore_eos": eos,
        "sweep_max_tokens": args.sweep_max_tokens,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "note": "off runs the default asynchronous scheduling; ngram runs the synchronous path while it "
        "may draft (adaptive: asynchronous above disable_by_batch_size)",
        "single_stream": single,
        "concurrency": sweep,
    }
    write_json(args.json, report)


def propose_from(oracle: OracleDrafts, spec, running, mtp: bool = False) -> None:
    """`Speculator.propose` with the oracle for prompt lookup (`mtp`: the oracle's drafts, the MTP's
    placeholders after them, so every verify step still runs the MTP layer's k draft steps)."""
    import numpy as np

    from runtime.speculative.speculator import MTP_DRAFT, can_draft

    k = spec.config.num_speculative_tokens
    for req in running:
        decoding = req.num_tokens - req.num_computed_tokens == 1
        tokens = np.asarray(req.all_token_ids)
        drafts = oracle(tokens, k, 0, 0) if decoding and can_draft(req) else []
        req.draft_token_ids = (
            drafts + [MTP_DRAFT] * (k - len(drafts)) if mtp and decoding and can_draft(req) else drafts
        )


if __name__ == "__main__":
    main()
