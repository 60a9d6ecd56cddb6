"""The checkpoint's own MTP layer (Qwen3.5 / Qwen3-Next): its weights, its caches, its two passes.

One MTP layer predicts the token after next from the token at t + 1 and the target's hidden state
at t (the output of the final norm), as vLLM's `Qwen3NextMultiTokenPredictor`:

    e = fc([pre_fc_norm_embedding(embed(x[t+1])) | pre_fc_norm_hidden(h[t])])     # fc: [2H] -> [H]
    y = norm(decoder_layer(e, position t))          # a full-attention layer (MoE in Qwen3-Next)
    logits = lm_head(y)                             # embed and lm_head shared with the target

Norms are the model's (zero-centred `1 + w`). Weights: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_*`,
`mtp.layers.0.*`, `mtp.norm.weight`; `mtp_num_hidden_layers: 1` in config.json.

Caches (`caches["mtp"]`): the layer's KV pages, the same page ids as the target's (the block table
is shared, one more layer), and `hidden` [state slots, H]: per request the target's hidden state
at its last computed token (the carry; copied with the GDN state into prefix checkpoints).
`absorb` runs inside every forward pass: the MTP layer's K/V at position p - 1 for every token at p
(its input token and the previous row's hidden state, or the carry), then the carry. `draft` runs
k MTP steps per drafting sequence inside the verify step (runtime/speculative/verify.py).

Drafts never change the output (verification is exact); what only lowers acceptance: a shared
prefix page's last MTP row is written by whichever request next runs the token after it. A
host-tier hit (cache.kv_offloading_size) restores the MTP rows with the pages and the carry with
the GDN state (runtime/engine/host_tier.py). Under P/D a prefill instance on an MTP checkpoint ships the
request's rows and carry with its pages (runtime/kv_transfer/spec_layout.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.batch import draft_rows_batch
from models.config import ATTENTION, ModelConfig
from models.prequantized import parse_quantization_config, read_linear
from models.safetensors_io import CheckpointError, SafetensorsDir
from models.sharding import (
    REPLICATED,
    ROW,
    TensorParallel,
    _leaf_spec,
    _place,
    group_param_specs,
    kv_heads_held,
    repeat_kv_heads,
)
from models.transformer import attention_layer, compute_logits, dense_mlp, moe_mlp, mtp_fc_input, rms_norm, rope_tables
from models.weights import _cast, _layer_params
from pallas_kernels.kv_cache import KVPages

PREFIX = "mtp."
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def layer_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP decoder layer as a one-layer config: full attention, the model's MLP kind."""
    return dataclasses.replace(
        cfg, num_layers=1, layer_types=(ATTENTION,), mlp_types=("moe" if cfg.num_experts else "dense",)
    )


def mtp_refusal(cfg: ModelConfig, path) -> str | None:
    """Why `speculative_config.method: mtp` cannot run on this checkpoint, or None."""
    if cfg.model_type not in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        return f"method 'mtp' needs a Qwen3.5 / Qwen3-Next checkpoint with MTP layers, not {cfg.architecture}"
    path = Path(path)
    if not path.is_dir() or not list(path.glob("*.safetensors")):
        return f"method 'mtp' reads the MTP layer from an HF safetensors directory; {path} is not one"
    hf = json.loads((path / "config.json").read_text())
    n = hf.get("mtp_num_hidden_layers", hf.get("text_config", {}).get("mtp_num_hidden_layers", 0))
    if n != 1:
        return f"method 'mtp' needs mtp_num_hidden_layers: 1 in {path / 'config.json'} (got {n}): no MTP layer"
    if PREFIX + "fc.weight" not in SafetensorsDir(path):
        return f"method 'mtp': {path} has no MTP weights (mtp.fc.weight is missing)"
    return None


def load_mtp_params(cfg: ModelConfig, path, dtype: str) -> dict:
    """The `mtp.*` tensors as {"fc" [2H, H], the three norms [H], "layer": our per-layer names}."""
    why = mtp_refusal(cfg, path)
    if why is not None:
        raise CheckpointError(why)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    src, H = SafetensorsDir(path), cfg.hidden_size
    stored = parse_quantization_config(json.loads((Path(path) / "config.json").read_text()).get("quantization_config"))

    def get(name, shape=None):
        return src.get(PREFIX + name, shape)

    def has(name):
        return PREFIX + name in src

    def lin(module, out, inp):  # as the target's: a pre-quantized checkpoint's stored-quantized ones stay so
        return read_linear(src, PREFIX + module, out, inp, stored)

    layer = _layer_params(layer_config(cfg), get, has, lin, 0)
    params = {"fc": _cast("fc", lin("fc", H, 2 * H), np_dtype)}
    params.update({name: _cast(name, get(f"{name}.weight", (H,)), np_dtype) for name in NORMS})
    params["layer"] = {k: _cast(k, v, np_dtype) for k, v in layer.items()}
    return params


def shard_mtp_params(mtp: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    """The MTP params placed on `plan`'s mesh as the target's: the decoder layer as one of the
    target's full-attention layers (its KV heads repeated where fewer than the chips; MoE as the
    target's MoE layers), `fc` [2H, H] row-parallel (each chip its slice of the concatenated
    input, one all-reduce of [T, H], as o_proj), the norms replicated."""
    layer = repeat_kv_heads({"groups": (mtp["layer"],)}, cfg, plan)["groups"][0]
    m, axis = plan.size, plan.axis
    fc_rule = ROW if m > 1 and (2 * cfg.hidden_size) % m == 0 else REPLICATED
    specs = {
        "fc": _leaf_spec(fc_rule, mtp["fc"], m, axis),
        **{name: P() for name in NORMS},
        "layer": group_param_specs(layer_config(cfg), layer, 0, plan),
    }
    return jax.tree.map(lambda x, s: _place(x, NamedSharding(plan.mesh, s)), {**mtp, "layer": layer}, specs)


def init_mtp_caches(model, num_pages: int, page_size: int, num_slots: int, kv_dtype, bit_storage: bool) -> dict:
    """The MTP layer's KV pool (`num_pages`, as one target attention layer's; `kv_dtype` resolved)
    and the carry [num_slots, H]. Under a mesh (`model.tp`) the pool is split on its (held) KV
    heads as the target's attention pools are, the carry replicated."""
    cfg, tp = model.cfg, model.tp
    kv = KVPages.create(num_pages, page_size, kv_heads_held(cfg, tp), cfg.head_dim, kv_dtype, bit_storage=bit_storage)
    caches = {"kv": kv, "hidden": jnp.zeros((num_slots, cfg.hidden_size), model.params["final_norm"].dtype)}
    if tp is None:
        return caches
    heads = P(None, tp.axis) if tp.attention else P()  # k, v [P, Hkv, ps, D]; scales [P, Hkv]
    return {
        "kv": jax.tree.map(lambda x: _place(x, NamedSharding(tp.mesh, heads)), caches["kv"]),
        "hidden": _place(caches["hidden"], NamedSharding(tp.mesh, P())),
    }


def keep_accepted(mtp_cache: dict, hidden, seqs, offsets, accepted, slots) -> dict:
    """After a verify step's acceptance: each drafting sequence's carry is the hidden state at its
    last accepted row (`hidden` [T, H] at the verify rows; `seqs`, `offsets` [T]; `accepted`,
    `slots` [S]), not at its last (maybe rejected) row."""
    S, carry = accepted.shape[0], mtp_cache["hidden"]
    at = (seqs >= 0) & (offsets == accepted[jnp.clip(seqs, 0, S - 1)])
    target = jnp.where(at, slots[jnp.clip(seqs, 0, S - 1)], carry.shape[0])
    return {**mtp_cache, "hidden": carry.at[target].set(hidden.astype(carry.dtype), mode="drop")}


def mtp_step(params, mtp_cache: dict, tokens, hidden, positions, valid, block_tables, cfg: ModelConfig, opts):
    """One MTP step for S sequences, one query each at `positions` [S] (K/V written there; `valid`
    [S] bool, others write nothing) -> (normed output [S, H], logits [S, V], the cache)."""
    p, lcfg = params["mtp"], layer_config(cfg)
    eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
    batch = draft_rows_batch(tokens, positions, valid, block_tables, mtp_cache["kv"].page_size)
    pos = batch.positions
    x = mtp_fc_input(p, params["embed"], tokens, hidden, cfg)
    lp = p["layer"]
    h, kv = attention_layer(
        lp, rms_norm(x, lp["input_norm"], eps, zc), mtp_cache["kv"], batch, rope_tables(pos, lcfg), 0, lcfg, opts
    )
    x = x + h
    h = rms_norm(x, lp["post_norm"], eps, zc)
    x = x + (
        moe_mlp(lp, h, lcfg, opts) if lcfg.mlp_types[0] == "moe" else dense_mlp(lp, h, opts=opts, act=cfg.hidden_act)
    )
    y = rms_norm(x, p["norm"], eps, zc)
    return y, compute_logits(params, y, cfg.final_logit_softcapping), {**mtp_cache, "kv": kv}


def draft(params, mtp_cache: dict, tokens, positions, slots, valid, block_tables, k: int, cfg: ModelConfig, opts):
    """k greedy drafts per sequence: tokens [S] its last token (at `positions` [S]), whose MTP step
    sits at position - 1 with the carry at `slots` [S]; step j feeds draft j and the MTP's own
    output. -> (drafts [S, k] i32, the cache; K/V written at positions - 1 .. positions + k - 2)."""
    hidden = mtp_cache["hidden"][slots]
    drafts = []
    for j in range(k):
        hidden, logits, mtp_cache = mtp_step(
            params, mtp_cache, tokens, hidden, positions - 1 + j, valid, block_tables, cfg, opts
        )
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), mtp_cache
