"""Where the WY chunked form beats the per-token recurrence for the ragged GDN op on CPU.

    python -m benchmarks.gdn_prefill                  # ~3 min on the 2-core box
    python -m benchmarks.gdn_prefill --quick --json out.json
    python -m benchmarks.gdn_prefill --engine .cache/peers/qwen3_5-small   # engine A/B, ~5 min
    python -m benchmarks.gdn_prefill --forward .cache/peers/qwen3_5-small  # one-prompt forward A/B

Times `pallas_kernels.gdn.gated_delta_rule` (one GDN layer's recurrence, the part that differs
between the paths) for ragged steps shaped like the engine's: a token bucket T, `max_num_seqs`
sequence rows, a mix of prefill rows (many new tokens) and decode rows (one token), padding up
to T. Each row of the output compares impl="reference" (per-token loop over the real tokens)
with impl="reference_chunked" at C = 16 / 32 / 64 (every row chunked) and with the "mixed"
path at C = 16 / 32 (multi-token rows chunked, one-token rows one batched step), all in ONE invocation so that a contended
machine slows every column alike: read the ratios, not the milliseconds. Heads follow the
Qwen3.5-shaped hybrid checkpoint (`.cache/peers/qwen3_5-small`: Hk 4, H 8, K = V = 128).

`--engine CHECKPOINT`: the whole engine instead, before (gdn_backend "reference": the per-token
loop in every step) vs after ("auto": the chunked CPU path), both engines built in the same
process and alternated: a burst of `--requests` prompts of `--prompt-len` tokens, 2 output
tokens each; TTFT per request (from the burst's submission to its first token) and prompt
tokens/s of the burst, medians over `--repeats` bursts.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gdn import gated_delta_rule, gated_delta_rule_mixed

HEADS = dict(key_heads=4, heads=8, key_dim=128, value_dim=128)
CHUNKS = (16, 32, 64)
MIXED_CHUNKS = (16, 32)
MAX_NUM_SEQS = 16
# (token bucket T, prefill lengths, decode rows): decode-only, one prompt, prompts + decodes.
FULL = [
    (16, [], 16),
    (32, [16], 8),
    (64, [48], 0),
    (64, [32], 15),
    (128, [128], 0),
    (128, [100], 15),
    (128, [40, 40], 8),
    (256, [256], 0),
    (256, [200], 15),
    (256, [60, 60, 60], 12),
    (512, [512], 0),
    (512, [480], 15),
    (512, [128, 128, 128], 13),
]
QUICK = [(16, [], 16), (128, [100], 15), (256, [256], 0)]


def ragged_step(
    key, bucket: int, prefill_lens: list[int], num_decode: int, heads=HEADS, max_num_seqs: int = MAX_NUM_SEQS
):
    """Random operands of one ragged step: the prefill rows first, then the decode rows."""
    hk, h, kd, vd = heads["key_heads"], heads["heads"], heads["key_dim"], heads["value_dim"]
    lens = list(prefill_lens) + [1] * num_decode
    assert sum(lens) <= bucket and len(lens) <= max_num_seqs, (bucket, lens)
    ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (bucket, hk, kd))) * kd**-0.5
    k = unit(jax.random.normal(ks[1], (bucket, hk, kd)))
    v = jax.random.normal(ks[2], (bucket, h, vd))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (bucket, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bucket, h)))
    num_slots = max_num_seqs + 1
    state = 0.1 * jax.random.normal(ks[5], (num_slots, h, kd, vd))
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1 : len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1 :] = cu[len(lens)]
    slots = np.zeros(max_num_seqs, np.int32)
    slots[: len(lens)] = np.arange(1, len(lens) + 1)
    has_initial = np.zeros(max_num_seqs, bool)
    has_initial[len(prefill_lens) : len(lens)] = True  # decode rows continue a sequence
    return (
        q,
        k,
        v,
        g,
        beta,
        state,
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_initial),
        jnp.asarray(len(lens), jnp.int32),
    )


def op(impl: str, chunk_size: int):
    """The jitted op. impl "mixed": the multi-token rows chunked, the one-token rows one batched
    recurrence step (what impl="chunked" runs from CHUNKED_MIN_TOKENS on)."""
    if impl == "mixed":
        return jax.jit(lambda *a: gated_delta_rule_mixed(*a, chunk_size=chunk_size))
    return jax.jit(lambda *a: gated_delta_rule(*a, impl=impl, chunk_size=chunk_size))


def time_interleaved(fns: dict, repeats: int) -> dict:
    """Median ms per zero-argument function after a warm-up (compile) call each; the functions
    take turns in every repeat, so a load change on the shared machine hits them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def engine_ab(checkpoint: str, num_requests: int, prompt_len: int, repeats: int) -> dict:
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    engines = {
        name: LLMEngine(
            EngineConfig(
                model=checkpoint,
                dtype="float32",
                max_num_seqs=16,
                max_num_batched_tokens=512,
                max_model_len=1024,
                page_size=16,
                enable_prefix_caching=False,
                gdn_backend=backend,
                seed=0,
            ),
            progress=False,
        )
        for name, backend in (("before (per-token loop)", "reference"), ("after (chunked)", "auto"))
    }
    vocab = next(iter(engines.values())).model.cfg.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    results = {name: dict(ttft_ms=[], prompt_tok_s=[]) for name in engines}
    for burst in range(repeats + 1):  # burst 0 warms up every bucket the burst uses
        prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(num_requests)]
        for name, engine in engines.items():
            t0, first = time.perf_counter(), {}
            for i, p in enumerate(prompts):
                engine.add_request(EngineRequest(f"b{burst}-{i}", p, params))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.new_token_ids and out.request_id not in first:
                        first[out.request_id] = time.perf_counter() - t0
            if burst:
                results[name]["ttft_ms"].append(1e3 * statistics.median(first.values()))
                results[name]["prompt_tok_s"].append(num_requests * prompt_len / max(first.values()))
    summary = {
        name: dict(
            ttft_p50_ms=statistics.median(r["ttft_ms"]), prompt_tok_s=statistics.median(r["prompt_tok_s"]), runs=r
        )
        for name, r in results.items()
    }
    for name, r in summary.items():
        print(
            f"{name:<26} median TTFT {r['ttft_p50_ms']:8.1f} ms   prefill {r['prompt_tok_s']:8.1f} prompt tok/s",
            flush=True,
        )
    return dict(checkpoint=checkpoint, requests=num_requests, prompt_len=prompt_len, results=summary)


def forward_ab(checkpoint: str, prompt_lens: list[int], repeats: int) -> dict:
    """One prompt through the model's forward pass (`Model.logits`), per-token loop vs the chunked
    path, interleaved: the prefill step without the engine around it."""
    from models.model import load_model
    from models.ops import KernelOptions

    model = load_model(checkpoint, dtype="float32")
    rng = np.random.default_rng(0)
    variants = {"recurrent": KernelOptions(gdn="reference"), "chunked": KernelOptions()}
    rows = []
    for n in prompt_lens:
        ids = rng.integers(3, model.cfg.vocab_size, size=n).tolist()
        fns = {name: functools.partial(model.logits, ids, opts=opts) for name, opts in variants.items()}
        row = dict(prompt_len=n, **{f"{name}_ms": ms for name, ms in time_interleaved(fns, repeats).items()})
        rows.append(row)
        print(
            f"prompt {n:>4}: per-token loop {row['recurrent_ms']:8.1f} ms, chunked {row['chunked_ms']:8.1f} ms "
            f"({row['recurrent_ms'] / row['chunked_ms']:.2f}x)",
            flush=True,
        )
    return dict(checkpoint=checkpoint, rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--engine", metavar="CHECKPOINT", help="engine A/B on this checkpoint instead of the op table")
    parser.add_argument("--forward", metavar="CHECKPOINT", help="one-prompt forward A/B on this checkpoint")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args(argv)
    if args.engine or args.forward:
        result = (
            engine_ab(args.engine, args.requests, args.prompt_len, args.repeats)
            if args.engine
            else forward_ab(args.forward, [128, 256, 512], args.repeats)
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    rows = []
    print(
        f"{'T':>4} {'prefill lens':<16} {'dec':>3} {'recurrent ms':>12} "
        + " ".join(f"{'C=' + str(c) + ' ms':>9} {'ratio':>6}" for c in CHUNKS)
        + " ".join(f"{'mix' + str(c) + ' ms':>9} {'ratio':>6}" for c in MIXED_CHUNKS)
    )
    for i, (bucket, prefill, decode) in enumerate(QUICK if args.quick else FULL):
        step = ragged_step(jax.random.key(i), bucket, prefill, decode)
        fns = {"recurrent": op("reference", 64)}
        fns.update({f"chunked_{c}": op("reference_chunked", c) for c in CHUNKS})
        fns.update({f"mixed_{c}": op("mixed", c) for c in MIXED_CHUNKS})
        row = dict(bucket=bucket, prefill_lens=prefill, decode_rows=decode)
        calls = {name: functools.partial(fn, *step) for name, fn in fns.items()}
        row.update({f"{name}_ms": ms for name, ms in time_interleaved(calls, args.repeats).items()})
        rows.append(row)
        cols = [name for name in fns if name != "recurrent"]
        print(
            f"{bucket:>4} {prefill!s:<16} {decode:>3} {row['recurrent_ms']:>12.2f} "
            + " ".join(f"{row[f'{n}_ms']:>9.2f} {row['recurrent_ms'] / row[f'{n}_ms']:>5.2f}x" for n in cols),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(heads=HEADS, max_num_seqs=MAX_NUM_SEQS, device=jax.devices()[0].device_kind, rows=rows),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
