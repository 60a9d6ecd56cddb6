"""What `LLMEngine` is built from: the model, loaded and laid out as its execution plan says
(`prepare_model`), the page pool and state slots sized for it (`size_cache`), and the step's
scheduling and device side for one rank or, when the config's mesh has a data axis, for attention
data parallelism (`build_step_parts`, which calls runtime/parallel/data_parallel.py's factory).

Every choice is made elsewhere (the execution plan, `plan_state_slots`, the config's rules); these
functions carry them out in the order the engine needs them, before any cache exists.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, replace

import jax
import numpy as np

from models.cache_formats import on_tpu
from models.config import ConfigError
from models.draft_model import draft_params_like, forward_with_draft, init_draft_caches, load_draft
from models.mla_split import check_split
from models.model import Model, load_model, resolve_kv_dtype
from models.mtp import init_mtp_caches, load_mtp_params, mtp_refusal, shard_mtp_params
from models.ops import KernelOptions
from models.sharding import shard_model
from paged_kv.checkpoint_policy import plan_state_slots
from paged_kv.window_pages import window_pool_pages
from pallas_kernels import cpu_native
from pallas_kernels.kv_cache import token_minor_fits
from runtime.buckets import pages_for
from runtime.engine.host_tier import refuse_host_tier
from runtime.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.parallel.data_parallel import DataParallel, build_data_parallel, data_parallel_size, rank_share
from runtime.parallel.mesh import make_mesh
from runtime.scheduling.dp_scheduler import DataParallelScheduler
from runtime.scheduling.scheduler import Scheduler
from runtime.steps.executables import StepExecutables
from runtime.steps.execution_plan import ExecutionPlan, plan_execution
from runtime.steps.table_host import RequestTableHost

log = logging.getLogger("jaxserve.engine")


def prepare_model(
    config: EngineConfig, model: Model | None, progress: bool, plan: ExecutionPlan | None
) -> tuple[Model, ExecutionPlan]:
    """`model` (default: loaded from `config.model`) quantized and sharded as the config asks, and
    laid out as `plan` (default: `plan_execution(config, model config, backend)`) says."""
    parallel = config.parallel_config()
    mesh = None if parallel.mesh_shape is None else make_mesh(*parallel.mesh_shape)
    qcfg = config.quantization_config()
    # an orbax checkpoint is restored straight into this sharding (each process reads its shards)
    loaded = model or load_model(
        config.model,
        dtype=config.dtype,
        progress=progress,
        mesh=mesh,
        quantization=qcfg,
        keep_gguf_quantized=config.keep_gguf_quantized,
        expert_parallel=parallel.expert_parallel,
    )
    if model is not None and qcfg is not None and not model.quantization:
        model.quantize(qcfg)
    if mesh is not None and loaded.tp is None:
        shard_model(loaded, mesh, expert_parallel=parallel.expert_parallel)
    if loaded.tp is not None:  # MLA latent pools split by token (models/mla_split.py): the weights' split is the same
        split = check_split(
            parallel.mla_latent,
            loaded.tp.size,
            config.page_size,
            loaded.cfg.mla is not None,
            config.kv_cache_dtype,
            config.kv_transfer is not None,
        )
        loaded.tp = dataclasses.replace(loaded.tp, latent_split=split)
    loaded.state_dtype = config.state_dtype  # the GDN / KDA state slots' dtype (Model.init_caches)
    if config.state_dtype != "float32" and loaded.cfg.mamba is not None:
        raise ConfigError(
            f"cache.state_dtype {config.state_dtype!r} is for GDN and KDA hybrids; Mamba-2 (Nemotron-H) state slots are "
            "float32 only for now (the SSD path does not round its state on store yet)"
        )
    backend = jax.default_backend()
    plan = plan or plan_execution(
        config, loaded.cfg, backend, dtype=loaded.dtype, native_matmul=backend == "cpu" and cpu_native.matmul_simd()
    )
    for warning in plan.warnings:
        log.warning("%s", warning)
    log.info("%s", plan.describe())
    if plan.layer_loop == "unroll":
        loaded.unstack_layers()
    if plan.weight_layout == "out_in":
        loaded.hold_out_in()
    elif plan.weight_layout == "packed":
        loaded.hold_packed()
    spec = config.speculative_config
    if spec is not None and spec.method == "mtp" and "mtp" not in loaded.params:  # the MTP layer
        why = mtp_refusal(loaded.cfg, loaded.path)
        if why is not None:
            raise ValueError(f"speculative_config: {why}")
        mtp = load_mtp_params(loaded.cfg, loaded.path, loaded.dtype)
        if loaded.tp is not None:  # split as the target's layers (models/mtp.py)
            mtp = shard_mtp_params(mtp, loaded.cfg, loaded.tp)
        loaded.params = {**loaded.params, "mtp": mtp}
    if spec is not None and spec.method == "draft_model":  # a second, smaller model (models/draft_model.py)
        if mesh is not None or loaded.tp is not None:
            raise ValueError("speculative_config: method 'draft_model' under a mesh is not supported yet")
        draft = load_draft(spec.model, loaded, config.dtype)
        loaded.draft = draft
        loaded.params = {**loaded.params, "draft": draft_params_like(draft, plan)}
    return loaded, plan


def computes_mtp(config: EngineConfig, model: Model) -> bool:
    """Whether the engine holds the MTP layer's caches: `method: mtp`, drafting, or on a P/D prefill
    instance, which computes the MTP's K/V and carry over each prompt and ships them
    (runtime/kv_transfer/spec_layout.py) and drafts nothing itself. Opt-in there, as vLLM sets the
    same speculative config on both sides: it costs one more attention layer's K/V projections per
    prompt token, its pages, and its rows on the wire."""
    spec = config.speculative_config
    return spec is not None and spec.method == "mtp" and "mtp" in model.params


def window_paging(config: EngineConfig, model: Model) -> int | None:
    """The sliding window whose layers page apart (paged_kv/window_pages.py), or None. `cache.window_paging`
    null: on where the model has window layers, under attention DP (each rank has both pools) and P/D
    roles too (the window layers' live pages travel: runtime/kv_transfer/window_layout.py)."""
    windows = [w for i in range(model.cfg.num_layers) if (w := model.cfg.sliding_window(i)) is not None]
    if not windows or config.window_paging is False:
        return None
    return max(windows)


def size_cache(
    config: EngineConfig, model: Model, max_blocks_per_seq: int, dp_size: int, window: int | None = None
) -> tuple[int, int, int | None, int]:
    """-> (pages, state slots, checkpoint slots or None, window pages: 0 without `window`) of one rank.
    Hybrids get one slot per running sequence plus the checkpoint budget (docs/prefix_caching.md);
    configured pools are totals over the data-parallel ranks; without `num_pages`, the pages the
    memory budget leaves. With window-aware paging (`window`) the window layers' pool holds
    `window_pool_pages` (every running sequence's window and a step's chunks) and `num_pages` (or
    the budget left after that pool) is the full layers' pool."""
    auto_latent(config, model, max_blocks_per_seq)
    num_slots, num_checkpoint_slots = 0, None
    if model.cfg.is_hybrid:
        num_slots, num_checkpoint_slots = plan_state_slots(
            max_num_seqs=config.max_num_seqs,
            prefix_caching=config.enable_prefix_caching,
            budget_fraction=config.hybrid_checkpoint_budget,
            cache_bytes=cache_budget_bytes(config),
            state_bytes_per_slot=model.state_bytes_per_slot_per_device(),  # cache_bytes is per device too
            page_bytes=page_bytes(config, model, "all" if window is None else "full"),
        )
        if config.num_state_slots:
            num_slots, num_checkpoint_slots = config.num_state_slots, None
    if dp_size > 1 and model.cfg.is_hybrid and config.num_state_slots:
        num_slots = rank_share(config.num_state_slots, dp_size, "num_state_slots")
    num_window_pages = 0
    if window is not None:
        ps = config.page_size
        spec = config.speculative_config
        k = 0 if spec is None else spec.num_speculative_tokens  # drafts' pages past the committed position
        num_window_pages = window_pool_pages(window, ps, config.max_num_seqs, config.max_num_batched_tokens, k)
        num_window_pages = min(num_window_pages, config.max_num_seqs * max_blocks_per_seq + 1)
    num_pages = rank_share(config.num_pages, dp_size, "num_pages") or default_num_pages(
        config, model, max_blocks_per_seq, num_slots, num_window_pages
    )
    return num_pages, num_slots, num_checkpoint_slots, num_window_pages


def auto_latent(config: EngineConfig, model: Model, max_blocks_per_seq: int) -> None:
    """`parallel.mla_latent: auto` (models/mla_split.py AUTO_RULE): the latent pools split where the
    replicated pool, sized from the memory budget, cannot hold every sequence at full length."""
    tp = model.tp
    if config.mla_latent != "auto" or tp is None or tp.latent_split or config.num_pages or model.cfg.mla is None:
        return
    bound = default_num_pages(config, model, max_blocks_per_seq, 0) < config.max_num_seqs * max_blocks_per_seq + 1
    args = (tp.size, config.page_size, True, config.kv_cache_dtype, config.kv_transfer is not None, bound)
    model.tp = dataclasses.replace(tp, latent_split=check_split("auto", *args))
    log.info("parallel.mla_latent auto: latent pools %s", "split by token" if model.tp.latent_split else "replicated")


def page_bytes(config: EngineConfig, model: Model, layers: str = "all") -> int:
    """One page's bytes on one device over the attention layers `layers` (Model.cache_bytes_per_token),
    the MTP layer's or the draft model's K/V included (both indexed by the target's page ids)."""
    tpu = on_tpu(model.tp.spec()) if model.tp else jax.default_backend() == "tpu"  # MLA pools pinned lane-padded
    per_page = max(model.cache_bytes_per_token(config.kv_cache_dtype, layers, lane_padded=tpu), 1) * config.page_size
    tp = model.tp
    if tp is not None and ((tp.attention and model.cfg.mla is None) or tp.latent_split):
        per_page = -(-per_page // tp.size)  # each device holds its KV heads only (MLA: its tokens' rows, or all)
    if layers != "window" and computes_mtp(config, model):  # the MTP layer's K/V (models/mtp.py)
        per_page += per_page // max(model.cfg.num_attention_layers, 1)
    draft = getattr(model, "draft", None)
    if draft is not None and layers != "window":  # the draft model's pools, the same page ids (models/draft_model.py)
        per_page += draft.cache_bytes_per_token(config.kv_cache_dtype) * config.page_size
    return per_page


def default_num_pages(
    config: EngineConfig, model: Model, max_blocks_per_seq: int, num_slots: int, num_window_pages: int = 0
) -> int:
    """Enough pages for every sequence at full length, capped by the memory budget left after
    the GDN state slots (pages and slots are budgeted together) and a window pool of
    `num_window_pages` (then a page is the full layers' only)."""
    want = config.max_num_seqs * max_blocks_per_seq + 1
    per_page = page_bytes(config, model, "full" if num_window_pages else "all")
    state_bytes = num_slots * model.state_bytes_per_slot_per_device()
    window_bytes = num_window_pages * page_bytes(config, model, "window") if num_window_pages else 0
    budget = cache_budget_bytes(config) - window_bytes
    return int(max(2, min(want, (budget - state_bytes) // per_page)))


def cache_budget_bytes(config: EngineConfig) -> int:
    """Device memory for KV pages + state slots (per device)."""
    budget = config.kv_cache_memory_bytes
    if budget is None:
        stats = jax.local_devices()[0].memory_stats() or {}  # on process 1+, devices()[0] is not ours
        if "bytes_limit" in stats:
            budget = int(stats["bytes_limit"] * config.memory_fraction) - stats.get("bytes_in_use", 0)
        else:
            budget = 2 * 2**30
    return budget


@dataclass(frozen=True)
class StepParts:
    """The sizes, scheduling and device side of one engine, chosen once when it is built."""

    max_blocks_per_seq: int
    cache_config: CacheConfig  # one rank's pool
    scheduler_config: SchedulerConfig
    opts: KernelOptions
    scheduler: Scheduler | DataParallelScheduler
    caches: dict
    seq_buckets: tuple[int, ...]
    executables: StepExecutables
    request_table: RequestTableHost | None  # the device-resident request table's host side; None under DP
    table: object  # its device side; None under DP
    dp: DataParallel | None  # attention data parallelism: the ranks and the host-built batch


def build_step_parts(
    config: EngineConfig,
    model: Model,
    plan: ExecutionPlan,
    *,
    max_model_len: int,
    rng: np.random.Generator,
) -> StepParts:
    """The pool sized (`size_cache`), then for one rank a `Scheduler`, the model's caches,
    `StepExecutables` and the request table; with a data axis (`data_parallel_size(config)` > 1),
    `build_data_parallel`'s per-rank schedulers, rank-stacked caches and DP executables."""
    dp_size = data_parallel_size(config)
    max_blocks_per_seq = pages_for(max_model_len, config.page_size)
    window = window_paging(config, model)
    num_pages, num_slots, num_checkpoint_slots, num_window_pages = size_cache(
        config, model, max_blocks_per_seq, dp_size, window
    )
    refuse_host_tier(config, window)
    drafting = getattr(model, "draft", None) is not None and "draft" in model.params
    if drafting and dp_size > 1:
        raise ValueError(
            "speculative_config: method 'draft_model' does not support attention data parallelism yet: "
            "its ranks' pages carry no draft K/V"
        )
    window_pool = None if window is None else (window, num_window_pages)
    cache_config = config.cache_config(num_pages, max_model_len, num_slots, num_checkpoint_slots, window_pool)
    if dp_size > 1:  # one host tier per rank: cache.kv_offloading_size is shared out, like cache.num_pages
        cache_config = replace(cache_config, host_tier_bytes=cache_config.host_tier_bytes // dp_size)
    scheduler_config = config.scheduler_config(max_model_len)
    opts = KernelOptions(
        attention=plan.attention_path, gdn=plan.gdn_path, interpret=config.kernel_config().interpret, tp=model.tp
    )
    sizes = (max_blocks_per_seq, cache_config, scheduler_config, opts)
    caches = model.init_caches(
        cache_config.num_pages,
        config.page_size,
        max(cache_config.num_state_slots, 2),
        config.kv_cache_dtype,
        bit_storage=plan.kv_bit_storage,
        num_window_pages=num_window_pages or None,
        # TPU kernel, head_dim < 128: pages stored [P, Hkv, D, ps] (no lane-padded copy of the pool)
        token_minor=plan.backend == "tpu"
        and plan.attention_path in ("pallas", "pallas_tpu")
        and token_minor_fits(model.cfg.head_dim, config.page_size),
    )
    if dp_size > 1:
        dp = build_data_parallel(
            config,
            model,
            opts,
            caches,
            size=dp_size,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            token_buckets=plan.token_buckets,
            max_blocks_per_seq=max_blocks_per_seq,
            max_model_len=max_model_len,
            fuse_greedy=plan.fuse_greedy,
            window_paging=window is not None,
        )
        return StepParts(*sizes, dp.scheduler, dp.caches, dp.seq_buckets, dp.executables, None, None, dp.dp)
    if computes_mtp(config, model):  # one more attention layer, same pages
        caches["mtp"] = init_mtp_caches(
            model,
            cache_config.num_pages,
            config.page_size,
            max(cache_config.num_state_slots, 2),
            resolve_kv_dtype(config.kv_cache_dtype, model.dtype),
            plan.kv_bit_storage,
        )
    forward_fn = {}
    if drafting:  # the draft model's KV pools, the same page ids as the target's
        caches["draft"] = init_draft_caches(
            model.draft, cache_config.num_pages, config.page_size, config.kv_cache_dtype, plan.kv_bit_storage
        )
        forward_fn = {"forward_fn": functools.partial(forward_with_draft, draft_cfg=model.draft.cfg)}
    executables = StepExecutables(
        model,
        caches,
        opts,
        token_buckets=plan.token_buckets,
        seq_buckets=plan.seq_buckets,
        max_num_seqs=config.max_num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        max_top_k=config.max_top_k,
        fuse_greedy=plan.fuse_greedy,
        max_model_len=max_model_len,
        page_size=config.page_size,
        window_paging=window is not None,
        **forward_fn,
    )
    window_columns = None if window is None else max_blocks_per_seq
    request_table = RequestTableHost(
        config.max_num_seqs, config.page_size, plan.token_buckets[-1], rng=rng, window_columns=window_columns
    )
    scheduler = Scheduler(scheduler_config, cache_config.build_manager())
    table = executables.new_table()
    return StepParts(*sizes, scheduler, caches, plan.seq_buckets, executables, request_table, table, None)
