"""The executable table of one engine: every step program compiled per bucket, keyed by `StepKey`.

    exes = StepExecutables(model, caches, opts, token_buckets=..., seq_buckets=..., ...)
    exes.compile_all(every_variant=True)           # the start-up set, then sealed
    exes.compile(StepKey("backbone", 64))          # one entry: trace, lower, compile, timed
    exes.lower(StepKey("batch_backbone", 64), lowering_platforms=("cuda",))   # `jaxserve plan` on GPU
    caches, table, hidden = exes.run_table_backbone(params, caches, table, step, prev_tokens)

A key names a program (runtime/steps/programs.py) and the static shape that picks its executable:

    backbone[T]           the step backbone. With the request table, prepare is fused in (one dispatch):
                          (table, TableStep, prev_tokens [max_num_seqs]) -> (caches, table, hidden);
                          attention DP (`token_feed`, host-built batch): (batch, TokenFeed) -> (caches, hidden)
    greedy_backbone[T]    StepKey("backbone", T, greedy=True): the argmax fused in, tokens instead of
                          hidden (`fuse_greedy`, decode buckets T <= max_num_seqs: `greedy_buckets`)
    batch_backbone[T]     a host-built ForwardBatch, no feed: `jaxserve plan`'s cost and CUDA lowering
    scoring_backbone[T]   prompt logprobs: the largest bucket only (one scoring executable)
    prepare[T]            a scoring step's own prepare (every other step's runs inside its backbone)
    write_table           page writes that overflow a step's own, at the largest bucket's width
    sampler[S, ...]       per sequence bucket: logprobs, penalty/banned/bias widths, all_greedy, bitmask width
    copy_states           GDN state slot copies (prefix caching on hybrids)

Every step's sampled tokens come out padded to `max_num_seqs` rows, so one `prev_tokens` shape serves.

The variant space is bounded. Samplers: per sequence bucket, "plain" (no penalty, banned token,
logit bias or logprobs in the step) or "full" (any of them: every feature matrix padded to a
fixed width, `full_widths`, and MAX_LOGPROBS alternatives), each greedy or not, each with or
without the grammar bitmask. `compile_all` compiles the backbone of every token bucket (and its
greedy twin), `write_table` and the plain samplers; with `every_variant` also the full samplers,
the scoring backbone and its prepare, and `copy_states`, and then seals the table: a step that
would need anything else raises `CompileAfterStartup` instead of compiling in the serving loop.
Unsealed (tests, `aot_compile=False`), missing entries compile on first use and are logged.
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
from tqdm.auto import tqdm

from models.batch import ForwardBatch
from models.cache_formats import cache_formats, format_specs, one_tpu
from models.model import Model
from models.ops import KernelOptions
from models.transformer import forward
from runtime.buckets import BucketMiss
from runtime.steps import programs, specs
from runtime.steps.programs import TokenFeed
from runtime.steps.sampling_metadata import FullWidths, SamplingMetadata
from runtime.steps.table_device import RequestTable, init_table
from runtime.steps.table_host import TableStep
from runtime.types import MAX_LOGPROBS

log = logging.getLogger("jaxserve.step")

__all__ = [
    "MAX_LOGPROBS",
    "CompileAfterStartup",
    "StepExecutables",
    "StepKey",
    "TokenFeed",
    "enable_persistent_cache",
]

KINDS = ("backbone", "batch_backbone", "scoring_backbone", "prepare", "write_table", "sampler", "copy_states")


class CompileAfterStartup(RuntimeError):
    """A step needed an executable that the sealed start-up set does not hold."""


def enable_persistent_cache(cache_dir: str | Path) -> None:
    """JAX persistent compilation cache on local disk; cache every compile, however small."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
    """One executable: a program (`KINDS`) and the static shape that distinguishes its executables.
    `size` is the token bucket T (backbones, prepare) or the sequence bucket S (sampler)."""

    kind: str
    size: int = 0
    greedy: bool = False  # backbone: the argmax fused in; sampler: every row temperature 0
    num_logprobs: int = 0  # sampler only, like every field below
    output_width: int = 0  # penalty matrices' widths
    prompt_width: int = 0
    banned: int = 0
    bias: int = 0
    mask_width: int = 0  # grammar bitmask [S, mask_width] i32; 0: no bitmask

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown executable kind {self.kind!r} (known: {', '.join(KINDS)})")

    @classmethod
    def sampler(cls, S: int, greedy: bool = False, mask_width: int = 0, num_logprobs: int = 0, widths=(0, 0, 0, 0)):
        """widths: (output_ids, prompt_ids, banned, logit_bias) of the sampling metadata."""
        out_w, prompt_w, banned, bias = widths
        return cls("sampler", S, bool(greedy), num_logprobs, out_w, prompt_w, banned, bias, mask_width)

    @property
    def name(self) -> str:
        if self.kind == "sampler":
            return (
                f"sampler[S={self.size},logprobs={self.num_logprobs},pen={self.output_width}/{self.prompt_width},"
                f"banned={self.banned},bias={self.bias}{',greedy' if self.greedy else ''}"
                f"{',masked' if self.mask_width else ''}]"
            )
        if self.kind in ("write_table", "copy_states"):
            return self.kind
        return f"{'greedy_' if self.greedy else ''}{self.kind}[T={self.size}]"


class StepExecutables:
    """The table (`executables`: StepKey -> compiled) and what the engine calls each step."""

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
        window_paging: bool = False,
    ):
        # forward_fn: the model's forward pass; attention DP passes its per-rank vmap of it (runtime/parallel/data_parallel.py)
        self.model, self.opts = model, opts
        self.forward = functools.partial(forward_fn, cfg=model.cfg, opts=opts)
        # With max_model_len every sampler variant is plain or full (bounded); without it the
        # feature matrices keep their power-of-two widths (one variant per width, compiled lazily).
        self.full_widths = FullWidths.for_model_len(max_model_len) if max_model_len else None
        self.sealed = False
        self.token_buckets, self.seq_buckets = tuple(token_buckets), tuple(seq_buckets)
        self.max_num_seqs, self.max_blocks_per_seq, self.max_top_k = max_num_seqs, max_blocks_per_seq, max_top_k
        self.page_size = page_size
        self.window_paging = window_paging  # a second block table (paged_kv/window_pages.py)
        self._tables = 2 if window_paging else 1
        # Under a mesh (opts.tp) specs carry the arrays' shardings, step inputs are replicated and
        # outputs are pinned to the input shardings, so donated caches keep their layout.
        # (on TPU an MLA latent pool's sharding is a Format pinning it rows-minor, one chip's too: models/cache_formats.py)
        self._replicated = one_tpu(caches) if opts.tp is None else opts.tp.spec()
        self._specs = specs.abstract_spec if self._replicated is None else specs.sharded_spec
        self._cache_shardings = None if self._replicated is None else cache_formats(caches)
        self._cache_specs = jax.tree.map(self._specs, caches) if self._replicated is None else format_specs(caches)
        self.fuse_greedy = fuse_greedy
        self.greedy_buckets = tuple(T for T in self.token_buckets if max_num_seqs >= T) if fuse_greedy else ()
        self.executables: dict[StepKey, object] = {}  # the table: key -> compiled executable
        self.compile_seconds: dict[str, float] = {}  # key.name -> seconds, in compile order
        self._jitted: dict[str, object] = {}

    # ---- programs -----------------------------------------------------------------------
    def program(self, name: str):
        """The jitted program `name` (runtime/steps/programs.py) with this engine's statics bound."""
        if name not in self._jitted:
            statics = programs.Statics(
                self.forward,
                self.max_num_seqs,
                self.page_size,
                self.max_top_k,
                self.model.num_groups,
                self.model.cfg.final_logit_softcapping,
            )
            self._jitted[name] = programs.jit_program(name, statics, self._cache_shardings, self._replicated)
        return self._jitted[name]

    def _trace_args(self, key: StepKey) -> tuple[str, tuple, dict]:
        """(program name, abstract positional arguments, static keyword arguments) of `key`."""
        i32, T = jnp.int32, key.size
        if key.kind == "write_table":
            width = specs.table_write_width(T, self.max_num_seqs, self.page_size, self._tables)
            return "write_table", (self._table_spec(), self._host_spec((width,), i32)), {}
        if key.kind == "prepare":
            return "prepare", self._table_args_spec(T), {}
        if key.kind == "copy_states":
            index = self._host_spec((self.max_num_seqs,), i32)
            return "copy_states", (self._cache_specs, index, index, self._host_spec((), i32)), {}
        params = jax.tree.map(self._specs, self.model.params)
        if key.kind == "sampler":
            hidden = self._host_spec((self.max_num_seqs, self.model.cfg.hidden_size), jnp.dtype(self.model.dtype))
            meta = self._meta_spec(T, (key.output_width, key.prompt_width, key.banned, key.bias))
            bitmask = self._host_spec((T, key.mask_width), i32) if key.mask_width else None
            table = self._table_spec() if self.row_params_in_table else None
            static = dict(num_rows=T, num_logprobs=key.num_logprobs, all_greedy=key.greedy)
            return "sampler", (params, hidden, meta, bitmask, table), static
        if key.kind == "scoring_backbone":
            return "scoring_backbone", (params, self._cache_specs, self._batch_spec(T), self._host_spec((T,), i32)), {}
        if key.kind == "batch_backbone":
            return "backbone", (params, self._cache_specs, self._batch_spec(T)), {}
        if self.token_feed:
            name = "greedy_backbone" if key.greedy else "backbone"
            return name, (params, self._cache_specs, self._batch_spec(T), self._feed_spec(T)), {}
        return "table_backbone", (params, self._cache_specs, *self._table_args_spec(T)), {"greedy": key.greedy}

    # ---- abstract arguments -------------------------------------------------------------
    def _host_spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return specs.host_spec(shape, dtype, self._replicated)

    def batch_spec(self, T: int) -> ForwardBatch:
        """The abstract host-built batch of token bucket T (attention DP: its flat rank-major batch)."""
        return self._batch_spec(T)

    def _batch_spec(self, T: int) -> ForwardBatch:  # DataParallelExecutables widens it
        return specs.batch_spec(T, self.max_num_seqs, self.max_blocks_per_seq, self._replicated, self.window_paging)

    def _feed_spec(self, T: int) -> TokenFeed:
        return specs.feed_spec(T, self.max_num_seqs, self._replicated)

    def _table_spec(self) -> RequestTable:
        return specs.table_spec(self.max_num_seqs, self.max_blocks_per_seq, self._replicated, self.window_paging)

    def _table_args_spec(self, T: int) -> tuple:
        """(table, table_step, prev_tokens) specs of token bucket T."""
        step = specs.table_step_spec(T, self.max_num_seqs, self.page_size, self._replicated, self._tables)
        return self._table_spec(), step, self._host_spec((self.max_num_seqs,), jnp.int32)

    def _meta_spec(self, S: int, widths=(0, 0, 0, 0)) -> SamplingMetadata:
        return specs.meta_spec(S, widths, row_params=not self.row_params_in_table, sharding=self._replicated)

    def new_table(self) -> RequestTable:
        """An empty request table (every row free) on the device."""
        return init_table(self.max_num_seqs, self.max_blocks_per_seq, self._replicated, self.window_paging)

    @property
    def row_params_in_table(self) -> bool:
        """The sampler reads temperature ... seeds from the request table (not with attention DP)."""
        return not self.token_feed

    # ---- the table ----------------------------------------------------------------------
    def lower(self, key: StepKey, **lower_kwargs):
        """`key`'s program traced on abstract arguments and lowered (`lower_kwargs`: e.g.
        lowering_platforms=("cuda",) on a host without that device)."""
        name, args, static = self._trace_args(key)
        return self.program(name).trace(*args, **static).lower(**lower_kwargs)

    def compile(self, key: StepKey):
        """Compile `key` into the table (timed in `compile_seconds`); CompileAfterStartup once sealed."""
        self._check_unsealed(key.name)
        t0 = time.perf_counter()
        exe = self.lower(key).compile()
        self.compile_seconds[key.name] = time.perf_counter() - t0
        self.executables[key] = exe
        return exe

    def _check_unsealed(self, name: str) -> None:
        if self.sealed:
            raise CompileAfterStartup(
                f"{name} was not compiled at start-up and compiling in the serving loop is off "
                f"({len(self.compile_seconds)} executables compiled at start-up)"
            )

    def executable(self, key: StepKey):
        """The table's entry for `key`, compiled now (and logged) if start-up did not."""
        exe = self.executables.get(key)
        if exe is None:
            log.info("compiling %s (not compiled ahead of time)", key.name)
            exe = self.compile(key)
        return exe

    def startup_keys(self, bitmask_width: int = 0, every_variant: bool = False) -> list[StepKey]:
        """What `compile_all` compiles, in order (see the module docstring)."""
        keys = [StepKey("backbone", T) for T in self.token_buckets]
        for w in sorted({0, bitmask_width}):
            for S in self.seq_buckets:
                keys += [StepKey.sampler(S, False, w), StepKey.sampler(S, True, w)]
                if every_variant:
                    keys += [self._full_sampler_key(S, False, w), self._full_sampler_key(S, True, w)]
        keys += [StepKey("backbone", T, greedy=True) for T in self.greedy_buckets]
        if not self.token_feed:  # the request table's executables
            keys.append(StepKey("write_table", self.token_buckets[-1]))
        if every_variant:
            keys += [StepKey("scoring_backbone", self.token_buckets[-1]), StepKey("copy_states")]
            if not self.token_feed:  # a scoring step's own prepare (other steps' is fused into the backbone)
                keys.append(StepKey("prepare", self.token_buckets[-1]))
        return keys

    def _full_sampler_key(self, S: int, greedy: bool, mask_w: int) -> StepKey:
        w = self.full_widths
        return StepKey.sampler(
            S, greedy, mask_w, MAX_LOGPROBS, (w.output_ids, w.prompt_ids, w.banned_ids, w.logit_bias)
        )

    def compile_all(
        self, progress: bool = True, bitmask_width: int = 0, every_variant: bool = False
    ) -> dict[str, float]:
        """Compile `startup_keys`: with `bitmask_width` the samplers' grammar-masked twins too, so a
        request with a grammar joining a batch compiles nothing; `every_variant` (needs
        max_model_len) also the full samplers, the scoring backbone, its prepare and copy_states,
        then seal: nothing compiles after start-up. Logs the count and the time."""
        if every_variant and self.full_widths is None:
            raise ValueError("every_variant needs StepExecutables(max_model_len=...) to bound the sampler widths")
        t_start, before = time.perf_counter(), len(self.compile_seconds)
        keys = self.startup_keys(bitmask_width, every_variant)
        for key in tqdm(keys, desc="compiling buckets", unit="bucket", disable=not progress):
            self.compile(key)
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

        backbones = sorted((k for k in self.executables if k.kind == "backbone"), key=lambda k: (k.greedy, k.size))
        for key in backbones:
            exe, T = self.executables[key], key.size
            if self.token_feed:
                batch = dataclasses.replace(zeros(self._batch_spec(T)), slot_mapping=jnp.full((T,), -1, jnp.int32))
                caches, out = exe(params, caches, batch, zeros(self._feed_spec(T)))
            else:  # a throwaway table: the step has no row with a token (every KV write to slot -1)
                _, step, prev_tokens = self._table_args_spec(T)
                caches, _, out = exe(params, caches, self.new_table(), zeros(step), zeros(prev_tokens))
            jax.block_until_ready(out)
        hidden = jnp.zeros((self.max_num_seqs, self.model.cfg.hidden_size), jnp.dtype(self.model.dtype))
        table = self.new_table() if self.row_params_in_table else None
        samplers = sorted(k for k in self.executables if k.kind == "sampler")
        for key in samplers:
            meta = zeros(self._meta_spec(key.size, (key.output_width, key.prompt_width, key.banned, key.bias)))
            bitmask = jnp.zeros((key.size, key.mask_width), jnp.int32) if key.mask_width else None
            jax.block_until_ready(self.executables[key](params, hidden, meta, bitmask, table))
        log.info(
            "warmed up %d backbones and %d samplers in %.1fs", len(backbones), len(samplers), time.perf_counter() - t0
        )
        return caches

    # ---- run ----------------------------------------------------------------------------
    def run_prepare(self, table: RequestTable, step: TableStep, prev_tokens) -> tuple[RequestTable, ForwardBatch]:
        """-> (table after the step, the step's device ForwardBatch). prev_tokens [max_num_seqs].
        Only a scoring step prepares apart; every other step's prepare runs inside its backbone."""
        T = step.host_tokens.shape[0]
        if T not in self.token_buckets:
            raise BucketMiss(f"token count {T} has no compiled prepare bucket {self.token_buckets}")
        return self.executable(StepKey("prepare", T))(table, step, prev_tokens)

    def run_write_table(self, table: RequestTable, write: np.ndarray) -> RequestTable:
        """Page writes that overflow a step's own (see runtime/steps/table_host.py)."""
        return self.executable(StepKey("write_table", self.token_buckets[-1]))(table, write)

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
        buckets = self.greedy_buckets if greedy else self.token_buckets
        if T not in buckets:
            kind = "greedy backbone" if greedy else "backbone"
            raise BucketMiss(f"token count {T} has no compiled {kind} bucket {buckets}")
        return self.executable(StepKey("backbone", T, greedy=greedy))

    def run_scoring_backbone(self, params, caches, batch: ForwardBatch, targets: np.ndarray):
        """-> (caches, hidden [max_num_seqs, H], TokenScores of every token row). targets [T] i32;
        the step is prepared in the largest token bucket (one scoring executable)."""
        T, T_max = batch.input_ids.shape[0], self.token_buckets[-1]
        if T_max != T:
            raise BucketMiss(f"a scoring step must be prepared in the largest token bucket {T_max}, not {T}")
        return self.executable(StepKey("scoring_backbone", T_max))(params, caches, batch, targets)

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
        meta, num_logprobs = self._bounded(meta, num_logprobs)
        widths = (meta.output_ids.shape[1], meta.prompt_ids.shape[1], meta.num_banned, meta.num_logit_bias)
        mask_w = 0 if bitmask is None else bitmask.shape[1]
        key = StepKey.sampler(meta.num_rows, all_greedy, mask_w, num_logprobs, widths)
        return self.executable(key)(params, hidden, meta, bitmask, table if self.row_params_in_table else None)

    def _bounded(self, meta: SamplingMetadata, num_logprobs: int) -> tuple[SamplingMetadata, int]:
        """A step using any sampler feature gets the full variant's fixed widths (plain stays plain)."""
        w = self.full_widths
        widths = (meta.output_ids.shape[1], meta.prompt_ids.shape[1], meta.num_banned, meta.num_logit_bias)
        if w is None or (num_logprobs == 0 and not any(widths)):
            return meta, num_logprobs
        return meta.with_widths(w.output_ids, w.prompt_ids, w.banned_ids, w.logit_bias), MAX_LOGPROBS

    def copy_states(self, caches, pairs: list[tuple[int, int]]):
        """Copy GDN state slots src -> dst for each (src, dst) pair; caches donated."""
        src = np.zeros(self.max_num_seqs, np.int32)
        dst = np.zeros(self.max_num_seqs, np.int32)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        exe = self.executables.get(StepKey("copy_states"))
        if exe is None:  # jit-compiled on first use, unrecorded, as before the table sealed anything
            self._check_unsealed("copy_states")
            exe = self.program("copy_states")
        return exe(caches, src, dst, np.int32(len(pairs)))
