"""The decoder forward pass shared by every supported family, over a ragged paged batch.

`forward(params, caches, batch, cfg=..., opts=...)` embeds the flat token batch, runs the layer
groups under `lax.scan` (one scan step = one repetition of the hybrid pattern, so compile time
does not grow with depth), and returns final hidden states at `batch.logits_indices` plus the
updated caches. Params from `unstack_layers` (one array per group instead of stacked ones) run
unrolled: XLA:CPU copies every weight slice a scan step reads before its matmul, which on a
small model is a fifth of a decode step; the unrolled loop reads the weights in place.

Caches hold, per position in the group, the layers of every group stacked along the page (or
slot) axis: layer-group g uses pages `[g*P, (g+1)*P)` and slots `[g*N, (g+1)*N)`,
so the ops see one ordinary page pool and the scan carries each cache in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models import gdn_replay, ops
from models.batch import ForwardBatch
from models.config import ATTENTION, ModelConfig
from models.deepseek_moe import deepseek_moe
from models.expert_parallel import expert_ffn, routed_experts_ep
from models.gpt_oss import gpt_oss_moe
from models.kda_layer import kda_layer
from models.mamba2 import mamba2_layer
from models.mamba2_config import MAMBA, NO_MIXER, NO_MLP
from models.mla_attention import mla_layer
from models.nemotron_moe import nemotron_moe
from models.quantization import QuantizedWeight, embed_lookup, out_in, qdot, tied_head
from models.tokenwise import tokenwise
from pallas_kernels import cpu_native


def rms_norm(x, w, eps: float, zero_centred: bool):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * y.astype(x.dtype)


def rope_tables(positions, cfg: ModelConfig, sliding: bool = False):
    """cos, sin [T, rotary_dim] at `positions`; `sliding`: the sliding-window layers' (Gemma 3's local base)."""
    inv_freq, scale = cfg.inv_freq(sliding)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale  # [T, rd]


def apply_rope(x, cos, sin, rotary_dim: int):
    # x: [T, heads, D]; rotate-half on the first rotary_dim channels, pass the rest through
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([rot * c + rotated * s, rest], axis=-1)


def _linear(x, w, b=None, opts=None, rows=None):
    y = ops.linear(x, w, opts, valid_rows=rows)
    return y if b is None else y + b


def attention_layer(p, x, kv, batch: ForwardBatch, rope, page_offset, cfg: ModelConfig, opts, sliding_window=None):
    T, D = x.shape[0], cfg.head_dim
    rows = batch.num_valid_rows
    q = _linear(x, p["q_proj"], p.get("q_bias"), opts, rows)
    if cfg.attn_output_gate:
        q, gate = jnp.split(q.reshape(T, cfg.num_heads, 2 * D), 2, axis=-1)
        gate = gate.reshape(T, cfg.num_heads * D)
    else:
        q = q.reshape(T, cfg.num_heads, D)
    # k, v: [T, Hkv held, D]: Hkv, or Hkv * kv_repeat after models.sharding.repeat_kv_heads
    k = _linear(x, p["k_proj"], p.get("k_bias"), opts, rows).reshape(T, -1, D)
    v = _linear(x, p["v_proj"], p.get("v_bias"), opts, rows).reshape(T, -1, D)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
    cos, sin = rope
    q = apply_rope(q, cos, sin, cfg.rotary_dim)
    k = apply_rope(k, cos, sin, cfg.rotary_dim)

    page_size = kv.page_size
    block_tables, slot_mapping = batch.block_tables, batch.slot_mapping
    if sliding_window is not None and batch.window_block_tables is not None:  # window-aware paging
        block_tables, slot_mapping = batch.window_block_tables, batch.window_slot_mapping
    slots = jnp.where(slot_mapping < 0, -1, slot_mapping + page_offset * page_size)
    kv = ops.write_kv(kv, k, v, slots, opts, max_seqs=block_tables.shape[0])
    out = ops.paged_attention(
        q,
        kv,
        batch.kv_lens,
        block_tables + page_offset,
        batch.cu_q_lens,
        batch.num_seqs,
        opts,
        sm_scale=cfg.attention_scale,
        sliding_window=sliding_window,
        sinks=p.get("sinks"),
    )
    out = out.reshape(T, cfg.num_heads * D)
    if cfg.attn_output_gate:
        out = out * jax.nn.sigmoid(gate)
    return _linear(out, p["o_proj"], p.get("o_bias"), opts, rows), kv


def gdn_layer(p, x, conv_state, rec_state, batch: ForwardBatch, slot_offset, cfg: ModelConfig, opts):
    T = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    slots, rows = batch.state_slot_ids + slot_offset, batch.num_valid_rows
    raw = ops.linear(x, p["in_qkv"], opts, valid_rows=rows)  # [T, conv_dim] = [Q all | K all | V all]
    verify = batch.spec_rows is not None  # a speculative verify pass: no state for drafts (models/gdn_replay.py)
    if verify:
        mixed, conv_state = gdn_replay.verify_conv(raw, p["conv_w"], conv_state, batch, slots, opts)
    else:
        mixed, conv_state = ops.causal_conv1d(
            raw, p["conv_w"], conv_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs, opts
        )
    q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    q = q.reshape(T, hk, dk).astype(jnp.float32)
    k = k.reshape(T, hk, dk).astype(jnp.float32)
    v = v.reshape(T, hv, dv)
    q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * dk**-0.5
    k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = jax.nn.sigmoid(qdot(x, p["in_b"], rows).astype(jnp.float32))  # [T, hv]
    a = qdot(x, p["in_a"], rows).astype(jnp.float32)
    g = -jnp.exp(p["A_log"]) * jax.nn.softplus(a + p["dt_bias"])
    q, k = q.astype(x.dtype), k.astype(x.dtype)
    stash = None
    if verify:
        o, rec_state = gdn_replay.verify_rule(q, k, v, g, beta, rec_state, batch, slots, opts)
        stash = gdn_replay.stash_rows(batch, raw, k, v, g, beta)
    else:
        o, rec_state = ops.gated_delta_rule(
            q, k, v, g, beta, rec_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs, opts
        )
    z = ops.linear(x, p["in_z"], opts, valid_rows=rows).reshape(T, hv, dv)
    o = o.astype(x.dtype)
    o32 = o.astype(jnp.float32)
    normed = (o32 * lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + cfg.rms_norm_eps)).astype(x.dtype)
    o = (p["gated_norm"] * normed).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    out = ops.linear(o.astype(x.dtype).reshape(T, hv * dv), p["out_proj"], opts, valid_rows=rows)
    return (out, conv_state, rec_state) if stash is None else (out, conv_state, rec_state, stash)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Nemotron-H
}


def dense_mlp(p, x, prefix: str = "", opts=None, rows=None, act: str = "silu"):
    """`rows`: x's leading real rows (`ForwardBatch.num_valid_rows`; None: all). `act`: the gate's
    activation (`ModelConfig.hidden_act`); without a `gate_proj` (Nemotron-H), up's."""
    up = _linear(x, p[prefix + "up_proj"], p.get(prefix + "up_bias"), opts, rows)
    if prefix + "gate_proj" not in p:
        return _linear(ACTIVATIONS[act](up), p[prefix + "down_proj"], p.get(prefix + "down_bias"), opts, rows)
    gate = _linear(x, p[prefix + "gate_proj"], p.get(prefix + "gate_bias"), opts, rows)
    return _linear(ACTIVATIONS[act](gate) * up, p[prefix + "down_proj"], p.get(prefix + "down_bias"), opts, rows)


def _routed_experts(x, weights, experts, w_gate_up, w_down, num_experts: int):
    """x [T, H], top-k weights / expert ids [T, K] -> weighted sum of expert outputs [T, H] (all
    experts local; under tensor parallelism GSPMD splits their intermediate dimension)."""
    T, H = x.shape
    K = experts.shape[1]
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert)
    token_of = order // K
    xs = x[token_of]  # [T*K, H] sorted by expert
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    y = expert_ffn(xs, w_gate_up, w_down, group_sizes)  # [T*K, H]
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((T, H), y.dtype).at[token_of].add(y)


def moe_mlp(p, x, cfg: ModelConfig, opts=None, rows=None):
    """Top-k routed experts (grouped matmuls over expert-sorted tokens; expert-parallel with
    `opts.tp.expert`, models/expert_parallel.py) plus the gated shared expert. `rows`: as `dense_mlp`."""
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    probs = jax.nn.softmax(qdot(x, p["router"], rows).astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = lax.top_k(probs, K)  # [T, K]
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    if opts is not None and opts.tp is not None and opts.tp.expert:  # whole experts per device, all-to-all
        out = routed_experts_ep(x, weights, experts, p["experts_gate_up"], p["experts_down"], opts.tp)
    else:
        out = _routed_experts(x, weights, experts, p["experts_gate_up"], p["experts_down"], E)
    if "shared_gate_proj" in p:
        shared = dense_mlp(p, x, prefix="shared_", opts=opts, rows=rows)
        out = out + jax.nn.sigmoid(qdot(x, p["shared_expert_gate"], rows)) * shared
    return out


def _group_step(params_g, x, caches, g, batch, ropes, cfg: ModelConfig, opts):
    """Run one repetition of the layer pattern (layers g*period + j for each j). `ropes`: the
    (full-attention, sliding-window) layers' RoPE tables. With `cfg.sandwich_norms` (Gemma 3) the
    attention and MLP outputs are normed before the residual adds (`post_norm` is the pre-MLP norm).
    A layer without a mixer or without an MLP (Nemotron-H's single-mixer blocks) skips that half.
    -> (x, caches, stash): stash per position, a verify pass's GDN inputs (`gdn_layer`), else None."""
    period = len(params_g)
    n_groups = cfg.num_layers // period
    kv_list, conv_list, rec_list = list(caches["kv"]), list(caches["conv"]), list(caches["rec"])
    stash = [None] * period
    for j in range(period):
        p = params_g[j]
        layer = j  # position in the group; the layer's kind is the same in every group
        kind = cfg.layer_types[layer]
        if kind != NO_MIXER:
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
            if cfg.mla is not None and kind == ATTENTION:  # MLA: one latent row per token (models/mla_attention.py)
                offset = g * (kv_list[j].num_pages // n_groups)
                h, kv_list[j] = mla_layer(p, h, kv_list[j], batch, ropes[0], offset, cfg, opts)
            elif kind == ATTENTION:
                pages_per_layer = kv_list[j].k.shape[0] // n_groups
                window = cfg.sliding_window(layer)
                rope = ropes[window is not None]
                h, kv_list[j] = attention_layer(p, h, kv_list[j], batch, rope, g * pages_per_layer, cfg, opts, window)
            else:  # recurrent: GDN or Mamba-2, its states in slots
                slots = rec_list[j].shape[0] // n_groups
                mixer = mamba2_layer if kind == MAMBA else kda_layer if cfg.kda else gdn_layer
                h, conv_list[j], rec_list[j], *extra = mixer(
                    p, h, conv_list[j], rec_list[j], batch, g * slots, cfg, opts
                )
                stash[j] = extra[0] if extra else None
            if cfg.sandwich_norms:
                h = rms_norm(h, p["attn_out_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
            x = x + h
        if cfg.mlp_types[layer] == NO_MLP:
            continue
        h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        if cfg.mlp_types[layer] == "dense":
            h = dense_mlp(p, h, opts=opts, rows=batch.num_valid_rows, act=cfg.hidden_act)
        else:  # per token: under attention DP's vmap, one call over every rank's tokens (models/tokenwise.py)
            moe = (
                nemotron_moe
                if cfg.mamba is not None
                else gpt_oss_moe
                if cfg.gpt_oss_moe
                else deepseek_moe
                if cfg.deepseek_moe is not None
                else moe_mlp
            )
            h = tokenwise(lambda p_, h_, rows: moe(p_, h_, cfg, opts, rows))(p, h, batch.num_valid_rows)
        if cfg.sandwich_norms:
            h = rms_norm(h, p["mlp_out_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        x = x + h
    return x, {"kv": tuple(kv_list), "conv": tuple(conv_list), "rec": tuple(rec_list)}, tuple(stash)


def forward(
    params, caches, batch: ForwardBatch, *, cfg: ModelConfig, opts: ops.KernelOptions, scan_layers: bool = True
):
    """-> (hidden [R, H] at batch.logits_indices, new caches). Every projection gets
    `batch.num_valid_rows`: the native CPU matmul skips the bucket's padding rows after them.
    A verify pass (`batch.spec_rows`) adds caches["replay"]: per position in the layer group, the GDN
    layers' stashed inputs stacked over groups (`models.gdn_replay.replay` commits them)."""
    x = embed_lookup(params["embed"], batch.input_ids, params["final_norm"].dtype)
    if cfg.scale_embeddings:  # Gemma: times sqrt(hidden_size), the scale rounded to the model dtype as HF does
        x = x * jnp.asarray(np.float32(cfg.hidden_size**0.5), x.dtype)
    rope = rope_tables(batch.positions, cfg)
    ropes = (rope, rope_tables(batch.positions, cfg, sliding=True) if cfg.has_sliding_rope else rope)
    n_groups = cfg.num_layers // cfg.layer_period()
    stashes, mtp = [], caches.get("mtp")
    caches = {k: v for k, v in caches.items() if k != "mtp"}
    if "layers" in params:  # unstacked (`unstack_layers`): one set of arrays per group
        for g, params_g in enumerate(params["layers"]):
            x, caches, stash = _group_step(params_g, x, caches, g, batch, ropes, cfg, opts)
            stashes.append(stash)
    elif scan_layers and n_groups > 1:

        def body(carry, xs):
            x, caches = carry
            params_g, g = xs
            x, caches, stash = _group_step(params_g, x, caches, g, batch, ropes, cfg, opts)
            return (x, caches), stash

        (x, caches), stacked = lax.scan(body, (x, caches), (params["groups"], jnp.arange(n_groups)))
    else:
        for g in range(n_groups):
            params_g = jax.tree.map(lambda a: a[g], params["groups"])
            x, caches, stash = _group_step(params_g, x, caches, g, batch, ropes, cfg, opts)
            stashes.append(stash)
    if batch.spec_rows is not None:
        if stashes:
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *stashes)
        caches = {**caches, "replay": stacked}
    if mtp is not None:  # the MTP layer's K/V and carry from every row's final hidden state (models/mtp.py)
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        return x[batch.logits_indices], {**caches, "mtp": mtp_absorb(params, mtp, x, batch, cfg, opts)}
    x = x[batch.logits_indices]
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm), caches


def mtp_fc_input(p, embed, tokens, hidden, cfg: ModelConfig):
    """The MTP layer's input: fc([norm(embed(tokens)) | norm(hidden)]) (models/mtp.py)."""
    eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
    e = rms_norm(embed_lookup(embed, tokens, hidden.dtype), p["pre_fc_norm_embedding"], eps, zc)
    return qdot(jnp.concatenate([e, rms_norm(hidden, p["pre_fc_norm_hidden"], eps, zc)], -1), p["fc"])


def mtp_absorb(params, mtp_cache: dict, hidden_all, batch: ForwardBatch, cfg: ModelConfig, opts) -> dict:
    """hidden_all [T, H]: the final norm's output at every row. Each row at position p >= 1 writes
    the MTP layer's K/V at p - 1 (its token, and the previous row's hidden state or, first in its
    sequence, the carry); each sequence's last row becomes its carry (models/mtp.py)."""
    p, T, S = params["mtp"], hidden_all.shape[0], batch.cu_q_lens.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), S - 1).astype(jnp.int32)
    carry = mtp_cache["hidden"]
    first = (t == batch.cu_q_lens[seq])[:, None]
    prev = jnp.where(first, carry[batch.state_slot_ids[seq]].astype(hidden_all.dtype), jnp.roll(hidden_all, 1, 0))
    h = rms_norm(
        mtp_fc_input(p, params["embed"], batch.input_ids, prev, cfg),
        p["layer"]["input_norm"],
        cfg.rms_norm_eps,
        cfg.zero_centred_norm,
    )
    rows, D, pos = batch.num_valid_rows, cfg.head_dim, jnp.maximum(batch.positions - 1, 0)
    k = _linear(h, p["layer"]["k_proj"], None, opts, rows).reshape(T, -1, D)
    v = _linear(h, p["layer"]["v_proj"], None, opts, rows).reshape(T, -1, D)
    if cfg.qk_norm:
        k = rms_norm(k, p["layer"]["k_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
    cos, sin = rope_tables(pos, cfg)
    k = apply_rope(k, cos, sin, cfg.rotary_dim)
    ps = mtp_cache["kv"].page_size
    slots = batch.block_tables[seq, pos // ps] * ps + pos % ps
    slots = jnp.where((batch.slot_mapping >= 0) & (batch.positions >= 1), slots, -1)
    kv = ops.write_kv(mtp_cache["kv"], k, v, slots, opts, max_seqs=S)
    last, live = batch.cu_q_lens[1:] - 1, batch.cu_q_lens[1:] > batch.cu_q_lens[:-1]  # [S]
    target = jnp.where(live, batch.state_slot_ids, carry.shape[0])  # not live: dropped
    carry = carry.at[target].set(hidden_all[jnp.maximum(last, 0)].astype(carry.dtype), mode="drop")
    return {"kv": kv, "hidden": carry}


def unstack_layers(params: dict) -> dict:
    """Stacked `groups` (each leaf [G, ...]) -> `layers`: a tuple of G groups whose leaves are
    separate arrays (same shardings); `forward` then runs the groups unrolled. The stacked
    arrays are not kept."""
    groups = params["groups"]
    n_groups = jax.tree.leaves(groups)[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, g=g: a[g], groups) for g in range(n_groups))
    return {**{k: v for k, v in params.items() if k != "groups"}, "layers": layers}


# The [K, N] weights `ops.linear` / `qdot` multiply (the rest: norms, biases, the GDN conv,
# A_log / dt_bias, MoE expert stacks, the embedding).
PROJECTIONS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "shared_expert_gate",
        "router",
        "in_qkv",
        "in_z",
        "in_b",
        "in_a",
        "in_proj",
        "out_proj",
    }
)


def out_in_projections(params: dict, hold=out_in) -> dict:
    """Every float projection (and an untied lm_head) as an `OutInWeight` [..., N, K]: the CPU
    weight layout (`hold=packed`: every bf16 one as a `PackedWeight`, the CPU layout for the
    native matmul). Stacked `groups` keep their leading axis; idempotent."""

    def layer(p: dict) -> dict:
        return {k: hold(w) if k in PROJECTIONS else w for k, w in p.items()}

    out = dict(params)
    if "layers" in params:
        out["layers"] = type(params["layers"])(type(group)(layer(p) for p in group) for group in params["layers"])
    if "groups" in params:
        out["groups"] = type(params["groups"])(layer(p) for p in params["groups"])
    if "lm_head" in params:
        out["lm_head"] = hold(params["lm_head"])
    return out


def compute_logits(params, hidden, softcap: float | None = None):
    """hidden [R, H] -> float32 logits [R, V] (tied embeddings when there is no lm_head; `head_packed`:
    the tied embedding's copy packed for the native CPU matmul, Model.hold_packed). `softcap`:
    `ModelConfig.final_logit_softcapping`, logits -> softcap * tanh(logits / softcap)."""
    logits = _logits(params, hidden)
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _logits(params, hidden):
    head = params.get("head_packed")
    if head is not None and hidden.dtype == jnp.bfloat16 and cpu_native.available():
        return cpu_native.bf16_matmul(hidden, head.p, head.n, out_dtype=jnp.float32)
    if "lm_head" not in params and not isinstance(params["embed"], QuantizedWeight):
        # tied float embedding [V, H]: contract its H axis in place. Spelled as embed.T @ ..., XLA:CPU
        # materialises a transposed (and, for bf16, float32-converted) copy of the table every call.
        return lax.dot_general(hidden, params["embed"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    w = params["lm_head"] if "lm_head" in params else tied_head(params["embed"])
    return qdot(hidden, w).astype(jnp.float32)
