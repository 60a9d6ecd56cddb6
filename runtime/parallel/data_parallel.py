"""Attention data parallelism (DP): D independent batches in one SPMD step.

With `parallel.mesh: {data: D, model: M}` (D > 1) the engine serves D *ranks*. Weights are split
over `model` and replicated over `data`; everything that belongs to a request is split over
`data`:

- **pages and slots**: every cache leaf gets a leading rank axis, `[D, ...one rank's cache...]`,
  sharded `P("data", <the model-axis spec>)`. Rank d owns `num_pages / D` pages (its own null
  page 0 included) and its own state slots; block tables and slot ids are *rank-local* indices.
- **scheduling** (runtime/scheduling/dp_scheduler.py, no JAX): `DataParallelScheduler` keeps one
  `Scheduler` (queue + cache manager) per rank. A new request goes to the rank with the most prefix-cache hit tokens, then the fewest
  outstanding tokens (tpu-inference's rule), and stays there. Each rank schedules on its own:
  a rank out of pages preempts or queues its own requests only; the others keep serving.
  `max_num_seqs` and `max_num_batched_tokens` are per rank, so a saturated step carries up to
  D x the tokens of a one-rank step.
- **the step**: `build_data_parallel_batch` pads each rank's `SchedulerOutput` to the same
  static token bucket T (the largest any rank needs) with the ordinary `build_batch`, and
  concatenates them rank-major: a flat `ForwardBatch` of `[D*T]` tokens, `[D*(S+1)]` cu_q_lens,
  `[D*S]` per-sequence rows, `[D]` num_seqs. Its `logits_indices` are *global* rows in the
  order of the combined `DataParallelOutput.sequences`, so the sampler, the greedy backbone and
  the engine's commit code see one ordinary batch of up to D*S sequences.
- **the forward pass**: `data_parallel_forward` reshapes that batch to `[D, ...]` and runs the
  unchanged single-rank `models.transformer.forward` under `jax.vmap(spmd_axis_name="data")`
  over (rank caches, rank batch). vmap rather than a `shard_map` over `data` keeps the model
  code exactly the single-device code (no per-rank branches, no manual collectives): GSPMD
  splits the rank axis over `data` because the caches and the step inputs are sharded that way,
  and `spmd_axis_name` tells every `shard_map` inside (the Pallas kernels' model-axis split,
  `models/ops.py`) that its new leading axis lives on `data`. The rank's final hidden states of
  all T rows come back as `[D*T, H]` and the global `logits_indices` gather the sampled rows.

Speculative decoding (`ngram`; runtime/speculative/dp_verify.py): a drafting sequence's k drafts
are k more tokens of its rank's slice (the same token buckets), the verify rows are global rows of
the flat batch, and a GDN hybrid's replay of the accepted prefixes runs per rank through
`over_ranks`, the vmap the forward pass uses.

Window-aware paging (paged_kv/window_pages.py): each rank holds both pools (stacked like every
cache) and its scheduler its own window tables; the flat batch carries them rank-major like the
block tables (a rank that schedules nothing: null tables). Prompt logprobs (the scoring backbone)
and P/D disaggregation are refused under DP (a precise ValueError), not served wrongly. The engine chooses DP when it is built: for D > 1 its constructor
takes its scheduler, caches, sequence buckets and executables from `build_data_parallel`; D == 1
keeps the engine's default path and only asks `data_parallel_size` / `rank_share` here
(identities for one rank). The MoE block is wrapped in
`models.tokenwise.tokenwise`, which without a vmap is the plain function.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.batch import ForwardBatch
from models.cache_formats import cache_formats
from models.transformer import forward
from runtime.buckets import bucket_for, pow2_buckets
from runtime.parallel.mesh import DATA_AXIS
from runtime.scheduling.dp_scheduler import DataParallelOutput, DataParallelScheduler
from runtime.steps.executables import StepExecutables
from runtime.steps.inputs import build_batch


# ---- the step's inputs --------------------------------------------------------------------------
def build_data_parallel_batch(
    out: DataParallelOutput,
    *,
    token_buckets: tuple[int, ...],
    max_num_seqs: int,
    max_blocks_per_seq: int,
    page_size: int,
) -> ForwardBatch:
    """Every rank's slice padded to the same bucket T, concatenated rank-major (see module doc).
    logits_indices [D*S]: the global token row of each combined sequence, then zeros."""
    need = max(max(o.num_batched_tokens, len(o.sequences)) for o in out.ranks)
    T = bucket_for(need, token_buckets)
    parts = [
        build_batch(
            o, token_buckets=(T,), max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks_per_seq, page_size=page_size
        )
        for o in out.ranks
    ]
    if any(p.window_block_tables is not None for p in parts):  # window paging: an idle rank's tables are null
        parts = [with_window_tables(p, max_num_seqs, max_blocks_per_seq) for p in parts]
    logits_rows = np.zeros(len(parts) * max_num_seqs, np.int32)
    logits_rows[: len(out.sequences)] = np.concatenate(
        [rank * T + part.logits_indices[: len(o.sequences)] for rank, (part, o) in enumerate(zip(parts, out.ranks))]
    )
    fields = {
        f.name: np.concatenate([np.atleast_1d(getattr(p, f.name)) for p in parts])
        for f in dataclasses.fields(ForwardBatch)
        if getattr(parts[0], f.name) is not None
    }
    return ForwardBatch(**{**fields, "logits_indices": logits_rows})


def with_window_tables(part: ForwardBatch, max_num_seqs: int, max_blocks_per_seq: int) -> ForwardBatch:
    """A rank's batch with window-aware paging's tables: a rank that schedules nothing has none from
    `build_batch` (it cannot tell), so they are the null page and no write."""
    if part.window_block_tables is not None:
        return part
    T = part.input_ids.shape[0]
    return dataclasses.replace(
        part,
        window_block_tables=np.zeros((max_num_seqs, max_blocks_per_seq), np.int32),
        window_slot_mapping=np.full(T, -1, np.int32),
    )


def split_ranks(batch: ForwardBatch, size: int) -> ForwardBatch:
    """The flat DP batch as [D, ...] per-rank arrays; each rank keeps the hidden state of all its rows."""
    ranks = {
        f.name: getattr(batch, f.name).reshape(size, -1, *getattr(batch, f.name).shape[1:])
        for f in dataclasses.fields(ForwardBatch)
        if getattr(batch, f.name) is not None
    }
    T = ranks["input_ids"].shape[1]
    ranks["num_seqs"] = batch.num_seqs  # [D]
    ranks["logits_indices"] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (size, T))
    return ForwardBatch(**ranks)


def over_ranks(fn, caches, batch: ForwardBatch, *args, opts, size: int):
    """fn(rank caches, rank batch, *rank args) of every rank at once (vmap over the rank axis, on
    `data`): caches and args [D, ...], batch the flat DP batch (`split_ranks`). The forward pass
    runs this way, and so does speculative decoding's GDN replay (runtime/speculative/dp_verify.py)."""
    ranks = split_ranks(batch, size)
    if opts.tp is not None:  # each rank's step inputs live on its own devices
        on_data = NamedSharding(opts.tp.mesh, P(DATA_AXIS))
        ranks = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, on_data), ranks)
    return jax.vmap(fn, spmd_axis_name=DATA_AXIS)(caches, ranks, *args)


def data_parallel_forward(params, caches, batch: ForwardBatch, *, cfg, opts, size: int):
    """forward() of every rank at once -> (hidden [len(batch.logits_indices), H], caches).

    caches: every leaf [D, ...] (rank axis on `data`); batch: the flat DP batch."""

    def one_rank(rank_caches, rank_batch):
        return forward(params, rank_caches, rank_batch, cfg=cfg, opts=opts)

    hidden, caches = over_ranks(one_rank, caches, batch, opts=opts, size=size)  # hidden [D, T, H]
    return hidden.reshape(-1, hidden.shape[-1])[batch.logits_indices], caches


# ---- caches and executables ---------------------------------------------------------------------
def stack_rank_caches(caches: dict, size: int, mesh) -> dict:
    """One rank's caches (split over `model`) -> [D, ...] caches, rank axis split over `data`."""

    def stack(x):
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        out = NamedSharding(mesh, P(DATA_AXIS, *spec))
        return jax.jit(lambda a: jnp.broadcast_to(a, (size, *a.shape)), out_shardings=out)(x)

    return jax.tree.map(stack, caches)


class DataParallelExecutables(StepExecutables):
    """`StepExecutables` over the flat DP batch: token buckets are D x the per-rank buckets, the
    sampled rows up to D x max_num_seqs; copy_states takes (rank, src, dst) triples. The batch is
    built on the host (no request table), so placeholders come through the TokenFeed."""

    token_feed = True

    def __init__(
        self,
        model,
        caches,
        opts,
        *,
        size: int,
        token_buckets,
        seq_buckets,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_top_k: int = 256,
        fuse_greedy: bool = False,
        max_model_len: int | None = None,
        window_paging: bool = False,
    ):
        self.size, self.rank_max_num_seqs = size, max_num_seqs
        self.rank_token_buckets = tuple(token_buckets)
        self.over_ranks = functools.partial(over_ranks, opts=opts, size=size)  # a per-rank function of a step
        super().__init__(
            model,
            caches,
            opts,
            token_buckets=tuple(size * T for T in token_buckets),
            seq_buckets=seq_buckets,
            max_num_seqs=size * max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            max_top_k=max_top_k,
            fuse_greedy=fuse_greedy,
            max_model_len=max_model_len,
            forward_fn=functools.partial(data_parallel_forward, size=size),
            window_paging=window_paging,
        )
        groups = model.num_groups

        def copy_rank_states(caches, src, dst):  # src, dst [D, max_num_seqs] rank-local slots
            def copy(a):  # [D, G*N, ...] -> per layer group [D, G, N, ...]
                if a is None:
                    return None
                per_layer = a.reshape(size, groups, a.shape[1] // groups, *a.shape[2:])
                rank = jnp.arange(size)[:, None]
                return per_layer.at[rank, :, dst].set(per_layer[rank, :, src]).reshape(a.shape)

            return {
                "kv": caches["kv"],
                "conv": tuple(map(copy, caches["conv"])),
                "rec": tuple(map(copy, caches["rec"])),
            }

        cache_shardings = cache_formats(caches)  # MLA pools kept in their pinned layout on TPU
        self._copy_jit = jax.jit(copy_rank_states, donate_argnums=0, out_shardings=cache_shardings)

    def _batch_spec(self, T: int) -> ForwardBatch:
        D, S = self.size, self.rank_max_num_seqs
        spec = super()._batch_spec(T)
        return dataclasses.replace(
            spec, cu_q_lens=self._host_spec((D * (S + 1),), jnp.int32), num_seqs=self._host_spec((D,), jnp.int32)
        )

    def run_scoring_backbone(self, params, caches, batch, targets):
        raise ValueError("prompt logprobs are not supported with attention data parallelism")

    def copy_states(self, caches, pairs: list[tuple[int, int, int]]):
        src = np.zeros((self.size, self.rank_max_num_seqs), np.int32)
        dst = np.zeros_like(src)
        used = [0] * self.size
        for rank, s, d in pairs:
            src[rank, used[rank]], dst[rank, used[rank]] = s, d
            used[rank] += 1
        return self._copy_jit(caches, src, dst)


# ---- engine wiring ------------------------------------------------------------------------------
def data_parallel_size(config) -> int:
    """D of an EngineConfig: the mesh's data axis (1 without a mesh)."""
    return config.parallel_config().data_parallel_size


def rank_share(total: int | None, size: int, what: str) -> int | None:
    """An explicitly configured pool size (`num_pages`, `num_state_slots`: totals over the ranks)
    -> one rank's share; None stays None (the per-device defaults are per rank already)."""
    if size == 1 or not total:
        return total
    share = total // size
    if share < 2:
        raise ValueError(
            f"{what}={total} split over {size} data-parallel ranks leaves {share} per rank "
            f"(each rank needs its own null entry and at least one usable one)"
        )
    return share


@dataclasses.dataclass
class DataParallel:
    """What the engine needs to run DP steps: the rank count and the step batch builder."""

    size: int
    token_buckets: tuple[int, ...]  # per rank
    max_num_seqs: int  # per rank
    max_blocks_per_seq: int
    page_size: int

    def build_batch(self, out: DataParallelOutput) -> ForwardBatch:
        return build_data_parallel_batch(
            out,
            token_buckets=self.token_buckets,
            max_num_seqs=self.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            page_size=self.page_size,
        )


@dataclasses.dataclass(frozen=True)
class DataParallelParts:
    """A `size`-rank engine's scheduling and device side, built once by `build_data_parallel`."""

    scheduler: DataParallelScheduler
    caches: dict  # every leaf [D, ...], the rank axis on `data`
    seq_buckets: tuple[int, ...]  # up to D x max_num_seqs
    executables: DataParallelExecutables
    dp: DataParallel


def build_data_parallel(
    config,
    model,
    opts,
    caches: dict,
    *,
    size: int,
    scheduler_config,
    cache_config,
    token_buckets: tuple[int, ...],
    max_blocks_per_seq: int,
    max_model_len: int,
    fuse_greedy: bool,
    window_paging: bool = False,
) -> DataParallelParts:
    """The parts of a `size`-rank engine (called by `LLMEngine.__init__` when `data_parallel_size(config)
    > 1`): per-rank schedulers, one rank's `caches` stacked over the ranks, DP executables and sequence
    buckets up to size x max_num_seqs. ValueError for what DP does not serve (P/D roles, no mesh)."""
    if config.kv_transfer is not None and config.kv_transfer.role != "both":
        raise ValueError(
            "prefill/decode disaggregation (parallel.role) is not supported with attention data "
            "parallelism; use data: 1"
        )
    if model.tp is None:
        raise ValueError("attention data parallelism needs a device mesh")
    caches = stack_rank_caches(caches, size, model.tp.mesh)
    seq_buckets = pow2_buckets(size * config.max_num_seqs, minimum=8)
    executables = DataParallelExecutables(
        model,
        caches,
        opts,
        size=size,
        token_buckets=token_buckets,
        seq_buckets=seq_buckets,
        max_num_seqs=config.max_num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        max_top_k=config.max_top_k,
        fuse_greedy=fuse_greedy,
        max_model_len=max_model_len,
        window_paging=window_paging,
    )
    return DataParallelParts(
        scheduler=DataParallelScheduler(scheduler_config, cache_config, size),
        caches=caches,
        seq_buckets=seq_buckets,
        executables=executables,
        dp=DataParallel(size, token_buckets, config.max_num_seqs, max_blocks_per_seq, config.page_size),
    )
