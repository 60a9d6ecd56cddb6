"""FP8 KV cache quality, measured: attention-output error and end-to-end logit error.

    python -m benchmarks.fp8_quality                       # both sections, markdown tables
    python -m benchmarks.fp8_quality --contexts 512,4096 --json fp8.json
    python -m benchmarks.fp8_quality --only attention       # or: --only model

attention  Decode queries (S sequences, one query each) over a paged KV cache of `context`
           tokens from two distributions: "normal" (N(0, 1) K and V) and "outliers" (also 4 K
           channels x10 for every token, like the large channels of real keys, and 0.1% of
           V entries x10). The same K/V are stored as
           f32, bf16, and FP8 (e4m3fn, e5m2) with two scale schemes:
             per-page  one scale per (page, kv head), the production write path (`write_kv`);
             per-tensor one scale for the whole cache, global amax / fmax, applied here;
           and attended by the pure-jnp reference op. Error of the output vs the f32 cache and
           vs the bf16 cache: max-abs, and relative = ||o - o_ref||_F / ||o_ref||_F.
model      The tiny checkpoints (tests/conftest.py) end to end: teacher-forced prompt logits
           with FP8 KV vs the auto (model dtype, f32) cache (max-abs error, top-1 agreement per
           position), and greedy generation through `LLM` (tokens equal to auto's, until the
           first divergence) for kv_cache_dtype fp8_e4m3 / fp8_e5m2.
Runs on any backend with the reference ops (CPU here); numbers are properties of the number
format and scale scheme, not of the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FP8_KINDS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


# ---- attention output error ---------------------------------------------------------------

KV_DISTRIBUTIONS = ("normal", "outliers")


def realistic_kv(
    rng,
    context,
    num_kv_heads,
    head_dim,
    distribution,
    *,
    outlier_channels=4,
    outlier_scale=10.0,
    v_outlier_fraction=1e-3,
    v_outlier_scale=10.0,
):
    """K, V [context, Hkv, D] f32. "normal": N(0, 1). "outliers": also `outlier_channels` K
    channels scaled by `outlier_scale` for every token, and a fraction of V entries scaled."""
    k = rng.standard_normal((context, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((context, num_kv_heads, head_dim)).astype(np.float32)
    if distribution == "outliers":
        channels = rng.choice(head_dim, size=outlier_channels, replace=False)
        k[:, :, channels] *= outlier_scale
        v[rng.random(v.shape) < v_outlier_fraction] *= v_outlier_scale
    return k, v


def _pages_from_dense(kv_dtype, k, v, page_size, num_seqs, *, per_tensor: bool):
    """Stores the same [L, Hkv, D] K/V for `num_seqs` sequences in consecutive pages."""
    import jax.numpy as jnp

    from pallas_kernels.kv_cache import KVPages, fp8_max, is_fp8, quantize
    from pallas_kernels.kv_write import write_kv

    context, num_kv_heads, head_dim = k.shape
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + num_seqs * pages_per_seq
    slots = np.concatenate([(1 + s * pages_per_seq) * page_size + np.arange(context) for s in range(num_seqs)]).astype(
        np.int32
    )
    k_all, v_all = np.tile(k, (num_seqs, 1, 1)), np.tile(v, (num_seqs, 1, 1))
    if not (is_fp8(kv_dtype) and per_tensor):
        kv = KVPages.create(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
        return write_kv(kv, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(slots))
    # Per-tensor: one scale from the global amax, written into every (page, head) scale entry.
    plain = write_kv(
        KVPages.create(num_pages, page_size, num_kv_heads, head_dim, jnp.float32),
        jnp.asarray(k_all),
        jnp.asarray(v_all),
        jnp.asarray(slots),
    )
    limit = fp8_max(kv_dtype)
    k_scale = jnp.float32(np.abs(k).max() / limit)
    v_scale = jnp.float32(np.abs(v).max() / limit)
    full = lambda s: jnp.full((num_pages, num_kv_heads), s, jnp.float32)
    return KVPages(
        k=quantize(plain.k, k_scale, kv_dtype),
        v=quantize(plain.v, v_scale, kv_dtype),
        k_scale=full(k_scale),
        v_scale=full(v_scale),
    )


def _decode_attention(q, kv, context, page_size):
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    num_seqs = q.shape[0]
    pages_per_seq = -(-context // page_size)
    block_tables = 1 + np.arange(num_seqs)[:, None] * pages_per_seq + np.arange(pages_per_seq)
    out = ragged_paged_attention(
        jnp.asarray(q),
        kv,
        jnp.full((num_seqs,), context, jnp.int32),
        jnp.asarray(block_tables, jnp.int32),
        jnp.arange(num_seqs + 1, dtype=jnp.int32),
        jnp.int32(num_seqs),
        sm_scale=q.shape[-1] ** -0.5,
        impl="reference",
    )
    return np.asarray(out, np.float64)


def _errors(out, ref):
    return {"max_abs": float(np.abs(out - ref).max()), "rel": float(np.linalg.norm(out - ref) / np.linalg.norm(ref))}


def attention_quality(contexts, *, num_seqs=4, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seed=0):
    """Rows of {kv, context, cache, scales, vs_f32: {max_abs, rel}, vs_bf16: {...}}."""
    rows = []
    for distribution, context in [(d, c) for d in KV_DISTRIBUTIONS for c in contexts]:
        rng = np.random.default_rng(seed)
        k, v = realistic_kv(rng, context, num_kv_heads, head_dim, distribution)
        q = rng.standard_normal((num_seqs, num_q_heads, head_dim)).astype(np.float32)
        run = lambda dtype, per_tensor=False: _decode_attention(
            q, _pages_from_dense(dtype, k, v, page_size, num_seqs, per_tensor=per_tensor), context, page_size
        )
        ref_f32, ref_bf16 = run("float32"), run("bfloat16")
        rows.append(
            {
                "kv": distribution,
                "context": context,
                "cache": "bf16",
                "scales": "-",
                "vs_f32": _errors(ref_bf16, ref_f32),
                "vs_bf16": None,
            }
        )
        for kind, dtype in FP8_KINDS.items():
            for scales in ("per-page", "per-tensor"):
                out = run(dtype, per_tensor=scales == "per-tensor")
                rows.append(
                    {
                        "kv": distribution,
                        "context": context,
                        "cache": f"fp8 {kind}",
                        "scales": scales,
                        "vs_f32": _errors(out, ref_f32),
                        "vs_bf16": _errors(out, ref_bf16),
                    }
                )
        print(f"  {distribution} context {context}: done", file=sys.stderr, flush=True)
    return rows


def attention_table(rows) -> str:
    lines = [
        "| K/V | context | KV cache | scales | max-abs vs f32 | rel vs f32 | max-abs vs bf16 | rel vs bf16 |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = r["vs_bf16"]
        bf16 = f"{b['max_abs']:.2e} | {b['rel']:.2e}" if b else "- | -"
        lines.append(
            f"| {r['kv']} | {r['context']} | {r['cache']} | {r['scales']} | {r['vs_f32']['max_abs']:.2e} | "
            f"{r['vs_f32']['rel']:.2e} | {bf16} |"
        )
    return "\n".join(lines)


# ---- end-to-end on the tiny checkpoints -----------------------------------------------------


def _prompt_logits(model, ids, kv_dtype):
    """Teacher-forced logits [T, vocab] of one prompt, K/V written to a `kv_dtype` cache."""
    from models.ops import KernelOptions

    return model.logits(ids, KernelOptions(attention="reference", gdn="reference"), kv_dtype=kv_dtype)


def model_quality(families, *, prompt_len=200, num_prompts=4, new_tokens=16, seed=0):
    from benchmarks.tiny_checkpoints import build_cached_checkpoint
    from models import load_model
    from runtime.engine.llm import LLM
    from runtime.types import SamplingParams

    rows = []
    for family in families:
        path = build_cached_checkpoint(family)
        model = load_model(path)
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(3, model.cfg.vocab_size, size=prompt_len).tolist() for _ in range(num_prompts)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)

        def generate(kv_dtype):
            llm = LLM(
                model,
                kv_cache_dtype=kv_dtype,
                attention_backend="reference",
                max_num_seqs=num_prompts,
                max_num_batched_tokens=256,
                max_model_len=512,
                load_tokenizer=False,
            )
            completions = [o.outputs[0] for o in llm.generate(prompts, params)]
            return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in completions]

        auto_logits = [_prompt_logits(model, p, "auto") for p in prompts]
        auto_gen = generate("auto")
        for kind in FP8_KINDS:
            kv_dtype = f"fp8_{kind}"
            logits = [_prompt_logits(model, p, kv_dtype) for p in prompts]
            max_abs = max(float(np.abs(a - b).max()) for a, b in zip(logits, auto_logits))
            top1 = np.mean([np.mean(a.argmax(-1) == b.argmax(-1)) for a, b in zip(logits, auto_logits)])
            gen = generate(kv_dtype)
            agree, total, lp_err = 0, 0, 0.0
            for (tokens, lps), (ref_tokens, ref_lps) in zip(gen, auto_gen):
                same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
                agree, total = agree + same, total + len(ref_tokens)
                if same:
                    lp_err = max(lp_err, float(np.abs(np.subtract(lps[:same], ref_lps[:same])).max()))
            rows.append(
                {
                    "family": family,
                    "kv_cache_dtype": kv_dtype,
                    "prompt_logits_max_abs": max_abs,
                    "prompt_top1_agreement": float(top1),
                    "greedy_tokens_before_divergence": f"{agree}/{total}",
                    "greedy_logprob_max_abs": lp_err,
                }
            )
            print(f"  {family} {kv_dtype}: done", file=sys.stderr, flush=True)
    return rows


def model_table(rows) -> str:
    lines = [
        "| checkpoint | kv_cache_dtype | prompt logits max-abs vs auto | prompt top-1 agreement | "
        "greedy tokens equal to auto (before 1st divergence) | sampled-token logprob max-abs |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['kv_cache_dtype']} | {r['prompt_logits_max_abs']:.2e} | "
            f"{r['prompt_top1_agreement']:.3f} | {r['greedy_tokens_before_divergence']} | "
            f"{r['greedy_logprob_max_abs']:.2e} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,4096,16384")
    parser.add_argument("--families", default="llama,qwen3_5")
    parser.add_argument("--only", choices=("attention", "model"))
    parser.add_argument("--json", help="also write the raw rows here")
    args = parser.parse_args(argv)
    started = time.time()
    result = {}
    if args.only != "model":
        result["attention"] = attention_quality([int(c) for c in args.contexts.split(",")])
        print("\nAttention output, decode (S=4, Hq=8, Hkv=2, D=128, page 16):\n")
        print(attention_table(result["attention"]))
    if args.only != "attention":
        result["model"] = model_quality(args.families.split(","))
        print("\nEnd to end, tiny checkpoints (prompt 200 tokens x 4, 16 greedy tokens):\n")
        print(model_table(result["model"]))
    print(f"\n({time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
