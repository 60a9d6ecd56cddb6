"""MXFP4 expert weights (gpt-oss as published): read into exact int8 `QuantizedWeight`s, and written
(a float gpt-oss checkpoint converted, for tests and benchmarks).

    src = Mxfp4Source(src)        # models/weights.py, when quantization_config.quant_method is mxfp4
    w = src.get("model.layers.0.mlp.experts.gate_up_proj", (E, H, 2 * I))   # QuantizedWeight [E, K, N]
    write_mxfp4_checkpoint(float_dir, out_dir)                                # experts -> *_blocks / *_scales

On disk (HF's `GptOssExperts` layout; per layer `mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`):
- `*_blocks` uint8 `[E, N, K/32, 16]`: the weight's transpose `[E, N, K]` (out, in) in groups of 32
  along K; byte j of a group holds element 2j in its low nibble and 2j+1 in its high nibble, each an
  FP4 e2m1 code (bit 3 the sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6);
- `*_scales` uint8 `[E, N, K/32]`: e8m0 exponents, w = fp4 * 2^(s - 127). 255 is NaN in the OCP MX
  spec (HF's dequantization makes it inf / nan): refused.
HF's float parameter of the same name is `[E, K, N]` (x @ W), the layout we load.

Kept quantized, exactly: 2 * fp4 is an integer in [-12, 12] and 2^(s - 127) a power of two, so
w = (2 * fp4) * 2^(s - 128): int8 codes `[E, K, N]` with one float32 scale per group of 32 along K
(`[E, K/32, N]`), the group-wise 8-bit `QuantizedWeight` of GGUF Q8_0. 1.125 bytes a weight in
memory instead of bf16's 2; the MoE path (`qragged_dot`) dequantizes it inside the step. Negative
zero (code 8) becomes +0. float32 holds every scale the format allows (2^-128 as a subnormal).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from models.quantization import QuantizedWeight
from models.safetensors_io import CheckpointError

BLOCK = 32  # values per e8m0 scale
FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# 2 * the e2m1 value of each 4-bit code: 0..7 positive, 8..15 the same magnitudes negated
TWICE_FP4 = np.concatenate([2 * FP4_MAGNITUDES, -2 * FP4_MAGNITUDES]).astype(np.int8)
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def unpack_codes(blocks: np.ndarray) -> np.ndarray:
    """uint8 blocks [..., G, 16] -> int8 twice-FP4 values [..., G * 32] (low nibble first)."""
    blocks = np.asarray(blocks, np.uint8)
    pairs = np.stack([TWICE_FP4[blocks & 15], TWICE_FP4[blocks >> 4]], axis=-1)  # [..., G, 16, 2]
    return pairs.reshape(*blocks.shape[:-2], blocks.shape[-2] * 2 * blocks.shape[-1])


def scales_from_exponents(scales: np.ndarray) -> np.ndarray:
    """e8m0 bytes -> float32 2^(s - 128): the scale of the twice-FP4 codes."""
    return np.ldexp(np.float32(1), np.asarray(scales, np.int32) - 128).astype(np.float32)


def mxfp4_weight(
    blocks: np.ndarray, scales: np.ndarray, name: str = "experts", origin: str = "checkpoint"
) -> QuantizedWeight:
    """HF's blocks [..., N, K/32, 16] + scales [..., N, K/32] -> a host QuantizedWeight [..., K, N].
    `name` (HF's float tensor name) and `origin` (the file) go into the errors."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    for part, arr in (("blocks", blocks), ("scales", scales)):
        if arr.dtype != np.uint8:
            raise CheckpointError(f"{origin}: MXFP4 tensor '{name}_{part}' is {arr.dtype}, expected uint8")
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"{origin}: MXFP4 tensors '{name}_blocks' {list(blocks.shape)} and '{name}_scales' "
            f"{list(scales.shape)} do not pair (blocks [..., N, K/{BLOCK}, {BLOCK // 2}], scales [..., N, K/{BLOCK}])"
        )
    if (scales == 255).any():
        raise CheckpointError(
            f"{origin}: MXFP4 tensor '{name}_scales' holds e8m0 exponent 255 (NaN in the OCP MX spec)"
        )
    codes = np.swapaxes(unpack_codes(blocks), -1, -2)  # [..., K, N]
    scale = np.swapaxes(scales_from_exponents(scales), -1, -2)  # [..., K/32, N]
    return QuantizedWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scale), bits=8, group_size=BLOCK)


class Mxfp4Source:
    """A TensorSource over an MXFP4 checkpoint: the experts' `gate_up_proj` / `down_proj` read from
    their `_blocks` / `_scales` as QuantizedWeights [E, K, N]; every other tensor as stored. An expert
    tensor stored in float (a module MXFP4 left unconverted) is read as float, as HF's loader does."""

    def __init__(self, src):
        self.src = src
        self.path = getattr(src, "path", getattr(src, "origin", "checkpoint"))

    def __contains__(self, name: str) -> bool:
        return name in self.src or (_is_expert(name) and f"{name}_blocks" in self.src)

    def get(self, name: str, shape=None):
        if not _is_expert(name) or (name in self.src and f"{name}_blocks" not in self.src):
            return self.src.get(name, shape)
        blocks_name, scales_name = f"{name}_blocks", f"{name}_scales"
        for part in (blocks_name, scales_name):
            if part not in self.src:
                raise CheckpointError(f"{self.path}: MXFP4 tensor {part!r} is missing from the checkpoint")
        blocks, scales = self.src.get(blocks_name), self.src.get(scales_name)
        if shape is not None:
            *lead, k, n = shape
            if k % BLOCK:
                raise CheckpointError(
                    f"{self.path}: {name}: input dim {k} is not a multiple of the MXFP4 block ({BLOCK})"
                )
            want_blocks, want_scales = (*lead, n, k // BLOCK, BLOCK // 2), (*lead, n, k // BLOCK)
            for part, arr, want in ((blocks_name, blocks, want_blocks), (scales_name, scales, want_scales)):
                if tuple(arr.shape) != want:
                    raise CheckpointError(
                        f"{self.path}: MXFP4 tensor {part!r} has shape {list(arr.shape)}, the config implies "
                        f"{list(want)}"
                    )
        return mxfp4_weight(blocks, scales, name, str(self.path))


def _is_expert(name: str) -> bool:
    return name.endswith(EXPERT_TENSORS)


# ---- writing ------------------------------------------------------------------------------------
def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8
    [..., N, K/32]): per group the smallest exponent with max |w| <= 6 * 2^e, values rounded to the
    nearest e2m1 magnitude (ties to the smaller)."""
    w = np.asarray(w, np.float64)
    *lead, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {k}")
    groups = w.reshape(*lead, n, k // BLOCK, BLOCK)
    amax = np.abs(groups).max(-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0**-126) / 6.0))
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = np.abs(groups) / np.ldexp(1.0, exponent)[..., None]
    magnitude = np.abs(scaled[..., None] - FP4_MAGNITUDES).argmin(-1).astype(np.uint8)  # [..., G, 32]
    codes = magnitude | np.where((groups < 0) & (magnitude > 0), 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + 127).astype(np.uint8)


def write_mxfp4_checkpoint(float_dir: str | Path, out_dir: str | Path) -> Path:
    """A float gpt-oss checkpoint directory -> the same model with its expert weights stored as
    MXFP4 (HF's tensor names and shapes, `quantization_config` as gpt-oss ships it); the other files
    copied. The experts' input dims (hidden size, intermediate size) must be multiples of 32."""
    from safetensors.torch import load_file, save_file

    float_dir, out_dir = Path(float_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    for f in float_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in sorted(float_dir.glob("*.safetensors")):
        tensors = load_file(f)
        for name in [n for n in tensors if _is_expert(n)]:
            w = tensors.pop(name).float().numpy()  # [E, K, N]
            blocks, scales = quantize_mxfp4(np.swapaxes(w, -1, -2))
            tensors[f"{name}_blocks"] = _torch_u8(blocks)
            tensors[f"{name}_scales"] = _torch_u8(scales)
        save_file(tensors, out_dir / f.name, metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.exists():  # sharded: the weight map names the new tensors
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        for name in [n for n in weight_map if _is_expert(n)]:
            where = weight_map.pop(name)
            weight_map[f"{name}_blocks"] = weight_map[f"{name}_scales"] = where
        index.write_text(json.dumps(data, indent=2))
    return out_dir


def _torch_u8(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))
