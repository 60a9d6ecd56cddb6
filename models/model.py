"""`load_model`: an HF checkpoint directory (or a GGUF file) -> a ready `Model`.

    m = load_model("/path/to/hf_dir", dtype="float32")
    logits = m.logits([3, 17, 5])  # numpy [T, vocab], causal, one sequence

`Model` holds the parsed config and parameters and makes the caches the serving step uses;
`logits` runs the same paged forward pass the engine runs, for one whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import mamba2_tp
from models.batch import decode_batch, single_sequence_batch
from models.cache_formats import place_pinned
from models.config import ATTENTION, ModelConfig, parse_config
from models.mamba2_config import NO_MIXER, recurrent_state_shapes
from models.ops import KernelOptions
from models.orbax_io import is_orbax_checkpoint, restore_params
from models.padding import SEQUENCE_PAD_MIN, pow2_bucket
from models.prequantized import parse_quantization_config
from models.quant_rules import QuantizationConfig, log_report, quantize_params
from models.quantization import OutInWeight, PackedWeight, QuantizedWeight, packed, param_bytes
from models.safetensors_io import CheckpointError, SafetensorsDir, read_json
from models.sharding import kv_heads_held, shard_caches, shard_model
from models.transformer import compute_logits, forward, out_in_projections, unstack_layers
from models.weights import DictSource, load_params
from pallas_kernels.kv_cache import KVPages
from pallas_kernels.mla import LatentPages

log = logging.getLogger("jaxserve.model")


class Model:
    def __init__(self, cfg: ModelConfig, params: dict, dtype: str, path: Path, tokenizer_loader=None):
        self.cfg, self.params, self.dtype, self.path = cfg, params, dtype, path
        self._tokenizer_loader = tokenizer_loader
        self._tokenizer = None
        self.tp = None  # models.sharding.TensorParallel once `shard_model` split it over a mesh
        self.quantization: dict[str, str] = {}  # module path -> scheme it got (empty: all float)
        self.state_dtype = "float32"  # GDN state slots (launch key cache.state_dtype); set before init_caches

    @property
    def tokenizer(self):
        """The checkpoint's own tokenizer (transformers), loaded on first use."""
        if self._tokenizer is None:
            if self._tokenizer_loader is not None:
                self._tokenizer = self._tokenizer_loader()
            else:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        return self._tokenizer

    @property
    def num_groups(self) -> int:
        return self.cfg.num_layers // self.cfg.layer_period()

    @property
    def unrolled(self) -> bool:
        return "layers" in self.params

    def quantize(self, qcfg: QuantizationConfig) -> None:
        """Quantize the float weights in place by `qcfg`'s rules (before `shard_model` /
        `unstack_layers`); logs which scheme each module group got."""
        if self.quantization:
            raise ValueError(f"model is already quantized ({sorted(set(self.quantization.values()))})")
        if self.tp is not None or self.unrolled or self.out_in:
            raise ValueError("quantize the model before sharding, unstacking or transposing it")
        self.params, self.quantization = quantize_params(self.params, qcfg)
        log_report(self.quantization)

    def hold_out_in(self) -> None:
        """Hold every float projection weight as its [out, in] transpose (`OutInWeight`, the CPU
        plan's weight layout; runtime/steps/execution_plan.py). Idempotent; call after `unstack_layers`.
        Quantized weights, norms, the conv and the MoE expert stacks are left as they are."""
        self.params = out_in_projections(self.params)

    def hold_packed(self) -> None:
        """Hold every bf16 projection weight packed for the native CPU matmul (`PackedWeight`, the
        CPU plan's layout for bf16 where the kernel runs AVX512-BF16). Idempotent; call after
        `unstack_layers`. Float32 and quantized weights are left as they are."""
        self.params = out_in_projections(self.params, hold=packed)
        embed = self.params["embed"]
        if (
            "lm_head" not in self.params
            and "head_packed" not in self.params
            and not isinstance(embed, QuantizedWeight)
            and embed.dtype == jnp.bfloat16
        ):  # tied: the logits' weight [V, H] packed
            self.params["head_packed"] = packed(OutInWeight(embed))

    @property
    def out_in(self) -> bool:
        """Whether the projections are held in a CPU layout ([out, in] or packed), not as loaded."""
        return any(
            isinstance(w, (OutInWeight, PackedWeight))
            for w in jax.tree.leaves(self.params, is_leaf=lambda w: isinstance(w, (OutInWeight, PackedWeight)))
        )

    def weight_bytes(self) -> int:
        """Bytes of the parameters on the device(s), scales included."""
        return param_bytes(self.params)

    def unstack_layers(self) -> None:
        """Hold one array per layer group instead of stacked ones: `forward` then runs the groups
        unrolled (`models.transformer.unstack_layers`). Call after `shard_model`."""
        if not self.unrolled:
            self.params = unstack_layers(self.params)

    def init_caches(
        self,
        num_pages: int,
        page_size: int,
        num_slots: int,
        kv_dtype: str = "auto",
        bit_storage: bool = False,
        place: bool = True,
        num_window_pages: int | None = None,
        token_minor: bool = False,
    ) -> dict:
        """Zeroed caches: per group position, a KV page pool (attention), conv/recurrent states (GDN,
        Mamba-2: `recurrent_state_shapes`) or nothing (an MLP-only block).

        `num_pages` and `num_slots` are per layer and include the null page / null slot 0.
        `bit_storage`: bf16 / FP8 pages held as raw bits, for the jnp attention paths on CPU
        (`KVPages.create`); the Pallas kernels need it off. The pages hold the KV heads the
        weights hold (`models.sharding.kv_heads_held`); `place=False`: not placed on the mesh.
        `num_window_pages`: window-aware paging, the sliding-window layers' own pool (per layer).
        `token_minor`: pages stored [P, Hkv, D, ps] (the TPU kernel, head_dim < 128: `KVPages`).
        """
        cfg, G = self.cfg, self.num_groups
        dtype = resolve_kv_dtype(kv_dtype, self.dtype)
        kv, conv, rec = [], [], []
        for j in range(cfg.layer_period()):
            if cfg.mla is not None and cfg.layer_types[j] == ATTENTION:  # one latent row per token and layer
                kv.append(LatentPages.create(G * num_pages, page_size, cfg.mla.latent_width, dtype, bit_storage))
                conv.append(None)
                rec.append(None)
            elif cfg.layer_types[j] == ATTENTION:
                pages = num_pages if num_window_pages is None or cfg.sliding_window(j) is None else num_window_pages
                kv.append(
                    KVPages.create(
                        G * pages,
                        page_size,
                        kv_heads_held(cfg, self.tp),
                        cfg.head_dim,
                        dtype,
                        bit_storage=bit_storage,
                        token_minor=token_minor,
                    )
                )
                conv.append(None)
                rec.append(None)
            elif cfg.layer_types[j] == NO_MIXER:
                kv.append(None)
                conv.append(None)
                rec.append(None)
            else:
                kv.append(None)
                conv_shape, rec_shape = recurrent_state_shapes(cfg, mamba2_tp.held(cfg.mamba, self.tp))
                conv.append(jnp.zeros((G * num_slots, *conv_shape), self.state_dtype))
                rec.append(jnp.zeros((G * num_slots, *rec_shape), self.state_dtype))
        caches = {"kv": tuple(kv), "conv": tuple(conv), "rec": tuple(rec)}
        if not place:
            return caches
        return place_pinned(caches) if self.tp is None else shard_caches(caches, cfg, self.tp.mesh, self.tp)

    def cache_bytes_per_token(self, kv_dtype: str = "auto", layers: str = "all", lane_padded: bool = False) -> int:
        """KV bytes per token over all devices (repeated KV heads counted) of the attention layers
        `layers`: "all", "full" (no sliding window) or "window" (window-aware paging's two pools).
        `lane_padded`: MLA rows as TPU holds them, pinned rows-minor (models/cache_formats.py): the
        row width rounded up to 128 lanes (DeepSeek-V3: 576 -> 640)."""
        itemsize = jnp.dtype(resolve_kv_dtype(kv_dtype, self.dtype)).itemsize
        if self.cfg.mla is not None:  # MLA: one row of latent + RoPE key, no heads
            width = -(-self.cfg.mla.latent_width // 128) * 128 if lane_padded else self.cfg.mla.latent_width
            return self.cfg.num_attention_layers * width * itemsize
        heads = kv_heads_held(self.cfg, self.tp)
        cfg = self.cfg
        windowed = sum(t == ATTENTION and cfg.sliding_window(i) is not None for i, t in enumerate(cfg.layer_types))
        count = {"all": cfg.num_attention_layers, "full": cfg.num_attention_layers - windowed, "window": windowed}
        return 2 * count[layers] * heads * cfg.head_dim * itemsize

    def state_bytes_per_slot(self) -> int:
        """One state slot's bytes (conv and recurrent states of every GDN / Mamba-2 layer, in `state_dtype`)."""
        shapes = recurrent_state_shapes(self.cfg, mamba2_tp.held(self.cfg.mamba, self.tp))
        per_layer = sum(np.prod(shape) for shape in shapes)
        return int(jnp.dtype(self.state_dtype).itemsize * per_layer * self.cfg.num_linear_layers)

    def state_bytes_per_slot_per_device(self) -> int:
        """One state slot's bytes on one device: GDN heads split over the model axis (`tp.gdn`)."""
        per_slot = self.state_bytes_per_slot()
        split = self.tp is not None and (self.tp.gdn or self.tp.mamba)
        return per_slot // self.tp.size if split else per_slot

    def logits(
        self, token_ids, opts: KernelOptions | None = None, page_size: int = 16, kv_dtype: str = "auto"
    ) -> np.ndarray:
        """Causal logits [T, vocab] (float32 numpy) for one sequence, from an empty cache whose KV
        pages are stored as `kv_dtype` (e.g. "fp8_e4m3" to measure FP8 KV quality)."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        bad = [t for t in token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        opts = self._with_tp(opts)
        T = len(token_ids)
        padded = pow2_bucket(T, SEQUENCE_PAD_MIN)  # few shapes, few compiles
        batch = single_sequence_batch(token_ids, page_size, pad_to=padded)
        caches = self.init_caches(2 + padded // page_size, page_size, num_slots=2, kv_dtype=kv_dtype)
        return np.asarray(_logits_fn(self.cfg, opts)(self.params, caches, batch))[:T]

    def greedy(
        self, token_ids, max_new_tokens: int, opts: KernelOptions | None = None, page_size: int = 16
    ) -> list[int]:
        """Greedy continuation of one sequence: one prefill, then one-token decode steps through the
        paged caches (pages and state slot carried between steps). No EOS handling: exactly
        `max_new_tokens` tokens. The plain reference loop the engine is checked against."""
        opts = self._with_tp(opts)
        ids = [int(t) for t in token_ids]
        total = len(ids) + max_new_tokens
        full = single_sequence_batch(list(range(total)), page_size)
        step = _step_fn(self.cfg, opts)
        out: list[int] = []
        padded = pow2_bucket(len(ids), SEQUENCE_PAD_MIN)
        caches = self.init_caches(2 + (padded + max_new_tokens) // page_size, page_size, num_slots=2)
        batch = dataclasses.replace(
            single_sequence_batch(ids, page_size, pad_to=padded),
            block_tables=full.block_tables,  # one table width: fewer compiles
            logits_indices=np.array([len(ids) - 1], np.int32),
        )
        for i in range(max_new_tokens):
            caches, tok = step(self.params, caches, batch)
            out.append(int(tok[0]))
            batch = decode_batch(full, out[-1], len(ids) + i)
        return out

    def _with_tp(self, opts: KernelOptions | None) -> KernelOptions:
        opts = opts or KernelOptions()
        return opts if self.tp is None else dataclasses.replace(opts, tp=self.tp)


@functools.cache
def _logits_fn(cfg: ModelConfig, opts: KernelOptions):
    def run(params, caches, batch):
        hidden, _ = forward(params, caches, batch, cfg=cfg, opts=opts)
        return compute_logits(params, hidden, cfg.final_logit_softcapping)

    return jax.jit(run)


@functools.cache
def _step_fn(cfg: ModelConfig, opts: KernelOptions):
    def run(params, caches, batch):
        hidden, caches = forward(params, caches, batch, cfg=cfg, opts=opts)
        return caches, jnp.argmax(compute_logits(params, hidden, cfg.final_logit_softcapping), axis=-1)

    return jax.jit(run, donate_argnums=1)


def _gguf_kind(w: QuantizedWeight) -> str:
    return f"int{w.bits}-g{w.group_size}" + ("-offset" if w.offset is not None else "")


KV_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}


def resolve_kv_dtype(kv_dtype: str, model_dtype: str):
    if kv_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    return jnp.dtype(KV_DTYPES[kv_dtype])


def load_model(
    path: str | Path,
    dtype: str = "float32",
    progress: bool = False,
    mesh=None,
    quantization: QuantizationConfig | None = None,
    keep_gguf_quantized: bool = True,
    expert_parallel: bool = False,
) -> Model:
    """Load an HF checkpoint directory (config.json + *.safetensors), a GGUF file / directory, or a
    `jaxserve convert` orbax directory, split over `mesh` when given (`models.sharding.shard_model`;
    an orbax checkpoint is restored straight into that sharding, each process reading its shards).
    With `quantization`, float weights are quantized online (before sharding). Pre-quantized
    checkpoints (AWQ, GPTQ, compressed-tensors FP8, GGUF Q4_0 / Q4_1 / Q8_0 unless
    `keep_gguf_quantized` is False) stay quantized. `expert_parallel`: MoE experts split over the
    mesh by expert index."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if is_orbax_checkpoint(path):
        cfg = parse_config(read_json(path / "config.json"), read_json(path / "generation_config.json", required=False))
        params, tp = restore_params(path, cfg, dtype, mesh, expert_parallel)
        model = Model(cfg, params, dtype, path)
        model.tp = tp
        if quantization is not None:
            raise CheckpointError(
                f"{path}: online quantization of an orbax checkpoint is not supported; "
                "quantize before `jaxserve convert`, or serve the HF directory"
            )
        return model
    model = _load_unsharded(path, dtype, progress, keep_gguf_quantized)
    if quantization is not None:
        model.quantize(quantization)
    return model if mesh is None else shard_model(model, mesh, expert_parallel)


def _load_unsharded(path: Path, dtype: str, progress: bool, keep_gguf_quantized: bool) -> Model:
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if ggufs and not (path.is_dir() and list(path.glob("*.safetensors"))):
        from models.gguf import read_gguf

        ckpt = read_gguf(ggufs[0], progress=progress, keep_quantized=keep_gguf_quantized)
        cfg = parse_config(ckpt.config)
        params = load_params(cfg, DictSource(ckpt.tensors, str(ggufs[0])), dtype, progress)
        model = Model(cfg, params, dtype, ggufs[0], tokenizer_loader=ckpt.tokenizer_factory)
        kept = sorted({_gguf_kind(w) for w in ckpt.tensors.values() if isinstance(w, QuantizedWeight)})
        if kept:
            model.quantization = {"checkpoint": "gguf " + ", ".join(kept)}
            log.info("GGUF weights kept quantized: %s", ", ".join(kept))
        return model
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected an HF checkpoint directory or a .gguf file")
    hf = read_json(path / "config.json")
    generation = read_json(path / "generation_config.json", required=False)
    cfg = parse_config(hf, generation)
    stored = parse_quantization_config(hf.get("quantization_config"))
    params = load_params(cfg, SafetensorsDir(path), dtype, progress, quantization=stored)
    model = Model(cfg, params, dtype, path)
    if stored is not None:
        kind = (
            f"-{stored.block[0]}x{stored.block[1]}"
            if stored.block
            else (f"-g{stored.group_size}" if stored.group_size else "")
        )
        model.quantization = {"checkpoint": stored.method + kind}
        log.info("weights stored quantized (%s): kept quantized", model.quantization["checkpoint"])
    return model
