"""GGUF Q4_0 / Q4_1 / Q8_0 tensors repacked into `QuantizedWeight`s instead of dequantized.

A GGUF weight has `rows` (HF out features, or the vocab for `token_embd`) of `cols` values
stored in blocks of 32 along the row (llama.cpp's block layouts, little-endian):

- Q8_0 (34 bytes): d float16, 32 int8 codes                      w = d * q
- Q4_0 (18 bytes): d float16, 16 bytes of nibbles                w = d * (q - 8)
- Q4_1 (20 bytes): d float16, m float16, 16 bytes of nibbles     w = d * q + m

where byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).
Blocks run along the input dim, exactly our group-wise layout with group size 32: the result
is a host `QuantizedWeight` `[cols, rows]`, i.e. `[in, out]` for a Linear and `[H, V]` for the
embedding (the quantized-embedding convention of models/quantization.py).
"""

from __future__ import annotations

import gguf
import numpy as np

from models.quantization import QuantizedWeight, pack_int4

BLOCK = 32
Q = gguf.GGMLQuantizationType
KEPT_TYPES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}  # type -> bytes per block


def repack(data: np.ndarray, tensor_type, rows: int, cols: int) -> QuantizedWeight:
    """Raw GGUF block bytes (uint8 [rows, bytes per row]) -> QuantizedWeight [cols, rows]."""
    size = KEPT_TYPES[tensor_type]
    blocks = np.ascontiguousarray(data, np.uint8).reshape(rows, cols // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if tensor_type == Q.Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantizedWeight(np.ascontiguousarray(codes.T), np.ascontiguousarray(d.T), bits=8, group_size=BLOCK)
    start = 2 if tensor_type == Q.Q4_0 else 4
    nibbles = blocks[..., start : start + 16]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)  # element j, then j + 16
    offset = None
    if tensor_type == Q.Q4_1:
        offset = np.ascontiguousarray(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32).T)
    return QuantizedWeight(pack_int4(codes.T), np.ascontiguousarray(d.T), offset, bits=4, group_size=BLOCK)
