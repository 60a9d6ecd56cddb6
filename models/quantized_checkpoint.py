"""Pre-quantized tiny checkpoints for tests: AWQ, GPTQ (desc_act false / true), compressed-tensors FP8.

    write_quantized_checkpoint(float_dir, out_dir, "gptq", group_size=32, desc_act=True)

Reads a float HF checkpoint (e.g. one `models.random_checkpoint` wrote), quantizes its decoder
Linear weights by round-to-nearest and writes them with each format's own packing and
`quantization_config`, as AutoAWQ / GPTQModel / llm-compressor would lay them out on disk
(see models/prequantized.py for the layouts). Modules a format cannot hold (a dim that is not a
multiple of the group size or of the 8-value int32 packing) stay float and are listed in the
config (`modules_to_not_convert` / `ignore`), as the real quantizers do. The embedding, the
lm_head, norms, the GDN conv / decay parameters and MoE routers are never quantized.

CLI: python -m models.quantized_checkpoint FLOAT_DIR OUT_DIR {awq,gptq,gptq-desc-act,fp8,fp8-dynamic}
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from models.prequantized import AWQ_ORDER
from models.safetensors_io import SafetensorsDir

METHODS = ("awq", "gptq", "gptq-desc-act", "fp8", "fp8-dynamic")
_SKIP = re.compile(r"(norm|conv1d|A_log|dt_bias|mlp\.gate\.|shared_expert_gate\.)")


def _quantizable(name: str, arr: np.ndarray) -> bool:
    return ".layers." in name and name.endswith(".weight") and arr.ndim == 2 and not _SKIP.search(name)


def _pack8(codes: np.ndarray, axis: int, order=None) -> np.ndarray:
    """uint codes -> int32, eight per word along `axis` (nibble i <- element order[i] of the eight)."""
    codes = np.moveaxis(codes.astype(np.uint32), axis, -1)
    words = codes.reshape(*codes.shape[:-1], -1, 8)
    if order is not None:
        words = words[..., order]
    packed = np.zeros(words.shape[:-1], np.uint32)
    for i in range(8):
        packed |= words[..., i] << np.uint32(4 * i)
    return np.moveaxis(packed, -1, axis).view(np.int32)


def _rtn_int4(w_in_out: np.ndarray, group: int, rows_order: np.ndarray, min_zero: int = 0):
    """Asymmetric 4-bit RTN over groups of `group` input rows taken in `rows_order`.
    -> (codes [in, out], scales [in/g, out], zeros [in/g, out], g_idx [in])."""
    k, n = w_in_out.shape
    ordered = w_in_out[rows_order].reshape(k // group, group, n)
    lo, hi = ordered.min(1), ordered.max(1)
    scales = (np.maximum(hi - lo, 1e-8) / 15).astype(np.float16).astype(np.float32)
    zeros = np.clip(np.round(-lo / scales), min_zero, 15)
    codes_ordered = np.clip(np.round(ordered / scales[:, None]) + zeros[:, None], 0, 15).reshape(k, n)
    codes = np.empty_like(codes_ordered)
    codes[rows_order] = codes_ordered
    g_idx = np.empty(k, np.int32)
    g_idx[rows_order] = np.arange(k) // group
    return codes.astype(np.uint8), scales, zeros.astype(np.uint8), g_idx


def _quantize_module(method: str, w: np.ndarray, group: int, rng) -> dict[str, np.ndarray] | None:
    """HF Linear weight [out, in] -> {suffix: tensor} in `method`'s layout, or None (stays float)."""
    out, inp = w.shape
    if method.startswith("fp8"):
        scale = np.maximum(np.abs(w).max(1, keepdims=True), 1e-8) / 448.0
        return {"weight": (w / scale).astype(ml_dtypes.float8_e4m3fn), "weight_scale": scale.astype(np.float32)}
    if inp % group or out % 8:
        return None
    order = rng.permutation(inp) if method == "gptq-desc-act" else np.arange(inp)
    # GPTQ v1 stores zero - 1 in an unsigned nibble: zeros start at 1
    codes, scales, zeros, g_idx = _rtn_int4(w.T.astype(np.float32), group, order, 0 if method == "awq" else 1)
    if method == "awq":
        return {
            "qweight": _pack8(codes, 1, AWQ_ORDER),
            "qzeros": _pack8(zeros, 1, AWQ_ORDER),
            "scales": scales.astype(np.float16),
        }
    return {
        "qweight": _pack8(codes, 0),
        "qzeros": _pack8(zeros - 1, 1),  # GPTQ v1 stores zero - 1
        "scales": scales.astype(np.float16),
        "g_idx": g_idx,
    }


def _quantization_config(method: str, group: int, skipped: list[str]) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": skipped,
        }
    if method.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": method == "gptq-desc-act",
            "sym": False,
            "checkpoint_format": "gptq",
        }
    acts = (
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
        if method == "fp8-dynamic"
        else None
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head", *skipped],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": acts,
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            }
        },
    }


def write_quantized_checkpoint(
    float_dir: str | Path, out_dir: str | Path, method: str, *, group_size: int = 32, seed: int = 0
) -> Path:
    """Quantize `float_dir`'s decoder Linear weights into `out_dir` in `method`'s on-disk format."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    import torch
    from safetensors.torch import save_file

    float_dir, out_dir = Path(float_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = SafetensorsDir(float_dir)
    rng = np.random.default_rng(seed)
    tensors, skipped = {}, []
    for name in sorted(src.names()):
        arr = np.asarray(src.get(name))
        packed = _quantize_module(method, arr.astype(np.float32), group_size, rng) if _quantizable(name, arr) else None
        if packed is None:
            tensors[name] = arr
            if _quantizable(name, arr):
                skipped.append(name[: -len(".weight")])
            continue
        module = name[: -len(".weight")]
        tensors.update({f"{module}.{suffix}": value for suffix, value in packed.items()})
    torch_tensors = {}
    for name, arr in tensors.items():
        if arr.dtype == ml_dtypes.float8_e4m3fn:
            torch_tensors[name] = torch.from_numpy(arr.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        else:
            torch_tensors[name] = torch.from_numpy(np.array(arr, order="C"))  # a writable contiguous copy
    save_file(torch_tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = _quantization_config(method, group_size, skipped)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (float_dir / extra).exists():
            shutil.copy(float_dir / extra, out_dir / extra)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.quantized_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("float_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args(argv)
    print(write_quantized_checkpoint(args.float_dir, args.out_dir, args.method, group_size=args.group_size))


if __name__ == "__main__":
    main()
