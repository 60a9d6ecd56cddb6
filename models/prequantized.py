"""Pre-quantized HF checkpoints: AWQ (GEMM), GPTQ (v1, desc_act false / true) and
compressed-tensors FP8, read into `QuantizedWeight`s without dequantizing.

    fmt = parse_quantization_config(hf_config.get("quantization_config"))  # None: a float checkpoint
    w = read_linear(src, "model.layers.0.mlp.up_proj", out_features, in_features, fmt)

`read_linear` returns a host `QuantizedWeight` in our `[in, out]` layout when the module is stored
quantized, else the float `[in, out]` weight (modules the quantizer skipped, e.g. `lm_head`).

On-disk layouts (HF `[out, in]` Linear weights; int4 codes packed eight to an int32, low bits first):
- AWQ GEMM: `qweight` int32 `[in, out/8]` packed along out in AWQ's interleaved nibble order
  (nibble i holds column `8c + AWQ_ORDER[i]`), `qzeros` int32 `[in/g, out/8]` packed the same way,
  `scales` fp16 `[in/g, out]`; w = (q - z) * s.
- GPTQ (checkpoint_format gptq): `qweight` int32 `[in/8, out]` packed along in (nibble j = row
  8r + j), `qzeros` int32 `[in/g, out/8]` packed along out in order, storing z - 1; `scales`
  `[in/g, out]`; `g_idx` int32 `[in]`, the group of each input row. With desc_act the groups are
  formed in activation order, so rows of one group are scattered: we sort the rows by group and
  keep the permutation (`QuantizedWeight.perm`); `qdot` gathers the activations to match.
- compressed-tensors FP8 (`float-quantized`): `weight` float8_e4m3fn `[out, in]`, `weight_scale`
  float32 `[out, 1]` (channel) or `[1]` (tensor); dynamic per-token FP8 input activations, when
  configured, make it W8A8-fp8.
- HF fine-grained FP8 (`quant_method: fp8`, DeepSeek-V3/R1, Kimi K2, Qwen3-Next-FP8): `weight`
  float8_e4m3fn `[out, in]` and `weight_scale_inv` float32 `[ceil(out/bo), ceil(in/bi)]` for
  `weight_block_size` `[bo, bi]` (128 x 128 as published; the last block of a dim that does not
  divide is partial), w = fp8 * scale_inv per block. Which modules are quantized is what the
  tensors say (a `weight_scale_inv` present; `modules_to_not_convert` lists the rest, e.g. the
  embedding, lm_head and MoE router): a float8 weight without its scale is refused. Kept as FP8
  codes with their block scales (`QuantizedWeight.block_n`); the step dequantizes per block, and
  activations stay in the model dtype (`activation_scheme: dynamic` is HF's per-token-group FP8
  input quantization, an accelerator speed path; not applied here).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from models.quantization import QuantizedWeight, block_scales, pack_int4, per_column, unpack_int4_np
from models.safetensors_io import CheckpointError

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # "awq" | "gptq" | "fp8" | "fp8-block" | "mxfp4" (gpt-oss experts only: models/mxfp4.py)
    group_size: int = 0  # 0: one group per output channel
    desc_act: bool = False
    act: str = "none"  # "fp8": dynamic per-token FP8 activations (compressed-tensors W8A8)
    block: tuple[int, int] | None = None  # "fp8-block": weight_block_size [out rows, in columns]; None per tensor


_REQUIRED = object()


def _field(qc: dict, name: str, kind: type, default=_REQUIRED, *, aliases=()):
    for key in (name, *aliases):
        if key in qc:
            value = qc[key]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise CheckpointError(f"config.json quantization_config.{key}: expected {kind.__name__}, got {value!r}")
            return value
    if default is _REQUIRED:
        raise CheckpointError(f"config.json quantization_config.{name}: missing")
    return default


def _group_size(qc: dict, *aliases) -> int:
    g = _field(qc, "group_size", int, aliases=aliases)
    if g == -1:
        return 0
    if g <= 0 or g % 8:
        raise CheckpointError(
            f"config.json quantization_config.group_size: must be -1 or a positive multiple of 8, got {g}"
        )
    return g


def parse_quantization_config(qc) -> CheckpointQuantization | None:
    """config.json's `quantization_config` -> what `read_linear` needs; CheckpointError names the field."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"config.json quantization_config: expected an object, got {qc!r}")
    method = _field(qc, "quant_method", str)
    if method == "awq":
        bits = _field(qc, "bits", int, aliases=("w_bit",))
        if bits != 4:
            raise CheckpointError(f"config.json quantization_config.bits: AWQ supports 4 bits, got {bits}")
        version = _field(qc, "version", str, "gemm").lower()
        if version != "gemm":
            raise CheckpointError(
                f"config.json quantization_config.version: only the AWQ GEMM layout is supported, got {version!r}"
            )
        if not _field(qc, "zero_point", bool, True):
            raise CheckpointError(
                "config.json quantization_config.zero_point: AWQ without zero points is not supported"
            )
        return CheckpointQuantization("awq", _group_size(qc, "q_group_size"))
    if method == "gptq":
        bits = _field(qc, "bits", int)
        if bits != 4:
            raise CheckpointError(f"config.json quantization_config.bits: GPTQ supports 4 bits, got {bits}")
        fmt = _field(qc, "checkpoint_format", str, "gptq")
        if fmt != "gptq":
            raise CheckpointError(
                f"config.json quantization_config.checkpoint_format: only 'gptq' (v1) is supported, got {fmt!r}"
            )
        return CheckpointQuantization("gptq", _group_size(qc), desc_act=_field(qc, "desc_act", bool, False))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss's experts (models/mxfp4.py); every other weight is stored in float
        return CheckpointQuantization("mxfp4", 32)
    if method == "fp8":
        return _parse_fp8_blocks(qc)
    raise CheckpointError(
        "config.json quantization_config.quant_method: supported are awq, gptq, compressed-tensors, fp8 and mxfp4, "
        f"got {method!r}"
    )


def _parse_fp8_blocks(qc: dict) -> CheckpointQuantization:
    """HF's FineGrainedFP8Config (`quant_method: fp8`)."""
    where = "config.json quantization_config"
    scheme = _field(qc, "activation_scheme", str, "dynamic").lower()
    if scheme != "dynamic":
        raise CheckpointError(
            f"{where}.activation_scheme: only 'dynamic' is supported (static input scales are not), got {scheme!r}"
        )
    fmt = _field(qc, "fmt", str, "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}.fmt: only 'e4m3' (float8_e4m3fn weights) is supported, got {fmt!r}")
    experts = _field(qc, "expert_dtype", str, "fp8")
    if experts != "fp8":
        raise CheckpointError(f"{where}.expert_dtype: only 'fp8' experts are supported, got {experts!r}")
    block = qc.get("weight_block_size", [128, 128])
    if block is None:
        return CheckpointQuantization("fp8-block")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(f"{where}.weight_block_size: expected two positive integers [out, in], got {block!r}")
    return CheckpointQuantization("fp8-block", block=(block[0], block[1]))


def _parse_compressed_tensors(qc: dict) -> CheckpointQuantization:
    fmt = _field(qc, "format", str)
    if fmt != "float-quantized":
        raise CheckpointError(
            f"config.json quantization_config.format: only 'float-quantized' (FP8) is supported, got {fmt!r}"
        )
    groups = _field(qc, "config_groups", dict)
    if len(groups) != 1:
        raise CheckpointError(f"config.json quantization_config.config_groups: expected one group, got {len(groups)}")
    ((name, group),) = groups.items()
    where = f"config.json quantization_config.config_groups.{name}"
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}.weights: missing")
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise CheckpointError(
            f"{where}.weights: only num_bits 8 / type float is supported, got "
            f"{weights.get('num_bits')} / {weights.get('type')}"
        )
    if weights.get("strategy") not in ("channel", "tensor"):
        raise CheckpointError(f"{where}.weights.strategy: channel or tensor, got {weights.get('strategy')!r}")
    acts = group.get("input_activations")
    if acts is None:
        return CheckpointQuantization("fp8")
    if (
        not isinstance(acts, dict)
        or not acts.get("dynamic")
        or acts.get("type") != "float"
        or acts.get("num_bits") != 8
        or acts.get("strategy") != "token"
    ):
        raise CheckpointError(
            f"{where}.input_activations: only dynamic per-token FP8 (num_bits 8, type float, "
            f"strategy token, dynamic true) is supported, got {acts!r}"
        )
    return CheckpointQuantization("fp8", act="fp8")


# ---- unpacking ----------------------------------------------------------------------------------
def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 array -> its eight 4-bit values (low bits first) on a new axis after `axis`."""
    u = np.asarray(packed).view(np.uint32)
    u = np.expand_dims(u, axis + 1)
    shifts = _SHIFTS.reshape([-1 if d == axis + 1 else 1 for d in range(u.ndim)])
    return ((u >> shifts) & 15).astype(np.uint8)


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """AWQ int32 [R, C/8] -> codes [R, C]: nibble i of word c is column 8c + AWQ_ORDER[i]."""
    nib = _nibbles(packed, 1)  # [R, C/8, 8]
    codes = np.empty_like(nib)
    codes[..., AWQ_ORDER] = nib
    return codes.reshape(packed.shape[0], -1)


def unpack_gptq_rows(packed: np.ndarray) -> np.ndarray:
    """GPTQ qweight int32 [K/8, N] -> codes [K, N] (nibble j of row r is input row 8r + j)."""
    return _nibbles(packed, 0).reshape(-1, packed.shape[1])


def unpack_gptq_cols(packed: np.ndarray) -> np.ndarray:
    """GPTQ qzeros int32 [G, N/8] -> codes [G, N] (nibble j of word c is column 8c + j)."""
    return _nibbles(packed, 1).reshape(packed.shape[0], -1)


def _check(src, name: str, shape) -> np.ndarray:
    return np.asarray(src.get(name, shape))


def read_linear(src, module: str, out: int, inp: int, fmt: CheckpointQuantization | None):
    """The `[in, out]` weight of Linear `module`: a host QuantizedWeight if stored quantized, else float."""
    if fmt is None or all(f"{module}.{t}" not in src for t in ("qweight", "weight_scale", "weight_scale_inv")):
        stored = src.get(f"{module}.weight")
        if isinstance(stored, QuantizedWeight):  # GGUF blocks kept quantized: already [in, out]
            return _checked(src, f"{module}.weight", stored, (inp, out))
        w = np.asarray(src.get(f"{module}.weight", (out, inp)))
        if w.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(
                f"{src_name(src)}: tensor {module}.weight is float8_e4m3fn but its scale "
                f"({module}.weight_scale_inv or .weight_scale) is missing"
            )
        return w.T
    if fmt.method == "fp8-block":
        return _read_fp8_blocks(src, module, out, inp, fmt.block)
    if fmt.method == "fp8":
        q = _check(src, f"{module}.weight", (out, inp))
        if q.dtype != ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{src_name(src)}: tensor {module}.weight is {q.dtype}, expected float8_e4m3fn")
        scale = np.asarray(src.get(f"{module}.weight_scale"), np.float32)
        if scale.size not in (1, out):
            raise CheckpointError(
                f"{src_name(src)}: tensor {module}.weight_scale has shape {list(scale.shape)}, "
                f"expected [{out}, 1] or [1]"
            )
        scale = np.broadcast_to(scale.reshape(1, -1), (1, out)).copy()
        return QuantizedWeight(np.ascontiguousarray(q.T), scale, bits=8, act=fmt.act)
    g = fmt.group_size or inp
    if inp % g or out % 8 or inp % 8:
        raise CheckpointError(
            f"{src_name(src)}: {module} [{out}, {inp}] does not fit group size {g} and 8-value int32 packing"
        )
    groups = inp // g
    scale = np.asarray(src.get(f"{module}.scales", (groups, out)), np.float32)
    if fmt.method == "awq":
        codes = unpack_awq(_check(src, f"{module}.qweight", (inp, out // 8)))
        zeros = unpack_awq(_check(src, f"{module}.qzeros", (groups, out // 8))).astype(np.float32)
        perm = None
    else:
        codes = unpack_gptq_rows(_check(src, f"{module}.qweight", (inp // 8, out)))
        zeros = unpack_gptq_cols(_check(src, f"{module}.qzeros", (groups, out // 8))).astype(np.float32) + 1
        codes, perm = _group_rows(src, module, codes, g, inp)
    return QuantizedWeight(pack_int4(codes), scale, -zeros * scale, perm, bits=4, group_size=fmt.group_size and g)


def _read_fp8_blocks(src, module: str, out: int, inp: int, block) -> QuantizedWeight:
    """HF fine-grained FP8: fp8 [out, in] + scale_inv [ceil(out/bo), ceil(in/bi)] -> [in, out] codes
    with [ceil(in/bi), ceil(out/bo)] block scales (a per-tensor scale is one block of the whole matrix)."""
    q = _check(src, f"{module}.weight", (out, inp))
    if q.dtype != ml_dtypes.float8_e4m3fn:
        raise CheckpointError(f"{src_name(src)}: tensor {module}.weight is {q.dtype}, expected float8_e4m3fn")
    bo, bi = block or (out, inp)
    expected = (-(-out // bo), -(-inp // bi))
    scale = np.asarray(src.get(f"{module}.weight_scale_inv"))
    if block is None and scale.size == 1:
        scale = scale.reshape(expected)
    if tuple(scale.shape) != expected:
        raise CheckpointError(
            f"{src_name(src)}: tensor {module}.weight_scale_inv has shape {list(scale.shape)}, expected "
            f"{list(expected)} (weight [{out}, {inp}] in blocks of [{bo}, {bi}])"
        )
    if scale.dtype.kind in "iub":
        raise CheckpointError(f"{src_name(src)}: tensor {module}.weight_scale_inv is {scale.dtype}, expected float")
    scale = np.ascontiguousarray(scale.astype(np.float32).T)
    return QuantizedWeight(np.ascontiguousarray(q.T), scale, bits=8, group_size=bi, block_n=bo)


def concat_columns(ws: list):
    """Linear weights [in, out_i] side by side along out (MoE gate | up): block-FP8 weights stay
    quantized (block scales joined when every width fills whole blocks, else per column); other
    quantized weights are dequantized, as are mixes."""
    if all(isinstance(w, QuantizedWeight) and w.block_n for w in ws):
        first = ws[0]
        if len({(w.group_size, w.block_n, w.q.shape[:-1]) for w in ws}) == 1:
            if any(w.q.shape[-1] % w.block_n for w in ws[:-1]):
                ws = [per_column(w) for w in ws]
            return QuantizedWeight(
                np.concatenate([w.q for w in ws], -1),
                np.concatenate([w.scale for w in ws], -1),
                bits=8,
                group_size=first.group_size,
                block_n=ws[0].block_n,
            )
    return np.concatenate([dequantize_np(w) if isinstance(w, QuantizedWeight) else w for w in ws], -1)


def _checked(src, name: str, w: QuantizedWeight, shape) -> QuantizedWeight:
    if tuple(w.shape) != tuple(shape):
        raise CheckpointError(
            f"{src_name(src)}: tensor {name!r} has [in, out] shape {list(w.shape)}, the config implies {list(shape)}"
        )
    return w


def read_embedding(src, name: str, vocab: int, hidden: int):
    """The embedding: float [V, H], or a QuantizedWeight [H, V] (GGUF blocks kept quantized)."""
    stored = src.get(name)
    if isinstance(stored, QuantizedWeight):
        return _checked(src, name, stored, (hidden, vocab))
    return src.get(name, (vocab, hidden))


def _group_rows(src, module: str, codes: np.ndarray, g: int, inp: int):
    """GPTQ: sort input rows so each group's rows are contiguous (act order); -> (codes, perm or None)."""
    name = f"{module}.g_idx"
    if name not in src:
        return codes, None
    g_idx = np.asarray(src.get(name, (inp,))).astype(np.int64)
    if np.array_equal(g_idx, np.arange(inp) // g):
        return codes, None
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    if not np.array_equal(g_idx[perm], np.arange(inp) // g):
        raise CheckpointError(f"{src_name(src)}: tensor {name} does not assign {g} rows to each group")
    return codes[perm], perm


def src_name(src) -> str:
    return str(getattr(src, "path", getattr(src, "origin", "checkpoint")))


def stack_layers(values: list):
    """Stack one parameter over layers: float arrays, or QuantizedWeights of one layout (a mix, e.g.
    a layer the quantizer skipped, is dequantized to float)."""
    if not any(isinstance(v, QuantizedWeight) for v in values):
        return np.stack(values)
    if all(isinstance(v, QuantizedWeight) for v in values) and len({_layout(v) for v in values}) == 1:
        first = values[0]
        leaves = [
            None if getattr(first, f) is None else np.stack([getattr(v, f) for v in values])
            for f in ("q", "scale", "offset", "perm")
        ]
        return QuantizedWeight(
            *leaves, bits=first.bits, group_size=first.group_size, act=first.act, block_n=first.block_n
        )
    return np.stack([dequantize_np(v) if isinstance(v, QuantizedWeight) else v for v in values])


def _layout(w: QuantizedWeight):
    return (
        w.bits,
        w.group_size,
        w.act,
        w.block_n,
        w.q.shape,
        w.scale.shape,
        w.q.dtype,
        w.offset is None,
        w.perm is None,
    )


def dequantize_np(w: QuantizedWeight) -> np.ndarray:
    """Host float32 dequantization [K, N] in original input-row order (for float fallbacks)."""
    if w.block_n:
        return w.q.astype(np.float32) * block_scales(
            np.asarray(w.scale, np.float32), w.q.shape, w.group_size, w.block_n, np
        )
    codes = unpack_int4_np(w.q).astype(np.float32) if w.bits == 4 else w.q.astype(np.float32)
    g = w.group_size or codes.shape[-2]
    s = np.repeat(w.scale, g, axis=-2)
    if w.offset is not None:
        deq = codes * s + np.repeat(w.offset, g, axis=-2)
    else:
        deq = (codes - 8 if w.bits == 4 else codes) * s
    if w.perm is not None:
        out = np.empty_like(deq)
        out[..., w.perm, :] = deq
        deq = out
    return deq
