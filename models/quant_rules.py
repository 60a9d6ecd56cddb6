"""Online quantization of a loaded float model: which module gets which scheme.

    qcfg = QuantizationConfig("int4", group_size=32, keep_float=("lm_head",))
    params, report = quantize_params(params, qcfg)
    log_report(report)   # one start-up line per module group: scheme, or float and why

Rules are glob patterns over HF-style module paths without the layer index (`embed_tokens`,
`lm_head`, `self_attn.q_proj`, `linear_attn.in_proj_a`, `mlp.experts.gate_up_proj`, ...); a
pattern matches the whole path or its trailing components (`in_proj_a` matches
`linear_attn.in_proj_a`). Matching modules stay in float; a tied embedding is also the lm_head, so
a rule keeping either keeps it. Norms, biases, the GDN conv and decay
parameters are never quantized. int4 groups run along the input dim; a module whose input
dim is not a multiple of the group size takes the largest smaller group size that divides it
(32 at least), as the start-up log says.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging

import numpy as np

from models.quantization import GROUP_SIZES, get_scheme, quantize_weight, to_device

log = logging.getLogger("jaxserve.quantization")

# our parameter name -> HF module path (the rules' vocabulary)
MODULE_PATHS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "q_a_proj": "self_attn.q_a_proj",  # MLA (models/mla_attention.py)
    "q_b_proj": "self_attn.q_b_proj",
    "kv_a_proj": "self_attn.kv_a_proj_with_mqa",
    "kv_b_proj": "self_attn.kv_b_proj",  # absorbed: dequantized in the step (mla_attention.absorbed_weight)
    "f_a": "self_attn.f_a_proj",  # KDA's low-rank decay gate and output gate (models/kda_layer.py)
    "f_b": "self_attn.f_b_proj",
    "g_a": "self_attn.g_a_proj",
    "g_b": "self_attn.g_b_proj",
    "in_qkv": "linear_attn.in_proj_qkv",
    "in_z": "linear_attn.in_proj_z",
    "in_b": "linear_attn.in_proj_b",
    "in_a": "linear_attn.in_proj_a",
    "out_proj": "linear_attn.out_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "router": "mlp.gate",
    "experts_gate_up": "mlp.experts.gate_up_proj",
    "experts_down": "mlp.experts.down_proj",
    "shared_gate_proj": "mlp.shared_expert.gate_proj",
    "shared_up_proj": "mlp.shared_expert.up_proj",
    "shared_down_proj": "mlp.shared_expert.down_proj",
    "shared_expert_gate": "mlp.shared_expert_gate",
    "embed": "embed_tokens",
    "lm_head": "lm_head",
}
# Kept in float unless the user's rules say otherwise: the embedding and lm_head (as vLLM's AWQ /
# GPTQ / FP8 checkpoints do; quantizing SmolLM2's tied one to int4 drops greedy agreement with fp32
# from 0.69 to 0.03, docs/quantization.md), and tiny, precision-sensitive matmuls: the MoE router
# and shared-expert gate (routing flips), GDN's decay / beta inputs (a, b: a few columns), and
# KDA's decay gate (f_a, f_b: the per-channel decay, GDN's `a` per channel; its beta is in_proj_b).
DEFAULT_KEEP_FLOAT = (
    "embed_tokens",
    "lm_head",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "self_attn.f_a_proj",
    "self_attn.f_b_proj",
)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    scheme: str
    group_size: int = 32  # int4 only (configs/schema.py's default)
    keep_float: tuple[str, ...] = DEFAULT_KEEP_FLOAT

    def __post_init__(self):
        get_scheme(self.scheme)
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if isinstance(self.keep_float, str) or not all(isinstance(p, str) and p for p in self.keep_float):
            raise ValueError(f"quantization_keep_float must be a list of module-path patterns, got {self.keep_float!r}")


def rule_match(path: str, patterns) -> str | None:
    """The first pattern that keeps `path` in float (whole path or trailing components), else None."""
    parts = path.split(".")
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts))):
            return pattern
    return None


def _quantize_leaf(name: str, arr, qcfg: QuantizationConfig, report: dict, tied: bool = False) -> object:
    path = MODULE_PATHS[name]
    kept = rule_match(path, qcfg.keep_float)
    if kept is None and tied:  # the tied lm_head is the embedding: a rule keeping either keeps both
        kept = rule_match("lm_head", qcfg.keep_float)
    if kept is not None:
        report[path] = f"float (rule {kept!r})"
        return arr
    scheme = get_scheme(qcfg.scheme)
    host = np.asarray(arr, np.float32)
    if name == "embed":
        host = np.swapaxes(host, -1, -2)  # [V, H] -> [H, V]: one scale per vocab row
    k = host.shape[-2]
    group = qcfg.group_size
    if scheme.code == "int4":
        group = fitting_group_size(k, qcfg.group_size)
        if group is None:
            report[path] = f"float (input dim {k} not a multiple of 32)"
            return arr
    w = quantize_weight(host, scheme, group)
    report[path] = qcfg.scheme + (f"-g{group}" if scheme.grouped else "")
    return to_device(w)


def fitting_group_size(k: int, requested: int) -> int | None:
    """The requested int4 group size, else the largest smaller one of GROUP_SIZES dividing K
    (SmolLM2's hidden 576 takes groups of 64 under int4-g128), else None."""
    for g in sorted((g for g in GROUP_SIZES if g <= requested), reverse=True):
        if k % g == 0:
            return g
    return None


def quantize_params(params: dict, qcfg: QuantizationConfig) -> tuple[dict, dict[str, str]]:
    """Quantize every matmul weight of a stacked (`groups`) parameter tree by `qcfg`'s rules.
    -> (new params, {module path: what it got})."""
    report: dict[str, str] = {}
    out = dict(params)
    tied = "lm_head" not in params
    out["embed"] = _quantize_leaf("embed", params["embed"], qcfg, report, tied)
    if tied:
        report["lm_head"] = f"{report['embed_tokens']} (tied to embed_tokens)"
    if "lm_head" in params:
        out["lm_head"] = _quantize_leaf("lm_head", params["lm_head"], qcfg, report)
    out["groups"] = tuple(
        {name: _quantize_leaf(name, leaf, qcfg, report) if name in MODULE_PATHS else leaf for name, leaf in g.items()}
        for g in params["groups"]
    )
    return out, report


def log_report(report: dict[str, str]) -> None:
    """One log line per distinct outcome, listing its module paths."""
    by_outcome: dict[str, list[str]] = {}
    for path, outcome in report.items():
        by_outcome.setdefault(outcome, []).append(path)
    for outcome, paths in by_outcome.items():
        log.info("weights %s: %s", outcome, ", ".join(sorted(paths)))
