"""Read llama.cpp GGUF checkpoints as HF-style (config dict, float32 tensors, tokenizer).

The model code consumes HF safetensors names (`model.layers.{i}.self_attn.q_proj.weight`, ...)
and an HF `config.json`-style dict; this module is the bridge from GGUF. Tensors are
dequantized with the `gguf` package, and the Q/K row permutation that llama.cpp's converter
applies for its interleaved rotary layout is undone, so the result equals what HF transformers
loads from the same file. Tied embeddings (no `output.weight`) are reported through
`tie_word_embeddings` with no `lm_head.weight` tensor, as in an HF safetensors checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from models.gguf_quant import KEPT_TYPES, repack
from models.gguf_tokenizer import build_gguf_tokenizer, read_tokenizer_metadata
from models.quantization import take_columns

# GGUF `general.architecture` -> HF `architectures` entry. Only these are converted.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# Tensor types we dequantize (the ones gguf-py implements in numpy and that llama.cpp's
# common quantizations produce). Anything else is rejected up front, naming the tensor.
SUPPORTED_TENSOR_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)

# GGUF tensor name -> HF name; `{i}` is the layer index.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file (and tensor)."""


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file converted to HF form.

    config: HF LlamaConfig-style dict (what `config.json` would hold).
    tensors: HF name -> float32 array, in HF layout (`[out_features, in_features]`).
    tokenizer_factory: builds the tokenizer on demand (it takes a few seconds).
    metadata: the file's scalar and string metadata (`general.name`, `tokenizer.chat_template`, ...).
    """

    path: Path
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer_factory: Callable[[], Any]
    metadata: dict[str, Any]


def read_gguf(path: str | Path, *, progress: bool = False, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file: HF config, dequantized float32 tensors in HF names, tokenizer factory.
    With `keep_quantized`, Q4_0 / Q4_1 / Q8_0 weights come back as host `QuantizedWeight`s in
    our [in, out] layout ([H, V] for the embedding) instead (models/gguf_quant.py)."""
    path = Path(path)
    reader = _open_reader(path)
    fields = _scalar_fields(reader)
    architecture = fields.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _llama_config(path, fields, gguf_tensors)
    expected_shapes = _llama_tensor_shapes(config)

    unknown = [name for name in gguf_tensors if _hf_name(name) not in expected_shapes]
    if unknown:
        raise GGUFError(f"{path}: unsupported tensor(s) for a Llama model: {', '.join(unknown[:8])}")
    required = [hf for hf in expected_shapes if not (hf == "lm_head.weight" and config["tie_word_embeddings"])]
    present = {_hf_name(name) for name in gguf_tensors}
    missing = [hf for hf in required if hf not in present]
    if missing:
        raise GGUFError(
            f"{path}: missing tensor {_gguf_name(missing[0])} ({missing[0]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )

    items = list(gguf_tensors.items())
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"Dequantizing {path.name}", unit="tensor")
    tensors = {}
    for gguf_name, tensor in items:
        hf_name = _hf_name(gguf_name)
        if keep_quantized and tensor.tensor_type in KEPT_TYPES:
            tensors[hf_name] = _kept_quantized(path, gguf_name, tensor, expected_shapes[hf_name], config)
            continue
        weights = _dequantize(path, tensor)  # [rows, cols] = HF [out, in]
        if weights.shape != expected_shapes[hf_name]:
            raise GGUFError(
                f"{path}: tensor {gguf_name} has shape {weights.shape}, "
                f"expected {expected_shapes[hf_name]} for {hf_name}"
            )
        if gguf_name.endswith("attn_q.weight"):
            weights = unpermute_rotary_rows(weights, config["num_attention_heads"])
        elif gguf_name.endswith("attn_k.weight"):
            weights = unpermute_rotary_rows(weights, config["num_key_value_heads"])
        tensors[hf_name] = weights
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensors=tensors,
        tokenizer_factory=functools.partial(load_gguf_tokenizer, path),
        metadata=fields,
    )


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows [x0 x1 y0 y1 ...] -> [x0 y0 ... x1 y1 ...].

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half,
    second half) to interleaved pairs; this restores the HF order.
    weight: [num_heads * head_dim, in_features]
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [H, half, 2, in] -> [H, 2, half, in]
    return np.ascontiguousarray(
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer built from the GGUF metadata, with its chat template.

    Byte-level BPE vocabularies (the default model's) are built with `tokenizers` alone
    (models/gguf_tokenizer.py); other tokenizer models go through transformers' GGUF
    converter, which needs torch.
    """
    path = Path(path)
    metadata = read_tokenizer_metadata(_open_reader(path))
    try:
        tokenizer = build_gguf_tokenizer(metadata)
        if tokenizer is None:
            tokenizer = _transformers_gguf_tokenizer(path)
    except GGUFError:
        raise
    except Exception as error:  # transformers/tokenizers raise many kinds; say which file failed
        raise GGUFError(f"{path}: could not build the tokenizer from GGUF metadata: {error}") from error
    if not getattr(tokenizer, "chat_template", None) and metadata.get("tokenizer.chat_template"):
        tokenizer.chat_template = metadata["tokenizer.chat_template"]
    return tokenizer


def _transformers_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError/IndexError/struct errors on garbage
        raise GGUFError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from error


def _scalar_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Metadata key -> Python value for scalar and string fields (arrays are skipped)."""
    values = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY or not field.data:
            continue
        part = field.parts[field.data[0]]
        if field.types[0] == gguf.GGUFValueType.STRING:
            values[key] = bytes(part).decode("utf-8")
        else:
            values[key] = part[0].item()
    return values


def _llama_config(path: Path, fields: dict[str, Any], tensors: dict) -> dict[str, Any]:
    def required(key: str):
        if f"llama.{key}" not in fields:
            raise GGUFError(f"{path}: missing metadata llama.{key}")
        return fields[f"llama.{key}"]

    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = int(fields.get("llama.attention.head_count_kv", num_heads))
    head_dim = int(fields.get("llama.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(fields.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise GGUFError(
            f"{path}: partial rotary (rope.dimension_count={rotary_dim}, head_dim={head_dim}) is not supported"
        )
    if "llama.rope.scaling.type" in fields or "rope_freqs.weight" in tensors:
        raise GGUFError(f"{path}: RoPE scaling (llama.rope.scaling.* / rope_freqs.weight) is not supported yet")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: missing tensor token_embd.weight (model.embed_tokens.weight)")
    vocab_size = int(fields.get("llama.vocab_size", _shape_rows(tensors["token_embd.weight"])))
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES["llama"]],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0))},
        "vocab_size": vocab_size,
        "max_position_embeddings": int(fields.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for token in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{token}_token_id"
        if key in fields:
            config[f"{'pad' if token == 'padding' else token}_token_id"] = int(fields[key])
    return config


def _shape_rows(tensor) -> int:
    return int(tensor.shape[-1])  # GGUF shapes are innermost-first


def _llama_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> expected shape for every tensor of the Llama model `config` describes."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for layer in range(config["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"
    return None


def _gguf_name(hf_name: str) -> str:
    for gguf_name, hf in _GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    suffix = next(g for g, h in _LAYER_TENSORS.items() if h == rest)
    return f"blk.{layer}.{suffix}"


def _kept_quantized(path: Path, gguf_name: str, tensor, shape: tuple[int, ...], config: dict[str, Any]):
    """A Q4_0 / Q4_1 / Q8_0 tensor repacked, not dequantized; Q/K rows un-permuted like `weights`."""
    rows, cols = shape
    if tuple(int(n) for n in tensor.shape[::-1]) != (rows, cols):
        raise GGUFError(
            f"{path}: tensor {gguf_name} has shape {tuple(int(n) for n in tensor.shape[::-1])}, "
            f"expected {shape} for {_hf_name(gguf_name)}"
        )
    weight = repack(tensor.data, tensor.tensor_type, rows, cols)  # [cols, rows] = [in, out]
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    for suffix, num_heads in heads.items():
        if gguf_name.endswith(suffix):
            order = unpermute_rotary_rows(np.arange(rows)[:, None], num_heads)[:, 0]
            weight = take_columns(weight, order)
    return weight


def _dequantize(path: Path, tensor) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"{path}: tensor {tensor.name} has unsupported type "
            f"{tensor.tensor_type.name}; supported: "
            f"{', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}"
        )
    try:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as error:
        raise GGUFError(
            f"{path}: cannot dequantize tensor {tensor.name} ({tensor.tensor_type.name}): {error}"
        ) from error
    # Copy out of the memory map so the arrays outlive the file handle.
    return np.array(weights, dtype=np.float32, copy=True)
