"""`jaxserve plan`: a launch config's serving steps compiled for its target chip, from shapes alone.

    report = plan_config(load_config("configs/tpu-v5e-8-qwen3_5-27b.yaml"))
    print(format_report(report)); report.raise_if_unfit()

The model is built from its `config.json` (the checkpoint's, else the shipped copy in
`configs/models/`) as abstract arrays: no weights are read. TPU targets compile every token
bucket's backbone and the sampler with libtpu's real compiler through
`jax.experimental.topologies` (any slice, multi-host included) on this CPU-only host; the
compiler's `memory_analysis()` and `cost_analysis()` are per device. The KV pool is sized the way
the engine sizes it (`memory_fraction` of HBM minus the weights, minus the GDN state slots), and
the state slots by the engine's rule: one per sequence and, with prefix caching, checkpoint slots
within `cache.hybrid_checkpoint_budget` of that memory (`state_slots`).

GPU targets cannot be compiled without a CUDA device (jaxlib has no CUDA compile-only client):
the step is lowered for CUDA (which runs the Triton kernels' lowering) and the memory figures
are the arrays' own sizes, marked `analytic`. On a machine with a GPU (`gpu_attached`) every
bucket is compiled on it like a TPU target, with the compiler's memory analysis
(benchmarks/gpu_check.sh runs that for the H200 config).

Attention data parallelism (`mesh.data` D > 1, runtime/parallel/data_parallel.py): every figure is one
DP rank's (num_pages, state slots and max_num_seqs are per rank, and a device holds its rank's
pages only), so the per-device memory is that of the one-rank step compiled here; the roofline
counts the D ranks' batches of one step (D x the tokens over D x the devices). An explicit
`cache.num_pages` is the total over the ranks, as in the engine.

Roofline: a step takes max(bytes accessed / HBM bandwidth, flops / peak FLOP/s). The Pallas
attention and GDN kernels are custom calls the cost analysis does not see, so the KV bytes a
decode step reads are added analytically at a stated mean context length.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from configs.chips import CHIPS
from configs.schema import CONFIG_DIR, DEFAULT_MEMORY_FRACTION, LaunchConfig
from models.abstract import abstract_caches, abstract_model, block_fp8_params, shard_abstract_model
from models.config import parse_config
from models.mla_split import check_split
from models.ops import KernelOptions
from models.prequantized import parse_quantization_config
from models.safetensors_io import read_json
from paged_kv.checkpoint_policy import plan_state_slots
from paged_kv.window_pages import window_pool_pages
from pallas_kernels.kv_cache import token_minor_fits
from runtime.aot.costs import StepFigures, extrapolated_cost, figures, gpu_lowered, per_device_bytes
from runtime.aot.plan_report import (
    ROOFLINE_CONTEXT,
    HostTierPlan,
    PlanError,
    PlanReport,
    format_report,
    gib,
    report_json,
)
from runtime.parallel.mesh import DATA_AXIS, MODEL_AXIS
from runtime.steps.executables import StepExecutables, StepKey
from runtime.steps.execution_plan import plan_buckets

__all__ = [  # the report's names, from runtime/aot/plan_report.py, for this module's callers
    "ROOFLINE_CONTEXT",
    "PlanError",
    "PlanReport",
    "format_report",
    "model_config_json",
    "plan_config",
    "report_json",
    "target_mesh",
]
log = logging.getLogger("jaxserve.plan")

MODELS_DIR = CONFIG_DIR / "models"
# Checkpoint directory name -> the shipped copy of its config.json (configs/models/, sources there).
SHIPPED_MODEL_CONFIGS = {
    "Qwen3.5-9B": "qwen3_5-9b.json",
    "Qwen3.5-27B": "qwen3_5-27b.json",
    "Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b.json",
    "Qwen3-Next-80B-A3B-Thinking": "qwen3-next-80b-a3b.json",
    "gemma-3-27b-it": "gemma-3-27b.json",
    "gemma-3-27b-pt": "gemma-3-27b.json",
    "Nemotron-H-8B-Base-8K": "nemotron-h-8b.json",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "nemotron-3-nano-30b-a3b.json",
    "NVIDIA-Nemotron-3-Nano-30B-A3B": "nemotron-3-nano-30b-a3b.json",
    "DeepSeek-V3": "deepseek-v3.json",
    "DeepSeek-V3-FP8": "deepseek-v3-fp8.json",  # the same with its published block-FP8 quantization_config
    "Kimi-Linear-48B-A3B-Instruct": "kimi-linear-48b-a3b.json",
}


# ---- the model and the target ----------------------------------------------------------------------
def model_config_json(launch: LaunchConfig) -> Path:
    """The checkpoint's config.json when the model directory exists here, else the shipped copy."""
    path = launch.model.path
    if path is None:
        raise PlanError("model.path is null (the CPU demo model): plan a config that names a checkpoint")
    local = Path(path) / "config.json"
    if local.is_file():
        return local
    shipped = SHIPPED_MODEL_CONFIGS.get(Path(path).name)
    if shipped is None:
        raise PlanError(
            f"{path}: no config.json there and no shipped copy in {MODELS_DIR} "
            f"(known: {', '.join(sorted(SHIPPED_MODEL_CONFIGS))})"
        )
    return MODELS_DIR / shipped


def _topology_dims(topology: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in topology.split("x"))
    return dims + (1,) * (3 - len(dims))


def target_mesh(launch: LaunchConfig) -> Mesh:
    """The (data, model) mesh over the target TPU slice's devices (no TPU attached)."""
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another JAX process may hold libtpu's lock
    par = launch.parallel
    chip = CHIPS[par.chip]
    if par.topology is None:
        raise PlanError(f"parallel.topology is required for {chip.name}, e.g. 2x4")
    kwargs = {}
    if par.multihost is None:  # the whole slice on one host
        kwargs["chips_per_host_bounds"] = _topology_dims(par.topology)
    topology = topologies.get_topology_desc(f"{chip.topology_name}:{par.topology}", platform="tpu", **kwargs)
    devices = topology.devices
    hosts = len({d.process_index for d in devices})
    want_hosts = 1 if par.multihost is None else par.multihost.num_processes
    if hosts != want_hosts:
        raise PlanError(f"{chip.name}:{par.topology} spans {hosts} hosts, parallel.multihost says {want_hosts}")
    mesh = par.mesh
    if len(devices) != mesh.num_devices:
        raise PlanError(
            f"parallel.mesh data={mesh.data} x model={mesh.model} needs {mesh.num_devices} devices; "
            f"{chip.name}:{par.topology} has {len(devices)}"
        )
    grid = np.array(devices, dtype=object).reshape(mesh.data, mesh.model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def kv_page_layout(head_dim: int, page_size: int, platform: str) -> tuple[bool, str | None]:
    """(pages stored token-minor, a warning or None): the engine's rule (runtime/engine/construction.py).
    On TPU a head_dim below 128 is stored token-minor ([P, Hkv, D, ps]) when the page holds whole
    128-token lane rows; otherwise the kernel's tiles pad head_dim to 128 lanes and the compiled step
    holds a lane-padded copy of the pool (measured: benchmarks/results/cache-copies/)."""
    if platform != "tpu" or head_dim >= 128:
        return False, None
    if token_minor_fits(head_dim, page_size):
        return True, None
    return False, (
        f"head_dim {head_dim} < 128 with {page_size}-token pages: the TPU attention kernel pads head_dim to "
        f"128 lanes, so the step holds a lane-padded copy of the KV pool as temp (up to {128 // head_dim} x "
        f"its bytes); set cache.page_size to a multiple of 128 (pages then stored token-minor, no copy)"
    )


def gpu_attached() -> bool:
    """Whether this process has a CUDA device: then a GPU config's steps are compiled on it (the
    compiler's memory analysis, temp included) instead of only lowered."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# ---- sizing: the engine's rule ---------------------------------------------------------------------
def state_slots(launch: LaunchConfig, model, cache_bytes: int) -> tuple[int, int | None]:
    """(state slots incl. the null slot, checkpoint slots or None): the engine's rule
    (runtime/engine/construction.py `size_cache`), paged_kv's `plan_state_slots` over one device's
    cache memory (`cache_bytes`: KV pages + state slots) and one slot's bytes on a device."""
    if not model.cfg.is_hybrid:
        return 0, None
    return plan_state_slots(
        max_num_seqs=launch.scheduler.max_num_seqs,
        prefix_caching=launch.cache.enable_prefix_caching,
        budget_fraction=launch.cache.hybrid_checkpoint_budget,
        cache_bytes=cache_bytes,
        state_bytes_per_slot=model.state_bytes_per_slot_per_device(),
    )


def window_pool(launch: LaunchConfig, cfg, model, tp_size: int, blocks_per_seq: int) -> tuple:
    """Window-aware paging as the engine sizes it (runtime/engine/construction.py): (the window or
    None, window pages, the full layers' KV bytes per token and the window pool's bytes, per device)."""
    sched, page_size, kv_dtype = launch.scheduler, launch.cache.page_size, launch.cache.kv_cache_dtype
    windows = [w for i in range(cfg.num_layers) if (w := cfg.sliding_window(i)) is not None]
    if not windows or launch.cache.window_paging is False:  # under DP per rank, as the engine
        return None, 0, 0, 0
    split = tp_size if model.tp is not None and model.tp.attention else 1
    window = max(windows)
    num_window_pages = window_pool_pages(window, page_size, sched.max_num_seqs, sched.max_num_batched_tokens)
    num_window_pages = min(num_window_pages, sched.max_num_seqs * blocks_per_seq + 1)
    window_bytes = num_window_pages * page_size * (model.cache_bytes_per_token(kv_dtype, "window") // split)
    return window, num_window_pages, model.cache_bytes_per_token(kv_dtype, "full") // split, window_bytes


def host_tier_plan(launch: LaunchConfig, caches, num_pages: int, num_slots: int, host_ram_bytes: int | None):
    """The host tier at these caches' shapes (one rank's, whole over the model axis, as the engine's
    store counts an entry: runtime/engine/host_tier.py), or None when cache.kv_offloading_size is off."""
    size = launch.cache.kv_offloading_size
    if not size:
        return None

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    state = nbytes((caches["conv"], caches["rec"]))
    return HostTierPlan(
        total_bytes=int(size * 2**30),
        data_ranks=launch.parallel.mesh.data,
        page_bytes=nbytes(caches["kv"]) // num_pages,
        checkpoint_bytes=state // num_slots if state else 0,
        host_ram_bytes=host_ram_bytes,
    )


def _pool_size(launch, chip, weight_bytes, per_page, state_bytes, want) -> tuple[int, list[str]]:
    if launch.cache.num_pages is not None:  # the total over the data-parallel ranks: one rank's share
        return launch.cache.num_pages // launch.parallel.mesh.data, []
    fraction = launch.cache.memory_fraction or DEFAULT_MEMORY_FRACTION
    budget = int(chip.hbm_bytes * fraction) - weight_bytes - state_bytes
    problems = []
    if budget < 2 * per_page:
        problems.append(
            f"weights {gib(weight_bytes)} + state slots {gib(state_bytes)} per device exceed "
            f"memory_fraction {fraction} x HBM {gib(chip.hbm_bytes)} = {gib(int(chip.hbm_bytes * fraction))}"
        )
    return int(max(2, min(want, budget // per_page))), problems


def plan_config(
    launch: LaunchConfig,
    config_name: str = "<config>",
    *,
    token_buckets: tuple[int, ...] | None = None,
    compile_sampler: bool = True,
    compile_cost: bool = True,
    host_ram_bytes: int | None = None,
) -> PlanReport:
    """Compile `launch` for its chip and report per-device memory and cost (see module docstring).

    `token_buckets`: compile only these (a subset, for quick checks); default every bucket.
    `compile_cost`: also compile the 1- and 2-group variants that give the whole model's cost
    (`extrapolated_cost`). `host_ram_bytes`: the host's memory, which the host tier
    (cache.kv_offloading_size) must fit in. Nothing is compiled when the weights and state slots alone overflow."""
    par, cache, sched = launch.parallel, launch.cache, launch.scheduler
    if par.chip is None:
        raise PlanError(
            f"{config_name}: parallel.chip is not set; plan needs a target chip ({', '.join(sorted(CHIPS))})"
        )
    chip = CHIPS[par.chip]
    hf_config = read_json(model_config_json(launch))
    cfg = parse_config(hf_config)
    dtype = launch.model.dtype
    model = abstract_model(cfg, dtype, launch.model.path)
    model.state_dtype = launch.cache.state_dtype
    # the checkpoint's count, taken before sharding may repeat KV heads (models.sharding.repeat_kv_heads)
    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(model.params))
    stored = parse_quantization_config(hf_config.get("quantization_config"))
    if stored is not None and stored.method == "fp8-block":  # held as loaded: FP8 codes + block scales
        model.params = block_fp8_params(model.params, stored.block)
    gpu = chip.platform == "gpu"
    mesh = None if gpu else target_mesh(launch)
    if mesh is not None:
        try:
            shard_abstract_model(model, mesh, par.expert)
        except ValueError as err:  # a split the model refuses (Mamba-2 under TP, experts that do not divide)
            raise PlanError(f"{config_name}: {err}") from None
        try:  # MLA latent pools replicated or split by token (models/mla_split.py)
            split = check_split(
                par.mla_latent,
                model.tp.size,
                cache.page_size,
                cfg.mla is not None,
                cache.kv_cache_dtype,
                par.role != "both",
            )
        except ValueError as err:
            raise PlanError(f"{config_name}: {err}") from None
        model.tp = dataclasses.replace(model.tp, latent_split=split)
    tp_size = 1 if model.tp is None else model.tp.size
    max_model_len = min(launch.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    page_size = cache.page_size
    blocks_per_seq = -(-max_model_len // page_size)
    kv_dtype = cache.kv_cache_dtype
    per_token = model.cache_bytes_per_token(kv_dtype, lane_padded=chip.platform == "tpu")  # models/cache_formats.py
    # per_token counts the KV heads the model holds (repeated where fewer than the devices): split over all
    split = model.tp is not None and ((model.tp.attention and cfg.mla is None) or model.tp.latent_split)  # MLA: or all
    per_token_device = per_token // tp_size if split else per_token
    weights_device = per_device_bytes(model.params)
    # what the engine's cache_budget_bytes is on the device once the weights are loaded
    cache_bytes = int(chip.hbm_bytes * (cache.memory_fraction or DEFAULT_MEMORY_FRACTION)) - weights_device
    want = sched.max_num_seqs * blocks_per_seq + 1
    if par.mla_latent == "auto" and model.tp is not None and cache.num_pages is None and per_token_device:
        bound = cache_bytes // (per_token_device * page_size) < want  # models/mla_split.py AUTO_RULE
        args = (tp_size, page_size, cfg.mla is not None, kv_dtype, par.role != "both", bound)
        model.tp = dataclasses.replace(model.tp, latent_split=check_split("auto", *args))
        per_token_device = per_token // tp_size if model.tp.latent_split else per_token_device
    slots, checkpoint_slots = state_slots(launch, model, cache_bytes)
    state_device = slots * model.state_bytes_per_slot_per_device()
    window, num_window_pages, full_device, window_device = window_pool(launch, cfg, model, tp_size, blocks_per_seq)
    full_device = full_device if window is not None else per_token_device
    num_pages, problems = _pool_size(
        launch,
        chip,
        weights_device,
        full_device * page_size,
        state_device + window_device,
        want,
    )
    mla = cfg.mla is not None  # latent rows [P, ps, W], pinned rows-minor on TPU (models/cache_formats.py)
    token_minor, layout_warning = (False, None) if mla else kv_page_layout(cfg.head_dim, page_size, chip.platform)
    caches = abstract_caches(
        model,
        num_pages,
        page_size,
        max(slots, 2),
        kv_dtype,
        num_window_pages=num_window_pages or None,
        token_minor=token_minor,
    )
    kv_device = per_device_bytes(caches["kv"])
    host = host_tier_plan(launch, caches, num_pages, max(slots, 2), host_ram_bytes)
    if host is not None and window is not None:
        problems.append("the host tier (cache.kv_offloading_size) does not support window-aware paging yet")
    if host is not None and host_ram_bytes is not None and host.total_bytes > host_ram_bytes:
        problems.append(
            f"the host tier (cache.kv_offloading_size {gib(host.total_bytes)}) exceeds host RAM {gib(host_ram_bytes)}"
        )
    if (num_pages - 1) * page_size < max_model_len:
        problems.append(
            f"the KV pool ({num_pages - 1} pages x {page_size} = {(num_pages - 1) * page_size} tokens, "
            f"{gib(kv_device)} per device) cannot hold one max_model_len ({max_model_len}) sequence"
        )
    impl = f"pallas_{chip.platform}"
    opts = KernelOptions(attention=impl, gdn=impl, tp=model.tp)
    buckets, seq_buckets = plan_buckets(
        sched.max_num_batched_tokens, sched.max_num_seqs, sched.token_buckets, chip.platform
    )
    buckets = tuple(b for b in buckets if token_buckets is None or b in token_buckets)
    steps: list[StepFigures] = []
    if problems:
        pass  # the weights alone overflow: nothing worth compiling
    elif gpu and not gpu_attached():
        steps = gpu_lowered(model, caches, opts, buckets, sched, blocks_per_seq)
    else:  # a TPU slice through topologies, or the GPU this process runs on
        exes = StepExecutables(
            model,
            caches,
            opts,
            token_buckets=buckets,
            seq_buckets=seq_buckets,
            max_num_seqs=sched.max_num_seqs,
            max_blocks_per_seq=blocks_per_seq,
            window_paging=window is not None,
        )
        try:
            for T in buckets:
                log.info("compiling backbone T=%d for %s", T, chip.name)
                steps.append(figures(f"backbone[T={T}]", T, exes.compile(StepKey("backbone", T))))
            if compile_sampler:
                S = seq_buckets[-1]
                steps.append(figures(f"sampler[S={S}]", S, exes.compile(StepKey.sampler(S))))
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            problems.append(
                f"the {chip.name} compiler: {str(err).splitlines()[0]} (weights {gib(weights_device)}, "
                f"KV {gib(kv_device)}, GDN state {gib(state_device)} per device)"
            )
    if steps and compile_cost:
        decode_T = next((T for T in buckets if sched.max_num_seqs <= T), buckets[-1])
        for T in sorted({decode_T, buckets[-1]}):
            flops, moved = extrapolated_cost(
                cfg,
                dtype,
                mesh,
                opts,
                T,
                num_pages=num_pages,
                page_size=page_size,
                num_slots=max(slots, 2),
                kv_dtype=kv_dtype,
                max_num_seqs=sched.max_num_seqs,
                blocks_per_seq=blocks_per_seq,
                gpu=gpu,
                expert_parallel=par.expert,
                latent_split=model.tp is not None and model.tp.latent_split,
                state_dtype=cache.state_dtype,
                token_minor=token_minor,
            )
            steps = [
                dataclasses.replace(s, flops=flops, bytes_accessed=moved) if s.name == f"backbone[T={T}]" else s
                for s in steps
            ]
    worst = max(steps, key=lambda s: s.peak_bytes, default=None)
    if worst is not None and worst.peak_bytes > chip.hbm_bytes:
        problems.append(
            f"{worst.name} needs {gib(worst.peak_bytes)} per device (arguments "
            f"{gib(worst.argument_bytes)} + outputs {gib(worst.output_bytes)} - aliased "
            f"{gib(worst.alias_bytes)} + temp {gib(worst.temp_bytes)}) > HBM {gib(chip.hbm_bytes)}"
        )
    processes = 1 if par.multihost is None else par.multihost.num_processes
    return PlanReport(
        config_name,
        Path(launch.model.path).name,
        chip,
        par.mesh.num_devices,
        processes,
        (par.mesh.data, par.mesh.model),
        param_count,
        weights_device,
        kv_device,
        num_pages,
        page_size,
        per_token_device,
        state_device,
        slots,
        sched.max_num_seqs,
        max_model_len,
        0.0 if cache.num_pages is not None else cache.memory_fraction or DEFAULT_MEMORY_FRACTION,
        steps,
        problems,
        expert_parallel=model.tp is not None and model.tp.expert,
        latent_split=model.tp is not None and model.tp.latent_split,
        num_checkpoint_slots=checkpoint_slots,
        checkpoint_budget=cache.hybrid_checkpoint_budget if cfg.is_hybrid and cache.enable_prefix_caching else None,
        cache_bytes=cache_bytes,
        window=window,
        num_window_pages=num_window_pages,
        warnings=[] if layout_warning is None else [layout_warning],
        kv_token_minor=token_minor,
        host_tier=host,
    )
