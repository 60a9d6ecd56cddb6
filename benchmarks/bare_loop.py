"""The overhead limit: the same model decoding in one jitted `lax.scan`, no engine around it.

    python -m benchmarks.bare_loop CHECKPOINT --batch 16 --prompt-len 128 --output-len 128

S sequences of `prompt_len` tokens are prefilled in one `forward` call, then decode one token
each per step for `output_len - 1` steps inside a single `lax.scan` (greedy argmax in-loop,
the paged caches carried and donated). Each sequence owns a contiguous run of pages and its
own state slot, so there is no scheduler, no host round trip and no padding: whatever the
engine achieves above this is overhead. Both functions are compiled once (timed separately)
and then run `repeats` times; the result is the median.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.batch import ForwardBatch
from models.model import Model, load_model
from models.ops import KernelOptions
from models.transformer import compute_logits, forward


def _layout(S: int, max_len: int, page_size: int):
    """Sequence s owns pages [1 + s*MB, 1 + (s+1)*MB); page 0 is the null page."""
    MB = -(-max_len // page_size)
    block_tables = 1 + np.arange(S * MB, dtype=np.int32).reshape(S, MB)
    return block_tables, 1 + S * MB


def _slots(block_tables, positions, page_size: int):
    # positions: [S] (decode) or [S, P] (prefill), per-sequence
    pages = jnp.take_along_axis(block_tables, (positions // page_size).reshape(block_tables.shape[0], -1), axis=1)
    return (pages * page_size + positions.reshape(pages.shape) % page_size).reshape(-1)


def make_bare_loop(model: Model, opts: KernelOptions, *, batch: int, prompt_len: int, output_len: int,
                   page_size: int = 16, max_model_len: int | None = None):
    """-> (prefill(params, caches, prompts [S, P]) -> (caches, first [S]),
           decode(params, caches, first [S]) -> (caches, tokens [output_len - 1, S]),
           fresh_caches())"""
    cfg, S, P = model.cfg, batch, prompt_len
    block_tables_np, num_pages = _layout(S, max(max_model_len or 0, P + output_len), page_size)
    block_tables = jnp.asarray(block_tables_np)
    seq_ids = jnp.arange(S, dtype=jnp.int32)

    def prefill(params, caches, prompts):
        positions = jnp.tile(jnp.arange(P, dtype=jnp.int32), (S, 1))  # [S, P]
        cu = jnp.arange(S + 1, dtype=jnp.int32) * P
        fb = ForwardBatch(
            input_ids=prompts.reshape(-1), positions=positions.reshape(-1),
            slot_mapping=_slots(block_tables, positions, page_size), cu_q_lens=cu,
            kv_lens=jnp.full((S,), P, jnp.int32), block_tables=block_tables, state_slot_ids=seq_ids + 1,
            has_initial_state=jnp.zeros((S,), bool), num_seqs=jnp.asarray(S, jnp.int32), logits_indices=cu[1:] - 1)
        hidden, caches = forward(params, caches, fb, cfg=cfg, opts=opts)
        return caches, jnp.argmax(compute_logits(params, hidden), axis=-1).astype(jnp.int32)

    def decode(params, caches, first):
        def step(carry, i):
            caches, tokens = carry
            pos = jnp.full((S,), P, jnp.int32) + i  # [S]
            fb = ForwardBatch(
                input_ids=tokens, positions=pos, slot_mapping=_slots(block_tables, pos, page_size),
                cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32), kv_lens=pos + 1, block_tables=block_tables,
                state_slot_ids=seq_ids + 1, has_initial_state=jnp.ones((S,), bool),
                num_seqs=jnp.asarray(S, jnp.int32), logits_indices=seq_ids)
            hidden, caches = forward(params, caches, fb, cfg=cfg, opts=opts)
            nxt = jnp.argmax(compute_logits(params, hidden), axis=-1).astype(jnp.int32)
            return (caches, nxt), nxt

        (caches, _), tokens = jax.lax.scan(step, (caches, first), jnp.arange(output_len - 1, dtype=jnp.int32))
        return caches, tokens

    def fresh_caches():
        return model.init_caches(num_pages, page_size, S + 1,
                                 bit_storage=opts.impl("attention") in ("chunked", "reference"))

    return jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1), fresh_caches


def run_bare_loop(model: Model, prompts: np.ndarray, output_len: int, *, opts: KernelOptions | None = None,
                  page_size: int = 16, max_model_len: int | None = None, repeats: int = 3) -> dict:
    """Time the bare loop on `prompts [S, P]` int32; -> throughput numbers and the greedy tokens.

    `max_model_len` sets the block-table width (default: just enough for P + output_len); pass
    the engine's to give the attention op the same shapes the engine gives it."""
    if output_len < 2:
        raise ValueError("output_len must be >= 2 (one prefill token + at least one decode step)")
    opts = opts or KernelOptions()
    S, P = prompts.shape
    prefill, decode, fresh = make_bare_loop(model, opts, batch=S, prompt_len=P, output_len=output_len,
                                            page_size=page_size, max_model_len=max_model_len)
    params = model.params
    prompts = jnp.asarray(prompts, jnp.int32)
    t0 = time.perf_counter()
    caches = fresh()
    prefill_exe = prefill.trace(params, caches, prompts).lower().compile()
    first_spec = jax.ShapeDtypeStruct((S,), jnp.int32)
    decode_exe = decode.trace(params, caches, first_spec).lower().compile()
    compile_s = time.perf_counter() - t0
    prefill_times, decode_times = [], []
    for _ in range(repeats):
        caches = fresh()
        jax.block_until_ready(caches)
        t0 = time.perf_counter()
        caches, first = prefill_exe(params, caches, prompts)
        first.block_until_ready()
        t1 = time.perf_counter()
        caches, tokens = decode_exe(params, caches, first)
        tokens.block_until_ready()
        t2 = time.perf_counter()
        prefill_times.append(t1 - t0)
        decode_times.append(t2 - t1)
    prefill_s, decode_s = float(np.median(prefill_times)), float(np.median(decode_times))
    all_tokens = np.concatenate([np.asarray(first)[None, :], np.asarray(tokens)], axis=0).T  # [S, output_len]
    return {
        "batch": S, "prompt_len": P, "output_len": output_len, "compile_s": compile_s,
        "block_table_width": int(-(-max(max_model_len or 0, P + output_len) // page_size)),
        "prefill_s": prefill_s, "decode_s": decode_s,
        "output_tokens_per_s": S * output_len / (prefill_s + decode_s),
        "decode_tokens_per_s": S * (output_len - 1) / decode_s,
        "decode_step_ms": 1000 * decode_s / (output_len - 1),
        "tokens": all_tokens.tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=None, help="block-table width, as the engine's")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = load_model(args.checkpoint, dtype=args.dtype)
    from benchmarks.workloads import token_id_range

    low, high = token_id_range(model.cfg.vocab_size)
    prompts = np.random.default_rng(args.seed).integers(low, high, size=(args.batch, args.prompt_len), dtype=np.int32)
    result = run_bare_loop(model, prompts, args.output_len, max_model_len=args.max_model_len, repeats=args.repeats)
    result.pop("tokens")
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
