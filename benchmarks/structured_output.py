"""Structured output overhead: tokens/s with every request under a JSON schema vs none, the
grammar mask fill time per step, and grammar compile time cold vs cached.

    python -m benchmarks.structured_output CHECKPOINT --json out.json

Sections (one invocation runs them all):
  offline   the mixed workload through one engine (`LLMEngine`, temperature 1, ignore_eos, so
            every request yields exactly its max_tokens), plain vs every request under a JSON
            schema that cannot complete within max_tokens (so both runs generate the same
            tokens); output tokens/s each (median of --repeats, the two interleaved) and the ratio
  online    the same requests at saturation (all at once) through the HTTP server and the
            official async `openai` client (`/v1/completions` with token-id prompts), plain vs
            `structured_outputs.json`; tokens/s each and the ratio
  mask      `StructuredOutputManager.fill` for --mask-rows sequences under the schema, each
            advanced by a random allowed token per step: ms per step (median, p90)
  compile   --compile-schemas distinct JSON schemas: ms each on a fresh compiler (cold), then
            again (cached), and the one-off tokenizer view build
  sampler   no checkpoint: the jitted sampler alone on random logits [--mask-rows, --vocab] on the
            default device, plain vs with a host bitmask sent every call (half the rows
            constrained), temperature 1 and all-greedy: ms per call (median) and the ratio

    python -m benchmarks.structured_output --only sampler --vocab 151936   # e.g. on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from benchmarks.workloads import make_workload, summarize

SECTIONS = ("offline", "online", "mask", "compile", "sampler")
# Never complete within a benchmark's max_tokens (minItems), and bounded strings: every step of
# the grammar run is masked, like a long structured answer.
SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 10000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 12},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}


def _engine(args):
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    return LLMEngine(
        EngineConfig(
            model=args.checkpoint,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=0,
        )
    )


def _params(max_tokens: int, seed: int, grammar):
    from runtime.types import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, structured_output=grammar)


def _run_offline(engine, requests, grammar) -> float:
    from runtime.types import EngineRequest

    for i, r in enumerate(requests):
        engine.add_request(
            EngineRequest(f"r{time.monotonic_ns()}-{i}", list(r.prompt_ids), _params(r.max_tokens, i, grammar))
        )
    t0 = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
    return generated / (time.perf_counter() - t0)


def offline(engine, requests, grammar, repeats: int) -> dict:
    _run_offline(engine, requests[:8], grammar)  # warm-up: the grammar compiles, executables are AOT
    _run_offline(engine, requests[:8], None)
    plain, masked = [], []
    for _ in range(repeats):  # interleaved: a noisy machine slows both alike
        plain.append(_run_offline(engine, requests, None))
        masked.append(_run_offline(engine, requests, grammar))
    p, m = statistics.median(plain), statistics.median(masked)
    return {"plain_tok_s": p, "json_schema_tok_s": m, "ratio": m / p, "plain_runs": plain, "json_schema_runs": masked}


def online(engine, requests, repeats: int) -> dict:
    import openai

    from configs.schema import ServerConfig
    from runtime.engine.thread_client import AsyncEngine
    from server.testing import LiveServer

    async_engine = AsyncEngine(engine, "bench")
    live = LiveServer(async_engine, ServerConfig(max_waiting_requests=100000))

    async def wave(structured: bool) -> float:
        extra = {"ignore_eos": True}
        if structured:
            extra["structured_outputs"] = {"json": SCHEMA}
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *[
                    c.completions.create(
                        model="bench",
                        prompt=list(r.prompt_ids),
                        max_tokens=r.max_tokens,
                        temperature=1.0,
                        seed=i,
                        extra_body=extra,
                    )
                    for i, r in enumerate(requests)
                ]
            )
            wall = time.perf_counter() - t0
        return sum(o.usage.completion_tokens for o in outs) / wall

    try:
        asyncio.run(wave(True))  # warm-up
        plain, masked = [], []
        for _ in range(repeats):
            plain.append(asyncio.run(wave(False)))
            masked.append(asyncio.run(wave(True)))
    finally:
        live.close()
        asyncio.run(async_engine.shutdown())
    p, m = statistics.median(plain), statistics.median(masked)
    return {"plain_tok_s": p, "json_schema_tok_s": m, "ratio": m / p, "plain_runs": plain, "json_schema_runs": masked}


def mask_fill(compiler, grammar, rows: int, steps: int) -> dict:
    from runtime.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(compiler, max_rows=rows)
    ids = [f"m{i}" for i in range(rows)]
    for request_id in ids:
        manager.add(request_id, grammar)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = manager.fill(ids, rows)
        times.append((time.perf_counter() - t0) * 1e3)
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        for row, request_id in enumerate(ids):
            manager.advance(request_id, int(rng.choice(np.flatnonzero(bits[row]))))
    return {
        "rows": rows,
        "steps": steps,
        "fill_ms_median": statistics.median(times),
        "fill_ms_p90": float(np.percentile(times, 90)),
        "per_row_us_median": statistics.median(times) * 1e3 / rows,
    }


def compile_times(tokenizer, vocab_size: int, eos_ids, count: int) -> dict:
    from runtime.structured_output import build_compiler
    from runtime.types import StructuredOutput

    t0 = time.perf_counter()
    compiler = build_compiler(tokenizer, vocab_size, eos_ids)
    tokenizer_s = time.perf_counter() - t0
    grammars = [StructuredOutput("json", json.dumps({**SCHEMA, "title": f"case {i}"})) for i in range(count)]

    def timed() -> list[float]:
        out = []
        for g in grammars:
            t = time.perf_counter()
            compiler.compile(g)
            out.append((time.perf_counter() - t) * 1e3)
        return out

    cold, cached = timed(), timed()
    compiler.shutdown()
    return {
        "tokenizer_view_s": tokenizer_s,
        "cold_ms_median": statistics.median(cold),
        "cold_ms_max": max(cold),
        "cached_ms_median": statistics.median(cached),
        "schemas": count,
    }


def sampler_overhead(rows: int, vocab: int, iters: int = 50) -> dict:
    import jax

    from runtime.steps.sampler import sample
    from runtime.steps.sampling_metadata import SamplingMetadata
    from runtime.structured_output import bitmask_width
    from runtime.types import SamplingParams

    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(size=(rows, vocab)).astype(np.float32))
    bitmask = np.full((rows, bitmask_width(vocab)), -1, np.int32)
    bitmask[: rows // 2] = rng.integers(-(2**31), 2**31, size=(rows // 2, bitmask.shape[1]), dtype=np.int64)
    result = {"rows": rows, "vocab": vocab, "device": str(jax.devices()[0])}
    for temperature in (1.0, 0.0):
        params = [SamplingParams(temperature=temperature, seed=i) for i in range(rows)]
        meta = jax.device_put(SamplingMetadata.from_params(params, [0] * rows, [[]] * rows, [[]] * rows, pad_to=rows))
        greedy = temperature == 0.0

        def timed(mask) -> float:
            for _ in range(3):
                sample(logits, meta, mask, all_greedy=greedy).tokens.block_until_ready()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                sample(logits, meta, mask, all_greedy=greedy).tokens.block_until_ready()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        plain, masked = timed(None), timed(bitmask)
        key = "greedy" if greedy else "temperature_1"
        result[key] = {"plain_ms": plain, "masked_ms": masked, "ratio": masked / plain}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None, help="HF checkpoint dir (not needed for sampler)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mask-rows", type=int, default=64)
    parser.add_argument("--mask-steps", type=int, default=50)
    parser.add_argument("--compile-schemas", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=151936, help="sampler section: logits width")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")

    result: dict = {}
    if "sampler" in sections:
        result["sampler"] = sampler_overhead(args.mask_rows, args.vocab)
        print("sampler", json.dumps(result["sampler"]), flush=True)
        sections.remove("sampler")
    if sections and args.checkpoint is None:
        parser.error(f"sections {sections} need a checkpoint")
    if sections:
        result.update(_with_engine(args, sections))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _with_engine(args, sections: list[str]) -> dict:
    from runtime.types import StructuredOutput

    grammar = StructuredOutput("json", json.dumps(SCHEMA))
    engine = _engine(args)
    cfg = engine.model.cfg
    requests = make_workload(
        args.workload,
        vocab_size=cfg.vocab_size,
        seed=0,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    result = {
        "checkpoint": args.checkpoint,
        "workload": {"name": args.workload, "scale": args.scale, **summarize(requests)},
        "max_num_seqs": args.max_num_seqs,
        "schema": SCHEMA,
    }
    if "offline" in sections:
        result["offline"] = offline(engine, requests, grammar, args.repeats)
        print("offline", json.dumps(result["offline"]), flush=True)
    if "mask" in sections:
        result["mask"] = mask_fill(engine.structured_output.compiler, grammar, args.mask_rows, args.mask_steps)
        print("mask", json.dumps(result["mask"]), flush=True)
    if "compile" in sections:
        result["compile"] = compile_times(
            engine.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids), args.compile_schemas
        )
        print("compile", json.dumps(result["compile"]), flush=True)
    if "online" in sections:  # last: the server takes the engine over
        result["online"] = online(engine, requests, args.repeats)
        print("online", json.dumps(result["online"]), flush=True)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
