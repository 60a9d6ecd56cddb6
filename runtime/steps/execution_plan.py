"""The execution plan: every backend- and model-dependent choice of how one engine runs, in one pure function.

    plan = plan_execution(engine_config, model_config, backend="cpu")
    plan.layer_loop, plan.token_buckets, plan.fuse_greedy, plan.attention_path, ...

`plan_execution` reads the engine config's knobs (each "auto" / None resolved here and nowhere
else), the model's shape and the backend (cpu | gpu | tpu), and returns a frozen
`ExecutionPlan`; `LLMEngine.__init__` only carries it out and logs `plan.describe()` in one line.
No JAX, no devices: the table test in tests/test_exec_plan.py checks it for every backend.

Each CPU rule keeps its measurement next to it. `benchmarks/exec_plan_ab.py` measures every
CPU choice on vs off (tiny dense + tiny hybrid, tokens/s, one invocation); its table is in
docs/benchmarks.md. Not to be confused with runtime/aot/chip_report.py (`jaxserve plan`: compile a launch
config for an accelerator and report its memory), which takes its buckets from `plan_buckets`.
"""

from __future__ import annotations

import dataclasses

from models.ops import reads_kv_bits, resolve_impl
from runtime.buckets import pow2_buckets

BACKENDS = ("cpu", "gpu", "tpu")

# `layer_loop: auto` unrolls the layers on the CPU backend up to this depth. Measured (random
# Llama, 6 layers, H=384): a 4-sequence decode step 9.4 -> 7.5 ms, because XLA:CPU copies each
# weight slice a scan step reads; SmolLM2-135M (30 layers): 3% faster for 4x the compile time,
# so deeper float32 models stay scanned. Accelerators scan (compile time flat in depth). Re-measured
# (exec_plan_ab, 2026-12-01): unroll / scan 1.80x on the tiny hybrid (4 layers), 0.99x on the
# tiny dense (6 layers): kept (>= 5 % on one of them).
UNROLL_MAX_LAYERS_CPU = 16
# bf16 / fp16 weights on CPU are unrolled at any depth. Under a scan XLA:CPU cannot hand the
# sliced bf16 weight to its XNNPACK dot: it converts the whole stacked weight set to float32
# outside the loop on every call (`python -m benchmarks.cpu_dtype`, 2026-12-01, decode step of 16
# sequences, bf16 scanned / unrolled / float32: SmolLM2-135M 337-392 / 90-120 / 182-213 ms, tiny
# dense 33.6 / 11.9 / 16.2 ms; docs/benchmarks.md round 6, in git history at 2c77c4d).
UNROLL_ANY_DEPTH_CPU_DTYPES = ("bfloat16", "float16")
# The smallest default token bucket: 16 rows fill an accelerator's matmul tile anyway; on CPU a
# matmul's cost follows its rows (4 vs 16 rows: ~2x faster MLP on the 6-layer model), and the
# tail of a mixed batch decodes a few sequences for many steps. For the same reason CPU also
# gets the 1.5x buckets (6, 12, 24, ...) up to max_num_seqs, the sizes decode steps take
# (tiny dense mixed workload: ~10% more tokens/s). Re-measured (exec_plan_ab, 2026-12-01,
# mixed): minimum 4 vs 16 1.34x tiny dense, 0.93x tiny hybrid; 1.5x steps 1.06x tiny dense,
# 0.97x tiny hybrid: both kept (>= 5 % on the dense model; the run-to-run spread was large).
MIN_TOKEN_BUCKET_CPU = 4
MIN_TOKEN_BUCKET_ACCELERATOR = 16
# Sampler rows: sequence counts round up to powers of two from 8 on every backend (the sampler
# is a small share of a step; fewer executables).
MIN_SEQ_BUCKET = 8
# `fuse_greedy: null` -> on for bf16 dense models on CPU, off otherwise. The fused greedy
# backbone (argmax inside, no sampling metadata) makes an all-greedy decode step ONE executable
# now that the request table's prepare is fused into every backbone (runtime/steps/executables.py): the bare
# loop's shape. History: chosen on CPU when a dispatch was ~1.5 ms of a ~6 ms decode step;
# dropped at 0.95x / 0.89x (exec_plan_ab, 2026-12-01, float32, load average ~21, prepare apart:
# 2 executables a step vs 3). Re-measured 2026-12-02 with prepare fused (1 vs 2; docs/benchmarks.md
# round 11), plan / off: bf16 tiny dense 1.11x, SmolLM2 offline 16 x 32/32 ~1.15x
# (720 / 678 vs 603 / 589 tok/s); float32 1.00x tiny dense and tiny hybrid, SmolLM2 no gain;
# bf16 tiny hybrid 1.01x and 0.95x (its steps are GDN prefill-heavy). Where a step is short the
# sampler's dispatch is a real share of it; kept only there (>= 5 %). It costs one executable
# per decode-sized bucket. Accelerators: not measured (no device run), off;
# `kernels.fuse_greedy: true` turns it on anywhere.
FUSE_GREEDY_CPU_DTYPES = ("bfloat16",)
# KV bit storage follows the attention path (`models.ops.reads_kv_bits`, the `kv_bits` fact of
# its entry in pallas_kernels/ragged_paged_attention.py's `KERNELS`): the jnp paths ("native",
# "chunked", "reference") hold bf16 / FP8 pages as raw bits because XLA:CPU converts the whole
# pool on every scatter into a bf16 / FP8 buffer (17 ms per 8 MiB of pages vs 0.02 ms,
# pallas_kernels/kv_cache.py); the Pallas kernels read float pages. A float32 pool is the same
# either way. Re-measured (exec_plan_ab, 2026-12-01, tiny dense, bf16 KV): bits / float storage
# 56x. The chunked attention path itself: chunked / reference 3.6x tiny dense, 1.33x tiny hybrid;
# "native" (the CPU "auto": "chunked" with its decode pass in C++, pallas_kernels/cpu_native.py).
# Weight layout: on CPU the float projections are held [out, in] (models.quantization.OutInWeight),
# the right-hand side XLA:CPU's XNNPACK dot packs fastest. Measured (30 SmolLM2-135M layers of
# projections, 2026-12-01): bf16 26.6 -> 18.8 ms at 16 rows, 24.5 -> 17.5 at 4, 38.2 -> 31.2 at
# 64; float32 42.9 -> 37.3 at 16, equal at 4 and 64. Accelerators and meshes keep [in, out] (the
# sharding rules and the Pallas quantized matmul are written for it).
# bf16 weights, where the native matmul runs AVX512-BF16 (`native_matmul`), are held packed for
# it instead (models.quantization.PackedWeight: 30 SmolLM2-135M layers of projections on an AMD
# EPYC Zen 4, 2 cores, 2026-12-01: 3.2x [out, in]'s speed at 4 rows, 1.65x at 16; in the engine
# a SmolLM2 bf16 decode step of 16 rows ~48 -> ~31 ms and a 512-token prefill step 562 -> 435 ms).
# The tied lm_head gets a packed copy of the embedding (+vocab x hidden bf16; 5.2 -> 3.1 ms at 16 rows).
WEIGHT_LAYOUT_CPU, WEIGHT_LAYOUT_DEFAULT, WEIGHT_LAYOUT_NATIVE = "out_in", "in_out", "packed"
# bf16 on CPU is the fast dtype since the float32-accumulating dot spelling (models/quantization.qdot)
# and the unrolled layers: decode step 1.62x (SmolLM2), 1.36x (tiny dense), 1.64x (tiny hybrid) float32's
# speed (benchmarks/cpu_dtype.py); at saturation 1.4-2.2x float32's tokens/s (benchmarks/saturation.py).
# float16 has no such measurement: it is served, with a warning.
_CPU_DTYPE_WARNING = (
    "serving in {dtype} on the CPU backend, which is not measured there (bfloat16 is: 1.4-2.2x "
    "float32's tokens/s at saturation, benchmarks/saturation.py); prefer model.dtype: bfloat16 or float32 for CPU serving"
)
CPU_WARNED_DTYPES = ("float16",)
# Speculative decoding's `disable_by_batch_size: auto` (issue 35): no drafts in a step while more
# decoding requests than this run. CPU: 16, the largest concurrency measured where ngram still
# paid (SmolLM2-135M Q4_1, 2 cores, k = 4, tokens/s ngram / off: 2.71x, 1.50x, 1.15x, 0.82x at
# concurrency 1, 4, 16, 64: benchmarks/results/spec-decode/smollm2-cpu-2core-final.json): the
# crossover lies between 16 and 64. Accelerators: not measured (no device run): None, always draft
# (vLLM's default), until a device measurement sets it.
SPEC_DISABLE_BY_BATCH_SIZE_CPU = 16
# The host tier's swap-or-recompute rule (issue 36; paged_kv/tiered_cache.SwapCost): a host hit is
# loaded (admission waits for it) only when `latency + bytes / bandwidth` is below `tokens x 2 x
# params / prefill FLOP/s`, per backend: (host -> device bytes/s, seconds per load batch, prefill
# FLOP/s). CPU: measured by benchmarks/host_swap_cost.py on qwen3_5-small, 2 cores, 2026-12-05
# (benchmarks/results/host-tier/swap-cost-cpu.json): one page's scatter 24 us, 16 pages' 76 us
# (18.7 GB/s), a 128-token prefill 81 ms (1,580 tokens/s x 2 x 34.7M parameters = 1.1e11 FLOP/s):
# a page's load costs what 0.04 tokens' recompute does, so on CPU a host hit is always taken.
# GPU / TPU: documented, not measured (no device run): H100/H200 PCIe Gen5 x16 is 64 GB/s a
# direction, taken at half; bf16 dense 989 TFLOP/s (H100 SXM) taken at 40 % MFU for prefill; TPU v5e
# 197 TFLOP/s at 40 %, its PCIe Gen4 host link (32 GB/s) at half; 0.1 ms per load batch (a
# dispatch and a DMA's set-up) on both. With these, on a GPU a short host hit that needs a large GDN
# checkpoint (tens of MiB at 9B shapes) is recomputed, a long one or a KV-only one loaded.
HOST_SWAP_CPU = (1.87e10, 2.4e-5, 1.1e11)
HOST_SWAP_COST = {
    "cpu": HOST_SWAP_CPU,
    "gpu": (32e9, 1e-4, 0.4 * 989e12),
    "tpu": (16e9, 1e-4, 0.4 * 197e12),
}


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """How one engine runs. Every field is resolved (no "auto")."""

    backend: str  # cpu | gpu | tpu
    layer_loop: str  # "scan" (one compiled layer group under lax.scan) | "unroll"
    token_buckets: tuple[int, ...]  # backbone token counts compiled
    seq_buckets: tuple[int, ...]  # sampler row counts compiled
    fuse_greedy: bool  # a greedy backbone (argmax fused in) per token bucket <= max_num_seqs
    attention_path: str  # KernelOptions.attention: a name of models.ops.ATTENTION_BACKENDS (native, pallas, ...)
    # KernelOptions.gdn: reference (per-token recurrence) | pallas | ...; the chunked-GDN CPU
    # prefill (issue 14 item 3) picks its path in `_gdn_path`.
    gdn_path: str
    kv_bit_storage: bool  # bf16 / FP8 KV pages held as raw bits (models.Model.init_caches)
    # "in_out" ([K, N] as loaded) | "out_in" (float projections transposed, Model.hold_out_in) |
    # "packed" (bf16 projections packed for the native matmul, Model.hold_packed)
    weight_layout: str
    aot_compile: bool  # compile every executable at start-up
    grammar_samplers: bool  # with aot_compile: also the grammar-masked samplers
    # speculative decoding: no drafts while more decoding requests run (None: always draft / off)
    spec_disable_by_batch_size: int | None = None
    # the host tier's swap-or-recompute constants (HOST_SWAP_COST): bytes/s, s per load, prefill FLOP/s
    host_swap_cost: tuple[float, float, float] = HOST_SWAP_COST["cpu"]
    warnings: tuple[str, ...] = ()  # logged at start-up

    def describe(self) -> str:
        """The one start-up log line."""
        return (
            f"execution plan ({self.backend}): layers {self.layer_loop}, token buckets {list(self.token_buckets)}, "
            f"seq buckets {list(self.seq_buckets)}, fuse_greedy {self.fuse_greedy}, "
            f"attention {self.attention_path}, gdn {self.gdn_path}, kv bit storage {self.kv_bit_storage}, "
            f"weights {self.weight_layout}, "
            f"aot {self.aot_compile}{' (+grammar samplers)' if self.aot_compile and self.grammar_samplers else ''}"
            + (
                f", no drafts above {self.spec_disable_by_batch_size} decoding"
                if self.spec_disable_by_batch_size is not None
                else ""
            )
        )


def plan_execution(
    engine_config, model_config, backend: str, dtype: str | None = None, *, native_matmul: bool = False
) -> ExecutionPlan:
    """Resolve every execution choice for `engine_config` (runtime.engine_config.EngineConfig) serving
    `model_config` (models.config.ModelConfig: num_layers, is_hybrid) on `backend` (cpu | gpu | tpu). `dtype`:
    the weights' dtype when it is not the config's (a loaded Model handed to the engine).
    `native_matmul`: whether this CPU runs the native bf16 matmul's AVX512-BF16 loop
    (`pallas_kernels.cpu_native.matmul_simd()`, a fact about the machine the caller looks up)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    c = engine_config
    k, mesh, compile_ = c.kernel_config(), c.parallel_config().mesh_shape, c.compile_config()
    on_cpu = backend == "cpu"
    token_buckets, seq_buckets = plan_buckets(c.max_num_batched_tokens, c.max_num_seqs, c.token_buckets, backend)
    attention = resolve_impl("attention", k.attention_backend, backend, k.interpret)
    dtype = dtype or c.dtype
    warnings = (_CPU_DTYPE_WARNING.format(dtype=dtype),) if on_cpu and dtype in CPU_WARNED_DTYPES else ()
    fuse_greedy_default = on_cpu and dtype in FUSE_GREEDY_CPU_DTYPES and not model_config.is_hybrid
    return ExecutionPlan(
        backend=backend,
        layer_loop=_layer_loop(k.layer_loop, model_config.num_layers, backend, dtype),
        token_buckets=token_buckets,
        seq_buckets=seq_buckets,
        fuse_greedy=fuse_greedy_default if k.fuse_greedy is None else k.fuse_greedy,
        attention_path=attention,
        gdn_path=_gdn_path(k.gdn_backend, backend, k.interpret),
        kv_bit_storage=reads_kv_bits(attention),
        weight_layout=_weight_layout(on_cpu and mesh is None, dtype, native_matmul),
        aot_compile=compile_.aot,
        grammar_samplers=compile_.grammar_samplers,
        spec_disable_by_batch_size=_spec_disable_by_batch_size(getattr(c, "speculative_config", None), backend),
        host_swap_cost=HOST_SWAP_COST[backend],
        warnings=warnings,
    )


def plan_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, explicit: tuple[int, ...] | None, backend: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token buckets, sequence buckets) for a backend; `explicit` token buckets win."""
    on_cpu = backend == "cpu"
    tokens = pow2_buckets(
        max_num_batched_tokens,
        explicit=explicit,
        minimum=MIN_TOKEN_BUCKET_CPU if on_cpu else MIN_TOKEN_BUCKET_ACCELERATOR,
        fine_until=max_num_seqs if on_cpu else 0,
    )
    return tokens, pow2_buckets(max_num_seqs, minimum=MIN_SEQ_BUCKET)


def _spec_disable_by_batch_size(config, backend: str) -> int | None:
    """`speculative_config.disable_by_batch_size` resolved: "auto" -> the measured CPU crossover
    (SPEC_DISABLE_BY_BATCH_SIZE_CPU) or None on accelerators; an explicit value or None as given."""
    if config is None:
        return None
    if config.disable_by_batch_size != "auto":
        return config.disable_by_batch_size
    return SPEC_DISABLE_BY_BATCH_SIZE_CPU if backend == "cpu" else None


def _weight_layout(cpu_single_device: bool, dtype: str, native_matmul: bool) -> str:
    if not cpu_single_device:  # accelerators and meshes: the sharding rules and Pallas kernels take [K, N]
        return WEIGHT_LAYOUT_DEFAULT
    return WEIGHT_LAYOUT_NATIVE if dtype == "bfloat16" and native_matmul else WEIGHT_LAYOUT_CPU


def _layer_loop(choice: str, num_layers: int, backend: str, dtype: str) -> str:
    if choice != "auto":
        return choice
    if backend != "cpu":
        return "scan"
    return "unroll" if num_layers <= UNROLL_MAX_LAYERS_CPU or dtype in UNROLL_ANY_DEPTH_CPU_DTYPES else "scan"


def _gdn_path(choice: str, backend: str, interpret) -> str:
    """The GDN layers' path. CPU: "native" (pallas_kernels/gdn.py `gated_delta_rule_native`): every
    row's recurrence in C++, state slots updated in place. Measured (benchmarks/cpu_native.py,
    2026-12-01, H=8, K=V=128, pool donated): 16 decode rows 2.0 -> 0.4 ms a layer against the jnp
    per-token loop, a 512-token prefill 15.6 -> 7.5 ms against the jnp WY chunks. Its fallback,
    "chunked", runs WY chunks of 16 from CHUNKED_MIN_TOKENS on (1.2-3.9x the jnp loop there,
    benchmarks/gdn_prefill.py) and the per-token loop below."""
    return resolve_impl("gdn", choice, backend, interpret)
