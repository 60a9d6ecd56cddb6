"""The overhead limit: the same model decoding in one jitted `lax.scan`, no engine around it.

    python -m benchmarks.bare_loop CHECKPOINT --batch 16 --prompt-len 128 --output-len 128

S sequences of `prompt_len` tokens are prefilled in one `forward` call, then decode one token
each per step for `output_len - 1` steps inside a single `lax.scan` (greedy argmax in-loop,
the paged caches carried and donated). Each sequence owns a contiguous run of pages and its
own state slot, so there is no scheduler, no host round trip and no padding: whatever the
engine achieves above this is overhead. Both functions are compiled once (timed separately)
and then run `repeats` times; the result is the median.

`run_bare_loop_requests` is the same limit for a ragged workload's own requests (mixed
lengths): waves of `batch` requests, each one ragged prefill plus one decode scan to the
wave's longest output.
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


def _decode_loop(cfg, opts: KernelOptions, block_tables, start_positions, steps: int, page_size: int):
    """decode(params, caches, first [S]) -> (caches, tokens [steps, S]): `steps` greedy one-token
    steps of every sequence in one `lax.scan`; sequence s writes position start_positions[s] + i."""
    S = block_tables.shape[0]
    seq_ids = jnp.arange(S, dtype=jnp.int32)

    def decode(params, caches, first):
        def step(carry, i):
            caches, tokens = carry
            pos = start_positions + i  # [S]
            fb = ForwardBatch(
                input_ids=tokens,
                positions=pos,
                slot_mapping=_slots(block_tables, pos, page_size),
                cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
                kv_lens=pos + 1,
                block_tables=block_tables,
                state_slot_ids=seq_ids + 1,
                has_initial_state=jnp.ones((S,), bool),
                num_seqs=jnp.asarray(S, jnp.int32),
                logits_indices=seq_ids,
            )
            hidden, caches = forward(params, caches, fb, cfg=cfg, opts=opts)
            nxt = jnp.argmax(compute_logits(params, hidden), axis=-1).astype(jnp.int32)
            return (caches, nxt), nxt

        (caches, _), tokens = jax.lax.scan(step, (caches, first), jnp.arange(steps, dtype=jnp.int32))
        return caches, tokens

    return decode


def make_bare_loop(
    model: Model,
    opts: KernelOptions,
    *,
    batch: int,
    prompt_len: int,
    output_len: int,
    page_size: int = 16,
    max_model_len: int | None = None,
):
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
            input_ids=prompts.reshape(-1),
            positions=positions.reshape(-1),
            slot_mapping=_slots(block_tables, positions, page_size),
            cu_q_lens=cu,
            kv_lens=jnp.full((S,), P, jnp.int32),
            block_tables=block_tables,
            state_slot_ids=seq_ids + 1,
            has_initial_state=jnp.zeros((S,), bool),
            num_seqs=jnp.asarray(S, jnp.int32),
            logits_indices=cu[1:] - 1,
        )
        hidden, caches = forward(params, caches, fb, cfg=cfg, opts=opts)
        return caches, jnp.argmax(compute_logits(params, hidden), axis=-1).astype(jnp.int32)

    decode = _decode_loop(cfg, opts, block_tables, jnp.full((S,), P, jnp.int32), output_len - 1, page_size)

    def fresh_caches():
        return model.init_caches(num_pages, page_size, S + 1, bit_storage=opts.kv_bit_storage)

    return jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1), fresh_caches


def run_bare_loop(
    model: Model,
    prompts: np.ndarray,
    output_len: int,
    *,
    opts: KernelOptions | None = None,
    page_size: int = 16,
    max_model_len: int | None = None,
    repeats: int = 3,
    before_each=None,
) -> dict:
    """Time the bare loop on `prompts [S, P]` int32; -> throughput numbers and the greedy tokens.

    `max_model_len` sets the block-table width (default: just enough for P + output_len); pass
    the engine's to give the attention op the same shapes the engine gives it. `before_each()`,
    if given, runs before every timed repeat (a benchmark interleaving another system's runs
    with these, so that the machine's drifting load hits both alike)."""
    if output_len < 2:
        raise ValueError("output_len must be >= 2 (one prefill token + at least one decode step)")
    opts = opts or KernelOptions()
    S, P = prompts.shape
    prefill, decode, fresh = make_bare_loop(
        model, opts, batch=S, prompt_len=P, output_len=output_len, page_size=page_size, max_model_len=max_model_len
    )
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
        if before_each is not None:
            before_each()
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
        "batch": S,
        "prompt_len": P,
        "output_len": output_len,
        "compile_s": compile_s,
        "block_table_width": int(-(-max(max_model_len or 0, P + output_len) // page_size)),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "all_tokens_per_s": [S * output_len / (p + d) for p, d in zip(prefill_times, decode_times)],
        "output_tokens_per_s": S * output_len / (prefill_s + decode_s),
        "decode_tokens_per_s": S * (output_len - 1) / decode_s,
        "decode_step_ms": 1000 * decode_s / (output_len - 1),
        "tokens": all_tokens.tolist(),
    }


def make_ragged_bare_loop(
    model: Model,
    opts: KernelOptions,
    *,
    prompt_lens: tuple[int, ...],
    decode_steps: int,
    page_size: int = 16,
    max_model_len: int | None = None,
):
    """The bare loop over sequences of different prompt lengths (a wave of a ragged workload):
    one ragged prefill `forward` of every prompt, then `decode_steps` decode steps of all
    sequences in one `lax.scan` (a sequence that needs fewer tokens keeps decoding as dead
    weight, as in any static batch). -> (prefill, decode, fresh_caches) like `make_bare_loop`."""
    cfg, S = model.cfg, len(prompt_lens)
    lens = np.asarray(prompt_lens, np.int32)
    block_tables_np, num_pages = _layout(S, max(max_model_len or 0, int(lens.max()) + decode_steps + 1), page_size)
    block_tables = jnp.asarray(block_tables_np)
    seq_ids = jnp.arange(S, dtype=jnp.int32)
    cu_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_of_token = np.repeat(np.arange(S), lens)
    pos_np = (np.arange(cu_np[-1]) - cu_np[seq_of_token]).astype(np.int32)
    page_np = block_tables_np[seq_of_token, pos_np // page_size]
    slots_np = (page_np * page_size + pos_np % page_size).astype(np.int32)
    p0 = jnp.asarray(lens)

    def prefill(params, caches, flat_prompts):
        fb = ForwardBatch(
            input_ids=flat_prompts,
            positions=jnp.asarray(pos_np),
            slot_mapping=jnp.asarray(slots_np),
            cu_q_lens=jnp.asarray(cu_np),
            kv_lens=p0,
            block_tables=block_tables,
            state_slot_ids=seq_ids + 1,
            has_initial_state=jnp.zeros((S,), bool),
            num_seqs=jnp.asarray(S, jnp.int32),
            logits_indices=jnp.asarray(cu_np[1:] - 1),
        )
        hidden, caches = forward(params, caches, fb, cfg=cfg, opts=opts)
        return caches, jnp.argmax(compute_logits(params, hidden), axis=-1).astype(jnp.int32)

    decode = _decode_loop(cfg, opts, block_tables, p0, decode_steps, page_size)

    def fresh_caches():
        return model.init_caches(num_pages, page_size, S + 1, bit_storage=opts.kv_bit_storage)

    return jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1), fresh_caches


def run_bare_loop_requests(
    model: Model,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    batch: int,
    opts: KernelOptions | None = None,
    page_size: int = 16,
    max_model_len: int | None = None,
    repeats: int = 3,
    before_each=None,
) -> dict:
    """The bare loop over a ragged workload's OWN requests: waves of `batch` requests in order, each
    wave prefilled in one ragged forward and decoded in one scan to its longest `max_tokens`.
    Throughput counts requested tokens only; compile time is reported apart (one prefill and one
    decode executable per wave shape). `before_each` as in `run_bare_loop`. -> numbers and each
    request's greedy tokens."""
    opts = opts or KernelOptions()
    waves = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    compiled, compile_s = [], 0.0
    for wave in waves:
        lens = tuple(len(prompts[i]) for i in wave)
        steps = max(max(max_tokens[i] for i in wave) - 1, 1)
        prefill, decode, fresh = make_ragged_bare_loop(
            model, opts, prompt_lens=lens, decode_steps=steps, page_size=page_size, max_model_len=max_model_len
        )
        flat = jnp.asarray(np.concatenate([prompts[i] for i in wave]).astype(np.int32))
        t0 = time.perf_counter()
        caches = fresh()
        prefill_exe = prefill.trace(model.params, caches, flat).lower().compile()
        decode_exe = decode.trace(model.params, caches, jax.ShapeDtypeStruct((len(wave),), jnp.int32)).lower().compile()
        compile_s += time.perf_counter() - t0
        compiled.append((wave, flat, prefill_exe, decode_exe, fresh))
    run_times, tokens = [], {}
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        elapsed = 0.0
        for wave, flat, prefill_exe, decode_exe, fresh in compiled:
            caches = fresh()
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches, first = prefill_exe(model.params, caches, flat)
            caches, rest = decode_exe(model.params, caches, first)
            rest.block_until_ready()
            elapsed += time.perf_counter() - t0
            wave_tokens = np.concatenate([np.asarray(first)[None, :], np.asarray(rest)], axis=0).T
            for row, i in enumerate(wave):
                tokens[i] = wave_tokens[row, : max_tokens[i]].tolist()
        run_times.append(elapsed)
    seconds = float(np.median(run_times))
    return {
        "batch": batch,
        "waves": len(waves),
        "compile_s": compile_s,
        "seconds": seconds,
        "all_seconds": run_times,
        "all_tokens_per_s": [sum(max_tokens) / t for t in run_times],
        "output_tokens_per_s": sum(max_tokens) / seconds,
        "tokens": [tokens[i] for i in range(len(prompts))],
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
