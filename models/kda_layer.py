"""The KDA mixer layer (Kimi Linear's `KimiLinearDeltaAttention`) over a ragged batch with state slots.

    q, k, v = x W_q, x W_k, x W_v          -> one causal depthwise conv (3 taps + this one) + silu
    q, k    = l2norm (fp32), q * K^-1/2     (`kda.kda_normalize_qk`)
    g       = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)   per channel [T, H, K] (`kda.kda_gate`)
    beta    = sigmoid(x W_b)                [T, H]
    o       = KDA(q, k, v, g, beta) from and back to the state slot   (pallas_kernels/kda.py)
    out     = o_proj(RMSNorm(o) * w * sigmoid(g_b(g_a(x))))   the norm and gate per head, in fp32

HF holds the q, k and v convs as one `conv1d` over [q | k | v] channels; published checkpoints as
`q_conv1d` / `k_conv1d` / `v_conv1d` (the same channels, concatenated at load). The conv state
([W-1, 3 H K] raw inputs) and the recurrent state ([H, K, K] fp32) live in state slots exactly as
a GDN layer's (models/transformer.py's `gdn_layer`): a sequence starts from its slot when
`has_initial_state` (a later prefill chunk, a decode step, a prefix-cache checkpoint) and from
zeros otherwise. Under tensor parallelism KDA heads split over the model axis as GDN's do
(`tp.gdn`, models/sharding.py): q/k/v columns and conv channels in per-shard order, f_b, g_b,
b_proj, A_log and dt_bias by head, o_proj by rows, each device's slots holding its own heads;
heads that do not divide by the axis keep the layer whole on every device. The KDA
implementation follows the GDN back-end choice where the KDA op has one of that name, "auto"
otherwise (the per-token loop on CPU, the Pallas kernels on TPU / GPU and with `interpret`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from models import gdn_replay, ops
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.quantization import qdot
from pallas_kernels import kda
from pallas_kernels.kernel_impls import resolve

KERNEL_CHUNK = 64  # the Pallas KDA kernels' default chunk (pallas_kernels/kda_kernel_*.py)


def kda_params(cfg: ModelConfig, get: Callable, has: Callable, lin: Callable, a: str) -> dict:
    """One KDA layer's weights from HF tensors under prefix `a` (`layers.{i}.self_attn.`); Linear
    weights [in, out] as `lin` reads them. The three projections are held as one [hidden, 3 H K]."""
    hidden, H, K, W = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim
    C = H * K
    qkv = [lin(a + f"{n}_proj", C, hidden) for n in "qkv"]
    if not all(isinstance(w, np.ndarray) for w in qkv):
        raise ValueError(f"{a}q/k/v_proj: pre-quantized Kimi Linear checkpoints are not supported yet")
    p = {"in_qkv": np.concatenate(qkv, axis=1)}
    if has(a + "conv1d.weight"):  # HF's fused conv
        p["conv_w"] = get(a + "conv1d.weight", (3 * C, 1, W))[:, 0, :]
    else:
        p["conv_w"] = np.concatenate([get(a + f"{n}_conv1d.weight", (C, 1, W))[:, 0, :] for n in "qkv"])
    gate = a if has(a + "f_a_proj.weight") else a + "forget_gate."  # published names, or HF's modules
    p["f_a"] = lin(gate + "f_a_proj", K, hidden)
    p["f_b"] = lin(gate + "f_b_proj", C, K)
    p["A_log"] = np.asarray(get(gate + "A_log")).reshape(-1)
    if p["A_log"].shape != (H,):
        raise ValueError(f"{gate}A_log holds {p['A_log'].size} values, the config implies {H} heads")
    p["dt_bias"] = get(gate + "dt_bias", (C,))
    p["in_b"] = lin(a + "b_proj", H, hidden)
    p["g_a"] = lin(a + "g_a_proj", K, hidden)
    p["g_b"] = lin(a + "g_b_proj", C, K)
    p["gated_norm"] = get(a + "o_norm.weight", (K,))
    p["out_proj"] = lin(a + "o_proj", hidden, C)
    return p


def kda_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes `kda_params` returns (for `models.weights.abstract_params`)."""
    hidden, H, K, W = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim
    C = H * K
    return {
        "in_qkv": (hidden, 3 * C),
        "conv_w": (3 * C, W),
        "f_a": (hidden, K),
        "f_b": (K, C),
        "A_log": (H,),
        "dt_bias": (C,),
        "in_b": (hidden, H),
        "g_a": (hidden, K),
        "g_b": (K, C),
        "gated_norm": (K,),
        "out_proj": (C, hidden),
    }


def kda_impl(opts: ops.KernelOptions) -> str:
    """The KDA implementation `opts` asks for: its GDN back-end's name when the KDA table has it."""
    choice = opts.gdn if opts.gdn in kda.KERNELS else "auto"
    return resolve(kda.KERNELS, choice, jax.default_backend(), opts.interpret)


def kda_layer(p, x, conv_state, rec_state, batch: ForwardBatch, slot_offset, cfg: ModelConfig, opts):
    """x [T, hidden] -> (out [T, hidden], conv_state, rec_state); the states are this layer's slot
    pools ([slots, W-1, 3 H K], [slots, H, K, K]), `slot_offset` its layer group's first slot. A
    verify pass (`batch.spec_rows`) commits no state for drafting sequences and appends their
    stashed per-token inputs (models/hybrid_replay.py)."""
    T, H, K = x.shape[0], cfg.linear_num_value_heads, cfg.linear_key_head_dim
    slots, rows = batch.state_slot_ids + slot_offset, batch.num_valid_rows
    raw = ops.linear(x, p["in_qkv"], opts, valid_rows=rows)  # [T, 3 H K] = [q | k | v]
    verify = batch.spec_rows is not None  # a speculative verify pass: no state for drafts (models/hybrid_replay.py)
    if verify:
        mixed, conv_state = gdn_replay.verify_conv(raw, p["conv_w"], conv_state, batch, slots, opts)
    else:
        mixed, conv_state = ops.causal_conv1d(
            raw, p["conv_w"], conv_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs, opts
        )
    q, k, v = (t.reshape(T, H, K) for t in jnp.split(mixed, 3, axis=-1))
    q, k = kda.kda_normalize_qk(q, k)  # fp32, as HF's kernel computes
    g = kda.kda_gate(qdot(qdot(x, p["f_a"], rows), p["f_b"], rows).reshape(T, H, K), p["A_log"], p["dt_bias"])
    beta = jax.nn.sigmoid(qdot(x, p["in_b"], rows)).astype(jnp.float32)  # [T, H]
    impl, tokens = kda_impl(opts), (q, k, v.astype(jnp.float32), g, beta)
    pad = max(0, KERNEL_CHUNK - T) if impl.startswith("pallas") else 0
    if pad:  # the kernels slice whole chunks of rows: a bucket shorter than one gets padding rows
        tokens = tuple(jnp.pad(t, [(0, pad)] + [(0, 0)] * (t.ndim - 1)) for t in tokens)
    run = functools.partial(kda.kda, impl=impl, interpret=opts.interpret)
    if opts.tp is not None and kda.KERNELS[impl].per_shard:  # a kernel on a mesh: its heads, or all of them
        heads = P(None, opts.tp.axis) if opts.tp.gdn else P()  # q, k, v, g [T, H, K]; beta [T, H]; state [N, H, K, V]
        specs = (heads,) * 6 + (P(),) * 4
        run = jax.shard_map(run, mesh=opts.tp.mesh, in_specs=specs, out_specs=(heads, heads), check_vma=False)
    if verify:
        o, rec_state = gdn_replay.verify_state(run, tokens, rec_state, batch, slots)
        stash = gdn_replay.stash_rows(batch, raw, k, v.astype(jnp.float32), g, beta)
    else:
        o, rec_state = run(*tokens, rec_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs)
    o = o[:T]  # [T, H, K] fp32
    o = o.astype(x.dtype).astype(jnp.float32)  # HF returns the core output in the model dtype
    gate = qdot(qdot(x, p["g_a"], rows), p["g_b"], rows).reshape(T, H, K).astype(jnp.float32)
    normed = o * lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = (normed * p["gated_norm"].astype(jnp.float32) * jax.nn.sigmoid(gate)).astype(x.dtype)
    out = ops.linear(o.reshape(T, H * K), p["out_proj"], opts, valid_rows=rows)
    return (out, conv_state, rec_state, stash) if verify else (out, conv_state, rec_state)
