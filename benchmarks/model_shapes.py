"""Cache-relevant shapes of a real model, read from its HF `config.json` without JAX or weights.

    shape = load_shape("configs/models/qwen3_5-9b.json")
    shape.kv_bytes_per_token("bfloat16"), shape.state_bytes_per_slot, shape.num_params
    plan = plan_memory(shape, device_gib=139, memory_fraction=0.9, max_num_seqs=256, budget_fraction=0.1)

`models/config.py` parses the same files but importing `models` pulls in JAX, so this reader
covers only what the cache needs: the attention layers' KV bytes per token (K and V, all KV
heads), the GDN layers' state bytes per slot (fp32 conv state `[K-1, conv_dim]` + recurrent
state `[Hv, dk, dv]`, as `Model.state_bytes_per_slot`), and the text-model parameter count
for the bf16 weights (embeddings, attention, GDN, dense or MoE MLPs; no vision tower, no MTP
head: they are not served).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paged_kv.checkpoint_policy import plan_state_slots

KV_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    num_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * KV_ITEMSIZE[kv_dtype]

    @property
    def state_bytes_per_slot(self) -> int:
        per_layer = (self.linear_conv_kernel_dim - 1) * self.conv_dim + (
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        )
        return 4 * per_layer * self.num_linear_layers

    @property
    def num_params(self) -> int:
        H = self.hidden_size
        q_width = self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        attention = H * q_width + 2 * H * self.num_kv_heads * self.head_dim + self.num_heads * self.head_dim * H
        value_width = self.linear_num_value_heads * self.linear_value_head_dim
        gdn = (
            H * (self.conv_dim + value_width + 2 * self.linear_num_value_heads)  # qkv, z, b, a
            + self.conv_dim * self.linear_conv_kernel_dim
            + value_width * H
        )  # conv1d, out_proj
        if self.num_experts:
            mlp = (
                self.num_experts * 3 * H * self.moe_intermediate_size
                + H * self.num_experts
                + 3 * H * self.shared_expert_intermediate_size
                + H
            )
        else:
            mlp = 3 * H * self.intermediate_size
        embeddings = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return (
            embeddings
            + self.num_attention_layers * attention
            + self.num_linear_layers * gdn
            + len(self.layer_types) * mlp
        )


def load_shape(path: str | Path) -> ModelShape:
    """The shape of the HF `config.json` at `path` (a nested `text_config` is unwrapped)."""
    path = Path(path)
    top = json.loads(path.read_text())
    hf = {**top, **top.get("text_config", {})}
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    return ModelShape(
        name=path.stem,
        hidden_size=hf["hidden_size"],
        vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(top.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
        layer_types=tuple(layer_types),
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        attn_output_gate=hf.get("attn_output_gate", hf.get("model_type") == "qwen3_next"),
        linear_num_key_heads=hf.get("linear_num_key_heads", 0),
        linear_num_value_heads=hf.get("linear_num_value_heads", 0),
        linear_key_head_dim=hf.get("linear_key_head_dim", 0),
        linear_value_head_dim=hf.get("linear_value_head_dim", 0),
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=hf.get("num_experts", 0),
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
    )


@dataclass(frozen=True)
class MemoryPlan:
    """How a device's cache memory splits into KV pages, running state slots and checkpoints."""

    cache_bytes: int  # device * memory_fraction - bf16 weights
    page_bytes: int
    state_bytes: int
    num_pages: int  # incl. the null page
    num_state_slots: int  # incl. the null slot
    num_checkpoint_slots: int | None  # None: shared with running slots, no budget

    @property
    def checkpoint_bytes(self) -> int:
        slots = self.num_checkpoint_slots
        return (self.num_state_slots - 1 if slots is None else slots) * self.state_bytes


def plan_memory(
    shape: ModelShape,
    *,
    device_gib: float = 139.0,
    memory_fraction: float = 0.9,
    page_size: int = 16,
    kv_dtype: str = "bfloat16",
    max_num_seqs: int = 256,
    budget_fraction: float | None = 0.25,
    prefix_caching: bool = True,
) -> MemoryPlan:
    """The engine's sizing rule (runtime/engine/llm_engine.py) on a device of `device_gib` usable GiB."""
    cache_bytes = int(device_gib * GIB * memory_fraction) - 2 * shape.num_params
    if cache_bytes <= 0:
        raise ValueError(
            f"{shape.name}: {shape.num_params / 1e9:.1f}B bf16 weights leave no cache memory on "
            f"{device_gib} GiB x {memory_fraction}"
        )
    num_slots, checkpoints = plan_state_slots(
        max_num_seqs=max_num_seqs,
        prefix_caching=prefix_caching,
        budget_fraction=budget_fraction,
        cache_bytes=cache_bytes,
        state_bytes_per_slot=shape.state_bytes_per_slot,
        page_bytes=shape.kv_bytes_per_token(kv_dtype) * page_size,
    )
    page_bytes = shape.kv_bytes_per_token(kv_dtype) * page_size
    num_pages = (cache_bytes - num_slots * shape.state_bytes_per_slot) // page_bytes
    return MemoryPlan(cache_bytes, page_bytes, shape.state_bytes_per_slot, int(num_pages), num_slots, checkpoints)
