"""EngineConfig: everything one engine instance needs, frozen and validated once.

One path builds it: `build_engine_config(launch, model_path, **engine_only)` maps a validated
launch config (configs/schema.py: the YAML, `--set` and the CLI flags, or the offline
`LLM(...)` arguments, which runtime/engine/llm.py turns into launch keys) onto an `EngineConfig`.
`ENGINE_FIELD_KEYS` is the one table of which engine field comes from which launch key.
The defaults are the launch schema's (`configs.schema.DEFAULTS`): an `EngineConfig(...)` built
directly (tests, benchmarks) and a launch config with the knob left out mean the same thing.
Fields without a launch key (`interpret`, `seed`, `num_state_slots`, ...) are engine-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from configs.schema import DEFAULT_MEMORY_FRACTION, DEFAULTS, LaunchConfig

_M, _C, _S, _K = DEFAULTS.model, DEFAULTS.cache, DEFAULTS.scheduler, DEFAULTS.kernels


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = _M.dtype
    max_model_len: int | None = _M.max_model_len  # None: the checkpoint's max_position_embeddings
    page_size: int = _C.page_size
    num_pages: int | None = _C.num_pages  # per layer, incl. the null page; None: from the memory budget
    kv_cache_memory_bytes: int | None = None  # KV budget; None: memory_fraction of the device
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    kv_cache_dtype: str = _C.kv_cache_dtype  # auto | bfloat16 | float32 | fp8_e4m3 | fp8_e5m2
    num_state_slots: int | None = None  # GDN slots incl. null slot; None: from max_num_seqs
    enable_prefix_caching: bool = _C.enable_prefix_caching
    hybrid_checkpoint_policy: str = _C.hybrid_checkpoint_policy  # GDN hybrids: paged_kv.CheckpointPolicy spec
    # max fraction of cache memory for checkpoints; None: 2 x max_num_seqs shared
    hybrid_checkpoint_budget: float | None = _C.hybrid_checkpoint_budget
    max_num_seqs: int = _S.max_num_seqs
    max_num_batched_tokens: int = _S.max_num_batched_tokens
    long_prefill_token_threshold: int = 0
    policy: str = _S.policy
    async_scheduling: bool = (
        _S.async_scheduling
    )  # plan step n+1 while step n runs (runtime/engine/llm_engine.py); False: wait for each step
    token_buckets: tuple[int, ...] | None = _S.token_buckets
    attention_backend: str = _K.attention_backend
    gdn_backend: str = _K.gdn_backend
    layer_loop: str = _K.layer_loop  # scan | unroll | auto (runtime/steps/execution_plan.py decides)
    fuse_greedy: bool | None = (
        _K.fuse_greedy
    )  # greedy backbone per bucket (StepExecutables); None: the execution plan decides
    interpret: Any = False
    aot_compile: bool = DEFAULTS.compile.aot
    aot_grammar_samplers: bool = True  # with aot_compile: also the grammar-masked samplers (structured output)
    # with aot_compile: every executable a step can ask for (full samplers, scoring backbone, state
    # copy), then nothing compiles in the serving loop (StepExecutables.compile_all); `serve` sets it
    # with compile.aot (runtime/engine/loading.py); engines built in code compile the extras lazily
    aot_compile_all: bool = False
    compile_cache_dir: str | None = DEFAULTS.compile.cache_dir
    max_top_k: int = 256
    seed: int | None = None
    load_tokenizer: bool = True
    mesh_shape: tuple[int, int] | None = None  # (data, model) devices; None: one device, no mesh
    expert_parallel: bool = False  # MoE experts split by expert index over `model` (else intermediate dim)
    quantization: str | None = _M.quantization  # online weight quantization (models/quantization.py SCHEMES)
    quantization_group_size: int = _M.quantization_group_size  # int4 schemes
    quantization_keep_float: tuple[str, ...] | None = None  # module-path globs kept in float; None: the defaults
    keep_gguf_quantized: bool = _M.keep_gguf_quantized  # GGUF blocks stay quantized (False: dequantize at load)
    kv_transfer: Any = None  # runtime.kv_transfer.KVTransferConfig (P/D role); None: role both

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
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


# EngineConfig field -> the launch key it comes from (dotted, as in `--set`). The one mapping.
ENGINE_FIELD_KEYS: dict[str, str] = {
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "quantization": "model.quantization",
    "quantization_group_size": "model.quantization_group_size",
    "quantization_keep_float": "model.quantization_keep_float",
    "keep_gguf_quantized": "model.keep_gguf_quantized",
    "page_size": "cache.page_size",
    "num_pages": "cache.num_pages",
    "memory_fraction": "cache.memory_fraction",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "hybrid_checkpoint_policy": "cache.hybrid_checkpoint_policy",
    "hybrid_checkpoint_budget": "cache.hybrid_checkpoint_budget",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "policy": "scheduler.policy",
    "async_scheduling": "scheduler.async_scheduling",
    "token_buckets": "scheduler.token_buckets",
    "attention_backend": "kernels.attention_backend",
    "gdn_backend": "kernels.gdn_backend",
    "layer_loop": "kernels.layer_loop",
    "fuse_greedy": "kernels.fuse_greedy",
    "expert_parallel": "parallel.expert",
    "aot_compile": "compile.aot",
    "compile_cache_dir": "compile.cache_dir",
}


def launch_value(launch: LaunchConfig, key: str) -> Any:
    """The value at a dotted launch key, e.g. `launch_value(cfg, "cache.page_size")`."""
    node: Any = launch
    for part in key.split("."):
        node = getattr(node, part)
    return node


def build_engine_config(launch: LaunchConfig, model_path: str, **engine_only: Any) -> EngineConfig:
    """The one way from a validated launch config to an engine config. `engine_only`: fields with
    no launch key (`interpret`, `seed`, `mesh_shape`, ...); a field that has one is a TypeError
    (set it on the launch config, so that it is validated there)."""
    routed = sorted(set(engine_only) & set(ENGINE_FIELD_KEYS))
    if routed:
        raise TypeError(
            f"{routed} come from the launch config ({[ENGINE_FIELD_KEYS[f] for f in routed]}), "
            "not engine-only arguments"
        )
    values = {field: launch_value(launch, key) for field, key in ENGINE_FIELD_KEYS.items()}
    if values["memory_fraction"] is None:
        values["memory_fraction"] = DEFAULT_MEMORY_FRACTION
    for field in ("token_buckets", "quantization_keep_float"):
        if values[field] is not None:
            values[field] = tuple(values[field])
    if values["compile_cache_dir"]:
        values["compile_cache_dir"] = str(Path(values["compile_cache_dir"]).expanduser())
    mesh = launch.parallel.mesh
    if mesh.num_devices > 1:
        values["mesh_shape"] = (mesh.data, mesh.model)
    if launch.parallel.role != "both":
        from runtime.kv_transfer import KVTransferConfig

        section = launch.kv_transfer.model_dump()
        section["token"] = launch.kv_transfer.token.get_secret_value() if launch.kv_transfer.token else None
        values["kv_transfer"] = KVTransferConfig(role=launch.parallel.role, **section)
    return EngineConfig(model=model_path, **{**values, **engine_only})
