"""Tensor parallelism: which axis of every parameter and cache is split over the mesh's `model` axis.

    plan = tensor_parallel_plan(cfg, mesh)       # what can be split, given head counts
    params = shard_params(params, cfg, mesh)     # NamedSharding per leaf (Megatron layout)
    caches = shard_caches(caches, cfg, mesh)
    shard_model(model, mesh)                     # both, in place on a models.model.Model

Megatron layout: q/k/v/gate/up/in_qkv/in_z/in_b/in_a are column-parallel (output dim = heads or
FFN columns), o_proj/down/out_proj row-parallel, norms replicated, MoE experts split on the
expert-intermediate dim, or, with expert parallelism (`expert_parallel=True`), on the expert index
(each device holds E/M whole experts; models/expert_parallel.py routes tokens to them with an
all-to-all; the shared expert stays column/row split). Stacked layer-group axis 0 is never split. No parameter is split over the
`data` axis (attention DP ranks share the weights; runtime/parallel/data_parallel.py splits the caches). The embedding and lm_head are split on the vocab: they are the
largest single tensors of small-hidden, large-vocab models (Qwen3.5: 248k x H), and a
vocab-split gather / matmul costs one all-reduce of [T, H] / an all-gather of the logits.

GDN's in_qkv is `[Q all | K all | V all]`, so a plain column split would hand one shard only
Q columns and another only V. When GDN is split, in_qkv's columns, conv_w's rows and the conv
state's channels are *reordered* to `[Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]` (`qkv_permutation`),
so shard i holds exactly its own q, k and v heads; `models/ops.causal_conv1d` restores the
canonical order of its output (`unpermute_qkv`). KDA (Kimi Linear) layers split the same way
(`plan.gdn`, its H key = value heads): q/k/v columns and convs as GDN's, the gate's f_b and the
output gate's g_b by head columns (f_a, g_a [hidden, K] whole), A_log, dt_bias and b_proj by
head, o_proj by rows; each device's state slots hold its own heads. A tensor whose heads (or
columns) do not divide by the model axis is replicated instead, and logged.

Fewer KV heads than chips (Qwen3.5-27B: 4 KV heads on 8 chips): when the model axis is a multiple
of Hkv (and Hq divides by it), every KV head is *repeated* `kv_repeat = model / Hkv` times at load,
as vLLM and tpu-inference do: k_proj / v_proj columns (and biases) of head j become heads
`j*r .. j*r+r-1` (`repeat_kv_heads`), so the model holds `model` KV heads, one per chip, and the KV
cache is split `model` ways. Query head h then reads held KV head `h // (Hq/model)`, a copy of
original head `h // (Hq/Hkv)`: the same arithmetic as one device. k_norm is per head_dim, unchanged.
A model axis that Hkv does not divide (Hkv=4 on 6 chips) keeps attention replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import mamba2_tp
from models.cache_formats import pin_formats
from models.config import ModelConfig
from models.quantization import QuantizedWeight, take_columns

log = logging.getLogger("jaxserve.sharding")

MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Static (hashable) description of how a model is split; travels in `KernelOptions.tp`."""

    mesh: Mesh
    attention: bool  # Hq and Hkv split over the model axis (else attention is replicated)
    gdn: bool  # GDN key and value heads split (else GDN is replicated)
    mamba: bool = False  # Mamba-2 heads and B / C groups split (models/mamba2_tp.py)
    gdn_qkv_widths: tuple[int, int, int] = (0, 0, 0)  # (Hk*K, Hk*K, H*V) conv channels
    axis: str = MODEL_AXIS
    expert: bool = False  # routed experts split on the expert index (expert parallelism)
    kv_repeat: int = 1  # each KV head held this many times (repeat_kv_heads): Hkv * kv_repeat divides the axis
    latent_split: bool = False  # MLA latent pools split by token over the axis (models/mla_split.py)

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def spec(self, *dims) -> NamedSharding:
        return NamedSharding(self.mesh, P(*dims))


def _divides(n: int, m: int) -> bool:
    return n > 0 and n % m == 0


@functools.cache  # one plan (and one set of fall-back warnings) per model and mesh
def tensor_parallel_plan(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> TensorParallel:
    """Which layer kinds split over `mesh`'s model axis; logs every fallback to replication.
    `expert_parallel` splits MoE experts by expert index (ValueError when E does not divide)."""
    m = mesh.shape[MODEL_AXIS]
    expert = _expert_parallel(cfg, m, expert_parallel)
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    kv_repeat = m // hkv if _divides(hq, m) and 0 < hkv < m and m % hkv == 0 and cfg.mla is None else 1
    # MLA: query heads split (q_b_proj / kv_b_proj columns, o_proj rows); the latent rows are replicated
    attention = _divides(hq, m) and (cfg.mla is not None or _divides(hkv * kv_repeat, m))
    if m > 1 and cfg.num_attention_layers and not attention:
        log.warning("attention replicated: %d query / %d KV heads do not divide by model axis %d", hq, hkv, m)
    if m > 1 and cfg.num_attention_layers and kv_repeat > 1:
        log.info("attention split: each of %d KV heads repeated on %d of %d devices", hkv, kv_repeat, m)
    gdn, widths = False, (0, 0, 0)
    if cfg.is_hybrid and cfg.mamba is None:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        gdn = _divides(hk, m) and _divides(hv, m)  # KDA (Kimi Linear): the same split, its gates by head too
        qk = hk * cfg.linear_key_head_dim
        widths = (qk, qk, hv * cfg.linear_value_head_dim)
        if m > 1 and not gdn:
            kind = "KDA" if cfg.kda else "GDN"
            log.warning("%s replicated: %d key / %d value heads do not divide by model axis %d", kind, hk, hv, m)
    return TensorParallel(
        mesh=mesh,
        attention=attention and m > 1,
        gdn=gdn and m > 1,
        mamba=cfg.mamba is not None and mamba2_tp.mamba_split(cfg.mamba, m),
        gdn_qkv_widths=widths,
        expert=expert,
        kv_repeat=kv_repeat if attention and m > 1 else 1,
    )


def kv_heads_held(cfg: ModelConfig, plan: TensorParallel | None) -> int:
    """KV heads the model holds (its weights' and caches' head count): Hkv, or Hkv * kv_repeat."""
    return cfg.num_kv_heads * (1 if plan is None else plan.kv_repeat)


def _expert_parallel(cfg: ModelConfig, m: int, asked: bool) -> bool:
    if not asked or m == 1:
        return False
    if "moe" not in cfg.mlp_types:
        log.warning("expert parallelism asked for a model without MoE layers: ignored")
        return False
    if cfg.num_experts % m:
        raise ValueError(
            f"expert parallelism: {cfg.num_experts} experts do not divide by model axis {m}; "
            "use a model axis that divides the expert count, or expert-intermediate TP "
            "(parallel.expert: false)"
        )
    return True


# ---- GDN channel order --------------------------------------------------------------------------
def qkv_permutation(widths: tuple[int, int, int], shards: int) -> np.ndarray:
    """Canonical channel index at each position of the per-shard `[Q_i K_i V_i]` order."""
    offsets = np.cumsum((0,) + tuple(widths))
    parts = []
    for i in range(shards):
        for offset, width in zip(offsets, widths):
            step = width // shards
            parts.append(offset + np.arange(i * step, (i + 1) * step))
    return np.concatenate(parts)


def unpermute_qkv(y: jax.Array, widths: tuple[int, int, int], shards: int) -> jax.Array:
    """y [T, C] in per-shard `[Q_i K_i V_i]` order -> canonical `[Q | K | V]` order."""
    T = y.shape[0]
    blocks = y.reshape(T, shards, -1)  # [T, M, C/M]: one block per shard
    q, k, v = jnp.split(blocks, np.cumsum([w // shards for w in widths[:2]]), axis=-1)
    return jnp.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)


# ---- parameters -----------------------------------------------------------------------------------
COLUMN = "column"  # split the last (output) dim
ROW = "row"  # split the input dim of a [.., in, out] weight
EXPERT = "expert"  # split the expert index of a [.., E, in, out] expert weight
VECTOR = "vector"  # split the last dim of a per-head / per-column vector
REPLICATED = "replicated"

ATTENTION_RULES = {
    "q_proj": COLUMN,
    "k_proj": COLUMN,
    "v_proj": COLUMN,
    "o_proj": ROW,
    "q_bias": VECTOR,
    "k_bias": VECTOR,
    "v_bias": VECTOR,
    "o_bias": REPLICATED,
    "q_norm": REPLICATED,
    "k_norm": REPLICATED,
    "sinks": VECTOR,  # one per query head
}
GDN_RULES = {
    "in_qkv": COLUMN,
    "in_z": COLUMN,
    "in_b": COLUMN,
    "in_a": COLUMN,
    "conv_w": "conv",
    "A_log": VECTOR,
    "dt_bias": VECTOR,
    "gated_norm": REPLICATED,
    "out_proj": ROW,
}
MLP_RULES = {
    "gate_proj": COLUMN,
    "up_proj": COLUMN,
    "down_proj": ROW,
    "gate_bias": VECTOR,
    "up_bias": VECTOR,
    "down_bias": REPLICATED,
}
MOE_RULES = {
    "router": REPLICATED,
    "experts_gate_up": COLUMN,
    "experts_up": COLUMN,  # Nemotron-H's gateless experts
    "experts_down": ROW,
    "shared_gate_proj": COLUMN,
    "shared_up_proj": COLUMN,
    "shared_down_proj": ROW,
    "shared_expert_gate": REPLICATED,
    "router_bias": REPLICATED,
    "experts_gate_up_bias": REPLICATED,  # [E, 2I]: gathered per row, kept whole
    "experts_down_bias": REPLICATED,
}
NORM_RULES = {
    "input_norm": REPLICATED,
    "post_norm": REPLICATED,
    "attn_out_norm": REPLICATED,
    "mlp_out_norm": REPLICATED,
}
# MLA (models/mla_attention.py): per-head projections split, the latent's replicated; DeepSeek's router
MLA_RULES = {
    "q_a_proj": REPLICATED,
    "q_a_norm": REPLICATED,
    "q_b_proj": COLUMN,
    "kv_a_proj": REPLICATED,
    "kv_a_norm": REPLICATED,
    "kv_b_proj": COLUMN,
    "ds_router": REPLICATED,
    "e_score_bias": REPLICATED,
}
EXPERT_PARALLEL_RULES = {"experts_gate_up": EXPERT, "experts_up": EXPERT, "experts_down": EXPERT}
# KDA's own names (the rest are GDN's): the low-rank gate projections' first halves [hidden, K] whole,
# their second halves [K, H K] split by head (column), as f_b's decay and g_b's output gate are per head
KDA_RULES = {"f_a": REPLICATED, "f_b": COLUMN, "g_a": REPLICATED, "g_b": COLUMN}


def _spec_for(rule: str, ndim: int, axis: str) -> P:
    dims: list = [None] * ndim
    if rule in (COLUMN, VECTOR):
        dims[-1] = axis
    elif rule == ROW or rule == "conv":
        dims[-2] = axis
    elif rule == EXPERT:
        dims[-3] = axis
    return P(*dims)


def _split_dim(rule: str, shape: tuple[int, ...]) -> int | None:
    if rule in (COLUMN, VECTOR):
        return shape[-1]
    if rule in (ROW, "conv"):
        return shape[-2]
    if rule == EXPERT:
        return shape[-3]
    return None


def group_param_specs(cfg: ModelConfig, params_g: dict, position: int, plan: TensorParallel) -> dict[str, P]:
    """PartitionSpecs of one layer-group position's stacked parameters ({name: [G, ...] array})."""
    m, axis = plan.size, plan.axis
    kind_ok = {**dict.fromkeys(ATTENTION_RULES, plan.attention), **dict.fromkeys(GDN_RULES, plan.gdn)}
    kind_ok.update(dict.fromkeys(KDA_RULES, plan.gdn))
    kind_ok.update(dict.fromkeys(("q_b_proj", "kv_b_proj"), plan.attention))
    rules = {
        **ATTENTION_RULES,
        **GDN_RULES,
        **MLP_RULES,
        **MOE_RULES,
        **NORM_RULES,
        **MLA_RULES,
        **KDA_RULES,
    }
    if cfg.mamba is not None:  # Mamba-2's names, some shared with GDN's: split with `plan.mamba`
        rules.update(mamba2_tp.RULES)
        kind_ok.update(dict.fromkeys(mamba2_tp.RULES, plan.mamba))
    if plan.expert:
        rules.update(EXPERT_PARALLEL_RULES)
    specs = {}
    for name, leaf in params_g.items():
        rule = rules.get(name)
        if rule is None:
            log.warning("no sharding rule for parameter %r: replicated", name)
            rule = REPLICATED
        if not kind_ok.get(name, True):
            rule = REPLICATED
        width = _split_dim(rule, leaf.shape)
        if m > 1 and width is not None and width % m:
            log.warning(
                "%s (layer position %d, shape %s) replicated: %d does not divide by model axis %d",
                name,
                position,
                tuple(leaf.shape),
                width,
                m,
            )
            rule = REPLICATED
        specs[name] = _leaf_spec(rule, leaf, m, axis)
    return specs


def _leaf_spec(rule: str, leaf, m: int, axis: str):
    """PartitionSpec of a float leaf; for a QuantizedWeight a QuantizedWeight of specs: codes split
    like the float weight, scales / offsets follow their columns (column split) or their row
    groups (row split, when the group count divides; else replicated), act-order perm replicated."""
    if not isinstance(leaf, QuantizedWeight):
        return _spec_for(rule, leaf.ndim, axis) if m > 1 else P()

    def part(a, splittable=True):
        if a is None:
            return None
        if m == 1 or not splittable or (rule == ROW and a.shape[-2] % m):
            return P()
        if rule == COLUMN and leaf.block_n and a.shape[-1] % m:  # fewer column blocks than shards
            return P()
        return _spec_for(rule, a.ndim, axis)

    return dataclasses.replace(
        leaf, q=part(leaf.q), scale=part(leaf.scale), offset=part(leaf.offset), perm=part(leaf.perm, False)
    )


def param_specs(params: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    """A pytree of PartitionSpecs matching `params`."""
    m, axis = plan.size, plan.axis
    vocab_split = m > 1 and cfg.vocab_size % m == 0
    if m > 1 and not vocab_split:
        log.warning("embed / lm_head replicated: vocab %d does not divide by model axis %d", cfg.vocab_size, m)
    embed = params["embed"]
    specs = {
        # [V, H], or quantized [H, V] (see models.quantization.embed_lookup)
        "embed": (
            _leaf_spec(COLUMN if vocab_split else REPLICATED, embed, m, axis)
            if isinstance(embed, QuantizedWeight)
            else P(axis, None)
            if vocab_split
            else P()
        ),
        "final_norm": P(),
        "groups": tuple(group_param_specs(cfg, g, j, plan) for j, g in enumerate(params["groups"])),
    }
    if "lm_head" in params:
        specs["lm_head"] = _leaf_spec(COLUMN if vocab_split else REPLICATED, params["lm_head"], m, axis)  # [H, V]
    return specs


def _place(x, sharding: NamedSharding):
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # every process holds the whole host array; each places its own shards
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _reorder_gdn(params: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    """in_qkv columns and conv_w rows in per-shard [Q_i K_i V_i] order (see module docstring);
    Mamba-2's in_proj / conv in theirs (models/mamba2_tp.py)."""
    if plan.mamba:
        return mamba2_tp.reorder_params(params, cfg.mamba, plan.size)
    if not plan.gdn:
        return params
    perm = qkv_permutation(plan.gdn_qkv_widths, plan.size)
    groups = []
    for g in params["groups"]:
        if "in_qkv" in g:
            g = {**g, "in_qkv": take_columns(g["in_qkv"], perm), "conv_w": g["conv_w"][:, perm, :]}
        groups.append(g)
    return {**params, "groups": tuple(groups)}


KV_HEAD_PARAMS = ("k_proj", "v_proj", "k_bias", "v_bias")  # output columns = KV heads x head_dim


def repeat_kv_heads(params: dict, cfg: ModelConfig, plan: TensorParallel | None) -> dict:
    """k/v projection columns (and biases) with every KV head repeated `plan.kv_repeat` times,
    consecutively: held head i is original head i // kv_repeat (see module docstring)."""
    if plan is None or plan.kv_repeat == 1:
        return params
    D = cfg.head_dim
    heads = np.repeat(np.arange(cfg.num_kv_heads), plan.kv_repeat)
    columns = (heads[:, None] * D + np.arange(D)[None]).reshape(-1)
    groups = tuple(
        {**g, **{n: take_columns(g[n], columns) for n in KV_HEAD_PARAMS if n in g}} for g in params["groups"]
    )
    return {**params, "groups": groups}


def canonical_param_specs(params: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    """Specs for the checkpoint's own layout (KV heads not repeated yet): `param_specs` of the
    repeated tree, with the KV-head leaves replicated while they are to be repeated."""
    specs = param_specs(jax.eval_shape(lambda p: repeat_kv_heads(p, cfg, plan), params), cfg, plan)
    if plan.kv_repeat == 1:
        return specs
    groups = tuple(
        {n: _leaf_spec(REPLICATED, g[n], plan.size, plan.axis) if n in KV_HEAD_PARAMS else s[n] for n in s}
        for g, s in zip(params["groups"], specs["groups"])
    )
    return {**specs, "groups": groups}


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> dict:
    """Place every parameter on `mesh` with its Megatron split (KV heads repeated where fewer than
    the devices, GDN qkv channels reordered)."""
    plan = tensor_parallel_plan(cfg, mesh, expert_parallel)
    params = _reorder_gdn(repeat_kv_heads(params, cfg, plan), cfg, plan)  # Mamba-2: may repeat B/C groups
    specs = param_specs(params, cfg, plan)
    return jax.tree.map(lambda x, s: _place(x, NamedSharding(mesh, s)), params, specs)


def shard_model(model, mesh: Mesh, expert_parallel: bool = False):
    """Split a loaded `Model` over `mesh` in place: its params, and from now on its caches and the
    `KernelOptions.tp` of its `logits` / `greedy`. `expert_parallel`: MoE experts split by expert
    index (else on their intermediate dimension). Returns the model."""
    if model.tp is not None:
        raise ValueError("model is already sharded")
    model.params = shard_params(model.params, model.cfg, mesh, expert_parallel)
    model.tp = tensor_parallel_plan(model.cfg, mesh, expert_parallel)
    return model


# ---- caches ----------------------------------------------------------------------------------------
def cache_specs(caches: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    """PartitionSpecs matching `caches` (arrays or ShapeDtypeStructs): KV pages [P, Hkv, ps, D] and
    scales [P, Hkv] on the (held: `kv_heads_held`) KV heads, conv state [N, W-1, C] on channels, rec [N, H, K, V] on value heads."""
    axis = plan.axis
    head = P(None, axis) if plan.attention and cfg.mla is None else P()  # MLA's latent rows: replicated
    head = P(None, axis) if cfg.mla is not None and plan.latent_split else head  # or split by token (mla_split.py)
    kv = tuple(None if pages is None else jax.tree.map(lambda _: head, pages) for pages in caches["kv"])
    split = plan.gdn or plan.mamba  # Mamba-2: conv channels in the per-shard order, SSM state on heads
    conv = tuple(None if c is None else (P(None, None, axis) if split else P()) for c in caches["conv"])
    rec = tuple(None if r is None else (P(None, axis) if split else P()) for r in caches["rec"])
    return {"kv": kv, "conv": conv, "rec": rec}


def cache_shardings(caches: dict, cfg: ModelConfig, plan: TensorParallel) -> dict:
    return jax.tree.map(
        lambda s: NamedSharding(plan.mesh, s), cache_specs(caches, cfg, plan), is_leaf=lambda x: isinstance(x, P)
    )


def shard_caches(caches: dict, cfg: ModelConfig, mesh: Mesh, plan: TensorParallel | None = None) -> dict:
    """Place caches on `mesh` as `plan` says (default: `tensor_parallel_plan`; MLA pools pinned:
    cache_formats.py); conv channels in per-shard [Q_i K_i V_i] order."""
    plan = plan or tensor_parallel_plan(cfg, mesh)
    if plan.gdn:
        perm = qkv_permutation(plan.gdn_qkv_widths, plan.size)
        caches = {**caches, "conv": tuple(None if c is None else c[..., perm] for c in caches["conv"])}
    if plan.mamba:
        perm = mamba2_tp.conv_permutation(mamba2_tp.held(cfg.mamba, plan), plan.size)
        caches = {**caches, "conv": tuple(None if c is None else c[..., perm] for c in caches["conv"])}
    return jax.tree.map(_place, caches, pin_formats(caches, cache_shardings(caches, cfg, plan)))
