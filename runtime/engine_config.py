"""The engine's one config object, `EngineConfig`, and the typed parts it hands its subsystems.

`EngineConfig` holds every knob of one engine, flat and frozen (`EngineConfig(model=path,
page_size=16)`), its fields grouped by the launch section they come from. It is built from a
validated launch config by `build_engine_config(launch, model_path, **engine_only)` (configs/schema.py:
the YAML, `--set` and the CLI flags, or `LLM(...)`'s arguments, which runtime/engine/llm.py turns
into launch keys), or directly (tests, benchmarks). `ENGINE_FIELD_KEYS` is the one table of which
field comes from which launch key; the defaults are the schema's (`configs.schema.DEFAULTS`), so a
knob left out means the same either way. Fields without a launch key (`interpret`, `seed`,
`num_state_slots`, ...) are engine-only.

Its parts are frozen, typed, and what a subsystem takes: `cache_config(...)` -> `CacheConfig` (the
page pool and state slots), `scheduler_config(...)` -> `SchedulerConfig`, `kernel_config()` ->
`KernelConfig` (what the execution plan resolves), `parallel_config()` -> `ParallelConfig` (the
mesh), `compile_config()` -> `CompileConfig`, `quantization_config()` (model loading) and
`kv_transfer`, a P/D role's `KVTransferConfig`. The first two need sizes the
engine resolves from the checkpoint and the device (pages, slots, the model length), so they are
built by those calls, which check what only resolved sizes can tell (the pool holds one sequence).

Each rule is checked by the one function in configs/rules.py that the launch schema calls too; a
name that plugins may add (back-ends, policies) by `configs.schema.check_name`, the one check against
the registries. Plain Python: importing it starts no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from configs import rules
from configs.schema import DEFAULT_MEMORY_FRACTION, DEFAULTS, LaunchConfig, check_name
from configs.speculative import SpeculativeConfig, parse_speculative_config
from paged_kv.cache_manager import CacheManager
from runtime.buckets import pages_for

_M, _C, _S, _K, _T = DEFAULTS.model, DEFAULTS.cache, DEFAULTS.scheduler, DEFAULTS.kernels, DEFAULTS.kv_transfer
_COUNT, _NON_NEGATIVE = rules.at_least(1), rules.at_least(0)


@dataclass(frozen=True)
class CacheConfig:
    """KV pages and GDN state slots, sized. Counts include the null page / null slot, matching the
    device arrays; num_state_slots == 0: a pure-attention model."""

    page_size: int = _C.page_size
    num_pages: int = 512
    num_state_slots: int = 0
    enable_prefix_caching: bool = _C.enable_prefix_caching
    # hybrids: paged_kv.CheckpointPolicy spec. The engine passes the launch config's (default
    # "auto"); "page" here keeps unit tests' checkpoints on every page boundary.
    checkpoint_policy: str = "page"
    num_checkpoint_slots: int | None = None  # hybrids: checkpoint budget in slots; None: shared pool
    window: int | None = None  # window-aware paging: the sliding window whose layers page apart
    num_window_pages: int = 0  # their pool, with the null page
    host_tier_bytes: int = 0  # host-memory tier for evicted pages / checkpoints (paged_kv/tiered_cache.py); 0: off

    def __post_init__(self) -> None:
        rules.check_fields(
            self,
            {"page_size": rules.page_size, "num_pages": rules.num_pages, "num_state_slots": rules.num_state_slots},
        )

    def build_manager(self) -> CacheManager:
        if self.host_tier_bytes:
            from paged_kv.tiered_cache import TieredCacheManager

            return TieredCacheManager(host_bytes=self.host_tier_bytes, **self._manager_args())
        return CacheManager(**self._manager_args())

    def _manager_args(self) -> dict:
        return dict(
            page_size=self.page_size,
            num_pages=self.num_pages,
            num_state_slots=self.num_state_slots,
            enable_prefix_caching=self.enable_prefix_caching,
            checkpoint_policy=self.checkpoint_policy,
            num_checkpoint_slots=self.num_checkpoint_slots,
            window=self.window,
            num_window_pages=self.num_window_pages,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget and policy, with the model length resolved.

    long_prefill_token_threshold: if > 0, one prefill chunk takes at most this many tokens, so
    a long prompt cannot monopolise a step's budget.
    """

    max_num_batched_tokens: int = _S.max_num_batched_tokens
    max_num_seqs: int = _S.max_num_seqs
    max_model_len: int = 2048
    policy: str = _S.policy
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        rules.check_fields(self, _SCHEDULER_RULES)
        rules.batch_budget(self.max_num_batched_tokens, self.max_num_seqs)


_SCHEDULER_RULES = {
    "max_num_seqs": _COUNT,
    "max_num_batched_tokens": _COUNT,
    "max_model_len": rules.max_model_len,
    "long_prefill_token_threshold": _NON_NEGATIVE,
    "policy": lambda name: check_name("scheduling_policy", name),
}


@dataclass(frozen=True)
class KernelConfig:
    """What the execution plan (runtime/steps/execution_plan.py) resolves kernels from: back-end
    names (checked against the kernel tables and plugins), the layer loop and greedy fusion
    ("auto" / None: the plan decides), Pallas interpret mode (CPU tests)."""

    attention_backend: str = _K.attention_backend
    gdn_backend: str = _K.gdn_backend
    layer_loop: str = _K.layer_loop
    fuse_greedy: bool | None = _K.fuse_greedy
    interpret: Any = False


@dataclass(frozen=True)
class ParallelConfig:
    """The device mesh of one engine: (data, model) devices, None for one device without a mesh;
    MoE experts split by expert index over `model` (else by the intermediate dimension)."""

    mesh_shape: tuple[int, int] | None = None
    expert_parallel: bool = False
    mla_latent: str = "replicated"  # MLA latent pools under TP: replicated | split | auto (models/mla_split.py)

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.mesh_shape is None else int(self.mesh_shape[0])


@dataclass(frozen=True)
class CompileConfig:
    """Ahead-of-time compilation at start-up: the step buckets (`aot`), the grammar-masked
    samplers with them, or every executable a step can ask for (`every_variant`); the persistent
    XLA compilation cache (None: off)."""

    aot: bool = DEFAULTS.compile.aot
    grammar_samplers: bool = True
    every_variant: bool = False
    cache_dir: str | None = None


@dataclass(frozen=True)
class KVTransferConfig:
    """`parallel.role` plus the `kv_transfer` section of the launch config (P/D disaggregation)."""

    role: str = "both"  # prefill | decode | both
    connector: str = _T.connector  # a name in runtime.kv_transfer.KV_CONNECTORS
    lease_s: float = _T.lease_s  # the prefill side frees offered state this long after offering it
    pull_timeout_s: float = _T.pull_timeout_s  # the decode side gives a claimed pull this long
    on_pull_failure: str = _T.on_pull_failure  # decode side: recompute (prefill locally) | error
    host: str = _T.host  # bind address of the control + transfer servers
    advertise_host: str | None = _T.advertise_host  # address the other side dials (default: host)
    control_port: int = _T.control_port  # 0: a free port
    token: str | None = field(default=None, repr=False)  # the internal credential (X-KV-Transfer-Token)
    insecure: bool = _T.insecure  # a non-loopback bind without a token (warned about every minute)
    # Decode side: prefill control endpoints ("host:port") it may dial. With a token configured,
    # transfer parameters are token-bearing (the server refused any without it), so the decode
    # side also dials the endpoints they name; without one it dials these only.
    peers: tuple[str, ...] = ()
    max_held_bytes: int = _T.max_held_bytes  # prefill side: offered state held at once; past it, 503
    max_staged_bytes: int = _T.max_staged_bytes  # decode side: state pulling or pulled, waiting for pages
    max_pulls_in_flight: int = _T.max_pulls_in_flight  # decode side: concurrent pulls (each bounded by pull_timeout_s)
    control_timeout_s: float = _T.control_timeout_s  # one claim or release exchange, end to end
    extra: dict[str, Any] = field(default_factory=dict)  # connector-specific options (plugins)

    def __post_init__(self):
        rules.check_fields(self, _KV_TRANSFER_RULES)
        object.__setattr__(self, "peers", tuple(rules.normalize_peer(p) for p in self.peers))


_KV_TRANSFER_RULES = {
    "role": rules.one_of(rules.ROLES),
    "on_pull_failure": rules.one_of(rules.PULL_FAILURE_ACTIONS),
    **dict.fromkeys(("lease_s", "pull_timeout_s", "control_timeout_s"), rules.positive),
    **dict.fromkeys(("max_held_bytes", "max_staged_bytes"), rules.positive),
    "max_pulls_in_flight": _COUNT,
    "peers": lambda peers: [rules.normalize_peer(p) for p in peers],
}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # the checkpoint: an HF directory, a GGUF file or an orbax checkpoint
    # ---- model: launch section `model`
    dtype: str = _M.dtype
    max_model_len: int | None = _M.max_model_len  # None: the checkpoint's max_position_embeddings
    quantization: str | None = _M.quantization  # online weight quantization (models/quantization.py SCHEMES)
    quantization_group_size: int = _M.quantization_group_size  # int4 schemes
    quantization_keep_float: tuple[str, ...] | None = None  # module-path globs kept in float; None: the defaults
    keep_gguf_quantized: bool = _M.keep_gguf_quantized  # GGUF blocks stay quantized (False: dequantize at load)
    load_tokenizer: bool = True
    # ---- cache: launch section `cache`
    page_size: int = _C.page_size
    num_pages: int | None = _C.num_pages  # per layer, incl. the null page; None: from the memory budget
    kv_cache_memory_bytes: int | None = None  # KV budget; None: memory_fraction of the device
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    kv_cache_dtype: str = _C.kv_cache_dtype  # auto | bfloat16 | float32 | fp8_e4m3 | fp8_e5m2
    state_dtype: str = _C.state_dtype  # GDN state slots: float32 | bfloat16 (the recurrence computes in f32)
    num_state_slots: int | None = None  # GDN slots incl. null slot; None: from max_num_seqs
    enable_prefix_caching: bool = _C.enable_prefix_caching
    hybrid_checkpoint_policy: str = _C.hybrid_checkpoint_policy  # GDN hybrids: paged_kv.CheckpointPolicy spec
    # max fraction of cache memory for checkpoints; None: 2 x max_num_seqs shared
    hybrid_checkpoint_budget: float | None = _C.hybrid_checkpoint_budget
    # window-aware paging for sliding-window layers; None: on where the model has them (one rank, no P/D role)
    window_paging: bool | None = _C.window_paging
    kv_offloading_size: float | None = _C.kv_offloading_size  # GiB of host memory for evicted pages/checkpoints
    kv_offloading_backend: str | None = _C.kv_offloading_backend  # "native" (paged_kv/host_tier.py)
    # ---- scheduler: launch section `scheduler`
    max_num_seqs: int = _S.max_num_seqs
    max_num_batched_tokens: int = _S.max_num_batched_tokens
    long_prefill_token_threshold: int = 0
    policy: str = _S.policy
    # plan step n+1 while step n runs (runtime/engine/llm_engine.py); False: wait for each step
    async_scheduling: bool = _S.async_scheduling
    token_buckets: tuple[int, ...] | None = _S.token_buckets
    max_top_k: int = 256
    seed: int | None = None
    # ---- kernels: launch section `kernels`
    attention_backend: str = _K.attention_backend
    gdn_backend: str = _K.gdn_backend
    layer_loop: str = _K.layer_loop  # scan | unroll | auto (runtime/steps/execution_plan.py decides)
    fuse_greedy: bool | None = _K.fuse_greedy  # greedy backbone per bucket; None: the execution plan decides
    interpret: Any = False
    # ---- parallel: launch section `parallel`
    mesh_shape: tuple[int, int] | None = None  # (data, model) devices; None: one device, no mesh
    expert_parallel: bool = False  # MoE experts split by expert index over `model` (else intermediate dim)
    mla_latent: str = "replicated"  # MLA latent pools under TP: replicated | split | auto (models/mla_split.py)
    kv_transfer: KVTransferConfig | None = None  # a P/D role's (with section `kv_transfer`); None: role both
    # ---- compile: launch section `compile`
    aot_compile: bool = DEFAULTS.compile.aot
    aot_grammar_samplers: bool = True  # with aot_compile: also the grammar-masked samplers (structured output)
    # with aot_compile: every executable a step can ask for (full samplers, scoring backbone, state
    # copy), then nothing compiles in the serving loop (StepExecutables.compile_all); `serve` sets it
    # with compile.aot (runtime/engine/loading.py); engines built in code compile the extras lazily
    aot_compile_all: bool = False
    compile_cache_dir: str | None = DEFAULTS.compile.cache_dir
    # ---- launch key `speculative_config`: a mapping or SpeculativeConfig; None: off (configs/speculative.py)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        rules.check_fields(self, _ENGINE_RULES)
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        rules.batch_budget(self.max_num_batched_tokens, self.max_num_seqs)
        if self.quantization is not None:
            self.quantization_config()  # raises ValueError naming the field

    def cache_config(
        self,
        num_pages: int,
        max_model_len: int,
        num_state_slots: int = 0,
        num_checkpoint_slots: int | None = None,
        window: tuple[int, int] | None = None,
    ) -> CacheConfig:
        """The page pool and state slots once the engine has sized them; ValueError if the pool
        cannot hold one sequence of `max_model_len` tokens. `window`: window-aware paging's
        (sliding window, window pool pages)."""
        check_pool_holds_one_sequence(num_pages, self.page_size, max_model_len)
        window, num_window_pages = window or (None, 0)
        return CacheConfig(
            page_size=self.page_size,
            num_pages=num_pages,
            num_state_slots=num_state_slots,
            enable_prefix_caching=self.enable_prefix_caching,
            checkpoint_policy=self.hybrid_checkpoint_policy,
            num_checkpoint_slots=num_checkpoint_slots,
            window=window,
            num_window_pages=num_window_pages,
            host_tier_bytes=int((self.kv_offloading_size or 0) * 2**30),
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's budget and policy for a model length the engine resolved."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            policy=self.policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )

    def kernel_config(self) -> KernelConfig:
        return KernelConfig(self.attention_backend, self.gdn_backend, self.layer_loop, self.fuse_greedy, self.interpret)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.mesh_shape, self.expert_parallel, self.mla_latent)

    def compile_config(self) -> CompileConfig:
        return CompileConfig(self.aot_compile, self.aot_grammar_samplers, self.aot_compile_all, self.compile_cache_dir)

    def quantization_config(self):
        """The models.quant_rules.QuantizationConfig asked for, or None."""
        if self.quantization is None:
            return None
        from models.quant_rules import DEFAULT_KEEP_FLOAT, QuantizationConfig

        keep = DEFAULT_KEEP_FLOAT if self.quantization_keep_float is None else tuple(self.quantization_keep_float)
        return QuantizationConfig(self.quantization, self.quantization_group_size, keep)


def check_pool_holds_one_sequence(num_pages: int, page_size: int, max_model_len: int) -> None:
    """vLLM's start-up rule: a KV pool that cannot hold one max_model_len sequence is refused
    (otherwise long requests would be admitted and then never fit). Page 0 is the null page."""
    usable_tokens = (num_pages - 1) * page_size
    if usable_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {usable_tokens} tokens ({num_pages - 1} usable pages x {page_size}) but one "
            f"sequence of max_model_len={max_model_len} tokens needs {pages_for(max_model_len, page_size)} pages; "
            f"give more pages (cache.num_pages / cache.memory_fraction) or lower model.max_model_len"
        )


def _named(kind: str) -> rules.Rule:
    return lambda name: check_name(kind, name)


_ENGINE_RULES = {
    "dtype": rules.one_of(rules.DTYPES),
    "max_model_len": rules.optional(rules.max_model_len),
    "page_size": rules.page_size,
    "num_pages": rules.optional(rules.num_pages),
    "memory_fraction": rules.memory_fraction,
    "kv_cache_dtype": rules.one_of(rules.KV_CACHE_DTYPES),
    "state_dtype": rules.one_of(rules.STATE_DTYPES),
    "num_state_slots": rules.optional(rules.num_state_slots),
    "hybrid_checkpoint_budget": rules.optional(rules.checkpoint_budget),
    "kv_offloading_size": rules.optional(rules.at_least(0)),
    "kv_offloading_backend": rules.optional(rules.one_of(("native",))),
    **{name: rule for name, rule in _SCHEDULER_RULES.items() if name != "max_model_len"},
    "attention_backend": _named("attention_backend"),
    "gdn_backend": _named("gdn_backend"),
    "layer_loop": rules.one_of(rules.LAYER_LOOPS),
    "mesh_shape": rules.optional(rules.mesh_shape),
    "mla_latent": rules.one_of(rules.MLA_LATENT),
}


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
    "state_dtype": "cache.state_dtype",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "hybrid_checkpoint_policy": "cache.hybrid_checkpoint_policy",
    "hybrid_checkpoint_budget": "cache.hybrid_checkpoint_budget",
    "window_paging": "cache.window_paging",
    "kv_offloading_size": "cache.kv_offloading_size",
    "kv_offloading_backend": "cache.kv_offloading_backend",
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
    "mla_latent": "parallel.mla_latent",
    "aot_compile": "compile.aot",
    "compile_cache_dir": "compile.cache_dir",
    "speculative_config": "speculative_config",
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
    values = {name: launch_value(launch, key) for name, key in ENGINE_FIELD_KEYS.items()}
    if values["memory_fraction"] is None:
        values["memory_fraction"] = DEFAULT_MEMORY_FRACTION
    for name in ("token_buckets", "quantization_keep_float"):
        if values[name] is not None:
            values[name] = tuple(values[name])
    if values["compile_cache_dir"]:
        values["compile_cache_dir"] = str(Path(values["compile_cache_dir"]).expanduser())
    mesh = launch.parallel.mesh
    if mesh.num_devices > 1:
        values["mesh_shape"] = (mesh.data, mesh.model)
    if launch.parallel.role != "both":
        section = launch.kv_transfer.model_dump()
        section["token"] = launch.kv_transfer.token.get_secret_value() if launch.kv_transfer.token else None
        values["kv_transfer"] = KVTransferConfig(role=launch.parallel.role, **section)
    return EngineConfig(model=model_path, **{**values, **engine_only})
