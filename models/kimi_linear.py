"""Kimi Linear's tensors: HF names to our parameter tree (one dict per layer) and their shapes.

Published checkpoints (and transformers 5.x's `save_pretrained`, whose conversion mapping writes
them back) keep Moonshot's names: the MLP of every layer under `block_sparse_moe.` (a dense one as
`gate_proj` / `up_proj` / `down_proj`, routed experts as `experts.{e}.w1` (gate), `w3` (up), `w2`
(down)), the KDA layer's gate projections directly under `self_attn.`, and its q / k / v convs
apart. HF's in-memory names (`mlp.`, `experts.{e}.gate_proj`, `forget_gate.`, one `conv1d`) are
read too. A KDA layer is models/kda_layer.py's, an MLA layer models/mla_attention.py's (NoPE), a
MoE layer models/deepseek_moe.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from models.config import ATTENTION, ModelConfig
from models.deepseek_moe import deepseek_moe_params, deepseek_moe_shapes
from models.kda_layer import kda_params, kda_shapes
from models.mla_attention import mla_params, mla_shapes

EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # ours (DeepSeek's) -> Moonshot's


def _moonshot_expert(name: str) -> str:
    """`...experts.{e}.gate_proj` -> `...experts.{e}.w1` (and up -> w3, down -> w2)."""
    head, _, leaf = name.rpartition(".")
    if ".experts." in name and leaf in EXPERT_NAMES:
        return f"{head}.{EXPERT_NAMES[leaf]}"
    return name


def layer_params(cfg: ModelConfig, get: Callable, has: Callable, lin: Callable, i: int) -> dict:
    """Layer i's parameters from `get(name, shape)`, `has(name)` and `lin(module, out, in)`
    (Linear weights as [in, out]); names are relative to the decoder prefix."""
    H, b = cfg.hidden_size, f"layers.{i}."
    p = {
        "input_norm": get(b + "input_layernorm.weight", (H,)),
        "post_norm": get(b + "post_attention_layernorm.weight", (H,)),
    }
    a = b + "self_attn."
    p.update(mla_params(cfg, get, lin, a) if cfg.layer_types[i] == ATTENTION else kda_params(cfg, get, has, lin, a))
    m = b + "block_sparse_moe."
    if not (has(m + "gate.weight") or has(m + "gate_proj.weight")):
        m = b + "mlp."
    if cfg.mlp_types[i] == "dense":
        I = cfg.intermediate_size
        p.update(
            gate_proj=lin(m + "gate_proj", I, H), up_proj=lin(m + "up_proj", I, H), down_proj=lin(m + "down_proj", H, I)
        )
        return p
    if has(m + "experts.0.w1.weight"):
        expert_lin = lambda module, out, inp: lin(_moonshot_expert(module), out, inp)
    else:
        expert_lin = lin
    p.update(deepseek_moe_params(cfg, get, has, expert_lin, m))
    return p


def layer_shapes(cfg: ModelConfig, j: int) -> dict[str, tuple[int, ...]]:
    """The shapes `layer_params` returns for a layer at position j of the pattern."""
    H = cfg.hidden_size
    shapes = {"input_norm": (H,), "post_norm": (H,)}
    shapes.update(mla_shapes(cfg) if cfg.layer_types[j] == ATTENTION else kda_shapes(cfg))
    if cfg.mlp_types[j] == "dense":
        I = cfg.intermediate_size
        shapes.update(gate_proj=(H, I), up_proj=(H, I), down_proj=(I, H))
    else:
        shapes.update(deepseek_moe_shapes(cfg))
    return shapes
