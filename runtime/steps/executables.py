"""The compiled executables of one engine: a backbone per token bucket, a sampler per sequence bucket.

    backbone[T](params, caches, table, table_step, prev_tokens [max_num_seqs])
        -> (caches, table, hidden [max_num_seqs, H])                           caches donated
    greedy_backbone[T](params, caches, table, table_step, prev_tokens) -> (caches, table, tokens [max_num_seqs])
    prepare[T_max](table, table_step, prev_tokens) -> (table, batch)           a scoring step's inputs
    scoring_backbone[T_max](params, caches, batch, targets [T]) -> (caches, hidden, TokenScores [T])
    write_table(table, table_write) -> table                                    overflowing page writes
    sampler[S, n_logprobs, penalty widths, bias, all_greedy, masked](params, hidden, meta, bitmask, table)
        -> SamplerOutput   (table: the per-row sampling parameters of the step's rows; None with attention DP)
    copy_states(caches, src, dst) -> caches                                     caches donated

Each step's `ForwardBatch` is gathered on the device from the request table
(`runtime.steps.table_device`, `runtime.steps.table_host`): `prepare` takes the host's small
`TableStep` (table rows, token counts, the token ids the host knows, row resets and page
writes) and the previous step's sampled tokens as they lie on the device, and returns the
batch the backbone consumes; the host never builds or transfers the per-token and per-sequence
arrays, and a step planned while the previous one still ran reads that step's tokens (its
placeholders) from the table. `prepare` runs inside the backbone's executable, so a greedy
decode step with the fused greedy backbone is one executable, the bare loop's shape
(docs/benchmarks.md round 11); only a step that scores its prompt tokens prepares apart,
because the scoring backbone takes its batch. Every step's sampled tokens come out padded to `max_num_seqs`
rows (the greedy backbone's and the sampler's alike) so one `prev_tokens` shape serves.

Attention data parallelism (`DataParallelExecutables`, `token_feed = True`) builds its
rank-major batch on the host instead: its backbones take (params, caches, batch, feed) and
return (caches, hidden | tokens), `feed` being the device token feed of asynchronous
scheduling (`TokenFeed`): the previous step's sampled tokens [max_num_seqs] and, for each token
row, the row of that array it takes (-1: keep `batch.input_ids`).

`greedy_backbone` (with `fuse_greedy=True`) is the backbone with the argmax of the logits
fused in: the step of a batch whose every request is plain greedy (temperature 0, no
penalties, banned tokens or logprobs) is one executable and needs no sampling metadata —
vLLM's all-greedy fast path taken one dispatch further. It returns what the all-greedy
sampler would (the argmax of the same float32 logits) for the first min(T, max_num_seqs)
rows, which hold every live sequence (each has at least one token in the step). It exists for
the decode-sized buckets only (T <= max_num_seqs, `greedy_buckets`), where the sampler's
dispatch is a real share of the step; larger (prefill) steps keep backbone + sampler.

`scoring_backbone` is the backbone of a step in which some request wants prompt logprobs: the
same forward pass also keeps the final hidden state of every token row, and scores each row's
target (the next prompt token, -1 where none is wanted) with log_softmax over the full
vocabulary plus the top MAX_LOGPROBS alternatives (vLLM's prompt_logprobs). No second model
pass; the cost is the logits of every token row of that step (computed `runtime.steps.sampler.SCORE_BLOCK` rows at a
time, so at most [256, V] floats live at once), paid only by steps that carry such a request.
Such a step is prepared in the largest token bucket: one scoring executable, not one per bucket.

The variant space is bounded. Samplers: per sequence bucket, "plain" (no penalty, banned token,
logit bias or logprobs in the step) or "full" (any of them: every feature matrix padded to a
fixed width, `full_widths`, and MAX_LOGPROBS alternatives), each greedy or not, each with or
without the grammar bitmask. `compile_all` compiles the backbone of every token bucket (and its
greedy twin with `fuse_greedy`), `write_table` and the plain samplers; with `every_variant` also
the full samplers, the scoring backbone and its prepare, and `copy_states`, and then seals
the set: a step that would need anything else raises `CompileAfterStartup` instead of
compiling in the serving loop.
Unsealed (tests, `aot_compile=False`), missing variants compile on first use and are logged.
A step whose token count exceeds the largest bucket raises `BucketMiss`. JAX's persistent
compilation cache makes a restart cheap (`enable_persistent_cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm.auto import tqdm

from models.batch import ForwardBatch
from models.model import Model
from models.ops import KernelOptions
from models.transformer import compute_logits, forward
from runtime.buckets import BucketMiss
from runtime.steps.sampler import sample, score_hidden_rows
from runtime.steps.sampling_metadata import FullWidths, SamplingMetadata
from runtime.steps.table_device import RequestTable, apply_write, init_table, prepare, row_sampling
from runtime.steps.table_host import TableStep, page_write_width, write_width
from runtime.types import MAX_LOGPROBS

log = logging.getLogger("jaxserve.step")

__all__ = ["MAX_LOGPROBS", "CompileAfterStartup", "StepExecutables", "TokenFeed", "enable_persistent_cache"]


class CompileAfterStartup(RuntimeError):
    """A step needed an executable that the sealed start-up set does not hold."""


def enable_persistent_cache(cache_dir: str | Path) -> None:
    """JAX persistent compilation cache on local disk; cache every compile, however small."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """prev_tokens [max_num_seqs] i32 (device: the previous step's sampled tokens), rows [T] i32:
    the prev_tokens row each token row takes, -1 where the host's input id stands."""

    prev_tokens: jax.Array
    rows: jax.Array


jax.tree_util.register_dataclass(TokenFeed, data_fields=["prev_tokens", "rows"], meta_fields=[])


def feed_tokens(batch: ForwardBatch, feed: TokenFeed | None) -> ForwardBatch:
    """The batch with every fed row's input id taken from the previous step's tokens (a gather)."""
    if feed is None:
        return batch
    fed = jnp.where(feed.rows >= 0, feed.prev_tokens[jnp.maximum(feed.rows, 0)], batch.input_ids)
    return dataclasses.replace(batch, input_ids=fed)


def pad_tokens(tokens: jax.Array, rows: int) -> jax.Array:
    """tokens [n] -> [rows]: cut or zero-padded (rows past the live sequences are padding anyway)."""
    n = tokens.shape[0]
    return tokens[:rows] if n >= rows else jnp.pad(tokens, (0, rows - n))


def _spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _sharded_spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)


class StepExecutables:
    token_feed = False  # the backbones take a TokenFeed (host-built batches: attention DP) instead of the table

    def __init__(
        self,
        model: Model,
        caches,
        opts: KernelOptions,
        *,
        token_buckets,
        seq_buckets,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_top_k: int = 256,
        fuse_greedy: bool = False,
        max_model_len: int | None = None,
        forward_fn=forward,
        page_size: int = 16,
    ):
        # forward_fn: the model's forward pass; attention DP passes its per-rank vmap of it (runtime/parallel/data_parallel.py)
        forward = forward_fn
        self.model, self.opts = model, opts
        # With max_model_len every sampler variant is plain or full (bounded); without it the
        # feature matrices keep their power-of-two widths (one variant per width, compiled lazily).
        self.full_widths = FullWidths.for_model_len(max_model_len) if max_model_len else None
        self.sealed = False
        self.token_buckets, self.seq_buckets = tuple(token_buckets), tuple(seq_buckets)
        self.max_num_seqs, self.max_blocks_per_seq, self.max_top_k = max_num_seqs, max_blocks_per_seq, max_top_k
        # Under a mesh (opts.tp) specs carry the arrays' shardings, step inputs are replicated and
        # outputs are pinned to the input shardings, so donated caches keep their layout.
        self._specs = _spec if opts.tp is None else _sharded_spec
        self._replicated = None if opts.tp is None else opts.tp.spec()
        cache_shardings = None if opts.tp is None else jax.tree.map(lambda x: x.sharding, caches)
        self._cache_specs = jax.tree.map(self._specs, caches)
        self.fuse_greedy = fuse_greedy
        self.greedy_buckets = tuple(T for T in self.token_buckets if max_num_seqs >= T) if fuse_greedy else ()
        self._backbones: dict[int, object] = {}
        self._greedy_backbones: dict[int, object] = {}
        self._scoring_backbones: dict[int, object] = {}
        self._samplers: dict[tuple, object] = {}
        self._copy = None  # compiled copy_states (every_variant), else the jit compiles it lazily
        self.page_size = page_size
        self._prepares: dict[int, object] = {}
        self._write_table = None
        self.compile_seconds: dict[str, float] = {}
        cfg = model.cfg

        pinned = {} if opts.tp is None else {"out_shardings": self._replicated}
        self._prepare_jit = jax.jit(functools.partial(prepare, page_size=page_size), **pinned)
        self._write_table_jit = jax.jit(apply_write, **pinned)

        def backbone(params, caches, batch, feed=None):
            hidden, caches = forward(params, caches, feed_tokens(batch, feed), cfg=cfg, opts=opts)
            return caches, hidden

        pinned = {} if opts.tp is None else {"out_shardings": (cache_shardings, self._replicated)}
        self._backbone_jit = jax.jit(backbone, donate_argnums=1, **pinned)

        def greedy_backbone(params, caches, batch, feed=None):
            caches, hidden = backbone(params, caches, batch, feed)
            rows = min(batch.input_ids.shape[0], max_num_seqs)
            tokens = jnp.argmax(compute_logits(params, hidden[:rows]), axis=-1).astype(jnp.int32)
            return caches, pad_tokens(tokens, max_num_seqs)

        self._greedy_backbone_jit = jax.jit(greedy_backbone, donate_argnums=1, **pinned)

        def table_backbone(params, caches, table, step, prev_tokens, *, greedy):
            # prepare fused into the backbone: one dispatch a step instead of two (see run_table_backbone)
            table, batch = prepare(table, step, prev_tokens, page_size=page_size)
            caches, out = (greedy_backbone if greedy else backbone)(params, caches, batch)
            return caches, table, out

        pinned = {} if opts.tp is None else {"out_shardings": (cache_shardings, self._replicated, self._replicated)}
        self._table_backbone_jit = jax.jit(table_backbone, donate_argnums=1, static_argnames="greedy", **pinned)

        def scoring_backbone(params, caches, batch, targets):
            S, T = batch.logits_indices.shape[0], batch.input_ids.shape[0]
            rows = jnp.concatenate([batch.logits_indices, jnp.arange(T, dtype=jnp.int32)])  # [S + T]
            batch = dataclasses.replace(batch, logits_indices=rows)
            hidden, caches = forward(params, caches, batch, cfg=cfg, opts=opts)
            return caches, hidden[:S], score_hidden_rows(params, hidden[S:], targets)

        scoring_pinned = (
            {} if opts.tp is None else {"out_shardings": (cache_shardings, self._replicated, self._replicated)}
        )
        self._scoring_backbone_jit = jax.jit(scoring_backbone, donate_argnums=1, **scoring_pinned)

        def sampler(params, hidden, meta, bitmask, table, *, num_rows, num_logprobs, all_greedy):
            if not meta.has_row_params:  # the request table holds them: gather the step's rows
                meta = dataclasses.replace(meta, **row_sampling(table, num_rows))
            logits = compute_logits(params, hidden[:num_rows])
            out = sample(logits, meta, bitmask, max_top_k=max_top_k, num_logprobs=num_logprobs, all_greedy=all_greedy)
            return dataclasses.replace(out, tokens=pad_tokens(out.tokens, max_num_seqs))  # one feed shape

        pinned = {} if opts.tp is None else {"out_shardings": self._replicated}
        self._sampler_jit = jax.jit(sampler, static_argnames=("num_rows", "num_logprobs", "all_greedy"), **pinned)
        G = model.num_groups

        def copy_states(caches, src, dst, n):
            # Only the n real pairs are copied, one slot at a time in place: as a gather + scatter of
            # all max_num_seqs (padded) pairs it moved 16 x 512 KiB per GDN layer for one
            # checkpoint (the tiny hybrid: ~6-8 ms per layer of a prefill step).
            def copy(a):
                if a is None:
                    return None
                per_layer = a.reshape(G, a.shape[0] // G, *a.shape[1:])

                def one(i, x):
                    slot = lax.dynamic_slice_in_dim(x, src[i], 1, axis=1)
                    return lax.dynamic_update_slice_in_dim(x, slot, dst[i], axis=1)

                return lax.fori_loop(0, n, one, per_layer).reshape(a.shape)

            return {
                "kv": caches["kv"],
                "conv": tuple(map(copy, caches["conv"])),
                "rec": tuple(map(copy, caches["rec"])),
            }

        pinned = {} if opts.tp is None else {"out_shardings": cache_shardings}
        self._copy_jit = jax.jit(copy_states, donate_argnums=0, **pinned)

    # ---- specs --------------------------------------------------------------------------
    def _host_spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def _batch_spec(self, T: int) -> ForwardBatch:
        S, MB = self.max_num_seqs, self.max_blocks_per_seq
        i32 = jnp.int32
        spec = self._host_spec
        return ForwardBatch(
            input_ids=spec((T,), i32),
            positions=spec((T,), i32),
            slot_mapping=spec((T,), i32),
            cu_q_lens=spec((S + 1,), i32),
            kv_lens=spec((S,), i32),
            block_tables=spec((S, MB), i32),
            state_slot_ids=spec((S,), i32),
            has_initial_state=spec((S,), jnp.bool_),
            num_seqs=spec((), i32),
            logits_indices=spec((S,), i32),
        )

    def _feed_spec(self, T: int) -> TokenFeed | None:
        if not self.token_feed:
            return None
        return TokenFeed(
            prev_tokens=self._host_spec((self.max_num_seqs,), jnp.int32), rows=self._host_spec((T,), jnp.int32)
        )

    def new_table(self) -> RequestTable:
        """An empty request table (every row free) on the device."""
        return init_table(self.max_num_seqs, self.max_blocks_per_seq, self._replicated)

    def _table_write_width(self, T: int) -> int:
        """A write's entries (runtime/steps/table_host.py) in token bucket T."""
        return write_width(self.max_num_seqs, page_write_width(T, self.max_num_seqs, self.page_size))

    def _table_step_spec(self, T: int) -> TableStep:
        meta = 2 * self.max_num_seqs + self._table_write_width(T)
        return TableStep(meta=self._host_spec((meta,), jnp.int32), host_tokens=self._host_spec((T,), jnp.int32))

    @property
    def row_params_in_table(self) -> bool:
        """The sampler reads temperature ... seeds from the request table (not with attention DP)."""
        return not self.token_feed

    def _meta_spec(
        self, S: int, out_width: int = 0, prompt_width: int = 0, banned: int = 0, bias: int = 0
    ) -> SamplingMetadata:
        f32, i32 = jnp.float32, jnp.int32
        spec = self._host_spec
        in_table = self.row_params_in_table
        row = lambda dt: None if in_table else spec((S,), dt)
        return SamplingMetadata(
            temperature=row(f32),
            top_k=row(i32),
            top_p=row(f32),
            min_p=row(f32),
            presence_penalty=row(f32),
            frequency_penalty=row(f32),
            repetition_penalty=row(f32),
            seeds=row(jnp.uint32),
            steps=spec((S,), i32),
            output_ids=spec((S, out_width), i32),
            prompt_ids=spec((S, prompt_width), i32),
            banned_ids=spec((S, banned), i32),
            logit_bias_ids=spec((S, bias), i32),
            logit_bias_values=spec((S, bias), f32),
        )

    # ---- compile ------------------------------------------------------------------------
    def _check_unsealed(self, name: str) -> None:
        if self.sealed:
            raise CompileAfterStartup(
                f"{name} was not compiled at start-up and compiling in the serving loop is off "
                f"({len(self.compile_seconds)} executables compiled at start-up)"
            )

    def _compile_backbone(self, T: int, greedy: bool = False):
        self._check_unsealed(f"{'greedy_' if greedy else ''}backbone[T={T}]")
        t0 = time.perf_counter()
        params = jax.tree.map(self._specs, self.model.params)
        if self.token_feed:
            fn = self._greedy_backbone_jit if greedy else self._backbone_jit
            exe = fn.trace(params, self._cache_specs, self._batch_spec(T), self._feed_spec(T)).lower().compile()
        else:  # prepare fused in
            exe = (
                self._table_backbone_jit.trace(params, self._cache_specs, *self._table_args_spec(T), greedy=greedy)
                .lower()
                .compile()
            )
        self.compile_seconds[f"{'greedy_' if greedy else ''}backbone[T={T}]"] = time.perf_counter() - t0
        (self._greedy_backbones if greedy else self._backbones)[T] = exe
        return exe

    def _table_spec(self) -> RequestTable:
        """The request table's specs, no array made (a compile-only client cannot hold one)."""
        shapes = jax.eval_shape(functools.partial(init_table, self.max_num_seqs, self.max_blocks_per_seq))
        return jax.tree.map(lambda s: self._host_spec(s.shape, s.dtype), shapes)

    def _table_args_spec(self, T: int) -> tuple:
        """(table, table_step, prev_tokens) specs of token bucket T."""
        return self._table_spec(), self._table_step_spec(T), self._host_spec((self.max_num_seqs,), jnp.int32)

    def _compile_prepare(self, T: int):
        self._check_unsealed(f"prepare[T={T}]")
        t0 = time.perf_counter()
        self._prepares[T] = self._prepare_jit.trace(*self._table_args_spec(T)).lower().compile()
        self.compile_seconds[f"prepare[T={T}]"] = time.perf_counter() - t0
        return self._prepares[T]

    def _compile_write_table(self):
        """One executable for the rare overflowing page writes, at the largest bucket's width."""
        self._check_unsealed("write_table")
        t0 = time.perf_counter()
        spec = self._host_spec((self._table_write_width(self.token_buckets[-1]),), jnp.int32)
        self._write_table = self._write_table_jit.trace(self._table_spec(), spec).lower().compile()
        self.compile_seconds["write_table"] = time.perf_counter() - t0
        return self._write_table

    def _compile_scoring_backbone(self, T: int):
        self._check_unsealed(f"scoring_backbone[T={T}]")
        t0 = time.perf_counter()
        params = jax.tree.map(self._specs, self.model.params)
        exe = (
            self._scoring_backbone_jit.trace(
                params, self._cache_specs, self._batch_spec(T), self._host_spec((T,), jnp.int32)
            )
            .lower()
            .compile()
        )
        self.compile_seconds[f"scoring_backbone[T={T}]"] = time.perf_counter() - t0
        self._scoring_backbones[T] = exe
        return exe

    def _compile_sampler(self, key):
        S, n_logprobs, out_w, prompt_w, banned, bias, greedy, mask_w = key
        self._check_unsealed(f"sampler{key}")
        t0 = time.perf_counter()
        params = jax.tree.map(self._specs, self.model.params)
        hidden = self._host_spec((self.max_num_seqs, self.model.cfg.hidden_size), jnp.dtype(self.model.dtype))
        bitmask = self._host_spec((S, mask_w), jnp.int32) if mask_w else None
        table = self._table_spec() if self.row_params_in_table else None
        exe = (
            self._sampler_jit.trace(
                params,
                hidden,
                self._meta_spec(S, out_w, prompt_w, banned, bias),
                bitmask,
                table,
                num_rows=S,
                num_logprobs=n_logprobs,
                all_greedy=greedy,
            )
            .lower()
            .compile()
        )
        name = (
            f"sampler[S={S},logprobs={n_logprobs},pen={out_w}/{prompt_w},banned={banned},bias={bias}"
            f"{',greedy' if greedy else ''}{',masked' if mask_w else ''}]"
        )
        self.compile_seconds[name] = time.perf_counter() - t0
        self._samplers[key] = exe
        return exe

    def _compile_copy_states(self):
        t0 = time.perf_counter()
        index = self._host_spec((self.max_num_seqs,), jnp.int32)
        self._copy = (
            self._copy_jit.trace(self._cache_specs, index, index, self._host_spec((), jnp.int32)).lower().compile()
        )
        self.compile_seconds["copy_states"] = time.perf_counter() - t0

    def _full_key(self, S: int, greedy: bool, mask_w: int) -> tuple:
        w = self.full_widths
        return (S, MAX_LOGPROBS, w.output_ids, w.prompt_ids, w.banned_ids, w.logit_bias, greedy, mask_w)

    def compile_all(
        self, progress: bool = True, bitmask_width: int = 0, every_variant: bool = False
    ) -> dict[str, float]:
        """Compile the backbone of every token bucket (and its greedy twin with `fuse_greedy`),
        write_table, and the plain and
        all-greedy samplers of every sequence bucket; with `bitmask_width`, their grammar-masked
        twins too, so a request with a grammar joining a batch compiles nothing. `every_variant`
        (needs max_model_len): also the full samplers, the scoring backbone and copy_states, then
        seal: nothing compiles after start-up (with the request table, also the scoring step's
        own prepare). Logs the count and the time."""
        if every_variant and self.full_widths is None:
            raise ValueError("every_variant needs StepExecutables(max_model_len=...) to bound the sampler widths")
        t_start, before = time.perf_counter(), len(self.compile_seconds)
        kinds = ("sampler", "greedy sampler") + (("full sampler", "full greedy sampler") if every_variant else ())
        jobs = [("backbone", T, 0) for T in self.token_buckets] + [
            (kind, S, w) for w in sorted({0, bitmask_width}) for S in self.seq_buckets for kind in kinds
        ]
        jobs += [("greedy backbone", T, 0) for T in self.greedy_buckets]
        if not self.token_feed:  # the request table's executables
            jobs += [("write table", 0, 0)]
        if every_variant:
            jobs += [("scoring backbone", self.token_buckets[-1], 0), ("copy states", 0, 0)]
            if not self.token_feed:  # a scoring step's own prepare (other steps' is fused into the backbone)
                jobs += [("prepare", self.token_buckets[-1], 0)]
        for kind, n, width in tqdm(jobs, desc="compiling buckets", unit="bucket", disable=not progress):
            greedy = "greedy" in kind
            if kind.endswith("backbone"):
                (
                    self._compile_scoring_backbone(n)
                    if kind == "scoring backbone"
                    else self._compile_backbone(n, greedy=greedy)
                )
            elif kind == "copy states":
                self._compile_copy_states()
            elif kind == "prepare":
                self._compile_prepare(n)
            elif kind == "write table":
                self._compile_write_table()
            elif kind.startswith("full"):
                self._compile_sampler(self._full_key(n, greedy, width))
            else:
                self._compile_sampler((n, 0, 0, 0, 0, 0, greedy, width))
        self.sealed = every_variant
        log.info(
            "compiled %d executables in %.1fs%s",
            len(self.compile_seconds) - before,
            time.perf_counter() - t_start,
            " (sealed: no compile after start-up)" if self.sealed else "",
        )
        log.info("executables: %s", ", ".join(self.compile_seconds))
        return dict(self.compile_seconds)

    def warm_up(self, params, caches):
        """Run every compiled backbone and sampler once on an empty batch (no live sequence: every
        KV write goes to slot -1 and no state slot is touched); returns the caches (donated and
        handed back). XLA:CPU does part of its work on an executable's first run: 70-140 ms per
        bucket for the tiny dense model (docs/benchmarks.md round 7, item 5, in git history at
        e136513), which would otherwise land on the first request that reaches each bucket."""
        t0 = time.perf_counter()

        def zeros(spec):
            return None if spec is None else jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)

        for _greedy, exes in ((False, self._backbones), (True, self._greedy_backbones)):
            for T, exe in sorted(exes.items()):
                if self.token_feed:
                    batch = dataclasses.replace(zeros(self._batch_spec(T)), slot_mapping=jnp.full((T,), -1, jnp.int32))
                    caches, out = exe(params, caches, batch, zeros(self._feed_spec(T)))
                else:  # a throwaway table: the step has no row with a token (every KV write to slot -1)
                    _, step, prev_tokens = self._table_args_spec(T)
                    caches, _, out = exe(params, caches, self.new_table(), zeros(step), zeros(prev_tokens))
                jax.block_until_ready(out)
        hidden = jnp.zeros((self.max_num_seqs, self.model.cfg.hidden_size), jnp.dtype(self.model.dtype))
        table = self.new_table() if self.row_params_in_table else None
        for key, exe in sorted(self._samplers.items()):
            S, _, out_w, prompt_w, banned, bias, _, mask_w = key
            meta = zeros(self._meta_spec(S, out_w, prompt_w, banned, bias))
            bitmask = jnp.zeros((S, mask_w), jnp.int32) if mask_w else None
            jax.block_until_ready(exe(params, hidden, meta, bitmask, table))
        log.info(
            "warmed up %d backbones and %d samplers in %.1fs",
            len(self._backbones) + len(self._greedy_backbones),
            len(self._samplers),
            time.perf_counter() - t0,
        )
        return caches

    # ---- run ----------------------------------------------------------------------------
    def run_prepare(self, table: RequestTable, step: TableStep, prev_tokens) -> tuple[RequestTable, ForwardBatch]:
        """-> (table after the step, the step's device ForwardBatch). prev_tokens [max_num_seqs].
        Only a scoring step prepares apart; every other step's prepare runs inside its backbone."""
        T = step.host_tokens.shape[0]
        exe = self._prepares.get(T)
        if exe is None:
            if T not in self.token_buckets:
                raise BucketMiss(f"token count {T} has no compiled prepare bucket {self.token_buckets}")
            log.info("compiling prepare bucket T=%d (not compiled ahead of time)", T)
            exe = self._compile_prepare(T)
        return exe(table, step, prev_tokens)

    def run_write_table(self, table: RequestTable, write: np.ndarray) -> RequestTable:
        """Page writes that overflow a step's own (see runtime/steps/table_host.py)."""
        return (self._write_table or self._compile_write_table())(table, write)

    def run_table_backbone(self, params, caches, table: RequestTable, step: TableStep, prev_tokens):
        """prepare + backbone in one executable -> (caches, table after the step, hidden [max_num_seqs, H])."""
        return self._backbone(step.host_tokens.shape[0], greedy=False)(params, caches, table, step, prev_tokens)

    def run_table_greedy_backbone(self, params, caches, table: RequestTable, step: TableStep, prev_tokens):
        """prepare + greedy backbone -> (caches, table, argmax tokens [max_num_seqs]: the first
        min(T, max_num_seqs) rows, zero padded)."""
        return self._backbone(step.host_tokens.shape[0], greedy=True)(params, caches, table, step, prev_tokens)

    def run_backbone(self, params, caches, batch: ForwardBatch, feed: TokenFeed | None = None):
        """A host-built batch (attention DP) -> (caches, hidden [max_num_seqs, H])."""
        return self._backbone(batch.input_ids.shape[0], greedy=False)(params, caches, batch, feed)

    def run_greedy_backbone(self, params, caches, batch: ForwardBatch, feed: TokenFeed | None = None):
        """A host-built batch -> (caches, argmax tokens [max_num_seqs]: the first min(T, max_num_seqs)
        rows, zero padded)."""
        return self._backbone(batch.input_ids.shape[0], greedy=True)(params, caches, batch, feed)

    def _backbone(self, T: int, greedy: bool):
        """The compiled backbone of bucket T (its signature: `token_feed`'s batch + feed, else the table's)."""
        exe = (self._greedy_backbones if greedy else self._backbones).get(T)
        if exe is None:
            buckets = self.greedy_buckets if greedy else self.token_buckets
            kind = "greedy backbone" if greedy else "backbone"
            if T not in buckets:
                raise BucketMiss(f"token count {T} has no compiled {kind} bucket {buckets}")
            log.info("compiling %s bucket T=%d (not compiled ahead of time)", kind, T)
            exe = self._compile_backbone(T, greedy=greedy)
        return exe

    def run_scoring_backbone(self, params, caches, batch: ForwardBatch, targets: np.ndarray):
        """-> (caches, hidden [max_num_seqs, H], TokenScores of every token row). targets [T] i32;
        the step is prepared in the largest token bucket (one scoring executable)."""
        T, T_max = batch.input_ids.shape[0], self.token_buckets[-1]
        if T_max != T:
            raise BucketMiss(f"a scoring step must be prepared in the largest token bucket {T_max}, not {T}")
        exe = self._scoring_backbones.get(T_max)
        if exe is None:
            log.info("compiling scoring backbone bucket T=%d (prompt logprobs)", T_max)
            exe = self._compile_scoring_backbone(T_max)
        return exe(params, caches, batch, targets)

    def run_sampler(
        self,
        params,
        hidden,
        meta: SamplingMetadata,
        num_logprobs: int,
        all_greedy: bool = False,
        bitmask: np.ndarray | None = None,
        table: RequestTable | None = None,
    ):
        """`all_greedy`: every real row has temperature 0 (padding rows always are), known on the host.
        `bitmask`: None, or the step's [S, W] i32 allowed-token bitmask (structured output).
        With the request table (`row_params_in_table`) `meta` carries no per-row parameters
        (`SamplingMetadata.from_params(..., row_params=False)`) and `table` is the table after the
        step's prepare: the sampler gathers them from the step's rows."""
        if meta.has_row_params == self.row_params_in_table or (self.row_params_in_table and table is None):
            where = "the request table (pass row_params=False and table=)" if self.row_params_in_table else "meta"
            raise ValueError(f"this sampler reads the per-row sampling parameters from {where}")
        S = meta.num_rows
        mask_w = 0 if bitmask is None else bitmask.shape[1]
        meta, num_logprobs = self._bounded(meta, num_logprobs)
        key = (
            S,
            num_logprobs,
            meta.output_ids.shape[1],
            meta.prompt_ids.shape[1],
            meta.num_banned,
            meta.num_logit_bias,
            bool(all_greedy),
            mask_w,
        )
        exe = self._samplers.get(key)
        if exe is None:
            log.info(
                "compiling sampler variant S=%d logprobs=%d penalty widths=%d/%d banned=%d bias=%d greedy=%s "
                "bitmask width=%d",
                *key,
            )
            exe = self._compile_sampler(key)
        return exe(params, hidden, meta, bitmask, table if self.row_params_in_table else None)

    def _bounded(self, meta: SamplingMetadata, num_logprobs: int) -> tuple[SamplingMetadata, int]:
        """A step using any sampler feature gets the full variant's fixed widths (plain stays plain)."""
        w = self.full_widths
        widths = (meta.output_ids.shape[1], meta.prompt_ids.shape[1], meta.num_banned, meta.num_logit_bias)
        if w is None or (num_logprobs == 0 and not any(widths)):
            return meta, num_logprobs
        return meta.with_widths(w.output_ids, w.prompt_ids, w.banned_ids, w.logit_bias), MAX_LOGPROBS

    def copy_states(self, caches, pairs: list[tuple[int, int]]):
        src = np.zeros(self.max_num_seqs, np.int32)
        dst = np.zeros(self.max_num_seqs, np.int32)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        if self._copy is None:
            self._check_unsealed("copy_states")
        return (self._copy or self._copy_jit)(caches, src, dst, np.int32(len(pairs)))
