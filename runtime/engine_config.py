"""EngineConfig: everything one engine instance needs, frozen and validated once.

The YAML launch config (configs/schema.py) and the offline `LLM(...)` arguments both fill it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    page_size: int = 16
    num_pages: int | None = None  # per layer, incl. the null page; None: from the memory budget
    kv_cache_memory_bytes: int | None = None  # KV budget; None: memory_fraction of the device
    memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # auto | bfloat16 | float32 | fp8_e4m3 | fp8_e5m2
    num_state_slots: int | None = None  # GDN slots incl. null slot; None: from max_num_seqs
    enable_prefix_caching: bool = True
    hybrid_checkpoint_policy: str = "auto"  # GDN hybrids: paged_kv.CheckpointPolicy spec
    hybrid_checkpoint_budget: float | None = 0.25  # max fraction of cache memory for checkpoints; None: 2 x max_num_seqs shared
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    async_scheduling: bool = True  # plan step n+1 while step n runs (runtime/engine.py); False: wait for each step
    token_buckets: tuple[int, ...] | None = None
    attention_backend: str = "auto"
    gdn_backend: str = "auto"
    layer_loop: str = "auto"  # scan | unroll | auto (unroll on CPU up to UNROLL_MAX_LAYERS_CPU layers)
    fuse_greedy: bool | None = None  # greedy backbone per bucket (StepExecutables); None: on the CPU backend
    interpret: Any = False
    aot_compile: bool = True
    aot_grammar_samplers: bool = True  # with aot_compile: also the grammar-masked samplers (structured output)
    compile_cache_dir: str | None = None
    max_top_k: int = 256
    seed: int | None = None
    load_tokenizer: bool = True
    mesh_shape: tuple[int, int] | None = None  # (data, model) devices; None: one device, no mesh
    quantization: str | None = None  # online weight quantization (models/quantization.py SCHEMES); None: as stored
    quantization_group_size: int = 128  # int4 schemes
    quantization_keep_float: tuple[str, ...] | None = None  # module-path globs kept in float; None: the defaults
    keep_gguf_quantized: bool = True  # GGUF Q4_0 / Q4_1 / Q8_0 blocks stay quantized (False: dequantize at load)
    kv_transfer: Any = None  # runtime.kv_transfer.KVTransferConfig (P/D role); None: role both

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.mesh_shape is not None and (len(self.mesh_shape) != 2 or min(self.mesh_shape) < 1):
            raise ValueError(f"mesh_shape must be (data, model) with both >= 1, got {self.mesh_shape}")
        if self.layer_loop not in ("auto", "scan", "unroll"):
            raise ValueError(f"layer_loop must be auto, scan or unroll, got {self.layer_loop!r}")
        if self.quantization is not None:
            self.quantization_config()  # raises ValueError naming the field
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")

    def quantization_config(self):
        """The models.quant_rules.QuantizationConfig asked for, or None."""
        if self.quantization is None:
            return None
        from models.quant_rules import DEFAULT_KEEP_FLOAT, QuantizationConfig

        keep = DEFAULT_KEEP_FLOAT if self.quantization_keep_float is None else tuple(self.quantization_keep_float)
        return QuantizationConfig(self.quantization, self.quantization_group_size, keep)
