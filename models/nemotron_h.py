"""Nemotron-H's tensors: HF names to our parameter tree (one dict per layer) and their shapes.

A block is one layer (models/mamba2_config.py): its norm is `input_norm` before a mixer (Mamba-2
or attention) and `post_norm` before an MLP, so models/transformer.py's layer step needs no
Nemotron-H case beyond the mixer. Published checkpoints keep the decoder under `backbone.`;
transformers 5.x saves it under `model.` (its conversion mapping renames one to the other).
"""

from __future__ import annotations

from collections.abc import Callable

from models.config import ATTENTION, ModelConfig
from models.mamba2_config import MAMBA, NO_MIXER
from models.nemotron_moe import nemotron_moe_params, nemotron_moe_shapes

EMBEDDING, FINAL_NORM = "embeddings.weight", "norm_f.weight"
PREFIXES = ("backbone.", "model.")


def layer_params(cfg: ModelConfig, get: Callable, has: Callable, lin: Callable, i: int) -> dict:
    """Layer i's parameters from `get(name, shape)` (norms, vectors) and `lin(module, out, in)`
    (Linear weights as [in, out]); names are relative to the decoder prefix."""
    H, kind, b = cfg.hidden_size, cfg.layer_types[i], f"layers.{i}."
    shapes = layer_shapes(cfg, i)
    p = {"post_norm" if kind == NO_MIXER else "input_norm": get(b + "norm.weight", (H,))}
    mixer = b + "mixer."
    if kind == MAMBA:
        m = cfg.mamba
        p["in_proj"] = lin(mixer + "in_proj", m.in_proj_size, H)
        p["conv_w"] = get(mixer + "conv1d.weight", (m.conv_dim, 1, m.conv_kernel))[:, 0, :]
        for name in ("A_log", "dt_bias", "D"):
            p[name] = get(mixer + name, (m.num_heads,))
        p["gated_norm"] = get(mixer + "norm.weight", (m.intermediate_size,))
        p["out_proj"] = lin(mixer + "out_proj", H, m.intermediate_size)
        biases = {"in_bias": "in_proj.bias", "conv_bias": "conv1d.bias", "out_bias": "out_proj.bias"}
    elif kind == ATTENTION:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            inp, out = shapes[name]
            p[name] = lin(mixer + name, out, inp)
        biases = {}
    elif cfg.mlp_types[i] == "moe":
        return {**p, **nemotron_moe_params(cfg, get, has, lin, mixer)}
    else:
        I = cfg.intermediate_size
        p["up_proj"] = lin(mixer + "up_proj", I, H)
        p["down_proj"] = lin(mixer + "down_proj", H, I)
        biases = {"up_bias": "up_proj.bias", "down_bias": "down_proj.bias"}
    for name, hf_name in biases.items():
        if name in shapes:
            p[name] = get(mixer + hf_name, shapes[name])
    return p


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer i's parameters, as `layer_params` returns them."""
    H, kind = cfg.hidden_size, cfg.layer_types[i]
    if kind == MAMBA:
        m = cfg.mamba
        shapes = {
            "input_norm": (H,),
            "in_proj": (H, m.in_proj_size),
            "conv_w": (m.conv_dim, m.conv_kernel),
            "A_log": (m.num_heads,),
            "dt_bias": (m.num_heads,),
            "D": (m.num_heads,),
            "gated_norm": (m.intermediate_size,),
            "out_proj": (m.intermediate_size, H),
        }
        if m.proj_bias:
            shapes.update(in_bias=(m.in_proj_size,), out_bias=(H,))
        if m.conv_bias:
            shapes["conv_bias"] = (m.conv_dim,)
        return shapes
    if kind == ATTENTION:
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {
            "input_norm": (H,),
            "q_proj": (H, q_out),
            "k_proj": (H, kv_out),
            "v_proj": (H, kv_out),
            "o_proj": (q_out, H),
        }
    if cfg.mlp_types[i] == "moe":
        return nemotron_moe_shapes(cfg)
    I = cfg.intermediate_size
    shapes = {"post_norm": (H,), "up_proj": (H, I), "down_proj": (I, H)}
    if cfg.mlp_bias:
        shapes.update(up_bias=(I,), down_bias=(H,))
    return shapes
